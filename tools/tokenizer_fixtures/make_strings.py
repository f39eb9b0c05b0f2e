#!/usr/bin/env python3
"""make_strings.py: builds the committed tokenizer conformance test set,
tests/fixtures/tokenizer/strings.jsonl: one JSON object per line,
  {"id": N, "cat": CATEGORY, "b64": base64 of the string's bytes[, "special": true]}
Categories: prose, code, numbers, whitespace, contractions, scripts, emoji, invalid
(invalid UTF-8 bytes), fuzz (random assigned code points), nfc (text that NFC
changes), special (contains added tokens such as <|endoftext|>; encoded with added
tokens matched). Prose and code are slices of the fetched corpus (tools/fetch_assets.sh);
the rest is generated. Deterministic (fixed seed). Characters are limited to those
assigned in Unicode 14 (this Python's unicodedata) so every reference library agrees
on their classes.

Also writes the reference input form: the same strings as JSON text in which each
invalid byte b is the private-use code point U+10FF00+b (see reference_text), the
convention the expectation scripts use to feed invalid bytes through libraries that
only accept valid text."""
import base64
import json
import os
import random
import sys
import unicodedata

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ASSETS = os.environ.get("MHAR_ASSETS", os.path.join(REPO, "assets"))
OUT = os.path.join(REPO, "tests", "fixtures", "tokenizer", "strings.jsonl")
PLACEHOLDER_BASE = 0x10FF00
ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
         "</tool_call>", "<tool_response>", "</tool_response>", "<|fim_prefix|>", "<|vision_pad|>"]

rng = random.Random(20261129)


def reference_text(b: bytes) -> str:
    """Valid UTF-8 decodes as usual; each byte that does not (Python's strict rules, the
    same as mhar's decoder) becomes U+10FF00 + byte."""
    s = b.decode("utf-8", errors="surrogateescape")
    return "".join(chr(PLACEHOLDER_BASE + ord(c) - 0xDC00) if 0xDC80 <= ord(c) <= 0xDCFF else c for c in s)


def assigned(c):
    cat = unicodedata.category(c)
    return cat not in ("Cn", "Cs", "Co") or (cat == "Co" and ord(c) < 0x10FF00)


def load_docs(split, source):
    path = os.path.join(ASSETS, "corpus", split, source + ".jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def slices(docs, n, lo, hi):
    out = []
    while len(out) < n:
        d = rng.choice(docs)
        if len(d) < lo:
            continue
        length = rng.randint(lo, min(hi, len(d)))
        start = rng.randint(0, len(d) - length)
        out.append(d[start:start + length])
    return out


def prose():
    docs = load_docs("train", "gutenberg") + load_docs("heldout", "gutenberg") + load_docs("train", "brown") \
        + load_docs("train", "fortunes") + load_docs("train", "sword")
    return slices(docs, 420, 5, 300)


def code():
    docs = load_docs("train", "python-doc") + load_docs("train", "linux-doc")
    blocks = []
    for d in docs:
        for part in d.split("\n\n"):
            if part.startswith("   ") and any(ch in part for ch in "(){}=;"):
                blocks.append(part)
    out = slices(blocks, 220, 10, 300)
    out += [
        "def f(x):\n    return x**2 + 1\n", "int main(void) { return 0; }\n",
        "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
        "const x = {a: 1, 'b': [2, 3], \"c\": null};", "if x != None and y >= 3: pass",
        "#include <stdio.h>\n#define MAX(a,b) ((a)>(b)?(a):(b))\n", "SELECT * FROM t WHERE id = 42;",
        "$ ls -la | grep '^d' && echo \"done\" > /dev/null 2>&1", "λx. x + 1 // ≠ ≤ ≥ → ∀∃",
        "x += 1;;; y -= 2;;;\n\n\n", "<div class=\"a\">&amp;&lt;</div>", "a_b_c = __init__.__dict__",
        "std::vector<std::pair<int,int>> v{{1,2},{3,4}};", "    \t    \n\t\t\n", "0x1F 0b1010 0o777 1e-9 3.14f",
        "fn main() { println!(\"{}\", 1_000_000u64); }", "@decorator\nclass A(B, metaclass=M): ...",
    ]
    return out


def numbers():
    out = []
    digits_sets = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "０１２３４５６７８９", "²³¹¼½¾", "ⅠⅡⅢⅣⅤ", "①②③"]
    for _ in range(200):
        kind = rng.randrange(8)
        if kind == 0:
            out.append(str(rng.randrange(10 ** rng.randint(1, 25))))
        elif kind == 1:
            out.append(f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 8)}f}")
        elif kind == 2:
            out.append(f"{rng.randrange(10**9):,}")
        elif kind == 3:
            out.append(f"{rng.randint(1900, 2100)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} "
                       f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}")
        elif kind == 4:
            out.append("".join(rng.choice(digits_sets[rng.randrange(len(digits_sets))]) for _ in range(rng.randint(1, 12))))
        elif kind == 5:
            out.append("".join(rng.choice("abc123 .,-+") for _ in range(rng.randint(1, 30))))
        elif kind == 6:
            out.append(f"{rng.random():.3e} x{rng.randrange(100)} ${rng.randrange(10**6)}.{rng.randrange(100):02d}")
        else:
            out.append(" " + " ".join(str(rng.randrange(10 ** rng.randint(1, 6))) for _ in range(rng.randint(1, 8))))
    return out


# U+0085 and U+FEFF are kept to a few dedicated strings (see whitespace()): JavaScript's
# \s (js-tiktoken) disagrees with Unicode White_Space (every other reference) on both.
WHITESPACE = [" ", " ", " ", "\t", "\n", "\n", "\r", "\r\n", "\v", "\f", "\u00a0", "\u2003", "\u2009",
              "\u3000", "\u2028", "\u2029", "\u1680", "\u202f", "\u205f", "\u200b", "\x1c", "\x1f"]


def whitespace():
    out = []
    words = ["a", "word", "Hello", "x1", "!", "(", "42", "ok.", "'s", "\u00e9t\u00e9", "\u4e2d"]
    for _ in range(300):
        parts = []
        for _ in range(rng.randint(1, 8)):
            parts.append("".join(rng.choice(WHITESPACE) for _ in range(rng.randint(0, 6))))
            if rng.random() < 0.7:
                parts.append(rng.choice(words))
        out.append("".join(parts))
    out += [" ", "  ", "\n", "\n\n\n", " \n \n ", "\t\t", "a  b", "a\n\nb", "  leading", "trailing  ",
            "\r\n\r\n", " \r\n x", "\u00a0\u00a0x", "x \ufeffy", "\ufeffHello", "a\u0085b", "a \u0085 b"]
    for _ in range(20):
        out.append(rng.choice(["x", " ", "\n", "ab", "1"]) + rng.choice(["\u0085", "\ufeff", " \ufeff", "\u0085 "])
                   + rng.choice(["y", " z", "\n", "", "!"]))
    return out


def contractions():
    out = []
    bases = ["I", "you", "he", "she", "it", "we", "they", "don", "can", "won", "O", "rock", "John", "X"]
    tails = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'lL",
             "'D", "'ſ", "'x", "'", "''", "'sss", "'tis", "'ll've", "\u2019s", "'\u017f"]
    for _ in range(150):
        s = rng.choice(bases) + rng.choice(tails)
        if rng.random() < 0.5:
            s += rng.choice([" ", "", ".", " and", "'s", "\n"]) + rng.choice(bases) + rng.choice(tails)
        out.append(s)
    out += ["don't", "I'm", "they'll", "we've", "you're", "she'd", "it's", "'s", "'", "''", "'''s",
            "rock 'n' roll", "'Twas", "O'Neil's", "ma'am", "y'all'd've"]
    return out


SAMPLES = [
    "中文文本，包含标点符号。", "日本語のテキストとカタカナ、ひらがな。", "한국어 문장입니다.", "Русский текст, ёлки!",
    "Ελληνικά γράμματα", "العربية نص مع أرقام ١٢٣", "עברית טקסט", "हिन्दी भाषा में वाक्य।", "ภาษาไทยไม่มีช่องว่าง",
    "ქართული ენა", "Հայերեն", "தமிழ் மொழி", "Tiếng Việt có dấu", "Ünïcödé façade naïve café", "ßẞ ŉ ǅ ǈ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙", "ℕ ℤ ℚ ℝ ℂ", "ᚠᛇᚻ᛫ᛒᛦᚦ", "ⴰⵣⵓⵍ", "ꦗꦮ", "𐌰𐌱𐌲", "Ⲁⲃⲅ", "አማርኛ", "ᏣᎳᎩ",
    "བོད་ཡིག", "မြန်မာ", "ខ្មែរ", "ລາວ", "ᠮᠣᠩᠭᠣᠯ", "ꆈꌠ", "𝒜𝒷𝒸", "ﬁ ﬂ ﬀ", "Ⅻ ⅻ", "㍿ ㌀",
]
BLOCKS = [(0x0400, 0x04FF), (0x0370, 0x03FF), (0x0590, 0x05FF), (0x0600, 0x06FF), (0x0900, 0x097F),
          (0x0E00, 0x0E7F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1100, 0x11FF),
          (0x0300, 0x036F), (0x2000, 0x206F), (0x2100, 0x214F), (0x2190, 0x22FF), (0x1D400, 0x1D7FF),
          (0x10A0, 0x10FF), (0x0B80, 0x0BFF), (0x1780, 0x17FF)]


def rand_from(lo, hi):
    while True:
        c = chr(rng.randint(lo, hi))
        if assigned(c):
            return c


def scripts():
    out = list(SAMPLES)
    for _ in range(370):
        if rng.random() < 0.5:
            s = rng.choice(SAMPLES)
            out.append(s[rng.randrange(len(s)):] + rng.choice(["", " ", " abc", "123", "\n"]) + rng.choice(SAMPLES))
        else:
            lo, hi = rng.choice(BLOCKS)
            out.append("".join(rand_from(lo, hi) if rng.random() < 0.8 else rng.choice(" .,1a\n")
                               for _ in range(rng.randint(1, 25))))
    return out


EMOJI = ["😀", "👍", "👍🏽", "❤️", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸", "🇯🇵", "1️⃣", "#️⃣", "🧑🏿‍🚀", "✨", "🔥", "©️", "™",
         "☺", "☺️", "🤷‍♀️", "👩🏻‍💻", "🐍", "🦀", "🫠", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "↩️", "⚡", "🙏🏼"]


def emoji():
    out = []
    for _ in range(160):
        parts = [rng.choice(EMOJI) for _ in range(rng.randint(1, 5))]
        glue = rng.choice(["", " ", "a", "!", "\n", "12"])
        s = glue.join(parts)
        if rng.random() < 0.5:
            s = rng.choice(["Hello ", "ok", "Great job", "(", "x"]) + s + rng.choice(["", " world", "!!", ")"])
        out.append(s)
    return out


def invalid():
    out = []
    specials = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xed\xbf\xbf",
                b"\xf4\x90\x80\x80", b"\xf5\x80", b"\xfe", b"\xff", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc3",
                b"\xe2\x28\xa1", b"\xf8\x88\x80\x80\x80", b"\x00", b"\x7f", b"\xef\xbb\xbf"]
    texts = [b"hello", b" world", b"abc", b"123", b" ", b"\n", b"caf\xc3\xa9", b"'s", b"(", b"\xe4\xb8\xad"]
    for _ in range(250):
        parts = []
        for _ in range(rng.randint(1, 6)):
            r = rng.random()
            if r < 0.4:
                parts.append(rng.choice(specials))
            elif r < 0.6:
                parts.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))))
            else:
                parts.append(rng.choice(texts))
        out.append(b"".join(parts))
    for b in range(0x80, 0x100):
        if rng.random() < 0.4:
            out.append(bytes([b]) + b"x" + bytes([b, b]))
    return out


def fuzz():
    out = []
    for _ in range(300):
        chars = []
        for _ in range(rng.randint(1, 20)):
            r = rng.random()
            if r < 0.3:
                chars.append(chr(rng.randint(0x20, 0x7E)))
            elif r < 0.9:
                chars.append(rand_from(0xA0, 0x2FFFF))
            else:
                chars.append(rng.choice(WHITESPACE))
        out.append("".join(chars))
    return out


def nfc():
    out = ["e\u0301", "cafe\u0301", "A\u030a", "\u212b", "\u2126", "\u037e", "\u1100\u1161\u11a8", "\u1100\u1161",
           "o\u0308\u0304", "a\u0323\u0302", "\u1e9b\u0323", "q\u0307\u0323", "\u0958", "\ufb2c", "\u00c5",
           "Cafe\u0301 au lait", "n\u0303o\u0303", "\u0041\u030a\u0301", "e\u0301\u0301\u0301", "\u0301start"]
    bases = "aeiouAEIOUncsyz"
    marks = [chr(c) for c in range(0x300, 0x36F) if assigned(chr(c))]
    for _ in range(100):
        s = ""
        for _ in range(rng.randint(1, 6)):
            s += rng.choice(bases) + "".join(rng.choice(marks) for _ in range(rng.randint(0, 3)))
            if rng.random() < 0.3:
                s += " "
        out.append(s)
    return out


def special():
    out = []
    for _ in range(60):
        parts = []
        for _ in range(rng.randint(1, 4)):
            parts.append(rng.choice(["Hello", " world", "\n", "", "a<|b", "<|endoftext|", "text.", "  "]))
            parts.append(rng.choice(ADDED[:1] * 3 + ADDED))
        out.append("".join(parts))
    out += ["<|endoftext|>", "<|endoftext|><|endoftext|>", "a<|endoftext|>b", " <|endoftext|> "]
    return out


def main():
    rows = []
    plain_generators = [("prose", prose), ("code", code), ("numbers", numbers), ("whitespace", whitespace),
                        ("contractions", contractions), ("scripts", scripts), ("emoji", emoji),
                        ("invalid", invalid), ("fuzz", fuzz), ("nfc", nfc)]
    seen = set()
    for cat, gen in plain_generators:
        for s in gen():
            b = s if isinstance(s, bytes) else s.encode("utf-8")
            t = reference_text(b)
            if not b or b in seen or any(a in t for a in ADDED) or "<|" in t:
                continue
            if any(ord(c) >= 0x10FF00 for c in b.decode("utf-8", "surrogateescape") if not 0xDC80 <= ord(c) <= 0xDCFF):
                continue
            seen.add(b)
            rows.append({"cat": cat, "bytes": b})
    for s in special():
        b = s.encode("utf-8")
        if b not in seen:
            seen.add(b)
            rows.append({"cat": "special", "bytes": b, "special": True})
    with open(OUT, "w") as f:
        for i, r in enumerate(rows):
            row = {"id": i, "cat": r["cat"], "b64": base64.b64encode(r["bytes"]).decode()}
            if r.get("special"):
                row["special"] = True
            f.write(json.dumps(row) + "\n")
    counts = {}
    for r in rows:
        counts[r["cat"]] = counts.get(r["cat"], 0) + 1
    print(f"make_strings: {len(rows)} strings -> {OUT}: {counts}")
    if len(sys.argv) > 1:  # also write the reference input form
        with open(sys.argv[1], "w") as f:
            for i, r in enumerate(rows):
                f.write(json.dumps({"id": i, "text": reference_text(r["bytes"]), "special": bool(r.get("special"))}) + "\n")


if __name__ == "__main__":
    main()

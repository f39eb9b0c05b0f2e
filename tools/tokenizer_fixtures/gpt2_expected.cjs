// gpt2_expected.cjs: GPT-2 expectations from js-tiktoken (the reference), one line per
// string of the reference input (see make_strings.py): {"id": N, "ids": [...]}.
// Plain strings use encode(text) (no special tokens allowed); "special" strings use
// encode(text, "all"). Invalid bytes arrive as U+10FF00+b; js-tiktoken's text encoder is
// swapped for one that turns them back into the raw byte, so its own regex sees an
// ordinary non-letter/number/space character and its own BPE runs on the real bytes.
// Usage: node gpt2_expected.cjs NODE_MODULES_DIR REFERENCE_INPUT OUT [BENCH_TEXT_FILE]
const fs = require("fs");
const path = require("path");
const [modules, input, out] = process.argv.slice(2);
const { Tiktoken } = require(path.join(modules, "js-tiktoken", "dist", "lite.cjs"));
const gpt2 = require(path.join(modules, "js-tiktoken", "dist", "ranks", "gpt2.cjs"));
const enc = new Tiktoken(gpt2);
const utf8 = new TextEncoder();
enc.textEncoder = {
  encode(s) {
    const bytes = [];
    for (const ch of s) {
      const cp = ch.codePointAt(0);
      if (cp >= 0x10ff00) bytes.push(cp - 0x10ff00);
      else bytes.push(...utf8.encode(ch));
    }
    return Uint8Array.from(bytes);
  },
};
const lines = fs.readFileSync(input, "utf8").split("\n").filter(Boolean);
const rows = [];
for (const line of lines) {
  const r = JSON.parse(line);
  const ids = r.special ? enc.encode(r.text, "all") : enc.encode(r.text);
  rows.push(JSON.stringify({ id: r.id, ids }));
}
fs.writeFileSync(out, rows.join("\n") + "\n");
console.log(`gpt2_expected: ${rows.length} strings -> ${out}`);

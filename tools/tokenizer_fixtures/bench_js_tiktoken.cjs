// bench_js_tiktoken.cjs: js-tiktoken's GPT-2 encoding throughput on the documents of
// .jsonl files (the reference figure for BENCHMARKS.md, Tokenizer). Each document is
// encoded as plain text (no special tokens), as `mhar data bench-tokenizer` does.
// Usage: node bench_js_tiktoken.cjs NODE_MODULES_DIR FILE.jsonl...
const fs = require("fs");
const path = require("path");
const [modules, ...files] = process.argv.slice(2);
const { Tiktoken } = require(path.join(modules, "js-tiktoken", "dist", "lite.cjs"));
const enc = new Tiktoken(require(path.join(modules, "js-tiktoken", "dist", "ranks", "gpt2.cjs")));
const docs = [];
let bytes = 0;
for (const f of files)
  for (const line of fs.readFileSync(f, "utf8").split("\n")) {
    if (!line.trim()) continue;
    const text = JSON.parse(line).text;
    docs.push(text);
    bytes += Buffer.byteLength(text, "utf8");
  }
const t0 = process.hrtime.bigint();
let tokens = 0;
for (const d of docs) tokens += enc.encode(d, [], []).length;
const secs = Number(process.hrtime.bigint() - t0) / 1e9;
console.log(`js-tiktoken ${require(path.join(modules, "js-tiktoken", "package.json")).version} (node ${process.version}): ` +
  `${docs.length} documents, ${(bytes / 1e6).toFixed(2)} MB, ${tokens} tokens, ${secs.toFixed(3)} s, ` +
  `${(bytes / 1e6 / secs).toFixed(2)} MB/s`);

#!/usr/bin/env bash
# bench_tokenizer.sh: GPT-2 encoding throughput of js-tiktoken (one core, the reference)
# and of mhar (1 thread, then every core), one after the other on the same documents.
#   tools/bench_tokenizer.sh [BUILD_DIR] [FILE.jsonl...]
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ASSETS="${MHAR_ASSETS:-$REPO/assets}"
BUILD="${1:-$REPO/build}"
shift || true
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=("$ASSETS/corpus/train/gutenberg.jsonl" "$ASSETS/corpus/train/python-doc.jsonl")
if [ ! -d "$ASSETS/node/node_modules/js-tiktoken" ]; then
  mkdir -p "$ASSETS/node"
  npm install --silent --no-audit --no-fund --prefix "$ASSETS/node" js-tiktoken@1.0.21 >/dev/null
fi
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
node "$REPO/tools/tokenizer_fixtures/bench_js_tiktoken.cjs" "$ASSETS/node/node_modules" "${FILES[@]}"
THREADS=(1)
for ((t = 2; t <= $(nproc); t *= 2)); do THREADS+=("$t"); done
[ "${THREADS[-1]}" != "$(nproc)" ] && THREADS+=("$(nproc)")
"$BUILD/mhar" data bench-tokenizer --tokenizer gpt2 --input "${FILES[@]}" --threads "${THREADS[@]}" --repeat 2

#!/usr/bin/env bash
# make_gpt2_expected.sh: regenerates tests/fixtures/tokenizer/gpt2_expected.jsonl with
# js-tiktoken (installed from npm into assets/node, pinned) on the committed strings.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
ASSETS="${MHAR_ASSETS:-$REPO/assets}"
JS_TIKTOKEN="js-tiktoken@1.0.21"
if [ ! -d "$ASSETS/node/node_modules/js-tiktoken" ]; then
  mkdir -p "$ASSETS/node"
  npm install --silent --no-audit --no-fund --prefix "$ASSETS/node" "$JS_TIKTOKEN" >/dev/null
fi
mkdir -p "$ASSETS/fixture_work"
python3 "$REPO/tools/tokenizer_fixtures/make_strings.py" "$ASSETS/fixture_work/reference_input.jsonl"
node "$REPO/tools/tokenizer_fixtures/gpt2_expected.cjs" "$ASSETS/node/node_modules" \
  "$ASSETS/fixture_work/reference_input.jsonl" "$REPO/tests/fixtures/tokenizer/gpt2_expected.jsonl"

#!/usr/bin/env bash
# make_scale_shards.sh: the Qwen3 shards of tools/dp/scale_out.sh's 300-step run, made
# here (the GPU machine has no network, so no corpus) and carried to it: the Gutenberg
# books, the Brown corpus and the Python documentation of the training corpus
# (tools/fetch_assets.sh), 6.7M training tokens (300 steps of 16,384 take 4.9M) and 26k
# validation tokens; uint32 tokens (Qwen3's vocabulary is larger than 65,536), 26 MB in
# .scale/qwen3 (git-ignored: add /.scale/ to .git/info/exclude and name .scale in the
# device call's carry).
#   MHAR (default build-cpu/mhar), MHAR_ASSETS (default assets)
set -euo pipefail
cd "$(dirname "$0")/../.."
MHAR="${MHAR:-build-cpu/mhar}"
ASSETS="${MHAR_ASSETS:-$PWD/assets}"
out=.scale/qwen3
rm -rf "$out"
mkdir -p .scale
"$MHAR" data prepare --tokenizer qwen3 --input "$ASSETS/corpus/train/gutenberg.jsonl" \
  "$ASSETS/corpus/train/brown.jsonl" "$ASSETS/corpus/train/python-doc.jsonl" --out "$out" \
  --val-fraction 0.01 --no-progress
du -sh "$out"

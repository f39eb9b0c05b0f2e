#!/usr/bin/env bash
# pack_assets.sh: the data the GPU machine needs for the replication grid (it has no network),
# as one git-ignored file to name in the device call's `carry`: .replicate/assets.tar.xz with
# corpus/train/*.jsonl and tokenizers/gpt2/ from $MHAR_ASSETS (default assets/; fetch them with
# tools/fetch_assets.sh). run_grid.sh unpacks it and makes the GPT-2 shards there (~30 s).
#   tools/replicate/pack_assets.sh      (29 MB; 75 s on the 2-core VM)
set -euo pipefail
cd "$(dirname "$0")/../.."
A="${MHAR_ASSETS:-$PWD/assets}"
for p in corpus/train tokenizers/gpt2/tokenizer.json; do
  [ -e "$A/$p" ] || { echo "pack_assets: no $A/$p (run tools/fetch_assets.sh, or set MHAR_ASSETS)" >&2; exit 1; }
done
mkdir -p .replicate
ex="$(git rev-parse --git-path info/exclude)"  # ignored, so it travels only when carried
grep -qx '/.replicate/' "$ex" 2>/dev/null || echo /.replicate/ >>"$ex"
tar -C "$A" -cf - corpus/train tokenizers/gpt2 | xz -T0 -6 >.replicate/assets.tar.xz.tmp
mv .replicate/assets.tar.xz.tmp .replicate/assets.tar.xz
ls -la .replicate/assets.tar.xz

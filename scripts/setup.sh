#!/usr/bin/env bash
# One-time, idempotent set-up: a venv in .venv with torch 2.13.0 (the CPU build on this machine's
# disk; a bare "torch" would pull a multi-GB CUDA build) and quickdraft installed editable.
#   scripts/setup.sh          runtime deps
#   scripts/setup.sh --dev    + test/lint deps, the `cluster` extra (Ray Serve: its tests run in
#                             CI), the `peers` extra (llama-cpp-python, built from source once,
#                             ~15-20 min on 2 cores; pip keeps the wheel: the llama.cpp oracle
#                             tests run in CI), and chromium + chromedriver (apt, Debian/Ubuntu)
#                             for the admin page's headless-browser test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# torch first and pinned, so that no later resolver picks a different build.
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
extra=""
if [ "${1:-}" = "--dev" ]; then extra="[dev,cluster]"; fi

install_browser() {
  # tests/test_admin_browser.py drives the admin page in Debian's chromium through chromedriver
  if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then return 0; fi
  if ! command -v apt-get >/dev/null; then
    echo "setup: no apt-get; install chromium + chromedriver for the browser test" >&2
    return 0
  fi
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "setup: installing chromium + chromium-driver (apt)"
  if ! { $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install \
      -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }; then
    echo "setup: WARNING: could not install chromium; the browser test will be skipped" >&2
  fi
}
if [ -n "$extra" ]; then install_browser; fi
.venv/bin/python -m pip install -q -e ".${extra}" "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
if [ -n "$extra" ]; then
  # The `peers` extra on its own, so that a failed llama.cpp build costs only the tests that need
  # it (they skip, saying so). Built for the x86-64 baseline every host here has (AVX2 + FMA +
  # F16C), not -march=native: the wheel pip keeps runs on any of them, and no AMX code is built
  # (a native build on an AMX host segfaults in multi-token batches: shared/REFERENCE.md, 7).
  if ! CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
-DGGML_F16C=ON -DGGML_BMI2=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
      .venv/bin/python -m pip install -q -e ".[peers]" "torch==2.13.0"; then
    echo "setup: WARNING: llama-cpp-python did not build; the llama.cpp tests will be skipped" >&2
  fi
fi
# Build the C++ kernels now (~2-3 min on 2 cores, once per install) rather than in the first
# `serve`; a machine without a compiler still runs, on the torch reference ops.
# On a machine with an NVIDIA GPU, PyPI's torch 2.13.0 is its CUDA build: --device auto takes the
# GPU (docs/gpu.md).
.venv/bin/python -c "from quickdraft.kernels import kernels_available; import torch; \
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'; \
print('quickdraft ready: torch', torch.__version__, '| CPU kernels', kernels_available(), '| GPU', gpu)"

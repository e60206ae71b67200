#!/usr/bin/env bash
# One-time, idempotent set-up: a venv in .venv with torch 2.13.0 (the CPU build on this machine's
# disk; a bare "torch" would pull a multi-GB CUDA build) and quickdraft installed editable.
#   scripts/setup.sh          runtime deps
#   scripts/setup.sh --dev    + test/lint deps
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
if [ "${1:-}" = "--dev" ]; then extra="[dev]"; fi
.venv/bin/python -m pip install -q -e ".${extra}" "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import quickdraft, torch; print('quickdraft ready: torch', torch.__version__)"

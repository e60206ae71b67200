#!/bin/bash
# One device call's worth of GPU checks (docs/gpu.md). Two steps:
#   bash bench/gpu_session.sh prepare   here: the configs and tokenizers of the catalog pair and
#                                       SmolLM2 into .gpu/configs (git-ignored; ~26 MB, under
#                                       the device's carry limit; weights stay behind), and the
#                                       wheels of what we import that the device image lacks
#                                       (gguf: every GPU test module imports it) into .gpu/whl
#   bash bench/gpu_session.sh run       there (carry .gpu), ~8 minutes in all: the CUDA and
#                                       Triton tests (170 s), bench/gpu_gguf.py (GGUF formats,
#                                       draft chains: 200 s) into $OUT/gpu-gguf, then
#                                       bench/gpu.py into $OUT/gpu (the rest of the time).
#                                       SKIP_TESTS=1, SKIP_GGUF=1, BENCH_ARGS=--compile,
#                                       TEST_TIMEOUT, GGUF_TIMEOUT, BENCH_TIMEOUT (seconds)
set -u
MODELS="qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m"
# pure-Python packages, so one wheel serves the device's Python whatever its version
CARRIED="gguf"
if [ "${1:-}" = prepare ]; then
  grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
  for m in $MODELS; do
    src=$(.venv/bin/python -c "from quickdraft.hub import resolve; print(resolve('$m', 'bf16'))")
    mkdir -p .gpu/configs/$m
    for f in config.json generation_config.json tokenizer.json tokenizer_config.json; do
      cp "$src/$f" .gpu/configs/$m/
    done
  done
  rm -rf .gpu/whl
  for p in $CARRIED; do
    v=$(.venv/bin/python -c "from importlib.metadata import version; print(version('$p'))")
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 -d .gpu/whl "$p==$v" || exit 1
  done
  du -sh .gpu
  exit 0
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
for p in $CARRIED; do
  if ! python3 -c "import $p" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .gpu/whl/$p-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/env.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
  'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/env.txt
if [ -z "${SKIP_TESTS:-}" ]; then
  # -v: each test's name and outcome as it ends, so a run cut by TEST_TIMEOUT still names them;
  # a per-test limit (pytest-timeout, in the device image) keeps one hung kernel from taking all
  PER_TEST=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60")
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -v -p no:cacheprovider -rA -s $PER_TEST \
    tests/test_triton_gguf.py tests/test_cuda.py tests/test_triton_ops.py tests/test_graphs.py \
    > $OUT/tests.txt 2>&1
  grep -E "^(FAILED|ERROR)|divergences|[0-9]+ (passed|failed)" $OUT/tests.txt | tail -40
  echo "$(grep -c ' PASSED' $OUT/tests.txt) passed as they ran (the full log: tests.txt)"
fi
echo "tests done at $(( $(date +%s) - T0 )) s"
C=.gpu/configs
A=bench/results/gguf-vs-llamacpp-xeon-amx-3/speculative.json
if [ -z "${SKIP_GGUF:-}" ]; then
  timeout ${GGUF_TIMEOUT:-200} python3 bench/gpu_gguf.py --models $C/qwen2.5-coder-1.5b \
    $C/qwen2.5-coder-0.5b --acceptance $A --out $OUT/gpu-gguf > $OUT/gguf.txt 2>&1
  echo "gguf bench rc=$? at $(( $(date +%s) - T0 )) s"
  grep -v "Writing model\|Loading weights\|deprecated" $OUT/gguf.txt | tail -30
fi
timeout ${BENCH_TIMEOUT:-170} python3 bench/gpu.py --models $C/qwen2.5-coder-1.5b \
  $C/qwen2.5-coder-0.5b --single $C/smollm2-135m --hybrid full --out $OUT/gpu ${BENCH_ARGS:-} \
  --acceptance bench/results/gguf-vs-llamacpp-xeon-amx-3/speculative.json > $OUT/bench.txt 2>&1
echo "bench rc=$? at $(( $(date +%s) - T0 )) s"
grep -v "Writing model\|Loading weights\|deprecated" $OUT/bench.txt | tail -60

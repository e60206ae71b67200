#!/bin/bash
# One device call's worth of GPU checks (docs/gpu.md). Two steps:
#   bash bench/gpu_session.sh prepare   here: the configs and tokenizers of the catalog pair and
#                                       SmolLM2 into .gpu/configs (git-ignored; ~26 MB, under
#                                       the device's carry limit; weights stay behind)
#   bash bench/gpu_session.sh run       there (carry .gpu), ~8 minutes in all: the CUDA and
#                                       Triton tests (170 s), bench/gpu_gguf.py (GGUF formats,
#                                       draft chains: 200 s) into $OUT/gpu-gguf, then
#                                       bench/gpu.py into $OUT/gpu (the rest of the time).
#                                       SKIP_TESTS=1, SKIP_GGUF=1, BENCH_ARGS=--compile,
#                                       TEST_TIMEOUT, GGUF_TIMEOUT, BENCH_TIMEOUT (seconds)
set -u
MODELS="qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m"
if [ "${1:-}" = prepare ]; then
  grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
  for m in $MODELS; do
    src=$(.venv/bin/python -c "from quickdraft.hub import resolve; print(resolve('$m', 'bf16'))")
    mkdir -p .gpu/configs/$m
    for f in config.json generation_config.json tokenizer.json tokenizer_config.json; do
      cp "$src/$f" .gpu/configs/$m/
    done
  done
  du -sh .gpu
  exit 0
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/env.txt
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/env.txt
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider -rA -s \
    tests/test_triton_gguf.py tests/test_cuda.py tests/test_triton_ops.py tests/test_graphs.py \
    > $OUT/tests.txt 2>&1
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|divergences" $OUT/tests.txt | tail -40
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

#!/bin/bash
# One call on a lent GPU machine (run from the repo root, `.whl/` carried; see BENCHMARKS.md's GPU
# section): the machine, the test suite with every engine on CUDA, greedy parity with transformers,
# the nano-vllm workload and a Qwen3-30B-A3B-shaped MoE (4 layers) grouped vs looped. Logs go to
# $OUT; the summary is the output's end.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp}
grep -m1 "model name" /proc/cpuinfo; nproc
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(amx|avx512_bf16|avx512_vnni|avx512f$|avx2$)' | tr '\n' ' '; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
            'transformers', transformers.__version__)"
TOKENMILL_TEST_DEVICE=cuda timeout "${PYTEST_S:-300}" python3 -m pytest -n "${WORKERS:-14}" -q -p no:cacheprovider \
    --deselect tests/integration/test_default_model.py ${TESTS:-tests} > "$OUT/pytest_cuda.txt" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda.txt" | cut -c1-200 | head -40
tail -1 "$OUT/pytest_cuda.txt"
timeout "${CHECK_S:-90}" python3 benchmarks/gpu_bench.py check > "$OUT/check.txt" 2>&1; echo "check exit $?"
grep -E "False|rror" "$OUT/check.txt" | cut -c1-200 | head -8; grep -c "equal to transformers: True" "$OUT/check.txt"
timeout "${BENCH_S:-110}" python3 benchmarks/gpu_bench.py bench --modes "${MODES:-graphs}" > "$OUT/bench.txt" 2>&1
echo "bench exit $?"; tail -6 "$OUT/bench.txt"
timeout "${MOE_S:-240}" python3 benchmarks/gpu_moe.py --layers 4 --rounds 1 > "$OUT/moe.txt" 2>&1
echo "moe exit $?"; grep -E "round|rror" "$OUT/moe.txt" | tail -6

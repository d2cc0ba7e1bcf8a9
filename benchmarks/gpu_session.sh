#!/bin/bash
# One call on a lent GPU machine, run from the repo root with `.whl/` carried (see BENCHMARKS.md's
# GPU sections):
#
#     OUT=$OUT bash benchmarks/gpu_session.sh [PART ...]      (default: every part, in this order)
#
# Parts:
#   suite  the test suite with every engine on CUDA (TOKENMILL_TEST_DEVICE=cuda), $WORKERS workers, -v
#   check  greedy parity with transformers on CUDA, chunked prefill and both preemption modes
#   bench  the nano-vllm workload (256 requests, a Qwen3-0.6B-shaped model with random weights)
#   moe    a Qwen3-30B-A3B-shaped MoE (4 layers), experts grouped against looped
# The packages in `.whl/` are installed once per machine, so amx_session.sh can run beside this
# one (each pinned to its own cores with taskset). Logs go to $OUT; the summary is the output's end.
set -o pipefail
OUT=${OUT:-/tmp}
PARTS=${*:-suite check bench moe}
# once per machine, under a lock: the other script may be installing beside this one
flock /tmp/site.lock bash -c '[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }' || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
wants() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
            'transformers', transformers.__version__)"

if wants suite; then
  # -v: a line per test as it ends, so a run the call's limit cuts short still names what failed
  TOKENMILL_TEST_DEVICE=cuda timeout "${PYTEST_S:-300}" python3 -m pytest -n "${WORKERS:-14}" -v -p no:cacheprovider \
      --timeout 150 --deselect tests/integration/test_default_model.py ${TESTS:-tests/unit tests/integration} \
      > "$OUT/pytest_cuda.txt" 2>&1
  echo "pytest exit $?; passed $(grep -c ' PASSED ' "$OUT/pytest_cuda.txt")"
  grep -E " (FAILED|ERROR) tests" "$OUT/pytest_cuda.txt" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -40
  tail -1 "$OUT/pytest_cuda.txt"
fi
if wants check; then
  timeout "${CHECK_S:-90}" python3 benchmarks/gpu_bench.py check > "$OUT/check.txt" 2>&1; echo "check exit $?"
  grep -E "False|rror" "$OUT/check.txt" | cut -c1-200 | head -8; grep -c "equal to transformers: True" "$OUT/check.txt"
fi
if wants bench; then
  timeout "${BENCH_S:-110}" python3 benchmarks/gpu_bench.py bench --modes "${MODES:-graphs}" > "$OUT/bench.txt" 2>&1
  echo "bench exit $?"; tail -6 "$OUT/bench.txt"
fi
if wants moe; then
  timeout "${MOE_S:-240}" python3 benchmarks/gpu_moe.py --layers 4 --rounds 1 > "$OUT/moe.txt" 2>&1
  echo "moe exit $?"; grep -E "round|rror" "$OUT/moe.txt" | tail -6
fi

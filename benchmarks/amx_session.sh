#!/bin/bash
# One call on a lent GPU machine whose host CPU has AMX (issue 28), run from the repo root with
# `.whl/` (the packages the image lacks) and `.amx/smollm2` (SmolLM2-135M's config and tokenizer)
# carried. On cores 0-1: tokenmill's kernels built for `amx` and for `avx512_bf16`, the bf16 panel
# tests on AMX tiles, the default workload on a SmolLM2-shaped model with random bf16 weights
# (amx, avx512_bf16 and float32 builds alternated) and the projections' GFLOP/s by row count
# beside oneDNN's. Meanwhile on cores 8-15 and the GPU: the Qwen3-30B-A3B-shaped MoE's grouped
# products against the per-expert loop by batch size (issue 32). Logs go to $OUT; the summary is
# the output's end.
set -o pipefail
OUT=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
grep -m1 "model name" /proc/cpuinfo; nproc
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(amx|avx512_bf16|avx512_vnni|avx512f$|avx2$)' | tr '\n' ' '; echo
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; gcc --version | head -1
(OUT=/tmp taskset -c 8-15 timeout "${MOE_S:-300}" python3 benchmarks/gpu_moe.py --layers 4 --rounds 1 \
    --batches 1 2 4 8 16 64 > "$OUT/moe.txt" 2>&1; echo "moe exit $?" >> "$OUT/moe.txt") &
build() {  # the kernels at level $1 (native: the CPU's own), in their cache for the runs below
  TOKENMILL_CPU_ISA=$1 MAX_JOBS=4 taskset -c "$2" timeout 240 python3 -c "
from tokenmill.cpu_kernels import load_cpu_kernels, this_cpu
k = load_cpu_kernels(required=True); print(this_cpu().describe(), 'bf16', k.bf16, 'amx', k.amx)"
}
build native 0-3 > "$OUT/build_amx.txt" 2>&1 & native=$!
build avx512_bf16 4-7 > "$OUT/build_bf16.txt" 2>&1
wait $native; cat "$OUT/build_amx.txt" "$OUT/build_bf16.txt" | grep -E "bf16|rror" | cut -c1-200
taskset -c 0-7 timeout 120 python3 -m pytest -q -p no:cacheprovider -k "bf16 or bfloat16 or amx" tests/unit/test_ops.py \
    tests/unit/test_cpu_kernels.py > "$OUT/amx_tests.txt" 2>&1
echo "amx tests exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/amx_tests.txt" | cut -c1-200 | head
python3 benchmarks/random_copy.py .amx/smollm2 /tmp/smol > /dev/null 2>&1 || echo "random_copy failed"
engine() {  # $1 level, $2 name, then bench arguments
  local isa=$1 name=$2; shift 2
  TOKENMILL_CPU_ISA=$isa taskset -c 0,1 timeout 150 python3 -m tokenmill.cli bench throughput --model /tmp/smol \
      --num-threads 2 --json "$OUT/engine_$name.json" "$@" > "$OUT/engine_$name.txt" 2>&1
  echo "$name: $(grep -E '^tokenmill ' "$OUT/engine_$name.txt" | awk '{print $2}') output tok/s"
}
engine native amx_1; engine avx512_bf16 bf16_1; engine native f32 --dtype float32
engine avx512_bf16 bf16_2; engine native amx_2
for isa in native avx512_bf16; do
  TOKENMILL_CPU_ISA=$isa taskset -c 0,1 timeout 100 python3 benchmarks/cpu_bf16_candidates.py --threads 2 \
      --variants tm_bf16 bf16_packed --rows 1 16 32 64 256 512 --shapes qkv gate_up down head > "$OUT/products_$isa.txt" 2>&1
done
for isa in native avx512_bf16; do echo "$isa:"; grep GFLOP "$OUT/products_$isa.txt" | cut -c1-110; done
taskset -c 0-7 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_ops.py tests/unit/test_moe_cpu.py \
    > "$OUT/kernel_tests.txt" 2>&1; echo "kernel tests exit $?"; tail -1 "$OUT/kernel_tests.txt"
wait; tail -14 "$OUT/moe.txt"

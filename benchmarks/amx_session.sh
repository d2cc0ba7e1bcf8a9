#!/bin/bash
# One call on a lent GPU machine whose host CPU has AMX (issue 28), run from the repo root:
#
#     OUT=$OUT bash benchmarks/amx_session.sh [PART ...]      (default: every part, in this order)
#
# with `.whl/` (the packages the image lacks) and `.amx/` carried. `.amx/` holds what the real
# models cannot send (a call carries 64 MiB): SmolLM2-135M's config and tokenizer (smollm2/, from
# its Hugging Face directory), the default GGUF's layout (smollm2_q4_1_layout.json, from
# `python benchmarks/random_gguf.py layout`) and, for the `llamacpp` part, a llama-bench built for
# Sapphire Rapids (see BENCHMARKS.md). Parts, each on cores 0-1 unless said:
#   moe       (in the background, cores 8-15 and the GPU) the Qwen3-30B-A3B-shaped MoE's grouped
#             products against the per-expert loop by batch size (issue 32)
#   build     tokenmill's kernels for `amx` and held to `avx512_bf16` (cores 0-7)
#   tests     the bf16 panel tests on AMX tiles, then the kernel and MoE tests (cores 0-7)
#   bf16      the default workload on a SmolLM2-shaped model with random bf16 weights: amx,
#             avx512_bf16 and float32, alternated
#   products  the projections' GFLOP/s by row count, tokenmill's bf16 panels beside oneDNN's
#   gguf      the default workload on the default GGUF's twin with random weights (random_gguf.py),
#             alternated with the bf16 model on AMX tiles
#   llamacpp  batch-1 decode on that twin: tokenmill (float32 x, 8-bit x) and llama-bench, rep by rep
#   roofline  `bench roofline` on the bf16 model: the layers at 512 rows against torch's bf16 peak
# Logs go to $OUT; the summary is the output's end.
set -o pipefail
OUT=${OUT:-/tmp}
PARTS=${*:-moe build tests bf16 products gguf llamacpp roofline}
# once per machine, under a lock: the other script may be installing beside this one
flock /tmp/site.lock bash -c '[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }' || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
grep -m1 "model name" /proc/cpuinfo; nproc
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(amx|avx512_bf16|avx512_vnni|avx512f$|avx2$)' | tr '\n' ' '; echo
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; gcc --version | head -1
wants() { [[ " $PARTS " == *" $1 "* ]]; }

if wants moe; then
  (OUT=/tmp taskset -c 8-15 timeout "${MOE_S:-300}" python3 benchmarks/gpu_moe.py --layers 4 --rounds 1 \
      --batches 1 2 4 8 16 64 > "$OUT/moe.txt" 2>&1; echo "moe exit $?" >> "$OUT/moe.txt") &
fi
build() {  # the kernels at level $1 (native: the CPU's own), in their cache for the runs below
  TOKENMILL_CPU_ISA=$1 MAX_JOBS=4 taskset -c "$2" timeout 240 python3 -c "
from tokenmill.cpu_kernels import load_cpu_kernels, this_cpu
k = load_cpu_kernels(required=True); print(this_cpu().describe(), 'bf16', k.bf16, 'amx_min_rows', k.amx_min_rows)"
}
if wants build; then
  build native 0-3 > "$OUT/build_amx.txt" 2>&1 & native=$!
  build avx512_bf16 4-7 > "$OUT/build_bf16.txt" 2>&1
  wait $native; cat "$OUT/build_amx.txt" "$OUT/build_bf16.txt" | grep -E "bf16|rror" | cut -c1-200
fi
if wants tests; then
  taskset -c 0-7 timeout 120 python3 -m pytest -q -p no:cacheprovider -k "bf16 or bfloat16 or amx" \
      tests/unit/test_ops.py tests/unit/test_cpu_kernels.py > "$OUT/amx_tests.txt" 2>&1
  echo "amx tests exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/amx_tests.txt" | cut -c1-200 | head
  taskset -c 0-7 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_ops.py tests/unit/test_moe_cpu.py \
      > "$OUT/kernel_tests.txt" 2>&1; echo "kernel tests exit $?"; tail -1 "$OUT/kernel_tests.txt"
fi
engine() {  # $1 level, $2 name, $3 model, then bench arguments
  local isa=$1 name=$2 model=$3; shift 3
  TOKENMILL_CPU_ISA=$isa taskset -c 0,1 timeout 150 python3 -m tokenmill.cli bench throughput --model "$model" \
      --num-threads 2 --json "$OUT/engine_$name.json" "$@" > "$OUT/engine_$name.txt" 2>&1
  echo "$name: $(grep -E '^tokenmill ' "$OUT/engine_$name.txt" | awk '{print $2}') output tok/s"
}
if wants bf16 || wants gguf || wants roofline; then
  python3 benchmarks/random_copy.py .amx/smollm2 /tmp/smol > /dev/null 2>&1 || echo "random_copy failed"
fi
if wants bf16; then
  engine native amx_1 /tmp/smol; engine avx512_bf16 bf16_1 /tmp/smol; engine native f32 /tmp/smol --dtype float32
  engine avx512_bf16 bf16_2 /tmp/smol; engine native amx_2 /tmp/smol
fi
if wants products; then
  for isa in native avx512_bf16; do
    TOKENMILL_CPU_ISA=$isa taskset -c 0,1 timeout 100 python3 benchmarks/cpu_bf16_candidates.py --threads 2 \
        --variants tm_bf16 bf16_packed --rows 1 8 16 32 64 256 512 --shapes qkv gate_up down head \
        > "$OUT/products_$isa.txt" 2>&1
    echo "$isa:"; grep GFLOP "$OUT/products_$isa.txt" | cut -c1-110
  done
fi
if wants gguf || wants llamacpp; then
  python3 benchmarks/random_gguf.py write .amx/smollm2_q4_1_layout.json /tmp/smol_q4_1.gguf || echo "random_gguf failed"
fi
if wants gguf; then
  engine native gguf_1 /tmp/smol_q4_1.gguf; engine native amx_bf16_1 /tmp/smol
  engine native gguf_2 /tmp/smol_q4_1.gguf; engine native amx_bf16_2 /tmp/smol
fi
if wants llamacpp; then
  taskset -c 0,1 timeout 200 python3 benchmarks/moe_vs_llamacpp.py /tmp/smol_q4_1.gguf --alternate --reps 5 \
      --int8-rows 2147483647 --llama-bench .amx/llama-bench > "$OUT/batch1_llamacpp.txt" 2>&1
  echo "llamacpp exit $?"; tail -6 "$OUT/batch1_llamacpp.txt"
fi
if wants roofline; then
  taskset -c 0,1 timeout "${ROOFLINE_S:-200}" python3 -m tokenmill.cli bench roofline --model /tmp/smol --num-threads 2 \
      > "$OUT/roofline.txt" 2>&1; echo "roofline exit $?"; tail -14 "$OUT/roofline.txt"
fi
wait; [ -f "$OUT/moe.txt" ] && tail -14 "$OUT/moe.txt"

#!/usr/bin/env bash
# Every CPU benchmark behind BENCHMARKS.md, one after the other (about 35 minutes on 2 cores).
# Tables go to benchmarks/results/*.txt, full figures to *.json, plots to benchmarks/results/plots/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
mkdir -p "$OUT/plots"
run() { local name=$1; shift; echo "== tokenmill $*" | tee "$OUT/$name.txt"; tokenmill "$@" --json "$OUT/$name.json" 2>/dev/null | tee -a "$OUT/$name.txt"; }
run throughput_compare bench throughput --compare --plot "$OUT/plots"
run pressure bench throughput --pressure
run prefix bench throughput --workload prefix
run long_default bench throughput --workload long
run long_uncapped bench throughput --workload long --long-prefill-token-threshold 0
run spec bench spec
run roofline bench roofline
run serve bench serve --request-rate 0.5 1 2 inf --num-prompts 32 --slo ttft=2000,tpot=250 --plot "$OUT/plots"
# GGUF blocks against float32 panels: decode steps side by side, then one user at a time over HTTP
python benchmarks/cpu_gguf_blocks.py 2>/dev/null | tee "$OUT/gguf_blocks.txt"
for b in true false; do
  echo "== tokenmill bench serve --max-concurrency 1 --num-prompts 8 --output-len 64 64 --gguf-blocks $b"
  tokenmill bench serve --max-concurrency 1 --num-prompts 8 --output-len 64 64 --gguf-blocks "$b" 2>/dev/null
done | tee "$OUT/serve_concurrency1_gguf_blocks.txt"
python benchmarks/cpu_block_formats.py 2>/dev/null | tee "$OUT/block_formats.txt"
# decode steps through the Python layers, the one-call C++ layers, and with 8-bit x; its quality
python benchmarks/cpu_step_paths.py 2>/dev/null | tee "$OUT/step_paths.txt"

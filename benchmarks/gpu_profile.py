"""Profile a few decode steps of the Qwen3-0.6B-shaped model on CUDA (see gpu_bench.py).

    python benchmarks/gpu_profile.py BATCH [nosplit] [noahead] [torchops]
    nosplit: one program per context; noahead: without async scheduling; torchops: torch's
    element-wise ops instead of the Triton kernels
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_bench import build_qwen3_0_6b  # noqa: E402

from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
model = build_qwen3_0_6b(Path("/tmp/qwen3-0.6b-random"))
engine = LLMEngine(EngineConfig(model=str(model), device="cuda", max_num_seqs=256, max_num_batched_tokens=16384,
                                max_model_len=4096, kv_cache_memory="24GiB", enable_prefix_caching=False,
                                async_scheduling="noahead" not in sys.argv,
                                kernels="torch" if "torchops" in sys.argv else "auto"))
if "nosplit" in sys.argv:  # decode attention without splitting contexts (the graphs are captured again)
    engine.runner.worker.backend.num_sms = 1
    engine.runner.worker.capture_graphs(256, 4096)
rng = random.Random(0)
for i in range(batch):
    prompt = [rng.randrange(10000) for _ in range(500)]
    engine.add_request(str(i), prompt, SamplingParams(max_tokens=400, ignore_eos=True))
for _ in range(20):
    engine.step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20):
    engine.step()
torch.cuda.synchronize()
print(f"batch {batch}: {(time.perf_counter() - t) / 20 * 1e3:.1f} ms per decode step", flush=True)
activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
with torch.profiler.profile(activities=activities) as prof:
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

# Where the host's time goes in a step (Python side), with the GPU work included where it is waited for.
import cProfile  # noqa: E402
import pstats  # noqa: E402

profiler = cProfile.Profile()
profiler.enable()
for _ in range(20):
    engine.step()
torch.cuda.synchronize()
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

"""CPU backend: a C++ kernel (csrc/paged_attention_cpu.cpp) for short queries, SDPA for long ones.

The kernel is compiled with torch's extension tooling on first use and cached under
torch's extension directory (~/.cache/torch_extensions), so later runs load it in
milliseconds. If no compiler is available the engine falls back to the torch backend.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from tokenmill.attention import AttentionMetadata, write_kv
from tokenmill.attention.reference import attend_sequences

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "paged_attention_cpu.cpp"


def load_kernel(required: bool):
    """Build (once) and import the C++ kernel; None when it cannot be built and not required."""
    try:
        from torch.utils.cpp_extension import load
        os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
        return load(name="tokenmill_paged_attention_cpu", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as exc:  # a missing compiler or headers: fall back rather than fail
        if required:
            raise RuntimeError(f"cannot build the CPU attention kernel: {exc}") from exc
        logger.warning("CPU attention kernel unavailable (%s); using the torch backend", exc)
        return None


class CpuPagedAttention:
    name = "cpu"
    short_query_max = 16  # longer prompt chunks are faster through SDPA's blocked kernel

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta)
        b, t = meta.num_short, meta.num_short_tokens
        if b == meta.num_seqs:
            return self.kernel.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                               meta.seq_lens, scale)
        out = torch.empty_like(q)
        if b:
            out[:t] = self.kernel.paged_attention(q[:t], k_cache, v_cache, meta.block_tables[:b],
                                                  meta.query_start_loc[:b + 1], meta.seq_lens[:b], scale)
        attend_sequences(q, k_cache, v_cache, meta, scale, out, first=b)
        return out

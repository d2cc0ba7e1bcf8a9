"""Decodes batched in plain torch: gather every decoding sequence's context into a padded
(B, L, Hkv, D) tensor and run one masked SDPA. The gather copies the context, which costs
memory bandwidth: cheap on a GPU, expensive on a CPU (where the C++ kernel reads the pool
in place). Prompt chunks go one by one through the reference path.

The padding reads slots past each sequence's end; they are masked out, but a NaN there
would still poison the product with V, so this backend asks for a zero-initialised pool
(`reads_padding`): afterwards every slot holds zeros or some earlier, finite K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata, write_kv
from tokenmill.attention.reference import attend_sequences


class TorchBatchedAttention:
    name = "torch"
    short_query_max = 1    # only single-token queries are batched
    reads_padding = True   # the runner zero-fills the pool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        b = meta.num_short
        if b:
            bs = meta.block_size
            num_blocks = -(-max(meta.seq_lens_host[:b]) // bs)
            tables = meta.block_tables[:b, :num_blocks].long()
            shape = (b, k_cache.shape[1], num_blocks * bs, k_cache.shape[3])
            # (B, Hkv, L, D), widened to the queries' dtype where the pool is narrower
            keys = k_cache[tables].transpose(1, 2).reshape(shape).to(q.dtype)
            values = v_cache[tables].transpose(1, 2).reshape(shape).to(q.dtype)
            mask = torch.arange(num_blocks * bs, device=q.device) < meta.seq_lens[:b].unsqueeze(1)  # (B, L)
            queries = q[:b].unsqueeze(2)              # (B, Hq, 1, D)
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None, None, :],
                                                  scale=scale, enable_gqa=True)
            out[:b] = attn.squeeze(2)
        attend_sequences(q, k_cache, v_cache, meta, scale, out, first=b)
        return out

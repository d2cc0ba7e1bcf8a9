"""Paged attention over a ragged batch.

The flat batch holds the new tokens of every scheduled sequence back to back:

    tokens      | a0 a1 a2 a3 | b0 | c0 c1 |          (T = 7, no padding)
    query_start   0             4    5       7
    seq_lens      a: 9 (5 cached + 4 new), b: 30 (decode), c: 2 (first chunk)

Each layer first writes the new K/V into the pool at each token's slot (the block that
holds its position, and the offset in that block), then attends each query token to its
own sequence's context only, causally: the query at absolute position p sees positions
0..p of its sequence, read through the sequence's block table.

The pool of one layer is (num_blocks, kv_heads, block_size, head_dim): the keys of one
head in one block are 4 KB of contiguous memory, which the CPU kernel streams. (An int8 pool's
rows are head_dim + 4 bytes wide, for their scales: worker.py.)

A layer with a sliding window of w tokens (forward's `window`) lets the query at position p see
only p - w + 1 .. p; every backend then starts reading a sequence at the block that holds the
first position its queries see, so blocks before it (given back to the pool, their table entries
a scratch block) are never read.

A layer may soft-cap its scores (Gemma 2, forward's `softcap`: s becomes c * tanh(s / c) before
the softmax), and may have attention sinks (gpt-oss, forward's `sinks`: a learned logit per query
head that joins each softmax's denominator and adds no value); every backend does both.

Backends share that contract and differ in speed:
  * reference: per sequence, gather the context and call SDPA. Obvious; the oracle.
  * cpu:       a C++ kernel reads K/V straight from the pool for decodes, speculative
               verification and, when the head size is a multiple of 32, prompt chunks of
               any length (as small matrix products); otherwise chunks longer than 32 tokens
               go through SDPA as in the reference. The only backend for an int8 pool (8-bit
               codes and a float32 scale per token and head, csrc/paged_attention_cpu.cpp),
               whose every query it then takes.
  * torch:     decodes batched by gathering a padded context (fine where memory bandwidth
               is plentiful, i.e. on a GPU); prompt chunks as in the reference.
  * triton:    (CUDA) Triton kernels read K/V in place from the pool: one for decodes, one
               for all the step's prompt chunks at once (causal, tiles of 64 queries).
"""

from __future__ import annotations

import os

import torch

from tokenmill.attention.metadata import AttentionMetadata, write_kv

__all__ = ["AttentionMetadata", "make_backend", "write_kv"]


def make_backend(name: str, device: torch.device, block_size: int = 16, head_dim: int = 64,
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None):
    """Pick an attention backend. "auto": the C++ kernel on a CPU (for float32 models, the only
    ones it takes), Triton on CUDA, and batched torch where those cannot be had (no compiler, no
    triton, tile shapes Triton cannot take, another dtype on a CPU). An int8 pool (kv_dtype) has
    the C++ kernel or nothing."""
    if kv_dtype == torch.int8:
        return _int8_pool_backend(name, device, head_dim, dtype)
    from tokenmill.attention.reference import ReferenceAttention
    from tokenmill.attention.torch_batched import TorchBatchedAttention

    if name == "reference":
        return ReferenceAttention()
    if name == "cpu" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"attention_backend='cpu' runs float32 models on a CPU, not {dtype} on {device.type} "
                         "(use 'auto' or 'torch')")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' runs on CUDA (or under TRITON_INTERPRET=1), "
                         f"not on {device.type} (use 'auto')")
    if name == "cpu" or (name == "auto" and device.type == "cpu" and dtype == torch.float32):
        from tokenmill.attention.cpu import CpuPagedAttention
        from tokenmill.cpu_kernels import load_cpu_kernels
        kernels = load_cpu_kernels(required=name == "cpu")
        return CpuPagedAttention(kernels, head_dim) if kernels is not None else TorchBatchedAttention()
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        backend = _triton_backend(block_size, head_dim, required=name == "triton")
        if backend is not None:
            return backend
    return TorchBatchedAttention()


def _int8_pool_backend(name: str, device: torch.device, head_dim: int, dtype: torch.dtype):
    """The C++ kernel over an int8 pool, or a ValueError that says what is missing."""
    if name not in ("auto", "cpu") or device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype='int8' is read by the CPU kernels alone: it needs float32 activations "
                         f"on a CPU and attention_backend 'auto' or 'cpu', not {dtype} on {device.type} with {name!r}")
    from tokenmill.attention.cpu import CpuPagedAttention
    from tokenmill.cpu_kernels import load_cpu_kernels
    return CpuPagedAttention(load_cpu_kernels(required=True), head_dim, int8_pool=True)


def _triton_backend(block_size: int, head_dim: int, required: bool):
    try:
        from tokenmill.attention.triton_decode import TritonPagedAttention, supported
    except ImportError:
        if required:
            raise
        return None
    if supported(block_size, head_dim):
        return TritonPagedAttention()
    if required:
        raise ValueError(f"the triton backend needs power-of-two block_size and head_dim >= 16, "
                         f"got {block_size} and {head_dim}")
    return None

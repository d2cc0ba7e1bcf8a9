"""Draft proposers for speculative decoding (spec_decode.py verifies what they propose).

  NgramProposer       prompt lookup: continue the latest earlier occurrence of the sequence's
                      last n tokens (n from ngram_max down to ngram_min); no second model.
  DraftModelProposer  a smaller model of the same tokenizer with its own paged KV cache.

Both set `request.draft_token_ids` (and, for a sampled draft model, `request.draft_probs`).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.device import activation_dtype
from tokenmill.request import Request
from tokenmill.sampler import SamplingMetadata


class NgramProposer:
    """Prompt lookup: no second model, drafts copied from the sequence itself."""

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        return 0  # no cache of its own

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max})")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        pass

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        for r, k in zip(requests, ks):
            r.draft_token_ids = self.lookup(r.token_ids, k)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest matching suffix."""
        arr = np.asarray(tokens)
        for n in range(min(self.ngram_max, len(arr) - 1), self.ngram_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every earlier n-gram
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def sync(self, request: Request) -> None:
        pass  # no state of its own: drafts are read from the sequence each step

    def release(self, request_id: str) -> None:
        pass


class DraftModelProposer:
    """A smaller model of the same tokenizer, with its own paged KV cache.

    Per step: catch up on the tokens the target accepted since last time (the whole prompt
    the first time), then k single-token steps, all sequences batched as a ragged batch.
    Its cache then holds the sequence plus k - 1 drafts; after verification `sync` trims it
    back to the tokens the target kept. A sequence whose draft cache does not fit, or that
    would run past the draft model's context length, simply gets no drafts this step.
    """

    def __init__(self, engine_config, model_path: str, target_vocab: int) -> None:
        from tokenmill.models.loader import load_model, open_checkpoint, resolve_model_path

        self.config = engine_config
        device = torch.device(engine_config.device)
        dtype = activation_dtype(engine_config, device)
        checkpoint = open_checkpoint(resolve_model_path(model_path))
        # The same tokenizer, its embedding table padded to the same or a smaller size (Qwen2.5-0.5B
        # pads to 151,936 rows, the 7B to 152,064): the draft's distributions get zeros past its rows.
        if checkpoint.config.vocab_size > target_vocab:
            raise ValueError(f"draft model vocab ({checkpoint.config.vocab_size}) is larger than the target's "
                             f"({target_vocab}): it must share the tokenizer")
        self.target_vocab, self.vocab = target_vocab, checkpoint.config.vocab_size
        self.max_len = max_len = checkpoint.config.max_position_embeddings
        self.model_config = checkpoint.config
        self.model = load_model(checkpoint, max_len, dtype, device, engine_config.kernels,
                                engine_config.gguf_blocks, engine_config.int8_rows_choice,
                                bf16_weights=engine_config.bf16_weights_choice)
        self.seqs: dict[str, Request] = {}   # request id -> the draft model's view of the sequence

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        """One token's K and V in the draft's pool."""
        from tokenmill.worker import kv_bytes_per_token
        return kv_bytes_per_token(self.model_config, kv_dtype)

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """The draft's KV pool (in the target pool's dtype) and runner, once the engine has sized the
        target's pool (the draft's weights are loaded before, so that a GPU's pool is sized from the
        memory they leave)."""
        from tokenmill.attention import make_backend
        from tokenmill.config import CacheConfig
        from tokenmill.kv_cache import KVCacheManager
        from tokenmill.model_runner import ModelRunner
        from tokenmill.worker import ModelWorker

        cfg, device = self.config, torch.device(self.config.device)
        # a draft whose every layer slides gives back its blocks outside the window as the target does
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False,
                                 window=self.model_config.kv_window)
        backend = make_backend(cfg.attention_backend, device, block_size, self.model_config.head_dim,
                               activation_dtype(cfg, device), kv_dtype)
        worker = ModelWorker(self.model, self.model_config, CacheConfig(num_blocks, block_size), backend, device,
                             kv_dtype)
        self.runner = ModelRunner(worker, cfg.seed)

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        active, counts, steps = [], [], max(ks, default=0)
        for r, k in zip(requests, ks):
            seq = self.seqs.get(r.request_id)
            if seq is None:
                seq = self.seqs[r.request_id] = Request(request_id=r.request_id, prompt_token_ids=[],
                                                        params=r.params.clone(n=1), max_tokens=1 << 30)
            elif seq.num_computed_tokens >= r.num_tokens:  # drafts no step verified (the request went
                self.sync(r)                                # unscheduled or was preempted): observe never synced
            seq.token_ids = list(r.token_ids)
            self.kv.release_outside_window(seq)
            catch_up = seq.num_tokens - seq.num_computed_tokens
            # no drafts past the draft model's own context (its rotary tables end there), nor for a
            # sequence with a token past its vocabulary (one of the target's padding rows)
            if (k == 0 or r.num_tokens + k > self.max_len
                    or max(seq.token_ids[seq.num_computed_tokens:], default=0) >= self.vocab
                    or not self.kv.allocate(seq, catch_up + k)):
                self.release(r.request_id)
                continue
            active.append((r, seq, k))
            counts.append(catch_up)
        draft_probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in active}
        for step in range(steps):
            batch = [(r, seq, n) for (r, seq, k), n in zip(active, counts) if step < k]
            if not batch:
                break
            tokens, probs = self._step([seq for _, seq, _ in batch], [n for _, _, n in batch])
            for (r, seq, n), token, q in zip(batch, tokens, probs):
                seq.num_computed_tokens += n
                seq.token_ids.append(token)
                draft_probs[r.request_id].append(q)
            counts = [1] * len(active)
        for r, seq, k in active:
            r.draft_token_ids = seq.token_ids[r.num_tokens:]
            if r.params.greedy:
                r.draft_probs = None
            else:
                q = torch.stack(draft_probs[r.request_id])
                r.draft_probs = torch.nn.functional.pad(q, (0, self.target_vocab - q.shape[-1]))

    @torch.inference_mode()
    def _step(self, seqs: list[Request], counts: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft forward pass; the next token of each sequence and its distribution q."""
        runner = self.runner
        inputs = runner.prepare(seqs, counts)
        hidden = runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta)
        logits = runner.worker.compute_logits(hidden[inputs.logits_indices])
        by_id = {s.request_id: i for i, s in enumerate(inputs.sampling_requests)}
        order = [by_id[s.request_id] for s in seqs]  # prepare may reorder; give results in input order
        logits = logits[order]
        meta = SamplingMetadata.build(seqs, {}, logits.shape[1], logits.device)
        if meta.all_greedy:
            return logits.argmax(dim=-1).tolist(), [None] * len(seqs)
        probs = runner.sampler.filter(logits, meta).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=runner.sampler.generator).squeeze(1)
        greedy = logits.argmax(dim=-1)
        tokens = torch.where(meta.greedy, greedy, tokens)
        return tokens.tolist(), list(probs)

    def sync(self, request: Request) -> None:
        """Trim the draft cache to the tokens the target kept, short of its last one: the next
        proposal feeds at least that token, whose logits give the first draft."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            return
        common = 0
        limit = min(seq.num_computed_tokens, request.num_tokens - 1)
        while common < limit and seq.token_ids[common] == request.token_ids[common]:
            common += 1
        seq.num_computed_tokens = common
        self.kv.trim(seq)

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)


def make_proposer(kind: str, engine_config, target_vocab: int):
    """The proposer, before its KV pool (`allocate`, once the engine has sized its own)."""
    if kind == "ngram":
        return NgramProposer(engine_config.ngram_min, engine_config.ngram_max)
    if kind.startswith("draft:"):
        return DraftModelProposer(engine_config, kind[len("draft:"):], target_vocab)
    raise ValueError(f"speculative must be 'ngram' or 'draft:PATH', got {kind!r}")

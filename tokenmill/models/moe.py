"""The mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss).

A router (one linear layer, `gate`; gpt-oss's with a bias) scores every expert for every token;
softmax in float32, the top k kept, renormalised to sum to 1 where the model does it (gpt-oss
instead keeps the k largest logits and takes the softmax over those alone). A step then runs only
the experts its tokens chose, each once over all the rows routed to it:

    (token, slot) pairs, T * k      sorted by expert:  e0 e0 e0 | e2 | e3 e3 | ...
    rows = x[token of each pair]    one product per active expert over its run of rows
    out[token] += weight * y        index_add back into (T, hidden)

So an expert's weights are read once a step however many tokens chose it, and an expert no
token chose is not read at all. The experts are the dense layers' SwiGLU modules (gate and up
fused into one matrix), or gpt-oss's ClampedSwiGLU (below), built by the caller: on a CPU the
loader packs them, biases and all, for the panel kernel like any other projection.

Under tensor parallelism each rank holds a contiguous share of the experts (expert parallelism:
whole experts, so a quantized file's blocks are never cut) and an AbsentExpert in place of the
others; the rows routed to an absent expert count zero here, and the sum over the ranks (one
all-reduce after the block, models/parallel.py) adds every expert's share once.

On a CPU with the C++ kernels, a layer's routed SwiGLU experts whose weights are all bias-free
panel products of one format (not gpt-oss's clamped ones, nor a tensor-parallel rank's share) run
as one call instead (`fused_experts`, csrc/moe_cpu.cpp, built by cpu_packing.fuse_experts):
the same grouping, products (with CpuFusedOps' silu_mul), weighting and sums, bit for bit,
without a call from Python per expert product. Its routing is route's arithmetic in plain loops
(`fused_experts.route`): the same experts and weights within float32 rounding of torch's,
without half a dozen torch operations a layer.

On CUDA (and on a CPU in another dtype than float32, where the C++ kernels do not run), a
layer's routed SwiGLU experts (bias-free, all on this rank) are stacked into one gate_up and one
down tensor at load (`group_experts`; each expert's weights become views of them) and run as two
grouped products (`torch._grouped_mm`, one kernel each over every expert's run of
rows, the runs' ends given on the device): no host sync and no Python per expert, so the same
path also runs inside a captured CUDA graph. Without it (another device or dtype
`_grouped_mm` refuses, gpt-oss's biased experts, a tensor-parallel rank's share), the loop above
runs; and while a CUDA graph is being captured, where the counts per expert cannot be read on the
host, each expert runs over every row, weighted by zero where it was not chosen: the same sums,
slower. A graph of one token (batch-1 decode) takes that path even where the experts are grouped:
there the grouped products' fixed cost outweighs running every expert over the one row (measured
on an H100, BENCHMARKS.md); from two tokens the grouped products win.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import MoEConfig

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")  # model_type values this block serves

# Mixtral's checkpoint names for what the other models call mlp, gate_proj, up_proj and down_proj
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def checkpoint_name(name: str) -> str:
    """A Hugging Face tensor name with Mixtral's expert names replaced by Qwen's
    (layers.0.block_sparse_moe.experts.3.w1.weight -> layers.0.mlp.experts.3.gate_proj.weight)."""
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL_NAMES.items():
        name = name.replace(old, new)
    return name


class AbsentExpert(nn.Module):
    """An expert another tensor-parallel rank holds: no weights here, nothing computed."""


def route(logits: torch.Tensor, top_k: int, renormalise: bool,
          softmax_after_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) float32, expert ids (T, k) int64): softmax in
    float32 over all experts, the k most probable, divided by their sum when `renormalise`; or,
    with `softmax_after_topk` (gpt-oss), the k largest logits and a softmax over those k."""
    if softmax_after_topk:
        top, experts = logits.topk(top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert: projections with biases around a clamped SwiGLU,

        gate = min(gate, limit),  up = clamp(up, -limit, limit)
        out  = down((up + 1) * gate * sigmoid(alpha * gate))

    gate_up_proj holds the gate rows then the up rows, as the dense MLP's (the checkpoint
    interleaves them: gpt_oss.py puts them in this order at load)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, alpha: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.limit, self.alpha = limit, alpha

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)        # (N, I) each
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj.forward((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class SparseMoeBlock(nn.Module):
    """Routed SwiGLU experts (and Qwen2-MoE's shared expert, gated by a sigmoid) over a flat
    batch of T tokens. `experts` and `shared_expert` are modules with forward(x, ops), such as
    llama.MLP."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, experts: list[nn.Module],
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        if len(experts) != cfg.num_experts:
            raise ValueError(f"SparseMoeBlock: {len(experts)} experts given, the config has {cfg.num_experts}")
        self.top_k, self.norm_topk_prob, self.float32_weights = cfg.top_k, cfg.norm_topk_prob, cfg.float32_weights
        self.softmax_after_topk = cfg.softmax_after_topk
        self.gate = nn.Linear(hidden_size, cfg.num_experts, bias=cfg.router_bias)  # the router
        self.experts = nn.ModuleList(experts)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None
        self.fused_experts = None  # the routed experts as one C++ call (cpu_packing.fuse_experts); None: per expert
        self.grouped: tuple[torch.Tensor, torch.Tensor] | None = None  # stacked (gate_up, down): group_experts

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        logits = self.gate.forward(x)                                           # (T, E)
        if self.fused_experts is not None:  # route's arithmetic in plain C++ loops, then the experts' call
            weights, experts = self.fused_experts.route(logits, self.top_k, self.norm_topk_prob)
            out = self.fused_experts.forward(x, experts, weights)
        else:
            out = self._experts(x, *route(logits, self.top_k, self.norm_topk_prob, self.softmax_after_topk), ops)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate.forward(x)) * self.shared_expert.forward(x, ops)
        return out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, ops) -> torch.Tensor:
        """The routed experts' weighted sum, (T, hidden), by the path this device and step take."""
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.grouped is not None and not (capturing and x.shape[0] == 1):
            return self._grouped_experts(x, weights, experts, ops)
        if capturing:
            return self._every_expert(x, weights, experts, ops)
        return self._routed_experts(x, weights, experts, ops)

    def _scaled(self, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert outputs (N, hidden) times their weights (N,) float32, in y's dtype: Mixtral
        multiplies by the float32 weights, the others by the weights cast to y's dtype."""
        if self.float32_weights:
            return (y * weights.unsqueeze(1)).to(y.dtype)
        return y * weights.to(y.dtype).unsqueeze(1)

    def _pairs_by_expert(self, x: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, slot) pairs, flat (T * k,) expert ids, sorted by expert: their order, each
        one's token and x's row for it (T * k, hidden), grouped by expert."""
        order = flat.argsort(stable=True)
        tokens = order // self.top_k
        return order, tokens, x.index_select(0, tokens)

    def _added_back(self, x: torch.Tensor, tokens: torch.Tensor, y: torch.Tensor,
                    pair_weights: torch.Tensor) -> torch.Tensor:
        """The pairs' outputs y, weighted, summed into their tokens' rows: (T, hidden)."""
        return torch.zeros_like(x).index_add_(0, tokens, self._scaled(y, pair_weights))

    def _routed_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, ops) -> torch.Tensor:
        """Tokens grouped by expert, one product per active expert, weighted and added back."""
        flat = experts.flatten()                                        # (T * k,) expert of each pair
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one host sync a layer
        order, tokens, rows = self._pairs_by_expert(x, flat)
        y = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                if isinstance(expert, AbsentExpert):
                    y[start:start + count] = 0
                else:
                    y[start:start + count] = expert.forward(rows[start:start + count], ops)  # (count, hidden)
                start += count
        return self._added_back(x, tokens, y, weights.flatten()[order])

    def _grouped_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, ops) -> torch.Tensor:
        """The same grouping as _routed_experts, each projection one grouped product over the
        experts' runs of rows; the runs' ends computed on the device (no host sync)."""
        gate_up, down = self.grouped
        flat = experts.flatten()                                        # (T * k,) expert of each pair
        counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
        ends = counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
        order, tokens, rows = self._pairs_by_expert(x, flat)
        h = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=ends)           # (T * k, 2 * width)
        y = torch._grouped_mm(ops.silu_mul(h), down.transpose(-2, -1), offs=ends)   # (T * k, hidden)
        return self._added_back(x, tokens, y, weights.flatten()[order])

    def _every_expert(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, ops) -> torch.Tensor:
        """Every expert over every row, weighted by zero where it was not chosen: no host sync."""
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            if isinstance(expert, AbsentExpert):
                continue
            chosen = (weights * (experts == index)).sum(dim=-1)          # (T,) this expert's weight, or 0
            out += self._scaled(expert.forward(x, ops), chosen)
        return out


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm computes on this device in this dtype (CUDA's needs bfloat16 and
    a recent GPU; torch's CPU fallback takes float32 and bfloat16), tried on a tiny product."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a, b = torch.ones(4, 16, device=device, dtype=dtype), torch.ones(2, 16, 16, device=device, dtype=dtype)
        torch._grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def group_experts(model: nn.Module) -> int:
    """Stack the routed experts of every SparseMoeBlock in `model` whose experts are all bias-free
    SwiGLU modules held here (gate_up_proj and down_proj, no AbsentExpert) into one (E, 2 * width,
    hidden) and one (E, hidden, width) tensor, each expert's weights then views of them, so that
    the block runs them as grouped products. Rows of each product must start on 16 bytes, as
    _grouped_mm asks. Returns how many blocks were grouped."""
    grouped = 0
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock) or not _groupable(block.experts):
            continue
        stacked = []
        for name in ("gate_up_proj", "down_proj"):
            weights = torch.stack([getattr(e, name).weight.detach() for e in block.experts])
            for index, expert in enumerate(block.experts):
                getattr(expert, name).weight = nn.Parameter(weights[index], requires_grad=False)
            stacked.append(weights)
        block.grouped = (stacked[0], stacked[1])
        grouped += 1
    return grouped


def _groupable(experts: nn.ModuleList) -> bool:
    """Whether every expert is a bias-free SwiGLU module held here, its rows a multiple of 16 bytes."""
    for e in experts:
        if not (hasattr(e, "gate_up_proj") and hasattr(e, "down_proj")) or isinstance(e, ClampedSwiGLU):
            return False
        if e.gate_up_proj.bias is not None or e.down_proj.bias is not None:
            return False
        if any(w.shape[-1] * w.element_size() % 16 for w in (e.gate_up_proj.weight, e.down_proj.weight)):
            return False
    return True

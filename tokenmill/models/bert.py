"""BERT as a bidirectional encoder over the engine's flat, ragged batch, for embeddings
(BertModel checkpoints, such as sentence-transformers' all-MiniLM-L6-v2):

    x = LayerNorm(word[id] + position[pos] + token_type[0])       absolute positions, one segment
    each layer, norm after the residual add:
        x = LayerNorm(x + O(attention(x)))                        q, k, v, O with biases
        x = LayerNorm(x + W2 gelu(W1 x))                          gelu as hidden_act says

Attention goes both ways, so a prompt's hidden states at every position depend on all of it:
it cannot run in chunks, nor start from cached K/V. Each encoder request therefore runs its whole
prompt in one step from position 0 (Request.bidirectional; the scheduler grants it whole or
not at all), and attention is over each prompt's own rows of the step, read from
`query_start_loc_host`: prompts of similar length padded into one scaled_dot_product_attention
call, the padding masked, no attention across prompts (group_prompts). No K/V
is kept between steps (the worker's pool has no layers for an encoder; its blocks are only
bookkeeping). The final hidden states go to the pooler as a decoder's do, and the model has no
LM head: an encoder engine generates nothing.

A sentence-transformers directory says how its vectors are pooled: modules.json lists a
Transformer (this model), a Pooling module (1_Pooling/config.json: cls, mean or lasttoken) and
optionally Normalize. Those are the engine's defaults for its embedding requests; a plain BertModel
directory pools the [CLS] token's state, L2-normalised (vLLM's default for BERT).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.config import EncoderConfig, ModelConfig, UnsupportedModel
from tokenmill.host_memory import to_device

# config.json's hidden_act -> F.gelu's approximate
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# sentence-transformers' pooling modes that tokenmill runs -> PoolingParams.pooling
ST_POOLING_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
# the boolean keys of an older 1_Pooling/config.json -> the mode each turns on
ST_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
ST_MODULES = ("Transformer", "Pooling", "Normalize")


def bert_model_config(path: Path, cfg: dict) -> ModelConfig:
    """The ModelConfig of a BERT directory: config.json (`cfg`), and its sentence-transformers
    modules for the pooling. Variants this model does not run are refused by name."""
    act = cfg.get("hidden_act", "gelu")
    if act not in GELU_APPROXIMATIONS:
        raise UnsupportedModel(f"unsupported hidden_act {act!r} for bert (supported: {', '.join(GELU_APPROXIMATIONS)})")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModel(f"unsupported position_embedding_type {cfg['position_embedding_type']!r} for bert "
                               "(supported: absolute)")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise UnsupportedModel("unsupported bert variant: is_decoder / add_cross_attention "
                               "(tokenmill runs the encoder)")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    if hidden % heads:
        raise ValueError(f"bert: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    pooling, normalize = sentence_transformers_pooling(path)
    encoder = EncoderConfig(layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
                            type_vocab_size=cfg.get("type_vocab_size", 2), gelu_approximate=GELU_APPROXIMATIONS[act],
                            pooling=pooling, normalize=normalize)
    return ModelConfig(
        architecture="bert", vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, max_position_embeddings=cfg.get("max_position_embeddings", 512),
        encoder=encoder)


def sentence_transformers_pooling(path: Path) -> tuple[str, bool]:
    """(pooling, normalize) from a sentence-transformers directory's modules.json and its Pooling
    module's config; ("cls", True) for a directory without modules.json."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return "cls", True
    modules = json.loads(modules_file.read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if unknown := [k for k in kinds if k not in ST_MODULES]:
        raise UnsupportedModel(f"{path}: unsupported sentence-transformers modules {unknown} "
                               f"(supported: {', '.join(ST_MODULES)})")
    if "Pooling" not in kinds:
        raise ValueError(f"{path}: modules.json lists no Pooling module")
    pooling = modules[kinds.index("Pooling")]
    return st_pooling_mode(json.loads((path / pooling["path"] / "config.json").read_text())), "Normalize" in kinds


def st_pooling_mode(cfg: dict) -> str:
    """PoolingParams.pooling from a 1_Pooling/config.json, in its current form ("pooling_mode") or
    its older one (pooling_mode_*_tokens booleans; none set means mean, as sentence-transformers
    reads it)."""
    if "pooling_mode" in cfg:
        modes = [cfg["pooling_mode"]] if isinstance(cfg["pooling_mode"], str) else list(cfg["pooling_mode"])
    else:
        modes = [mode for key, mode in ST_LEGACY_POOLING_KEYS.items() if cfg.get(key)] or ["mean"]
    if len(modes) != 1 or modes[0] not in ST_POOLING_MODES:
        raise UnsupportedModel(f"unsupported sentence-transformers pooling {modes} (supported: one of "
                               f"{', '.join(ST_POOLING_MODES)})")
    return ST_POOLING_MODES[modes[0]]


MAX_PADDING = 1.5  # a group of prompts padded to its longest has at most this many slots per token


@dataclass
class PromptGroup:
    """Prompts of similar length whose attention runs as one padded batch (n prompts, L slots each:
    the longest one's tokens); built on the host once per step, used by every layer, indexed
    without boolean masks so that a GPU never waits for the host."""

    rows: torch.Tensor         # (n, L) int64: the flat-batch row in each slot (padding repeats its prompt's first)
    slots: torch.Tensor        # (tokens,) int64: the real slots, as indices into the (n * L) grid
    targets: torch.Tensor      # (tokens,) int64: the flat-batch row of each real slot
    bias: torch.Tensor | None  # (n, 1, 1, L): 0 for a real key, -inf for padding; None: no padding


def group_prompts(spans: list[int], device: torch.device, dtype: torch.dtype) -> list[PromptGroup]:
    """The step's prompts (spans: their first rows and the end, query_start_loc_host) sorted by
    length and cut into groups whose padding keeps them within MAX_PADDING slots per token: a
    batch of short prompts costs one attention call rather than one each, and a long prompt beside
    many short ones does not pad them all to its length."""
    lengths = [end - start for start, end in zip(spans[:-1], spans[1:])]
    groups, members, tokens = [], [], 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if members and (len(members) + 1) * lengths[i] > MAX_PADDING * (tokens + lengths[i]):
            groups.append(members)
            members, tokens = [], 0
        members.append(i)
        tokens += lengths[i]
    groups.append(members)
    out = []
    for members in groups:
        starts = torch.tensor([spans[i] for i in members]).unsqueeze(1)  # (n, 1)
        slots = torch.arange(lengths[members[-1]])                       # (L,): the longest, last
        real = slots < torch.tensor([lengths[i] for i in members]).unsqueeze(1)  # (n, L)
        bias = None if real.all() else torch.zeros(real.shape, dtype=dtype).masked_fill(~real, float("-inf"))
        rows, taken = torch.where(real, starts + slots, starts), real.view(-1).nonzero().squeeze(1)
        out.append(PromptGroup(to_device(rows, device), to_device(taken, device),
                               to_device(rows.view(-1)[taken], device),
                               None if bias is None else to_device(bias[:, None, None, :], device)))
    return out


def bidirectional_attention(qkv: torch.Tensor, groups: list[PromptGroup]) -> torch.Tensor:
    """Each prompt's rows attend to all of that prompt's rows and to no other's. qkv: (T, 3, H, D);
    groups: the step's prompts (group_prompts). Returns (T, H * D)."""
    t, _, h, d = qkv.shape
    out = torch.empty_like(qkv[:, 0])  # (T, H, D)
    for g in groups:
        q, k, v = qkv[g.rows].permute(2, 0, 3, 1, 4).unbind(0)  # (n, H, L, D) each
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=g.bias).transpose(1, 2)  # (n, L, H, D)
        out.index_copy_(0, g.targets, attended.reshape(-1, h, d).index_select(0, g.slots))  # the real slots
    return out.view(t, h * d)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.encoder.layer_norm_eps
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps)
        self.up_proj = nn.Linear(hidden, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps)
        self.approximate = cfg.encoder.gelu_approximate

    def forward(self, x: torch.Tensor, groups: list[PromptGroup]) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(x.shape[0], 3, self.num_heads, self.head_dim)  # (T, 3, H, D)
        x = self.attention_norm(x + self.o_proj(bidirectional_attention(qkv, groups)))
        return self.output_norm(x + self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate)))


# A layer's checkpoint names (after encoder.layer.N.) -> (ours, shard of the fused q/k/v or None)
LAYER_NAMES = {
    "attention.self.query": ("qkv_proj", 0), "attention.self.key": ("qkv_proj", 1),
    "attention.self.value": ("qkv_proj", 2), "attention.output.dense": ("o_proj", None),
    "attention.output.LayerNorm": ("attention_norm", None), "intermediate.dense": ("up_proj", None),
    "output.dense": ("down_proj", None), "output.LayerNorm": ("output_norm", None)}
EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "embed_tokens", "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings", "embeddings.LayerNorm": "embedding_norm"}
# heads and buffers a BertModel checkpoint may carry that the encoder does not use: the pooler
# (tanh over [CLS], BertModel's, not sentence-transformers'), a masked-LM head, position ids
UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


def our_name(name: str) -> tuple[str, int | None] | None:
    """A checkpoint tensor's parameter here and its q/k/v shard; None for one the encoder does
    not use. A BertFor* checkpoint's "bert." prefix and old LayerNorm names (gamma, beta) are read too."""
    name = name.removeprefix("bert.")
    if name.startswith(UNUSED_PREFIXES):
        return None
    module, _, kind = name.rpartition(".")
    kind = {"gamma": "weight", "beta": "bias"}.get(kind, kind)
    if module in EMBEDDING_NAMES:
        return f"{EMBEDDING_NAMES[module]}.{kind}", None
    parts = module.split(".", 3)  # encoder, layer, N, the rest
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"] and parts[3] in LAYER_NAMES:
        ours, shard = LAYER_NAMES[parts[3]]
        return f"layers.{parts[2]}.{ours}.{kind}", shard
    raise ValueError(f"unexpected weight {name!r} in checkpoint")


class BertModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        hidden, enc = cfg.hidden_size, cfg.encoder
        # (not randomly initialised: the checkpoint overwrites them)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, hidden, _weight=torch.empty(cfg.vocab_size, hidden))
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, hidden,
                                                _weight=torch.empty(cfg.max_position_embeddings, hidden))
        self.token_type_embeddings = nn.Embedding(enc.type_vocab_size, hidden,
                                                  _weight=torch.empty(enc.type_vocab_size, hidden))
        self.embedding_norm = nn.LayerNorm(hidden, enc.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list, backend) -> torch.Tensor:
        """input_ids, positions: (T,), each prompt whole from position 0 (kv_caches and backend are
        the decoder's interface, unused). Returns the final hidden states (T, hidden)."""
        x = self.embed_tokens(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.embedding_norm(x)
        groups = group_prompts(meta.query_start_loc_host, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, groups)
        return x

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a BertModel checkpoint's tensors in, fusing q/k/v; raise on anything missing."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()
        hidden = self.config.hidden_size
        for name, tensor in weights:
            mapped = our_name(name)
            if mapped is None:
                continue
            target, shard = mapped
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            dest = params[target] if shard is None else params[target].narrow(0, shard * hidden, hidden)
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add((target, shard or 0))
        expected = {(n, i) for n in params for i in range(3 if ".qkv_proj." in n else 1)}
        if missing := sorted(expected - loaded):
            raise ValueError(f"checkpoint is missing weights: {[n for n, _ in missing][:8]}")


def load_bert(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
              device: torch.device) -> BertModel:
    """The encoder on `device` in `dtype`, filled from the checkpoint's tensors."""
    with torch.device("meta"):  # no random init: every weight is overwritten
        model = BertModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(weights)
    return model.eval()

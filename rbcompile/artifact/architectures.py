"""What rbcompile knows about each model type it compiles: one `Architecture` record each.

Everything the compiler needs beyond the traced graph lives here (the graph itself tells the
passes where blocks, residual adds, attention and matmuls are):
- `family`: decoder (causal LM, `AutoModelForCausalLM`) or encoder (`AutoModel`);
- `inputs`: the traced inputs, in order, and which one is the attention mask;
- `config`: which config attributes hold the dimensions (`dimensions(config)` reads them);
- `heads` / `channels`: the parameters (under a block's path) that hold attention heads and MLP
  channels, with the axis and index space they are laid out on, for importance permutation
  and elastic width;
- `kv_projections`: name parts of the key / value projections (prefix K/V cache candidates).

Adding an architecture is one record in REGISTRY plus a tiny-config case in
tests/artifact/test_architectures.py; `lookup` refuses any other model type with a message that says so.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rbcompile.errors import UserError

DECODER, ENCODER = "decoder", "encoder"
# the index spaces a width parameter is laid out on
QUERY_HEADS, KV_HEADS, CHANNELS = "q", "kv", "channels"


@dataclass(frozen=True)
class WidthParameter:
    """A parameter holding heads or channels: `suffix` under the block's module path, the
    `axis` they lie on, their index `space`, and `fused` blocks side by side (GPT-2's q/k/v).
    `blocks`: the index spaces of fused blocks of different spaces, in order (Phi-3's qkv_proj:
    q, kv, kv), instead of `fused` blocks of `space`. `narrowable`: whether keeping a prefix
    of its heads / channels is that parameter at the narrower width (not for a norm over all
    heads, OLMo 2's q/k norms: fewer heads change every head's scale); fused parameters are
    never narrowed (a prefix per block is not a view)."""
    suffix: str
    axis: int
    space: str
    fused: int = 1
    blocks: tuple[str, ...] = ()
    narrowable: bool = True

    @property
    def layout(self) -> tuple[str, ...]:
        """The index space of each block along the axis (one block unless fused)."""
        return self.blocks or (self.space,) * self.fused


@dataclass(frozen=True)
class ConfigNames:
    """Config attributes of each dimension, first present wins."""
    layers: tuple[str, ...] = ("num_hidden_layers",)
    hidden: tuple[str, ...] = ("hidden_size",)
    heads: tuple[str, ...] = ("num_attention_heads",)
    kv_heads: tuple[str, ...] = ("num_key_value_heads",)  # absent: as many as query heads
    head_dim: tuple[str, ...] = ("head_dim",)             # absent: hidden / heads
    channels: tuple[str, ...] = ("intermediate_size",)    # absent: 4 x hidden
    positions: tuple[str, ...] = ("max_position_embeddings",)


@dataclass(frozen=True)
class Dimensions:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    channels: int
    max_positions: int
    vocab: int


@dataclass(frozen=True)
class Architecture:
    model_type: str
    family: str
    heads: tuple[WidthParameter, ...]
    channels: tuple[WidthParameter, ...]
    kv_projections: tuple[str, ...]
    config: ConfigNames = ConfigNames()
    inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    mask_input: str = "attention_mask"
    # a config attribute p: positions start at p + 1 (RoBERTa's padding_idx + 1), p + 1 fewer
    position_offset: str | None = None

    def dimensions(self, config) -> Dimensions:
        """The model's sizes from its transformers config (or config.json as a dict)."""
        read = config.get if isinstance(config, dict) else lambda n, d=None: getattr(config, n, d)

        def first(names, default=None):
            return next((read(n) for n in names if read(n) is not None), default)

        hidden, heads = first(self.config.hidden), first(self.config.heads)
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1:
            raise UserError(f"{self.model_type} config lacks hidden size / attention heads "
                            f"({self.config.hidden[0]}, {self.config.heads[0]})")
        return Dimensions(layers=first(self.config.layers), hidden=hidden, heads=heads,
                          kv_heads=first(self.config.kv_heads, heads),
                          head_dim=first(self.config.head_dim, hidden // heads),
                          channels=first(self.config.channels, 4 * hidden),
                          max_positions=first(self.config.positions, 4096)
                          - ((read(self.position_offset) or 0) + 1 if self.position_offset else 0),
                          vocab=read("vocab_size"))

    def width_parameters(self, part: str) -> tuple[WidthParameter, ...]:
        """The parameters of `part` ("heads" or "channels")."""
        return {"heads": self.heads, "channels": self.channels}[part]


def _projections(prefix: str, names, axis: int, space: str):
    """Weight and bias of each projection `prefix.name` (a missing bias is skipped later)."""
    return tuple(WidthParameter(f"{prefix}.{name}.{tensor}", axis, space) for name in names
                 for tensor in ("weight", "bias"))


LLAMA = Architecture(
    model_type="llama", family=DECODER,
    heads=(_projections("self_attn", ["q_proj"], 0, QUERY_HEADS)
           + _projections("self_attn", ["k_proj", "v_proj"], 0, KV_HEADS)
           + (WidthParameter("self_attn.o_proj.weight", 1, QUERY_HEADS),)),
    channels=(_projections("mlp", ["gate_proj", "up_proj"], 0, CHANNELS)
              + (WidthParameter("mlp.down_proj.weight", 1, CHANNELS),)),
    kv_projections=("k_proj", "v_proj"))

GPT2 = Architecture(  # transformers' Conv1D stores weights as [in, out]
    model_type="gpt2", family=DECODER,
    heads=(WidthParameter("attn.c_attn.weight", 1, QUERY_HEADS, fused=3),
           WidthParameter("attn.c_attn.bias", 0, QUERY_HEADS, fused=3),
           WidthParameter("attn.c_proj.weight", 0, QUERY_HEADS)),
    channels=(WidthParameter("mlp.c_fc.weight", 1, CHANNELS),
              WidthParameter("mlp.c_fc.bias", 0, CHANNELS),
              WidthParameter("mlp.c_proj.weight", 0, CHANNELS)),
    kv_projections=("c_attn",),
    config=ConfigNames(layers=("n_layer",), hidden=("n_embd",), heads=("n_head",), kv_heads=(),
                       head_dim=(), channels=("n_inner",), positions=("n_positions",)))

BERT = Architecture(
    model_type="bert", family=ENCODER,
    heads=(_projections("attention.self", ["query", "key", "value"], 0, QUERY_HEADS)
           + (WidthParameter("attention.output.dense.weight", 1, QUERY_HEADS),)),
    channels=(_projections("intermediate", ["dense"], 0, CHANNELS)
              + (WidthParameter("output.dense.weight", 1, CHANNELS),)),
    kv_projections=("key", "value"))

# RoBERTa is BERT with positions from padding_idx + 1 (config.pad_token_id)
ROBERTA = dataclasses.replace(BERT, model_type="roberta", position_offset="pad_token_id")

DISTILBERT = Architecture(
    model_type="distilbert", family=ENCODER,
    heads=(_projections("attention", ["q_lin", "k_lin", "v_lin"], 0, QUERY_HEADS)
           + (WidthParameter("attention.out_lin.weight", 1, QUERY_HEADS),)),
    channels=(_projections("ffn", ["lin1"], 0, CHANNELS)
              + (WidthParameter("ffn.lin2.weight", 1, CHANNELS),)),
    kv_projections=("k_lin", "v_lin"),
    config=ConfigNames(layers=("n_layers",), hidden=("dim",), heads=("n_heads",), kv_heads=(),
                       head_dim=(), channels=("hidden_dim",)))

# Llama-shaped decoders: Qwen3 and Gemma 3 add per-head q/k norms (one weight shared by all
# heads: unchanged by head order); Granite multiplies embeddings, residual branches,
# attention scores and logits by constants; Gemma 2 / 3 put norms before and after each branch
# (inside it: skipping the branch skips them), scale embeddings and tie them to the LM head
QWEN3 = dataclasses.replace(LLAMA, model_type="qwen3")
GRANITE = dataclasses.replace(LLAMA, model_type="granite")
GEMMA2 = dataclasses.replace(LLAMA, model_type="gemma2")
GEMMA3_TEXT = dataclasses.replace(LLAMA, model_type="gemma3_text")

# OLMo 2: q/k norms over all heads at once (weights [heads x head_dim]): permuted with their
# heads; not narrowed (fewer heads would change the norm of the ones kept)
OLMO2 = dataclasses.replace(
    LLAMA, model_type="olmo2",
    heads=LLAMA.heads + (WidthParameter("self_attn.q_norm.weight", 0, QUERY_HEADS, narrowable=False),
                         WidthParameter("self_attn.k_norm.weight", 0, KV_HEADS, narrowable=False)))

# Phi-3: q/k/v in one matrix (q rows, then k, then v) and gate/up in one (gate rows, then up)
PHI3 = Architecture(
    model_type="phi3", family=DECODER,
    heads=(WidthParameter("self_attn.qkv_proj.weight", 0, QUERY_HEADS,
                          blocks=(QUERY_HEADS, KV_HEADS, KV_HEADS)),
           WidthParameter("self_attn.o_proj.weight", 1, QUERY_HEADS)),
    channels=(WidthParameter("mlp.gate_up_proj.weight", 0, CHANNELS, fused=2),
              WidthParameter("mlp.down_proj.weight", 1, CHANNELS)),
    kv_projections=("qkv_proj",))

# model types whose checkpoints have the same module names and dimensions as a record's: the
# record under another name (XLM-RoBERTa and CamemBERT are RoBERTa in transformers)
ALIASES = {LLAMA: ("mistral", "qwen2"), ROBERTA: ("xlm-roberta", "camembert")}

REGISTRY: dict[str, Architecture] = {
    arch.model_type: arch for arch in (
        LLAMA, GPT2, BERT, ROBERTA, DISTILBERT, QWEN3, GRANITE, OLMO2, PHI3, GEMMA2, GEMMA3_TEXT,
        *(dataclasses.replace(record, model_type=alias)
          for record, aliases in ALIASES.items() for alias in aliases))}


def lookup(config) -> Architecture:
    """The record of a transformers config (object or config.json dict); a UserError naming
    the model type, the supported ones and where to add a record otherwise."""
    read = config.get if isinstance(config, dict) else lambda n, d=None: getattr(config, n, d)
    model_type = read("model_type")
    if model_type in REGISTRY:
        return REGISTRY[model_type]
    classes = ",".join(read("architectures", None) or []) or "?"
    missing = f"; {NOT_EXPRESSIBLE[model_type]}" if model_type in NOT_EXPRESSIBLE else ""
    raise UserError(f"unsupported architecture: model_type={model_type!r} ({classes}){missing}; "
                    f"supported: {', '.join(sorted(REGISTRY))}; adding one is an Architecture "
                    "record in rbcompile/artifact/architectures.py")


# model types a record alone cannot add: what the passes lack for them
NOT_EXPRESSIBLE = {
    "deberta-v2": "its disentangled attention updates tensors in place (aten.add_ of the "
                  "relative-position scores, detach_ of lifted constants), which discover_blocks "
                  "takes for K/V-cache writes, so a layer exports more than its residual stream "
                  "(missing: a pass that functionalises in-place ops on layer-local tensors)",
}


def all_kv_projections() -> tuple[str, ...]:
    """K/V projection name parts of every record (graphs from torch.compile carry no config)."""
    return tuple(sorted({part for arch in REGISTRY.values() for part in arch.kv_projections}))

"""Qwen3 and Qwen3-MoE in PyTorch, driven by the checkpoint's config.json, with a static KV cache.

One forward serves every step: a prefill (a prompt per row, many tokens) and a decode step (one
token per row). Module names follow the Hugging Face checkpoint's, but for the fused qkv_proj and
gate_up_proj. This file is the reference: the Triton fast path (qwen3_triton.py) walks the same
modules' weights.
"""
import json
import math
import pathlib
import sys
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor


class UserError(Exception):
    """Bad input: the command-line tools print it as one line instead of a traceback."""


def read_json(path) -> dict:
    """A JSON object from a file; anything else (unreadable, not JSON, a list) is a UserError."""
    try:
        value = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, or not JSON
        raise UserError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(value, dict):
        kind = type(value).__name__
        raise UserError(f"{path}: not a JSON object but {kind}; download or convert it again")
    return value


def show_progress(what: str, done: int, total: int) -> None:
    """`what` and the share of it done, redrawn in place on stderr where stderr is a terminal (a
    log gets nothing); the line ends when done reaches total."""
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\r{what}: {100 * done // total}%", end=end, file=sys.stderr, flush=True)


def list_tensors(directory, pattern: str) -> dict[str, str]:
    """Every tensor's name in the safetensors files `pattern` of `directory` -> the file that holds
    it, read from the headers alone. A name in two files is refused: which one holds the weight is
    anyone's guess."""
    files = sorted(pathlib.Path(directory).glob(pattern))
    if not files:
        raise UserError(f"{directory}: no {pattern} files; download or convert it again")
    tensors = {}
    for file in files:
        try:
            with safe_open(file, "pt") as opened:
                names = list(opened.keys())
        except Exception as e:  # safetensors' own error type: a truncated or corrupt file
            raise UserError(f"{file}: not a readable safetensors file ({e})") from None
        twice = sorted(tensors.keys() & set(names))
        if twice:
            raise UserError(f"{file}: tensor {twice[0]} is in {tensors[twice[0]]} too")
        tensors.update(dict.fromkeys(names, str(file)))
    return tensors


# The supported architectures, each with its model_type
SUPPORTED = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
# The JSON types a config.json value may have, by the type of its ModelArgs field. A bool is no int
# here.
CONFIG_TYPES = {int: (int,), float: (int, float), bool: (bool,), list[int]: (list,), dict: (dict,)}


# What config.json must give, each above 0: no default is safe for these
REQUIRED = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings"]


def is_valid(value, field_type) -> bool:
    """Whether a config.json value suits a ModelArgs field: of one of its JSON types, and no
    negative int."""
    if type(value) not in CONFIG_TYPES.get(field_type, (str,)):
        return False
    return type(value) is not int or value >= 0


def rope_parameters(cfg: dict) -> dict:
    """The RoPE settings: rope_parameters (transformers 5), else rope_scaling (the hub's older
    configs)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"config.json: rope_parameters is {rope!r}, not an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise UserError(f"rope type {rope_type} is not supported: only default RoPE and YaRN")
    return dict(rope, rope_type=rope_type)


@dataclass
class ModelArgs:
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128  # its own setting: 0.6B's heads are 128 wide, not 1,024 / 16
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    # "int8": weight-only, a scale per output row (our converter's)
    quantization: str | None = None
    num_experts: int = 0  # MoE: experts per sparse layer; 0 for a dense model
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    # The dense layers of a MoE model
    mlp_only_layers: list[int] = field(default_factory=list)
    # The model's end-of-sequence tokens
    eos_token_id: list[int] = field(default_factory=list)
    # YaRN's parameters (factor, ...); empty: default RoPE
    yarn: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """From a Hugging Face Qwen3 config.json, or from the config.json our converter writes."""
        architecture = (cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
        model_type = cfg.get("model_type", "qwen3")
        if SUPPORTED.get(architecture) != model_type:
            raise UserError(f"{architecture} (model_type {model_type}) is not Qwen3: not supported")
        if cfg.get("use_sliding_window"):
            raise UserError("config.json: sliding-window attention is not supported")
        rope = rope_parameters(cfg)
        cfg = dict(cfg, rope_theta=rope.get("rope_theta", cfg.get("rope_theta")))
        # The hub's rope_scaling; our converter writes "yarn"
        if rope["rope_type"] == "yarn":
            named = ("rope_type", "type", "rope_theta")
            cfg["yarn"] = {key: value for key, value in rope.items() if key not in named}
            if not all(type(v) in (int, float, bool) for v in cfg["yarn"].values()):
                raise UserError(f"config.json: YaRN parameters {cfg['yarn']} are not all numbers")
        if type(cfg.get("eos_token_id")) is int:  # the hub writes one id, or a list
            cfg["eos_token_id"] = [cfg["eos_token_id"]]
        if "num_local_experts" in cfg:  # transformers' name for the hub's num_experts
            cfg["num_experts"] = cfg["num_local_experts"]
        given = {}
        for spec in fields(cls):
            value = cfg.get(spec.name)
            if value is None:
                continue
            if not is_valid(value, spec.type):
                raise UserError(f"config.json: {spec.name} is {value!r}, not a valid value")
            given[spec.name] = value
        missing = [name for name in REQUIRED if name not in given]
        if missing:
            raise UserError(f"config.json: {missing[0]} is missing; download or convert it again")
        for name in [*REQUIRED, "rope_theta"]:
            if given.get(name, 1) <= 0:
                raise UserError(f"config.json: {name} is {given[name]!r}; it must be above 0")
        if given.get("quantization") not in (None, "int8"):
            raise UserError(f"config.json: quantization {given['quantization']!r} is not supported")
        args = cls(**given)
        if cfg.get("head_dim") is None:
            args.head_dim = args.hidden_size // args.num_attention_heads
        if args.yarn:  # YaRN stretches the original context by its factor
            original = args.yarn.get("original_max_position_embeddings", 0)
            extended = int(original * args.yarn.get("factor", 1.0))
            args.max_position_embeddings = max(args.max_position_embeddings, extended)
        return args

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has a MoE block, as transformers decides it."""
        on_step = (layer + 1) % self.decoder_sparse_step == 0
        return self.num_experts > 0 and on_step and layer not in self.mlp_only_layers


def rope_frequencies(args: ModelArgs) -> tuple[Tensor, float]:
    """RoPE's inverse frequencies (head_dim / 2,) and the factor on cos and sin, as transformers
    computes them. YaRN (transformers' _compute_yarn_parameters) moves each frequency between the
    original one and the one divided by `factor` along a linear ramp, over the dimensions that turn
    between beta_fast and beta_slow times in the original context, and scales cos and sin by 0.1
    ln(factor) + 1 unless it is given an attention_factor."""
    dim = args.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    wavelengths = args.rope_theta ** exponents  # over 2 pi: (dim / 2,)
    original = 1.0 / wavelengths
    yarn = args.yarn
    if not yarn:
        return original, 1.0
    factor = yarn.get("factor", 1.0)
    scale = yarn.get("attention_factor")
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    context = yarn.get("original_max_position_embeddings", args.max_position_embeddings)

    # The dimension that turns `turns` times over the context
    def dimension(turns: float) -> float:
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(args.rope_theta))
    low = dimension(yarn.get("beta_fast") or 32)
    high = dimension(yarn.get("beta_slow") or 1)
    low = max(math.floor(low), 0)
    high = min(math.ceil(high), dim - 1)
    if high == low:
        high += 0.001  # as transformers: no division by zero
    # 0 below `low` (the original frequency), 1 above `high` (the interpolated one)
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    interpolated = 1.0 / (factor * wavelengths)  # transformers' rounding
    return interpolated * ramp + original * (1 - ramp), scale


class Linear(nn.Module):
    """A bias-free linear layer; with `experts`, a weight per expert: (experts, n_out, n_in). int8
    keeps the weight in int8 with a scale per output row (weight-only quantization)."""

    def __init__(self, n_in: int, n_out: int, int8: bool = False, experts: int | None = None):
        super().__init__()
        shape = (n_out, n_in) if experts is None else (experts, n_out, n_in)
        if int8:
            self.register_buffer("weight", torch.empty(shape, dtype=torch.int8))
            self.register_buffer("scale", torch.empty(shape[:-1]))
        else:
            self.weight = nn.Parameter(torch.empty(shape))
            self.scale = None

    def forward(self, x: Tensor) -> Tensor:
        # The int8 cast inside the product's expression: inductor fuses it into the product's loads
        # and never writes a full-precision copy of the weight.
        y = F.linear(x, self.weight.to(x.dtype))
        if self.scale is None:
            return y
        return y * self.scale


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: weight ~= q * scale[..., None]. Returns (q, scale)."""
    scale = weight.float().abs().amax(dim=-1).clamp(min=1e-8) / 127
    q = (weight.float() / scale[..., None]).round().clamp(-127, 127)
    return q.to(torch.int8), scale


def linear(args: ModelArgs, n_in: int, n_out: int, experts: int | None = None) -> Linear:
    return Linear(n_in, n_out, int8=args.quantization == "int8", experts=experts)


class StaticKVCache(nn.Module):
    """One layer's keys and values at absolute positions, a row per request slot: (slots, kv_heads,
    capacity, head_dim), zero-filled. A position not yet written, or left over from a longer earlier
    request, lies past every live query of its row, so the causal rule key_pos <= query_pos hides
    it: nothing is ever cleared."""

    def __init__(self, slots: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (slots, kv_heads, capacity, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", torch.zeros_like(k), persistent=False)

    def update(self, positions: Tensor, keys: Tensor, values: Tensor, kv_len: int):
        """Writes keys, values (R, T, kv_heads, head_dim) into rows 0 ... R - 1 at their positions
        (R, T); returns those rows' keys and values at positions [0, kv_len)."""
        count = positions.shape[0]
        rows = torch.arange(count, device=positions.device)[:, None]
        # (R, 1) and (R, T) index the row and position dims: their (R, T) comes first, heads after
        self.k[rows, :, positions] = keys
        self.v[rows, :, positions] = values
        return self.k[:count, :, :kv_len], self.v[:count, :, :kv_len]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the split-halves layout, as transformers: x * cos + rotate_half(x) * sin, where
    rotate_half(x1, x2) is (-x2, x1). Our sin table carries rotate_half's signs, (-sin, sin), so the
    rotation is a roll of the halves: one kernel instead of a negation and a concatenation."""
    half = x.shape[-1] // 2
    return x * cos + x.roll(half, dims=-1) * sin


@dataclass
class ForwardContext:
    """What every layer needs to know about one forward's tokens besides their activations."""
    positions: Tensor  # (R, T) the tokens' absolute positions: the grid of rows and tokens
    cos: Tensor  # (R, T, 1, head_dim) RoPE at those positions
    sin: Tensor  # the same for sin, with rotate_half's signs (see apply_rope)
    mask: Tensor | None  # (R, 1, T, kv_len), True where a query may attend; None: causal
    kv_len: int  # the attended prefix of the cache: every position so far is below it


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv = args.num_key_value_heads
        self.head_dim = args.head_dim
        qkv_size = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.qkv_proj = linear(args, args.hidden_size, qkv_size)
        self.o_proj = linear(args, self.n_heads * self.head_dim, args.hidden_size)
        self.q_norm = nn.RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, args.rms_norm_eps)
        self.kv_cache: StaticKVCache | None = None

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        qkv = self.qkv_proj(x)  # (R, T, (heads + 2 kv_heads) x head_dim)
        # (R, T, heads + 2 kv_heads, head_dim)
        heads = qkv.unflatten(-1, (-1, self.head_dim))
        q, k, v = heads.split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        q = apply_rope(self.q_norm(q), ctx.cos, ctx.sin)
        k = apply_rope(self.k_norm(k), ctx.cos, ctx.sin)
        keys, values = self.kv_cache.update(ctx.positions, k, v, ctx.kv_len)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=ctx.mask,
            is_causal=ctx.mask is None, enable_gqa=True)  # (R, heads, T, head_dim)
        y = y.transpose(1, 2).flatten(2)  # (R, T, heads x head_dim)
        return self.o_proj(y)


class MLP(nn.Module):
    """down(silu(gate) * up), gate and up from one product."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = linear(args, args.hidden_size, 2 * args.intermediate_size)
        self.down_proj = linear(args, args.intermediate_size, args.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    """A router picks num_experts_per_tok of the experts (SiLU-gated MLPs) for each token; their
    outputs are summed, weighted by the router's softmax (renormalised over the picked ones by
    norm_topk_prob)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        experts = args.num_experts
        inner = args.moe_intermediate_size
        self.gate = Linear(args.hidden_size, experts)  # the router: small, never quantized
        self.gate_up_proj = linear(args, args.hidden_size, 2 * inner, experts)
        self.down_proj = linear(args, inner, args.hidden_size, experts)
        self.grouped_mm = False  # set by Transformer.setup_cache (see expert_products)

    def forward(self, x: Tensor) -> Tensor:
        probs = self.gate(x).softmax(-1, dtype=torch.float)
        weights, picked = probs.topk(self.top_k)  # (R, T, top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        # Each token through its picked experts alone: its (token, pick) pairs, sorted by expert so
        # that each expert's pairs are one run of rows (int32 keys: half the radix sort's passes of
        # int64).
        expert_ids, order = picked.flatten().int().sort()  # (pairs,)
        inputs = x.flatten(0, 1)[order // self.top_k]  # (pairs, hidden): each pair's token
        gate_up = expert_products(inputs, dequantized(self.gate_up_proj, x.dtype), expert_ids,
                                  self.grouped_mm)
        gate, up = gate_up.chunk(2, dim=-1)
        # Rounded as transformers does
        pair_weights = weights.flatten()[order, None].to(x.dtype)
        hidden = F.silu(gate) * up * pair_weights
        y = expert_products(hidden, dequantized(self.down_proj, x.dtype), expert_ids,
                            self.grouped_mm)
        # Back in (token, pick) order: sorted row i is pair order[i]. A gather at the inverse
        # permutation, faster than scattering the rows themselves (bench/RESULTS.md).
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), dtype=order.dtype, device=x.device)
        per_pick = y[inverse].unflatten(0, (-1, self.top_k))  # (tokens, top_k, hidden)
        return per_pick.sum(1).view_as(x)


def expert_products(rows: Tensor, weight: Tensor, row_experts: Tensor, grouped_mm: bool) -> Tensor:
    """rows (pairs, K), sorted by their `row_experts` (pairs,), each times its expert's weight
    (experts, N, K): (pairs, N), in static shapes (for compile and graphs). grouped_mm: one grouped
    product, each expert over its own run of rows, whose ends are found on the device. Otherwise
    every expert multiplies every row (experts times the work), and each row keeps its own expert's
    product."""
    if grouped_mm:
        experts = torch.arange(len(weight), device=rows.device)
        ends = torch.searchsorted(row_experts, experts, right=True)  # (experts,)
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=ends.int())
    every = torch.einsum("pk,enk->pen", rows, weight)  # (pairs, experts, N)
    pairs = torch.arange(len(rows), device=rows.device)
    return every[pairs, row_experts]


def dequantized(proj: Linear, dtype) -> Tensor:
    """proj's weight in `dtype`, its int8 scales applied."""
    weight = proj.weight.to(dtype)
    if proj.scale is None:
        return weight
    return weight * proj.scale[..., None]


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        # nn.RMSNorm is F.rms_norm: normalised in fp32, as transformers does, in one kernel on CUDA
        self.input_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MoE(args) if args.is_sparse(layer) else MLP(args)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # An empty weight: nn.Embedding's own random init would load torch._dynamo (seconds) to run
        # on the meta device, where checkpoints are built, and a checkpoint replaces it anyway
        empty = torch.empty(args.vocab_size, args.hidden_size)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        # A tied lm_head is the embedding, never quantized
        int8 = args.quantization == "int8" and not args.tie_word_embeddings
        self.lm_head = Linear(args.hidden_size, args.vocab_size, int8=int8)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_cos", None, persistent=False)  # from setup_cache

    def setup_cache(self, slots: int, capacity: int):
        """Allocates a StaticKVCache per layer and the RoPE tables for positions [0, capacity)."""
        args = self.args
        if capacity > args.max_position_embeddings:
            raise UserError(f"a cache of {capacity} positions is over the model's "
                            f"{args.max_position_embeddings}: ask for fewer positions")
        device = self.norm.weight.device
        dtype = self.norm.weight.dtype
        # One spare position, never attended: every attended prefix is then a strict slice of the
        # buffer, so a compiled step's contiguity guards hold (no recompile) when the prefix reaches
        # the capacity.
        for layer in self.layers:
            layer.self_attn.kv_cache = StaticKVCache(slots, args.num_key_value_heads, capacity + 1,
                                                     args.head_dim, dtype, device)
        # Angles in fp32 on the CPU as transformers computes them (a product, not a matmul); the
        # tables in the model's dtype, as transformers casts them before rotating.
        inv_freq, scale = rope_frequencies(args)
        steps = torch.arange(capacity, dtype=torch.float)  # the positions, as floats
        # (capacity, head_dim): both halves alike
        angles = steps[:, None] * inv_freq.repeat(2)
        # rotate_half's signs: -1 for the first half, +1 for the second
        signs = torch.tensor([-1.0, 1.0]).repeat_interleave(args.head_dim // 2)
        cos = angles.cos() * scale
        sin = angles.sin() * scale * signs
        self.register_buffer("rope_cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device, dtype), persistent=False)
        key_positions = torch.arange(capacity, device=device)
        self.register_buffer("key_positions", key_positions, persistent=False)
        # torch._grouped_mm compiles for bf16 alone, and on CUDA has kernels for Hopper and
        # Blackwell alone: elsewhere it loops over the experts reading where each one's rows end on
        # the host, which a CUDA graph can't hold. There MoE layers multiply by every expert
        # instead.
        on_cuda = device.type == "cuda"
        hopper_or_blackwell = on_cuda and torch.cuda.get_device_capability(device)[0] in (9, 10)
        grouped_mm = dtype == torch.bfloat16 and (not on_cuda or hopper_or_blackwell)
        for module in self.modules():
            if isinstance(module, MoE):
                module.grouped_mm = grouped_mm

    def forward(self, tokens: Tensor, positions: Tensor, kv_positions: Tensor | None = None,
                logits_at: Tensor | None = None) -> Tensor:
        """Logits (R, T, vocab) of tokens (R, T) at `positions` (R, T), in cache rows 0 ... R - 1.

        kv_positions: the prefix of key_positions to attend over, covering every position written so
        far: a decode step, or tokens that continue a row's cached ones; None for prompts at
        positions 0 ... T - 1, which attend causally among themselves (flash attention, no T x T
        mask).

        logits_at (R, 1): the index of one token in each row; the logits of those tokens alone,
        (R, 1, vocab), since a prefill needs no others."""
        if self.rope_cos is None:
            raise RuntimeError("call setup_cache(slots, capacity) before running the model")
        mask = None
        if kv_positions is None:
            kv_len = tokens.shape[1]
        else:
            kv_len = kv_positions.shape[0]
            # (R, 1, T, kv_len), causal: it hides the unwritten and stale positions too
            mask = (kv_positions <= positions[..., None])[:, None]
        cos = self.rope_cos[positions][:, :, None]
        sin = self.rope_sin[positions][:, :, None]
        ctx = ForwardContext(positions=positions, cos=cos, sin=sin, mask=mask, kv_len=kv_len)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, ctx)
        if logits_at is not None:
            x = x.take_along_dim(logits_at[..., None], dim=1)  # (R, 1, hidden)
        return self.lm_head(self.norm(x))

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        """What a converted checkpoint holds: the state, but a tied lm_head, which is the
        embedding."""
        state = self.state_dict()
        if self.args.tie_word_embeddings:
            del state["lm_head.weight"]
        return state

    @classmethod
    def from_checkpoint(cls, path: str, device, dtype, split=None) -> "Transformer":
        """Loads a directory written by convert_hf_checkpoint.py, straight to `device`: a tensor
        at a time from its file, no second copy in host or device memory. split (tp.py's
        TensorParallel): this rank's share alone, at its shapes (split.rank_args), each tensor's
        slice read (split.read), the all-reduces added (split.apply)."""
        config = pathlib.Path(path, "config.json")
        if not config.is_file():
            raise UserError(f"{path}: no converted checkpoint; convert_hf_checkpoint.py writes one")
        cfg = read_json(config)
        if "quantization" not in cfg:  # every config.json our converter writes has it
            raise UserError(f"{path} is a Hugging Face snapshot: convert it first "
                            f"(python convert_hf_checkpoint.py --checkpoint-dir {path})")
        args = ModelArgs.from_config(cfg)
        if split is not None:
            args = split.rank_args(args)
        with torch.device("meta"):
            model = cls(args)
        expected = {name: t.shape for name, t in model.checkpoint_tensors().items()}
        tensors = list_tensors(path, "model*.safetensors")  # name -> its file
        state = {}
        for file in sorted(set(tensors.values())):
            # A file at a time: its pages are mapped until its last tensor is read
            with safe_open(file, "pt", device=str(device)) as opened:
                for name in opened.keys():
                    if split is None:
                        tensor = opened.get_tensor(name)
                    else:  # this rank's slice of it alone is read
                        tensor = split.read(name, opened.get_slice(name)).to(device)
                    if tensor.dtype != torch.int8:
                        tensor = tensor.to(dtype)
                    state[name] = tensor
                    show_progress(f"loading {path}", len(state), len(tensors))
        found = {name: t.shape for name, t in state.items()}
        mismatched = sorted(n for n in expected.keys() | found.keys()
                            if expected.get(n) != found.get(n))
        if mismatched:
            raise UserError(f"{path}: weights do not match config.json ({mismatched[0]}); "
                            "convert again")
        # The loaded tensors themselves, no copy; every one is checked above. A tied lm_head is not
        # among them: it is the embedding again.
        model.load_state_dict(state, strict=False, assign=True)
        if args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        if split is not None:
            split.apply(model)
        return model.eval().requires_grad_(False)

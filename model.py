"""Qwen3 and Qwen3-MoE in PyTorch, driven by the checkpoint's config.json, with a static KV cache.

The architecture and nothing else: ModelArgs, RoPE (with YaRN), StaticKVCache, Attention, MLP, MoE,
Block, Transformer. One forward serves every call: a prefill (a prompt per row, many tokens) and a
decode step (one token per row). Module names and tensors are transformers 5's: its stacked
experts, and our two fused products its tensors concatenated in its order, qkv_proj [q; k; v] and
the MLP's gate_up_proj [gate; up], as its experts' gate_up_proj is.

    model = Transformer(ModelArgs.from_config(config))  # or generate.load_model(path)
    model.setup_cache(slots=1, capacity=512)
    logits = model(prompt, torch.arange(T)[None], kv_len=T)  # a prompt: (1, T) tokens, 0 ... T - 1
    logits = model(next_token, torch.tensor([[T]]))  # the next position

Reading checkpoints lives in generate.py, int8 and int4 in quantize.py, the Triton fast path in
qwen3_triton.py: this file imports torch alone.
"""
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass
class ModelArgs:
    """The architecture's sizes, named as config.json names them."""
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    # its own setting: 0.6B's heads are 128 wide, not 1,024 / 16
    head_dim: int = 128
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    # YaRN's parameters (factor, original_max_position_embeddings, ...); empty: plain RoPE
    yarn: dict = field(default_factory=dict)
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    # MoE: experts per sparse layer; 0 for a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    # The dense layers of a MoE model
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        """From a config.json: a Hugging Face Qwen3 or Qwen3-MoE one, or the one our converter
        writes. It reads and doesn't check: the converter and generate.py's loader check a file's
        values first."""
        # A null is a value not set, as transformers reads it: the default
        config = {key: value for key, value in config.items() if value is not None}
        args = cls(**{spec.name: config[spec.name] for spec in fields(cls) if spec.name in config})
        # transformers 5 writes the hub's num_experts as num_local_experts
        args.num_experts = config.get("num_local_experts", args.num_experts)
        # older configs: heads split the hidden size
        if "head_dim" not in config:
            args.head_dim = args.hidden_size // args.num_attention_heads
        # RoPE: rope_parameters (transformers 5), else rope_theta and rope_scaling (older configs)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        args.rope_theta = rope.get("rope_theta", args.rope_theta)
        if rope.get("rope_type", rope.get("type")) == "yarn":
            named = ("rope_type", "type", "rope_theta")
            args.yarn = {key: value for key, value in rope.items() if key not in named}
        # YaRN stretches the original context by its factor; without YaRN, `original` is 0
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
    # over 2 pi: (dim / 2,)
    wavelengths = args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    original = 1.0 / wavelengths
    if not args.yarn:
        return original, 1.0
    factor = args.yarn.get("factor", 1.0)
    scale = args.yarn.get("attention_factor")
    if scale is None:
        # 1 for a factor of 1 or less
        scale = 0.1 * math.log(max(factor, 1)) + 1.0
    context = args.yarn.get("original_max_position_embeddings", args.max_position_embeddings)

    # The dimension that turns `turns` times over the context
    def dimension(turns: float) -> float:
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(args.rope_theta))
    low = max(math.floor(dimension(args.yarn.get("beta_fast") or 32)), 0)
    high = min(math.ceil(dimension(args.yarn.get("beta_slow") or 1)), dim - 1)
    if high == low:
        # as transformers: no division by zero
        high += 0.001
    # 0 below `low` (the original frequency), 1 above `high` (the interpolated one)
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    # transformers' rounding
    interpolated = 1.0 / (factor * wavelengths)
    return interpolated * ramp + original * (1 - ramp), scale


def rope_tables(args: ModelArgs, positions: int) -> tuple[Tensor, Tensor]:
    """cos and sin (positions, head_dim) of each position's angles, both halves alike. The angles
    in fp32 as transformers computes them (a product, not a matmul)."""
    inv_freq, scale = rope_frequencies(args)
    # (positions, head_dim)
    angles = torch.arange(positions, dtype=torch.float)[:, None] * inv_freq.repeat(2)
    return angles.cos() * scale, angles.sin() * scale


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the split-halves layout, as transformers: dimension i turns with i + head_dim / 2.
    x * cos + rotate_half(x) * sin, its product and sum one addcmul: a kernel fewer where the steps
    run eagerly or as our CUDA graphs."""
    return torch.addcmul(x * cos, rotate_half(x), sin)


class StaticKVCache(nn.Module):
    """One layer's keys and values at absolute positions, a row per request slot: (slots, kv_heads,
    capacity, head_dim), zero-filled. A position not yet written, or left over from a longer earlier
    request, lies past every live query of its row, so the causal rule key_pos <= query_pos hides
    it: nothing is ever cleared."""

    def __init__(self, slots: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        super().__init__()
        k = torch.zeros(slots, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", torch.zeros_like(k), persistent=False)

    def update(self, positions: Tensor, keys: Tensor, values: Tensor, kv_len: int):
        """Writes keys, values (R, T, kv_heads, head_dim) into rows 0 ... R - 1 at their positions
        (R, T); returns those rows' keys and values at positions [0, kv_len)."""
        count = len(positions)
        rows = torch.arange(count, device=positions.device)[:, None]
        # (R, 1) and (R, T) index the row and position dims: their (R, T) comes first, heads after
        self.k[rows, :, positions] = keys
        self.v[rows, :, positions] = values
        return self.k[:count, :, :kv_len], self.v[:count, :, :kv_len]


@dataclass
class ForwardContext:
    """What every layer needs to know about one forward's tokens besides their activations."""
    # (R, T) the tokens' absolute positions: the grid of rows and tokens
    positions: Tensor
    # (R, T, 1, head_dim) RoPE at those positions
    cos: Tensor
    sin: Tensor
    # (R, 1, T, kv_len), True where a query may attend; None: causal
    mask: Tensor | None
    # the attended prefix of the cache
    kv_len: int


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv = args.num_key_value_heads
        self.head_dim = args.head_dim
        qkv_size = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, qkv_size, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, args.rms_norm_eps)
        self.kv_cache: StaticKVCache | None = None

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        # (R, T, heads + 2 kv_heads, head_dim)
        heads = self.qkv_proj(x).unflatten(-1, (-1, self.head_dim))
        q, k, v = heads.split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        q = apply_rope(self.q_norm(q), ctx.cos, ctx.sin)
        k = apply_rope(self.k_norm(k), ctx.cos, ctx.sin)
        keys, values = self.kv_cache.update(ctx.positions, k, v, ctx.kv_len)
        # (R, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=ctx.mask,
                                           is_causal=ctx.mask is None, enable_gqa=True)
        # (R, T, heads x head_dim)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """down(silu(gate) * up), gate and up from one product: gate_up_proj's rows are [gate; up]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # (..., intermediate_size) each
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    """A router picks num_experts_per_tok experts for each token; the token goes through each of
    them, and their outputs are summed, weighted by the router's softmax (renormalised over the
    picked ones with norm_topk_prob)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        # the router
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = Experts(args)

    def forward(self, x: Tensor) -> Tensor:
        # (R x T, hidden)
        tokens = x.flatten(0, 1)
        # (tokens, top_k): the router's most probable experts
        weights, picked = self.gate(tokens).softmax(-1, dtype=torch.float).topk(self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        # Each token's picks (tokens, top_k, hidden) weighted, the weights rounded to x's dtype
        # before the product as transformers rounds them, and summed
        return (self.experts(tokens, picked) * weights[..., None].to(x.dtype)).sum(1).view_as(x)


class Experts(nn.Module):
    """num_experts SiLU-gated MLPs, each kind of weight one 3-D parameter: gate_up_proj (experts,
    2 x inner, hidden), its rows [gate; up] as MLP's, and down_proj (experts, hidden, inner)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        count, inner = args.num_experts, args.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(linear_weight(count, 2 * inner, args.hidden_size))
        self.down_proj = nn.Parameter(linear_weight(count, args.hidden_size, inner))
        # Whether to multiply by torch._grouped_mm (see expert_products): an engine sets it where
        # torch has kernels for it
        self.grouped_mm = False

    def weights(self, dtype) -> tuple[Tensor, Tensor]:
        """gate_up_proj and down_proj as the products read them (quantize.py's quantized experts
        dequantize here)."""
        return self.gate_up_proj, self.down_proj

    def forward(self, tokens: Tensor, picked: Tensor) -> Tensor:
        """Each token (tokens, hidden) through each of its picked experts (tokens, top_k): (tokens,
        top_k, hidden)."""
        gate_up_proj, down_proj = self.weights(tokens.dtype)
        # The (token, pick) pairs' experts (pairs,), sorted so that each expert's pairs are one run
        # of rows
        row_experts, order = picked.flatten().sort()
        # (pairs, hidden): each pair's token
        rows = tokens[order // picked.shape[1]]
        # (pairs, inner) each
        gate, up = expert_products(rows, gate_up_proj, row_experts, self.grouped_mm).chunk(2, -1)
        y = expert_products(F.silu(gate) * up, down_proj, row_experts, self.grouped_mm)
        # Back in (token, pick) order: pair i is sorted row order.argsort()[i]
        return y[order.argsort()].unflatten(0, picked.shape)


def linear_weight(*shape: int) -> Tensor:
    """Weights (..., out, in) initialised as nn.Linear initialises its own: uniform within 1 /
    sqrt(in)."""
    return torch.empty(shape).uniform_(-1, 1) / math.sqrt(shape[-1])


def expert_products(rows: Tensor, weight: Tensor, row_experts: Tensor, grouped_mm: bool) -> Tensor:
    """rows (pairs, K), sorted by their experts `row_experts` (pairs,), each times its expert's
    weight (experts, N, K): (pairs, N), in static shapes (for compile and CUDA graphs). The first
    form that serves:
    - grouped_mm, where torch._grouped_mm has kernels: one product, each expert over its own run
      of rows, whose ends are found on the device;
    - no more pairs than experts (a decode step): each row's expert's weight gathered, one
      batched product that reads the picked experts alone;
    - else (a prefill): every expert times every row, num_experts times the work, each row keeping
      its own expert's product."""
    if grouped_mm:
        experts = torch.arange(len(weight), device=rows.device)
        # (experts,)
        ends = torch.searchsorted(row_experts, experts, right=True)
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=ends.int())
    if len(rows) <= len(weight):
        # (pairs, N, K) each row's expert's weight, times the row
        return torch.bmm(weight[row_experts], rows[:, :, None])[:, :, 0]
    # (pairs, experts, N)
    every = torch.einsum("pk,enk->pen", rows, weight)
    pairs = torch.arange(len(rows), device=rows.device)
    return every[pairs, row_experts]


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
        # Uniform: nn.Embedding's own normal init would load torch._dynamo (seconds) to run on the
        # meta device, where checkpoints are built
        weight = torch.empty(args.vocab_size, args.hidden_size).uniform_(-1, 1)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # from setup_cache
        self.register_buffer("rope_cos", None, persistent=False)

    def setup_cache(self, slots: int, capacity: int):
        """Allocates a StaticKVCache per layer and the RoPE tables for positions [0, capacity)."""
        device, dtype = self.norm.weight.device, self.norm.weight.dtype
        for layer in self.layers:
            layer.self_attn.kv_cache = StaticKVCache(slots, self.args.num_key_value_heads,
                                                     capacity, self.args.head_dim, dtype, device)
        cos, sin = rope_tables(self.args, capacity)
        # In the model's dtype, as transformers casts them before rotating
        self.register_buffer("rope_cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device, dtype), persistent=False)
        self.register_buffer("key_positions", torch.arange(capacity, device=device),
                             persistent=False)

    def forward(self, tokens: Tensor, positions: Tensor, kv_len: int | None = None,
                logits_at: Tensor | None = None) -> Tensor:
        """Logits (R, T, vocab) of tokens (R, T) at `positions` (R, T), in cache rows 0 ... R - 1.
        Each query attends to every cache position at or below its own in its row: what earlier
        calls wrote there, and this call's tokens. Positions are always given: the cache can't tell
        a new prompt from a continuation.

        kv_len: attend to the cache's first kv_len positions alone, which is faster; every position
        given must be below it (checked on the device, with no wait for the host). None: the whole
        cache. kv_len = T: prompts at positions 0 ... T - 1 in every row (so checked), which
        attend causally among themselves: flash attention, with no T x kv_len mask.

        logits_at (R, 1): the index of one token in each row; the logits of those tokens alone,
        (R, 1, vocab), since a prefill needs no others."""
        if self.rope_cos is None:
            raise RuntimeError("call setup_cache(slots, capacity) before running the model")
        # kv_len None: the whole cache
        attended = self.key_positions[:kv_len]
        kv_len = len(attended)
        torch._assert_async((positions < kv_len).all(), "positions past kv_len")
        # kv_len T: a prompt from position 0, where the causal rule is flash attention's own
        prompt = kv_len == tokens.shape[1]
        if prompt:
            torch._assert_async((positions == attended).all(), "kv_len T needs positions 0 ... T-1")
        # (R, 1, T, kv_len), causal: it hides the unwritten and stale positions too
        mask = None if prompt else (attended <= positions[..., None])[:, None]
        cos, sin = self.rope_cos[positions][:, :, None], self.rope_sin[positions][:, :, None]
        ctx = ForwardContext(positions, cos, sin, mask, kv_len)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, ctx)
        if logits_at is not None:
            # (R, 1, hidden)
            x = x.take_along_dim(logits_at[..., None], dim=1)
        return self.lm_head(self.norm(x))

"""Qwen3 and Qwen3-MoE for fast decoding: fused projections, a static KV cache, one forward for prefill and
decode."""
import json
import math
import pathlib
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

try:  # optional: without kernels.py, or without Triton, every step runs PyTorch's ops
    import kernels
except ImportError:
    kernels = None


class UserError(Exception):
    """Bad input: the command-line tools print it as one line instead of a traceback."""


def read_json(path) -> dict:
    """A JSON object from a file; anything else (unreadable, not JSON, a list or a string) is a UserError."""
    try:
        value = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, or not JSON
        raise UserError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: not a JSON object but {type(value).__name__}; download or convert it again")
    return value


# The JSON types that a config.json value of a ModelArgs field may have (a bool is no int here).
CONFIG_TYPES = {int: (int,), float: (int, float), bool: (bool,), list[int]: (list,), dict: (dict,)}


@dataclass
class ModelArgs:
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128  # its own parameter: 0.6B has hidden 1024 but 16 heads x 128
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    quantization: str | None = None  # "int8": weight-only, per output channel (our converter writes it)
    num_experts: int = 0  # MoE: experts per sparse layer, 0 for a dense model
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)  # dense layers of a MoE model
    eos_token_id: list[int] = field(default_factory=list)  # the model's end-of-sequence tokens
    yarn: dict = field(default_factory=dict)  # YaRN's rope parameters (factor, ...); empty for default RoPE

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """From a Hugging Face Qwen3 config.json, or from the config.json our converter writes."""
        architecture = (cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
        model_type = cfg.get("model_type", "qwen3")
        supported = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
        if supported.get(architecture) != model_type:
            raise UserError(f"{architecture} (model_type {model_type}) is not supported: only Qwen3 is "
                            "(Qwen3ForCausalLM or Qwen3MoeForCausalLM)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # new style, then old
        if not isinstance(rope, dict):
            raise UserError(f"config.json: rope_parameters is {rope!r}, not an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise UserError(f"rope type {rope_type} is not supported: only default RoPE and YaRN")
        if cfg.get("use_sliding_window"):
            raise UserError("sliding-window attention is not supported: set use_sliding_window to false")
        cfg = dict(cfg, rope_theta=rope.get("rope_theta", cfg.get("rope_theta")))
        if rope_type == "yarn":  # our converter writes the parameters as "yarn"; the hub, in rope_scaling
            cfg["yarn"] = {k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}
            if not all(type(v) in (int, float, bool) for v in cfg["yarn"].values()):
                raise UserError(f"config.json: the YaRN parameters {cfg['yarn']} are not all numbers")
        if type(cfg.get("eos_token_id")) is int:  # the hub writes one id or a list
            cfg["eos_token_id"] = [cfg["eos_token_id"]]
        if "num_local_experts" in cfg:  # what transformers writes for the hub's num_experts
            cfg["num_experts"] = cfg["num_local_experts"]
        types = {f.name: f.type for f in fields(cls)}
        given = {name: cfg[name] for name in types if cfg.get(name) is not None}
        for name, value in given.items():
            if type(value) not in CONFIG_TYPES.get(types[name], (str,)) or type(value) is int and value < 0:
                raise UserError(f"config.json: {name} is {value!r}, which is not a valid value for it")
        args = cls(**given)
        if cfg.get("head_dim") is None:
            args.head_dim = args.hidden_size // args.num_attention_heads
        if args.yarn:  # YaRN extends the context to factor x the original positions
            extended = args.yarn.get("original_max_position_embeddings", 0) * args.yarn.get("factor", 1.0)
            args.max_position_embeddings = max(args.max_position_embeddings, int(extended))
        return args

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has a MoE block, as transformers decides it."""
        step = (layer + 1) % self.decoder_sparse_step == 0
        return self.num_experts > 0 and step and layer not in self.mlp_only_layers


def rope_frequencies(a: ModelArgs) -> tuple[Tensor, float]:
    """RoPE's inverse frequencies (head_dim / 2,) and the factor on cos and sin, as transformers computes
    them: default, or YaRN (its _compute_yarn_parameters: each frequency between the original and the one
    divided by `factor`, by a linear ramp over the dimensions between beta_fast and beta_slow rotations in the
    original context; cos and sin scaled by 0.1 ln(factor) + 1 unless attention_factor is given)."""
    dim = a.head_dim
    pos_freqs = a.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)  # 1 / RoPE's frequencies
    factor = a.yarn.get("factor", 1.0)  # default RoPE is YaRN with factor 1, to rounding
    scale = a.yarn.get("attention_factor") or 0.1 * math.log(max(factor, 1.0)) + 1.0  # 1 for factor <= 1

    def dimension(rotations):  # the dimension that turns `rotations` times over the original context
        original = a.yarn.get("original_max_position_embeddings", a.max_position_embeddings)
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(a.rope_theta))
    low, high = dimension(a.yarn.get("beta_fast") or 32), dimension(a.yarn.get("beta_slow") or 1)
    if a.yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    width = high - low if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / width).clamp(0, 1)
    return 1.0 / (factor * pos_freqs) * ramp + 1.0 / pos_freqs * (1 - ramp), scale  # interpolated, original


class Linear(nn.Module):
    """A bias-free linear layer; with `experts`, one weight per expert: (experts, n_out, n_in). int8 stores
    the weight as int8 with a scale per output row (weight-only quantization)."""

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
        # The int8 cast inside the matmul's expression: inductor fuses it into the matmul's loads and never
        # writes a full-precision copy of the weight.
        y = F.linear(x, self.weight.to(x.dtype))
        return y if self.scale is None else y * self.scale


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-row int8: w ~= q * scale[..., None]. Returns (q, scale)."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-8) / 127
    return (w.float() / scale[..., None]).round().clamp(-127, 127).to(torch.int8), scale


def linear(args: ModelArgs, n_in: int, n_out: int, experts: int | None = None) -> Linear:
    return Linear(n_in, n_out, int8=args.quantization == "int8", experts=experts)


def project(proj: nn.Module, x: Tensor, *, fused: bool, norm: nn.RMSNorm | None = None, gated: bool = False,
            residual: Tensor | None = None) -> Tensor:
    """residual + proj(a), where a is norm(x) with `norm`, silu(gate) * up of x = [gate, up] with `gated`,
    else x. fused: one Triton kernel (one token on CUDA); otherwise PyTorch's ops, the kernel's reference."""
    if fused:  # the kernel normalises x as it reads it, with the norm's weight and eps (if there is a norm)
        return kernels.gemv(x, proj.weight, scale=proj.scale, norm=getattr(norm, "weight", None),
                            eps=getattr(norm, "eps", 0.0), gated=gated, residual=residual)
    if norm is not None:
        x = norm(x)
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return proj(x) if residual is None else residual + proj(x)


class StaticKVCache(nn.Module):
    """Keys and values of one layer at absolute positions, one row per request slot: (slots, kv_heads,
    capacity, head_dim), zero-filled. A slot not yet written, or left over from a longer earlier request, sits
    at a position greater than every live query of its row, so the causal rule key_pos <= query_pos hides it:
    nothing to clear."""

    def __init__(self, slots: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (slots, kv_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, rows: slice, positions: Tensor, k: Tensor, v: Tensor, kv_len: int):
        """Writes k, v (R, T, kv_heads, head_dim) at (row, position) pairs; returns the keys and values of the
        first kv_len positions of those rows."""
        r = torch.arange(positions.shape[0], device=positions.device)[:, None]
        self.k[rows][r, :, positions] = k
        self.v[rows][r, :, positions] = v
        return self.k[rows, :, :kv_len], self.v[rows, :, :kv_len]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the split-halves layout, as transformers: x * cos + rotate_half(x) * sin, where rotate_half(x)
    is (-x2, x1) for x = (x1, x2). The sin table carries rotate_half's signs, (-sin, sin), so the rotation is
    a roll of the halves: one kernel instead of a negation and a concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


@dataclass
class ForwardContext:
    """What every layer needs to know about the tokens of one forward pass besides their activations."""
    rows: slice  # the cache rows of the batch
    positions: Tensor  # (R, T) absolute positions of the tokens
    cos: Tensor  # (R, T, 1, head_dim) RoPE at those positions; fused: the whole table (capacity, head_dim)
    sin: Tensor  # the same for sin, which carries rotate_half's signs (see apply_rope)
    mask: Tensor | None  # (R, 1, queries, kv_len), True where a query may attend; None: causal, no mask
    kv_len: int  # the attended length: every position so far is below it
    fused: bool  # one token on CUDA: the projections run as the Triton kernel
    grouped_mm: bool  # MoE layers multiply by the picked experts alone (see expert_products)
    queries_at: Tensor | None = None  # (R, 1) indices: the only queries (the last layer of a prefill)
    packed: Tensor | None = None  # (N,) indices into the (R, T) grid: the tokens that run; None: all

    def on_grid(self, x: Tensor) -> Tensor:
        """Activations (1, N, C) of the packed tokens on the (R, T) grid of the positions, zeros where a
        token didn't run; those of every token, (R, T, C), as they are."""
        if self.packed is None:
            return x
        grid = x.new_zeros(self.positions.numel(), x.shape[-1])  # (R x T, C)
        return grid.index_copy_(0, self.packed, x[0]).unflatten(0, self.positions.shape)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.qkv_proj = linear(args, args.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim)
        self.o_proj = linear(args, self.n_heads * self.head_dim, args.hidden_size)
        self.q_norm = nn.RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, args.rms_norm_eps)
        self.kv_cache: StaticKVCache | None = None

    def forward(self, x: Tensor, norm: nn.RMSNorm, residual: Tensor, ctx: ForwardContext) -> Tensor:
        """residual + attention(norm(x))."""
        qkv = project(self.qkv_proj, x, norm=norm, fused=ctx.fused)
        if ctx.fused:  # the q/k norms, RoPE, the cache write and attention in one kernel (and a merge)
            y = kernels.decode_attention(qkv, self.kv_cache.k, self.kv_cache.v, ctx.rows.start or 0,
                                         ctx.positions[:, 0], ctx.cos, ctx.sin, self.q_norm.weight,
                                         self.k_norm.weight, self.q_norm.eps, self.n_heads, ctx.kv_len)
        else:
            # Packed tokens (see Transformer.forward) attend on their grid: a row per prompt, zeros between.
            qkv = ctx.on_grid(qkv)
            q, k, v = qkv.unflatten(2, (-1, self.head_dim)).split([self.n_heads, self.n_kv, self.n_kv], dim=2)
            q = apply_rope(self.q_norm(q), ctx.cos, ctx.sin)
            k = apply_rope(self.k_norm(k), ctx.cos, ctx.sin)
            keys, values = self.kv_cache.update(ctx.rows, ctx.positions, k, v, ctx.kv_len)
            if ctx.queries_at is not None:  # the last layer of a prefill: see Transformer.forward (logits_at)
                q = q.take_along_dim(ctx.queries_at[..., None, None], dim=1)
                residual = ctx.on_grid(residual).take_along_dim(ctx.queries_at[..., None], dim=1)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=ctx.mask,
                                               is_causal=ctx.mask is None, enable_gqa=True).transpose(1, 2)
            if ctx.packed is not None and ctx.queries_at is None:  # back to the packed tokens
                y = y.flatten(0, 1)[ctx.packed]
        return project(self.o_proj, y.reshape(*residual.shape[:-1], -1), residual=residual, fused=ctx.fused)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = linear(args, args.hidden_size, 2 * args.intermediate_size)
        self.down_proj = linear(args, args.intermediate_size, args.hidden_size)

    def forward(self, x: Tensor, norm: nn.RMSNorm, residual: Tensor, ctx: ForwardContext) -> Tensor:
        """residual + down(silu(gate) * up) of norm(x)."""
        gate_up = project(self.gate_up_proj, x, norm=norm, fused=ctx.fused)
        return project(self.down_proj, gate_up, gated=True, residual=residual, fused=ctx.fused)


class MoE(nn.Module):
    """A router picks num_experts_per_tok of the experts (SiLU-gated MLPs) for each token; their outputs are
    summed, weighted by the router's softmax (renormalised over the picked ones with norm_topk_prob)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = Linear(args.hidden_size, args.num_experts)  # the router, never quantized: it is small
        self.gate_up_proj = linear(args, args.hidden_size, 2 * args.moe_intermediate_size, args.num_experts)
        self.down_proj = linear(args, args.moe_intermediate_size, args.hidden_size, args.num_experts)

    def forward(self, x: Tensor, norm: nn.RMSNorm, residual: Tensor, ctx: ForwardContext) -> Tensor:
        """residual + the routing-weighted sum over the picked experts e of down_e(silu(gate_e) * up_e)."""
        if ctx.fused:  # the kernels pick the experts from the logits and read the picked ones' weights alone
            logits = project(self.gate, x, norm=norm, fused=True)
            routing = dict(router=logits.view(-1), top_k=self.top_k, norm_topk_prob=self.norm_topk_prob)
            gate_up = kernels.gemv(x, self.gate_up_proj.weight, scale=self.gate_up_proj.scale,
                                   norm=norm.weight, eps=norm.eps, **routing)  # (top_k, 1, 2 x moe_inter.)
            return kernels.gemv(gate_up, self.down_proj.weight, scale=self.down_proj.scale, gated=True,
                                residual=residual, routed=True, **routing)
        normed = norm(x)
        weights, picked = self.gate(normed).softmax(-1, dtype=torch.float).topk(self.top_k)  # (R, T, top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        # Each token through its picked experts alone: its (token, pick) pairs, sorted by expert so that
        # each expert's pairs are one run of rows (int32 keys: half the radix sort's passes of int64).
        # Routing weights are rounded as transformers rounds them.
        experts, order = picked.flatten().int().sort()  # (pairs,)
        rows = normed.flatten(0, 1)[order // self.top_k]  # (pairs, hidden): each pair's token
        gate_up = expert_products(rows, dequantized(self.gate_up_proj, x.dtype), experts, ctx.grouped_mm)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up * weights.flatten()[order, None].to(x.dtype)
        y = expert_products(hidden, dequantized(self.down_proj, x.dtype), experts, ctx.grouped_mm)
        # Back in (token, pick) order by a gather at the inverse permutation (a gather is a few times faster
        # than the scatter, index_copy_, of the same rows).
        unsorted = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=x.device))
        return residual + y[unsorted].view(*x.shape[:2], self.top_k, -1).sum(2)


def expert_products(rows: Tensor, weight: Tensor, experts: Tensor, grouped_mm: bool) -> Tensor:
    """rows (pairs, K), sorted by their `experts` (pairs,), each times its expert's weight (experts, N, K):
    (pairs, N), in static shapes (for compile and graphs). grouped_mm: one grouped product, each expert over
    its own run of rows, the runs' ends computed on the device. Otherwise every expert multiplies every row
    (E times the work), and each row keeps its own expert's product."""
    if grouped_mm:
        ends = torch.searchsorted(experts, torch.arange(len(weight), device=rows.device), right=True)
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=ends.int())  # ends: (experts,) int32
    return torch.einsum("pk,enk->pen", rows, weight)[torch.arange(len(rows), device=rows.device), experts]


def dequantized(proj: Linear, dtype) -> Tensor:
    weight = proj.weight.to(dtype)
    return weight if proj.scale is None else weight * proj.scale[..., None]


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        # nn.RMSNorm is F.rms_norm: normalised in fp32, as transformers does, in one kernel on CUDA
        self.input_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MoE(args) if args.is_sparse(layer) else MLP(args)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        # Each norm is applied inside the first projection after it, each residual add inside the last one.
        h = self.self_attn(x, norm=self.input_layernorm, residual=x, ctx=ctx)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h, ctx=ctx)


class Transformer(nn.Module):
    """Module names follow the Hugging Face checkpoint's, except the fused qkv_proj and gate_up_proj."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        int8 = args.quantization == "int8" and not args.tie_word_embeddings  # a tied one: the embedding
        self.lm_head = Linear(args.hidden_size, args.vocab_size, int8=int8)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def setup_cache(self, slots: int, capacity: int):
        """Allocates a StaticKVCache per layer and the RoPE table for positions [0, capacity)."""
        a = self.args
        if capacity > a.max_position_embeddings:
            raise UserError(f"cache length {capacity} is over the model's {a.max_position_embeddings} "
                            "positions: shorten the prompt or lower --max-new-tokens / --cache-len")
        device = self.norm.weight.device
        dtype = self.norm.weight.dtype
        # One spare position, never attended: every attended prefix is then a strict slice of the buffer, so a
        # compiled step's contiguity guards don't fail (and recompile) when the prefix reaches the capacity.
        for layer in self.layers:
            layer.self_attn.kv_cache = StaticKVCache(slots, a.num_key_value_heads, capacity + 1, a.head_dim,
                                                     dtype, device)
        # Angles in fp32 on the CPU as transformers computes them (an elementwise product, not a matmul); the
        # table is kept in the model's dtype because transformers casts it so before rotating.
        inv_freq, scale = rope_frequencies(a)
        angles = torch.arange(capacity, dtype=torch.float)[:, None] * inv_freq.repeat(2)  # both halves alike
        self.register_buffer("rope_cos", (angles.cos() * scale).to(device, dtype), persistent=False)
        signs = torch.tensor([-1.0, 1.0]).repeat_interleave(a.head_dim // 2)  # rotate_half's, in the table
        self.register_buffer("rope_sin", (angles.sin() * scale * signs).to(device, dtype), persistent=False)
        self.register_buffer("key_positions", torch.arange(capacity, device=device), persistent=False)
        # torch._grouped_mm compiles for bf16 alone, and on CUDA it has a kernel for Hopper and Blackwell
        # alone: elsewhere it loops over the experts reading where each one's rows end on the host, which a
        # CUDA graph can't hold. MoE layers multiply by every expert where it doesn't apply.
        hopper_or_blackwell = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10)
        self.grouped_mm = dtype == torch.bfloat16 and (device.type == "cpu" or hopper_or_blackwell)

    def forward(self, tokens: Tensor, positions: Tensor, kv_positions: Tensor | None,
                rows: slice = slice(None), logits_at: Tensor | None = None, packed: Tensor | None = None,
                use_kernels: bool = False) -> Tensor:
        """tokens, positions: (R, T) for cache rows `rows`; kv_positions: the cache prefix to attend over (a
        slice of key_positions covering every position written so far), or None for prompts at positions
        0 ... T - 1, which attend causally among themselves (flash attention, no T x T mask). use_kernels: the
        Triton kernels run where they apply (a single token). Returns logits (R, T, vocab), or with logits_at
        (R, 1), the index of one token in each row, that token's (R, 1, vocab): then the last layer computes
        its keys and values at every token (the cache needs them) but its queries, attention, o_proj and MLP
        at those tokens alone, 1/layers of a prefill's work saved (8B, 32,000 tokens: 25 ms).

        packed (N,), indices into the flattened (R, T) grid, with kv_positions None: the tokens that run, the
        rest never computed (a batch of prompts padded to the longest: the padding). The projections and MLPs
        see the N tokens alone, (1, N, hidden); attention puts them back on the grid, a row per prompt, where
        the causal rule keeps every query to its row's keys; a token that didn't run has zeros there. So the
        tokens of a row that run must be its first ones: its prompt, then padding (which the causal rule
        hides from the prompt). Without logits_at, the logits are the packed tokens' (1, N, vocab)."""
        if self.layers[0].self_attn.kv_cache is None:
            raise RuntimeError("call setup_cache(slots, capacity) before running the model")
        fused = use_kernels and tokens.numel() == 1
        mask = None  # the kernels need none, and read the RoPE tables at the positions themselves
        cos, sin = self.rope_cos, self.rope_sin
        if not fused:
            cos, sin = cos[positions][:, :, None], sin[positions][:, :, None]
        if kv_positions is None:
            kv_positions = self.key_positions[:tokens.shape[1]]
        elif not fused:
            mask = (kv_positions <= positions[..., None])[:, None]  # causal: hides unwritten and stale slots
        ctx = ForwardContext(rows=rows, positions=positions, cos=cos, sin=sin, mask=mask, packed=packed,
                             kv_len=kv_positions.shape[0], fused=fused, grouped_mm=self.grouped_mm)
        x = self.embed_tokens(tokens if packed is None else tokens.flatten()[packed][None])
        for layer in self.layers[:-1]:
            x = layer(x, ctx)
        if logits_at is not None:  # the last layer goes on from its keys and values at logits_at alone
            query_positions = positions.take_along_dim(logits_at, dim=1)  # (R, 1)
            ctx = replace(ctx, queries_at=logits_at, mask=kv_positions <= query_positions[..., None, None])
        x = self.layers[-1](x, ctx)
        return project(self.lm_head, x, norm=self.norm, fused=fused)

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        """What a converted checkpoint holds: the state but a tied lm_head, which is the embedding."""
        state = self.state_dict()
        if self.args.tie_word_embeddings:
            del state["lm_head.weight"]
        return state

    @classmethod
    def from_checkpoint(cls, path: str, device, dtype) -> "Transformer":
        """Loads a directory written by convert_hf_checkpoint.py, straight to `device` (no second copy)."""
        from safetensors.torch import load_file
        config = pathlib.Path(path, "config.json")
        if not config.is_file():
            raise UserError(f"no converted checkpoint at {path}: download a Hugging Face snapshot, convert "
                            "it with convert_hf_checkpoint.py, and pass its output directory to --checkpoint")
        cfg = read_json(config)
        if "quantization" not in cfg:  # every config.json our converter writes has it
            raise UserError(f"{path} is a Hugging Face snapshot: convert it first "
                            f"(python convert_hf_checkpoint.py --checkpoint-dir {path})")
        args = ModelArgs.from_config(cfg)
        files = sorted(pathlib.Path(path).glob("model*.safetensors"))
        if not files:
            raise UserError(f"{path}: no model*.safetensors files; convert the checkpoint again")
        state = {}
        for file in files:
            try:
                state.update(load_file(file, device=str(device)))
            except Exception as e:  # safetensors' own error type: a truncated or corrupt file
                raise UserError(f"{file}: cannot be read ({e}); convert the checkpoint again") from None
        state = {name: t if t.dtype == torch.int8 else t.to(dtype) for name, t in state.items()}
        with torch.device("meta"):
            model = cls(args)
        expected = {name: t.shape for name, t in model.checkpoint_tensors().items()}
        found = {name: t.shape for name, t in state.items()}
        mismatched = sorted(n for n in expected.keys() | found.keys() if expected.get(n) != found.get(n))
        if mismatched:
            raise UserError(f"{path}: weights do not match config.json ({len(mismatched)} tensors missing, "
                            f"unexpected or of another shape, first {mismatched[0]}); convert the checkpoint "
                            "again")
        # The loaded tensors themselves, no copy; every one is checked above. A tied lm_head is not among
        # them: it is the embedding again.
        model.load_state_dict(state, strict=False, assign=True)
        if args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval().requires_grad_(False)

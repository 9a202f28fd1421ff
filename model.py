"""Qwen3 (dense) for fast decoding: fused projections, a static KV cache, and one forward for prefill and decode."""
import glob, json, os, pathlib
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import kernels


class UserError(Exception):
    """Bad input: the command-line tools print it as one line instead of a traceback."""


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

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """From a Hugging Face Qwen3 config.json, or from the config.json our converter writes."""
        arch = (cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
        if arch != "Qwen3ForCausalLM":
            raise UserError(f"architecture {arch} is not supported: only dense Qwen3 (Qwen3ForCausalLM) is")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # new style, then old
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise UserError(f"rope type {rope.get('rope_type', rope.get('type'))} is not supported: only default RoPE")
        if cfg.get("use_sliding_window"):
            raise UserError("sliding-window attention is not supported: set use_sliding_window to false")
        args = cls(**{f.name: cfg[f.name] for f in fields(cls) if cfg.get(f.name) is not None})
        args.rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", args.rope_theta)))
        if cfg.get("head_dim") is None:
            args.head_dim = args.hidden_size // args.num_attention_heads
        return args

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        if name not in PRESETS:
            raise UserError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
        return cls(*PRESETS[name][:5], 16 if name == "tiny" else 128, tie_word_embeddings=PRESETS[name][5])


PRESETS = {  # hidden, intermediate, layers, heads, kv heads, tied embeddings (from the published config.json files)
    "tiny": (64, 128, 2, 4, 2, True),
    "0.6B": (1024, 3072, 28, 16, 8, True),
    "1.7B": (2048, 6144, 28, 16, 8, True),
    "4B": (2560, 9728, 36, 32, 8, True),
    "8B": (4096, 12288, 36, 32, 8, False),
    "14B": (5120, 17408, 40, 40, 8, False),
    "32B": (5120, 25600, 64, 64, 8, False),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # as transformers: normalise in fp32, cast back, then scale
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Int8Linear(nn.Module):
    """y = (x @ int8 weight^T) * per-output-channel scale. The cast sits inside the matmul's expression so that
    inductor fuses it into the matmul's loads and never writes a full-precision copy of the weight."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype)) * self.scale


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w ~= q * scale[:, None]."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def linear(args: ModelArgs, n_in: int, n_out: int) -> nn.Module:
    return Int8Linear(n_in, n_out) if args.quantization == "int8" else nn.Linear(n_in, n_out, bias=False)


def project(x: Tensor, proj: nn.Module, norm: RMSNorm | None = None, gated: bool = False,
            residual: Tensor | None = None) -> Tensor:
    """residual + proj(norm(x)), or proj(silu(gate) * up) of x = [gate, up]: one fused kernel for a decode token
    on CUDA, PyTorch's ops (the reference) otherwise."""
    if kernels.usable(x):
        return kernels.gemv(x, proj.weight, getattr(proj, "scale", None), norm.weight if norm else None,
                            norm.eps if norm else 0.0, gated, residual)
    if norm is not None:
        x = norm(x)
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return proj(x) if residual is None else residual + proj(x)


class StaticKVCache(nn.Module):
    """Keys and values of one layer at absolute positions, one row per request slot: (slots, kv_heads, capacity,
    head_dim), zero-filled. A slot not yet written, or left over from a longer earlier request, sits at a position
    greater than every live query of its row, so the causal rule key_pos <= query_pos hides it: nothing to clear."""

    def __init__(self, slots: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (slots, kv_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, rows: slice, positions: Tensor, k: Tensor, v: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Writes k, v (R, T, kv_heads, head_dim) at (row, position) pairs; returns the first kv_len positions."""
        r = torch.arange(positions.shape[0], device=positions.device)[:, None]
        self.k[rows][r, :, positions] = k
        self.v[rows][r, :, positions] = v
        return self.k[rows, :, :kv_len], self.v[rows, :, :kv_len]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # split-halves layout, as transformers
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.qkv_proj = linear(args, args.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim)
        self.o_proj = linear(args, self.n_heads * self.head_dim, args.hidden_size)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps), RMSNorm(self.head_dim, args.rms_norm_eps)
        self.kv_cache: StaticKVCache | None = None

    def forward(self, x: Tensor, norm: RMSNorm, cos: Tensor, sin: Tensor, mask: Tensor, rows: slice,
                positions: Tensor) -> Tensor:
        """x + attention(norm(x))."""
        R, T, _ = x.shape
        qkv, cache = project(x, self.qkv_proj, norm), self.kv_cache
        if kernels.usable(x):  # norms, RoPE, cache write and attention in one kernel
            y = kernels.decode_attention(qkv, cache.k, cache.v, rows.start or 0, positions[:, 0], cos, sin,
                                         self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.n_heads)
        else:
            q, k, v = qkv.view(R, T, -1, self.head_dim).split([self.n_heads, self.n_kv, self.n_kv], dim=2)
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
            keys, values = cache.update(rows, positions, k, v, mask.shape[-1])
            y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
            y = y.transpose(1, 2)
        return project(y.reshape(R, T, -1), self.o_proj, residual=x)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = linear(args, args.hidden_size, 2 * args.intermediate_size)
        self.down_proj = linear(args, args.intermediate_size, args.hidden_size)

    def forward(self, x: Tensor, norm: RMSNorm) -> Tensor:
        """x + mlp(norm(x))."""
        return project(project(x, self.gate_up_proj, norm), self.down_proj, gated=True, residual=x)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: Tensor, *attn_args) -> Tensor:
        return self.mlp(self.self_attn(x, self.input_layernorm, *attn_args), self.post_attention_layernorm)


class Transformer(nn.Module):
    """Module names follow the Hugging Face checkpoint's, except the fused qkv_proj and gate_up_proj."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False) if args.tie_word_embeddings else \
            linear(args, args.hidden_size, args.vocab_size)  # int8 too, unless it is the embedding
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def setup_cache(self, slots: int, capacity: int):
        """Allocates a StaticKVCache per layer and the RoPE table for positions [0, capacity)."""
        a = self.args
        if capacity > a.max_position_embeddings:
            raise UserError(f"cache length {capacity} is over the model's {a.max_position_embeddings} positions: "
                            "shorten the prompt or lower --max-new-tokens / --cache-len")
        device, dtype = self.norm.weight.device, self.norm.weight.dtype
        # One spare position, never attended: every attended prefix is then a strict slice of the buffer, so a
        # compiled step's contiguity guards don't fail (and recompile) when the prefix reaches the capacity.
        for layer in self.layers:
            layer.self_attn.kv_cache = StaticKVCache(slots, a.num_key_value_heads, capacity + 1, a.head_dim, dtype,
                                                     device)
        # Angles in fp32 on the CPU as transformers computes them (an elementwise product, not a matmul).
        inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float) / a.head_dim))
        angles = torch.arange(capacity, dtype=torch.float)[:, None] * inv_freq.repeat(2)  # both halves alike
        self.register_buffer("rope_cos", angles.cos().to(device, dtype), persistent=False)  # in the model's dtype:
        self.register_buffer("rope_sin", angles.sin().to(device, dtype), persistent=False)  # transformers casts it so
        self.register_buffer("key_positions", torch.arange(capacity, device=device), persistent=False)

    def forward(self, tokens: Tensor, positions: Tensor, kv_positions: Tensor, rows: slice = slice(None),
                last_only: bool = False) -> Tensor:
        """tokens, positions: (R, T) for cache rows `rows`; kv_positions: the cache prefix to attend over
        (a slice of key_positions covering every position written so far). Returns logits (R, T or 1, vocab)."""
        x = self.embed_tokens(tokens)
        cos, sin = self.rope_cos[positions][:, :, None], self.rope_sin[positions][:, :, None]
        # (R, 1, T, kv_len): causal, and hides unwritten slots; the one-token kernel path needs none
        mask = None if kernels.usable(x) else (kv_positions <= positions[..., None])[:, None]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, rows, positions)
        x = x[:, -1:] if last_only else x
        return project(x, self.lm_head, self.norm)

    @classmethod
    def from_checkpoint(cls, path: str, device, dtype) -> "Transformer":
        """Loads a directory written by convert_hf_checkpoint.py, straight to `device` (no second copy)."""
        from safetensors.torch import load_file
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"no converted checkpoint at {path}: run python convert_hf_checkpoint.py --repo "
                            "Qwen/Qwen3-0.6B (or --checkpoint-dir DIR), then pass --checkpoint DIR/converted")
        args = ModelArgs.from_config(json.loads(pathlib.Path(path, "config.json").read_text()))
        files = sorted(glob.glob(os.path.join(path, "model*.safetensors")))
        state = {k: v for file in files for k, v in load_file(file, device=str(device)).items()}
        if (args.quantization == "int8") != any(k.endswith(".scale") for k in state):
            raise UserError(f"{path}: config.json and the weights disagree on int8 quantization; convert it again")
        try:
            return cls.from_state_dict(args, {k: v if v.dtype == torch.int8 else v.to(dtype) for k, v in state.items()})
        except RuntimeError as e:
            raise UserError(f"{path}: weights do not match config.json ({str(e).splitlines()[-1].strip()}); reconvert")

    @classmethod
    def from_state_dict(cls, args: ModelArgs, state: dict) -> "Transformer":
        """Builds the model around the tensors of `state` without copying them (meta device, then assign)."""
        with torch.device("meta"):
            model = cls(args)
        if args.tie_word_embeddings and "embed_tokens.weight" in state:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        if args.tie_word_embeddings:  # assign made two Parameters of one tensor: make them one again
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()

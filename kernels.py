"""Triton kernels for one-token decode steps on CUDA: a matrix-vector product with what surrounds it fused in
(RMSNorm, the SiLU gate, int8 dequantisation, the residual; for MoE, the router's picks and weights), and
split-KV attention for one query per row with the q/k norms, RoPE and the cache write fused in. model.py uses
PyTorch's ops where they don't apply (the CPU, several tokens), and as their reference in tests.

Why: a decode step at batch 1 is bound by its many small kernels, each a launch gap and a ramp-up even in a
CUDA graph: these make a layer six kernels (bench/RESULTS.md has the measurements)."""
import torch
import triton  # without Triton this module doesn't import, and model.py runs PyTorch's ops
import triton.language as tl
from torch import Tensor


@triton.jit
def _route(router, EXPERTS: tl.constexpr, TOP_K: tl.constexpr, NORM_TOPK: tl.constexpr,
           EB: tl.constexpr, KB: tl.constexpr):
    # The picks of a MoE router from its logits, as MoE.forward makes them: softmax in fp32, the TOP_K
    # most probable experts, renormalised to sum 1 with NORM_TOPK. Returns (ids, weights): vectors of KB
    # (TOP_K rounded up to a power of two), pick i at index i.
    e = tl.arange(0, EB)
    p = tl.load(router + e, mask=e < EXPERTS, other=float("-inf")).to(tl.float32)
    p = tl.exp(p - tl.max(p, axis=0))
    p = p / tl.sum(p, axis=0)
    rank = tl.arange(0, KB)
    ids = tl.zeros([KB], tl.int32)
    weights = tl.zeros([KB], tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=0)
        ids = tl.where(rank == i, best, ids)
        weights = tl.where(rank == i, tl.max(p, axis=0), weights)
        p = tl.where(e == best, -1.0, p)
    if NORM_TOPK:
        weights = weights / tl.sum(weights, axis=0)
    return ids, weights

@triton.jit
def _gemv(x, w, scale, norm, res, out, router, N, K, x_row, eps: tl.constexpr, NORM: tl.constexpr,
          GATED: tl.constexpr, SCALE: tl.constexpr, RES: tl.constexpr, EXPERTS: tl.constexpr,
          TOP_K: tl.constexpr, NORM_TOPK: tl.constexpr, ROUTED: tl.constexpr, TERMS: tl.constexpr,
          EB: tl.constexpr, KB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PACK: tl.constexpr):
    # out[j, n] = res[n] + scale[n] * sum_k w[n, k] * a[k], a = x * norm / rms(x) or silu(x[:K]) * x[K:].
    # MoE: w and scale hold EXPERTS experts, of which the router's logits pick TOP_K, and output j uses
    # pick j; or, ROUTED, one output sums the picks', each of its own input row x[t], by routing weight.
    # int8 weights come as int32 words of PACK = 4 bytes, and integer operations make each byte fp32 (the
    # float bits 0x4B000000 | byte ^ 0x80 are 2^23 + 128 + its value): a conversion instruction per byte
    # would be the limit.
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    j = tl.program_id(1)
    KW = K // PACK  # weight words per row
    y = tl.zeros([BN], tl.float32)
    expert = 0
    if EXPERTS:
        ids, weights = _route(router, EXPERTS, TOP_K, NORM_TOPK, EB, KB)
    for t in tl.static_range(TERMS):  # TOP_K picks when ROUTED, else 1; unrolled: their loads overlap
        if EXPERTS:
            pick = tl.arange(0, KB) == j + t
            expert = tl.sum(tl.where(pick, ids, 0), axis=0)
        xt = x + t * x_row
        wt_rows = w + expert * N * KW
        acc, squares = tl.zeros([BN, BK], tl.float32), tl.zeros([BK], tl.float32)
        for k0 in range(0, KW, BK):
            words = k0 + tl.arange(0, BK)
            wmask = (n[:, None] < N) & (words[None, :] < KW)
            wt = tl.load(wt_rows + n[:, None] * KW + words[None, :], mask=wmask, other=0)
            for i in tl.static_range(PACK):
                k = words * PACK + i
                a = tl.load(xt + k, mask=k < K, other=0.0).to(tl.float32)
                if GATED:
                    a = a * tl.sigmoid(a) * tl.load(xt + K + k, mask=k < K, other=0.0).to(tl.float32)
                if NORM:  # the 1/rms factor is applied at the end: it scales every output alike
                    squares += a * a
                    a = a * tl.load(norm + k, mask=k < K, other=0.0).to(tl.float32)
                if PACK == 4:
                    wi = (((wt >> 8 * i) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
                else:
                    wi = wt.to(tl.float32)
                acc += wi * a[None, :]
        yt = tl.sum(acc, axis=1)
        if NORM:
            yt = yt * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if SCALE:
            yt = yt * tl.load(scale + expert * N + n, mask=n < N, other=0.0).to(tl.float32)
        if ROUTED:
            yt = yt * tl.sum(tl.where(pick, weights, 0.0), axis=0)
        y += yt
    if RES:
        y = y + tl.load(res + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out + j * N + n, y.to(out.dtype.element_ty), mask=n < N)

@triton.jit
def _norm_rope(x, rows, rowmask, w, cos, sin, eps, HEAD_DIM: tl.constexpr, D: tl.constexpr):
    # RMSNorm over each row's head_dim, times w, then RoPE in the split-halves layout: as q_norm/k_norm
    # and apply_rope in model.py, in fp32.
    d = tl.arange(0, D)
    other = tl.where(d < HEAD_DIM // 2, d + HEAD_DIM // 2, d - HEAD_DIM // 2)  # rotate_half's partner
    mask = rowmask[:, None] & (d[None, :] < HEAD_DIM)
    xd = tl.load(x + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(x + rows[:, None] + other[None, :], mask=mask, other=0.0).to(tl.float32)
    wd = tl.load(w + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    wo = tl.load(w + other, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xd * xd, axis=1) / HEAD_DIM + eps)[:, None]
    rotated = xo * wo[None, :] * sin[None, :]  # the sin table carries rotate_half's signs
    return (xd * wd[None, :] * cos[None, :] + rotated) * rstd

@triton.jit
def _attention(qkv, k, v, first_row, pos, cos, sin, q_norm, k_norm, o, lse, qkv_row, cs_row, k_row,
               k_head, k_pos, eps: tl.constexpr, sm_scale: tl.constexpr, GROUP: tl.constexpr,
               HEAD_DIM: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
               SPLITS: tl.constexpr):
    # Program (row r, kv head h, split s), from the row's fused q|k|v projection: normalises and rotates
    # the GROUP query heads of h, attends over the split's share of the keys at positions <= p, the
    # query's (the cost follows the live length, not the cache's), and writes the softmax-normalised
    # partial output and its log-sum-exp for _merge. The split whose share holds p first writes the new
    # key (normalised and rotated) and value there; no other program reads position p.
    r, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, d = tl.arange(0, G), tl.arange(0, D)
    dmask = d < HEAD_DIM
    p = tl.load(pos + r)
    KV_HEADS = tl.num_programs(1)
    H = GROUP * KV_HEADS
    cs = tl.load(cos + p * cs_row + d, mask=dmask, other=0.0).to(tl.float32)
    sn = tl.load(sin + p * cs_row + d, mask=dmask, other=0.0).to(tl.float32)
    row = qkv + r * qkv_row
    qt = _norm_rope(row, (h * GROUP + g) * HEAD_DIM, g < GROUP, q_norm, cs, sn, eps, HEAD_DIM, D)
    qt = qt.to(k.dtype.element_ty)  # rounded as the model's activations are
    cache = (first_row + r) * k_row + h * k_head
    chunk = tl.cdiv(tl.cdiv(p + 1, SPLITS), BLOCK) * BLOCK
    lo = s * chunk
    hi = tl.minimum(lo + chunk, p + 1)
    if (lo <= p) & (p < hi):
        # The new key: one head, normalised as G rows of which row 0 alone is real, then summed.
        new_k = _norm_rope(row, tl.zeros([G], tl.int32) + (H + h) * HEAD_DIM, g < 1, k_norm, cs, sn, eps,
                           HEAD_DIM, D)
        tl.store(k + cache + p * k_pos + d, tl.sum(new_k, axis=0).to(k.dtype.element_ty), mask=dmask)
        new_v = tl.load(row + (H + KV_HEADS + h) * HEAD_DIM + d, mask=dmask)
        tl.store(v + cache + p * k_pos + d, new_v.to(v.dtype.element_ty), mask=dmask)
        tl.debug_barrier()  # the stores are seen by all of this program's threads before the loads below
    m = tl.full([G], -1e30, tl.float32)
    total = tl.zeros([G], tl.float32)  # the softmax's denominator so far
    acc = tl.zeros([G, D], tl.float32)
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        kvmask = (j[:, None] < hi) & dmask[None, :]
        offsets = cache + j[:, None] * k_pos + d[None, :]
        kt = tl.load(k + offsets, mask=kvmask, other=0.0)
        vt = tl.load(v + offsets, mask=kvmask, other=0.0)
        scores = tl.dot(qt, tl.trans(kt), input_precision="ieee") * sm_scale
        scores = tl.where(j[None, :] < hi, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        e = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(e, axis=1)
        acc = acc * alpha[:, None] + tl.dot(e.to(vt.dtype), vt, input_precision="ieee")
        m = m_new
    out = (r * H + h * GROUP + g) * SPLITS + s  # index into (rows, heads, SPLITS)
    tl.store(o + out[:, None] * HEAD_DIM + d[None, :], acc / tl.where(total > 0, total, 1.0)[:, None],
             mask=(g[:, None] < GROUP) & dmask[None, :])
    tl.store(lse + out, m + tl.log(total), mask=g < GROUP)  # -inf for an empty split

@triton.jit
def _merge(o, lse, out, HEAD_DIM: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    # One (row, head): the splits' outputs weighted by exp(lse) over their sum, which is exact.
    i, s, d = tl.program_id(0), tl.arange(0, SPLITS), tl.arange(0, D)
    w = tl.load(lse + i * SPLITS + s)
    w = tl.exp(w - tl.max(w, axis=0))
    parts = tl.load(o + (i * SPLITS + s[:, None]) * HEAD_DIM + d[None, :], mask=d[None, :] < HEAD_DIM)
    y = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out + i * HEAD_DIM + d, y.to(out.dtype.element_ty), mask=d < HEAD_DIM)


# Launch configurations of _gemv by what it fuses into its input and how the weights are stored, from sweeps
# on the H200 over the shapes of 0.6B, 8B and 30B-A3B, weighted by their count in a step (bench/RESULTS.md,
# 2026-12-01): more rows per program where the work on x is costlier, or for int8.
GEMV_CONFIGS = {  # BN: weight rows per program, BK: weight words per block
    ("norm", "float"): dict(BN=8, BK=512, num_warps=2),
    ("gated", "float"): dict(BN=8, BK=1024, num_warps=4),
    ("plain", "float"): dict(BN=2, BK=1024, num_warps=4),
    ("norm", "int8"): dict(BN=16, BK=128, num_warps=4),
    ("gated", "int8"): dict(BN=8, BK=512, num_warps=8),
    ("plain", "int8"): dict(BN=8, BK=512, num_warps=4),
    ("picked", "float"): dict(BN=16, BK=256, num_warps=1),  # MoE gate-up, 30B-A3B's shapes
    ("routed", "float"): dict(BN=4, BK=1024, num_warps=4),  # MoE down
    ("picked", "int8"): dict(BN=32, BK=128, num_warps=4),
    ("routed", "int8"): dict(BN=8, BK=256, num_warps=4),
}


# Custom ops: torch.compile calls them as they are, instead of analysing the kernels at each of their call
# sites (five a layer), which would be most of its compile time.
@torch.library.custom_op("qwen3_fast::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, scale: Tensor | None = None, norm: Tensor | None = None, eps: float = 0.0,
         gated: bool = False, residual: Tensor | None = None, router: Tensor | None = None, top_k: int = 0,
         norm_topk_prob: bool = False, routed: bool = False) -> Tensor:
    """residual + (weight @ a) * scale for one token x (1, 1, K), where a is RMSNorm(x) * norm with `norm`,
    silu(gate) * up of x = [gate, up] with `gated`, else x. weight (N, K) in x's dtype, or int8 (K a multiple
    of 4) with a `scale` per row. MoE: weight (experts, N, K), and the `router` logits (experts,) pick top_k
    of them as MoE.forward does: (top_k, 1, N), one output per pick; or, `routed`, with x (top_k, 1, K), the
    picks' sum weighted by their routing weights (1, 1, N)."""
    N, K = weight.shape[-2:]
    experts = 0 if router is None else router.shape[-1]
    out = gemv_output(x, weight, router=router, top_k=top_k, routed=routed)  # as the fake op gives it
    int8 = weight.dtype == torch.int8
    fused_input = "plain"
    if router is not None:
        fused_input = "routed" if routed else "picked"
    elif norm is not None or gated:
        fused_input = "gated" if gated else "norm"
    config = GEMV_CONFIGS[fused_input, "int8" if int8 else "float"]
    words = weight.view(torch.int32) if int8 else weight  # an int32 word holds 4 int8 weights
    routing = dict(EXPERTS=experts, TOP_K=top_k, NORM_TOPK=norm_topk_prob, ROUTED=routed,
                   TERMS=top_k if routed else 1, EB=triton.next_power_of_2(max(experts, 1)),
                   KB=triton.next_power_of_2(max(top_k, 1)))
    # A None argument is a constexpr None to Triton: the branches that would read it are not compiled.
    _gemv[(triton.cdiv(N, config["BN"]), out.shape[0])](
        x, words, scale, norm, residual, out, router, N, K, x.shape[-1], eps, NORM=norm is not None,
        GATED=gated, SCALE=scale is not None, RES=residual is not None, PACK=4 if int8 else 1, **routing,
        **config)
    return out


@gemv.register_fake
def gemv_output(x, weight, scale=None, norm=None, eps=0.0, gated=False, residual=None, router=None, top_k=0,
                norm_topk_prob=False, routed=False):
    """The output of gemv, uninitialised: (top_k, 1, N) for the picked experts, else (1, 1, N)."""
    outputs = top_k if router is not None and not routed else 1
    return x.new_empty(outputs, 1, weight.shape[-2])


@torch.library.custom_op("qwen3_fast::decode_attention", mutates_args=("cache_k", "cache_v"))
def decode_attention(qkv: Tensor, cache_k: Tensor, cache_v: Tensor, first_row: int, positions: Tensor,
                     cos: Tensor, sin: Tensor, q_norm: Tensor, k_norm: Tensor, eps: float, heads: int,
                     kv_len: int) -> Tensor:
    """One query per row: qkv (R, 1, (heads + 2 kv_heads) * head_dim), the fused projection, at positions (R,)
    of cache rows first_row ... first_row + R - 1 of cache_k/cache_v (slots, kv_heads, capacity, head_dim),
    which get the new key and value there; cos/sin the RoPE tables (positions, head_dim), sin with
    rotate_half's signs (model.apply_rope); q_norm/k_norm the RMSNorm weights. Attends to keys at positions
    <= the query's, split over the keys into programs per (row, kv head), so that one row still fills the
    GPU; returns (R, heads, head_dim). kv_len, a bound on the positions (the attended length), sets the
    number of splits: a 64-key block each until there are 32, then more blocks each, which measured best on
    the H200 from 1,024 to 32,768 keys (bench/RESULTS.md); any kv_len gives the same result."""
    splits = min(32, triton.next_power_of_2(triton.cdiv(kv_len, 64)))  # a power of two, for the merge
    R = qkv.shape[0]
    kv_heads, head_dim = cache_k.shape[1], cache_k.shape[3]
    o = torch.empty(R, heads, splits, head_dim, dtype=torch.float32, device=qkv.device)
    lse = torch.empty(R, heads, splits, dtype=torch.float32, device=qkv.device)
    D = max(16, triton.next_power_of_2(head_dim))  # tl.dot wants blocks of at least 16
    k_row, k_head, k_pos, _ = cache_k.stride()
    _attention[(R, kv_heads, splits)](
        qkv, cache_k, cache_v, first_row, positions, cos, sin, q_norm, k_norm, o, lse, qkv.stride(0),
        cos.stride(0), k_row, k_head, k_pos, eps=eps, sm_scale=head_dim ** -0.5, GROUP=heads // kv_heads,
        HEAD_DIM=head_dim, G=max(16, triton.next_power_of_2(heads // kv_heads)), D=D, BLOCK=64, SPLITS=splits)
    out = torch.empty(R, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _merge[(R * heads,)](o, lse, out, HEAD_DIM=head_dim, D=D, SPLITS=splits)
    return out


@decode_attention.register_fake
def _(qkv, cache_k, cache_v, first_row, positions, cos, sin, q_norm, k_norm, eps, heads, kv_len):
    return qkv.new_empty(qkv.shape[0], heads, cache_k.shape[-1])

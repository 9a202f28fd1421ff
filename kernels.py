"""Triton kernels for one-token decode steps on CUDA: a matrix-vector product with its neighbours fused in, split-KV
attention for one query with the q/k norms, RoPE and the cache write fused in, and top-k/top-p sampling. model.py and
generate.py use PyTorch's ops where these don't apply (CPU, several tokens or rows), and as their reference in tests.

Why (measured on the H200, Qwen3-0.6B): inductor's reductions moved 0.9-1.5 TB/s on the 4-13 MB weight matrices and
cuDNN's attention took ~8 us per layer for one query, in 11 kernels per layer; with these, 6.
Every kernel costs a launch gap and a ramp-up even inside a CUDA graph, which at this size is most of its time."""
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: model.py then never calls in here
    triton = None

ENABLED = triton is not None  # benchmarks switch it off to measure what the kernels buy


def usable(x: torch.Tensor) -> bool:  # one token of one row on CUDA: the shape these kernels are written for
    return ENABLED and x.is_cuda and x.numel() == x.shape[-1]


if triton is not None:
    @triton.jit
    def _gemv(x, w, scale, norm, res, out, N, K, eps: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
              SCALE: tl.constexpr, RES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PACK: tl.constexpr):
        # out[n] = res[n] + scale[n] * sum_k w[n, k] * a[k], a = x * norm / rms(x) or silu(x[:K]) * x[K:]. int8
        # weights come as int32 words of PACK = 4, and bit operations make each byte fp32 (float bits 0x4B000000 |
        # byte ^ 0x80 are 2^23 + 128 + its value): the conversion instruction capped int8 at ~2.5 TB/s, this 3.3.
        n, KW = tl.program_id(0) * BN + tl.arange(0, BN), K // PACK
        acc, squares = tl.zeros([BN, BK], tl.float32), tl.zeros([BK], tl.float32)
        for k0 in range(0, KW, BK):
            words = k0 + tl.arange(0, BK)
            wt = tl.load(w + n[:, None] * KW + words[None, :], mask=(n[:, None] < N) & (words[None, :] < KW), other=0)
            for i in tl.static_range(PACK):
                k = words * PACK + i
                a = tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)
                if GATED:
                    a = a * tl.sigmoid(a) * tl.load(x + K + k, mask=k < K, other=0.0).to(tl.float32)
                if NORM:  # the 1/rms factor is applied at the end: it scales every output alike
                    squares += a * a
                    a = a * tl.load(norm + k, mask=k < K, other=0.0).to(tl.float32)
                wi = (((wt >> 8 * i) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0 if PACK == 4 \
                    else wt.to(tl.float32)
                acc += wi * a[None, :]
        y = tl.sum(acc, axis=1)
        if NORM:
            y = y * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if SCALE:
            y = y * tl.load(scale + n, mask=n < N, other=0.0).to(tl.float32)
        if RES:
            y = y + tl.load(res + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out + n, y.to(out.dtype.element_ty), mask=n < N)

    @triton.jit
    def _norm_rope(x, rows, rowmask, w, cos, sin, eps, HEAD_DIM: tl.constexpr, D: tl.constexpr):
        # RMSNorm over each row's head_dim, times w, then RoPE in the split-halves layout: as q_norm/k_norm and
        # apply_rope in model.py, in fp32.
        d = tl.arange(0, D)
        other = tl.where(d < HEAD_DIM // 2, d + HEAD_DIM // 2, d - HEAD_DIM // 2)  # rotate_half's partner
        mask = rowmask[:, None] & (d[None, :] < HEAD_DIM)
        xd = tl.load(x + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(x + rows[:, None] + other[None, :], mask=mask, other=0.0).to(tl.float32)
        wd = tl.load(w + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        wo = tl.load(w + other, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xd * xd, axis=1) / HEAD_DIM + eps)[:, None]
        rotated = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)[None, :] * xo * wo[None, :] * sin[None, :]
        return (xd * wd[None, :] * cos[None, :] + rotated) * rstd

    @triton.jit
    def _attention(qkv, k, v, first_row, pos, cos, sin, q_norm, k_norm, o, lse, qkv_row, cs_row, k_row, k_head,
                   k_pos, eps: tl.constexpr, sm_scale: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
        # Program (row, kv head, split), from the row's fused q|k|v projection: normalises and rotates the GROUP
        # query heads of kv head h and the new key, attends over the split's share of the row's live keys
        # (positions <= the query's: cost follows the live length, not the cache's) and writes the softmax-
        # normalised partial output and its log-sum-exp for the merge. The new key and value are used from
        # registers, and split 0 writes them to the cache: no program reads position p from memory this step.
        r, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        g, d, dmask = tl.arange(0, G), tl.arange(0, D), tl.arange(0, D) < HEAD_DIM
        p, H = tl.load(pos + r), GROUP * tl.num_programs(1)
        cs = tl.load(cos + r * cs_row + d, mask=dmask, other=0.0).to(tl.float32)
        sn = tl.load(sin + r * cs_row + d, mask=dmask, other=0.0).to(tl.float32)
        row = qkv + r * qkv_row
        qt = _norm_rope(row, (h * GROUP + g) * HEAD_DIM, g < GROUP, q_norm, cs, sn, eps, HEAD_DIM, D)
        qt = qt.to(k.dtype.element_ty)  # rounded as the model's activations are
        new_k = tl.sum(_norm_rope(row, (H + h) * HEAD_DIM + g * 0, g < 1, k_norm, cs, sn, eps, HEAD_DIM, D), axis=0)
        new_k = new_k.to(k.dtype.element_ty)
        new_v = tl.sum(tl.load(row + (H + tl.num_programs(1) + h) * HEAD_DIM + g[:, None] * 0 + d[None, :],
                               mask=(g[:, None] < 1) & dmask[None, :], other=0.0), axis=0)
        cache = (first_row + r) * k_row + h * k_head
        here = cache + p * k_pos + d
        tl.store(k + here, new_k, mask=dmask & (d * 0 + s == 0))
        tl.store(v + here, new_v.to(v.dtype.element_ty), mask=dmask & (d * 0 + s == 0))
        chunk = tl.cdiv(tl.cdiv(p + 1, SPLITS), BLOCK) * BLOCK
        lo = s * chunk
        hi = tl.minimum(lo + chunk, p + 1)
        end = tl.minimum(hi, p)  # keys before the new one
        m, l = tl.full([G], -1e30, tl.float32), tl.zeros([G], tl.float32)
        acc = tl.zeros([G, D], tl.float32)
        for start in range(lo, end, BLOCK):
            j = start + tl.arange(0, BLOCK)
            kvmask = (j[:, None] < end) & dmask[None, :]
            offsets = cache + j[:, None] * k_pos + d[None, :]
            kt, vt = tl.load(k + offsets, mask=kvmask, other=0.0), tl.load(v + offsets, mask=kvmask, other=0.0)
            scores = tl.dot(qt, tl.trans(kt), input_precision="ieee") * sm_scale
            scores = tl.where(j[None, :] < end, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            e, alpha = tl.exp(scores - m_new[:, None]), tl.exp(m - m_new)
            l = l * alpha + tl.sum(e, axis=1)
            acc = acc * alpha[:, None] + tl.dot(e.to(vt.dtype), vt, input_precision="ieee")
            m = m_new
        own = (lo <= p) & (p < hi)  # the split whose share holds the new key
        score = tl.where(own, tl.sum(qt.to(tl.float32) * new_k.to(tl.float32)[None, :], axis=1) * sm_scale,
                         float("-inf"))
        m_new = tl.maximum(m, score)
        e, alpha = tl.exp(score - m_new), tl.exp(m - m_new)
        l = l * alpha + e
        acc = acc * alpha[:, None] + e[:, None] * new_v.to(tl.float32)[None, :]
        m = m_new
        out = (r * H + h * GROUP + g) * SPLITS + s  # index into (rows, heads, SPLITS)
        tl.store(o + out[:, None] * HEAD_DIM + d[None, :], acc / tl.where(l > 0, l, 1.0)[:, None],
                 mask=(g[:, None] < GROUP) & dmask[None, :])
        tl.store(lse + out, m + tl.log(l), mask=g < GROUP)  # -inf for an empty split

    @triton.jit
    def _merge(o, lse, out, HEAD_DIM: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
        # One (row, head): the splits' outputs weighted by exp(lse) over their sum, which is exact.
        i, s, d = tl.program_id(0), tl.arange(0, SPLITS), tl.arange(0, D)
        w = tl.load(lse + i * SPLITS + s)
        w = tl.exp(w - tl.max(w, axis=0))
        parts = tl.load(o + (i * SPLITS + s[:, None]) * HEAD_DIM + d[None, :], mask=d[None, :] < HEAD_DIM)
        y = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out + i * HEAD_DIM + d, y.to(out.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _sample(x, values, ids, seed, token, N, temperature, top_p, K: tl.constexpr, KP: tl.constexpr,
                BLOCK: tl.constexpr, DRAW: tl.constexpr):
        # Program (row, chunk of BLOCK of the row's N scores x): the chunk's K largest of x / T, largest first, by K
        # rounds of take-the-max-and-remove-it (K is small: a sort measured 2.6x slower than torch.topk). Over the
        # logits, it writes each chunk's best to values and ids; then (DRAW) over values, in one chunk, it keeps a
        # candidate while the mass before it is < top_p and draws by Gumbel-max: argmax(v + g), g = -log(-log(u)),
        # is an exact draw from softmax(v) over the ones kept.
        r, c, j, n = tl.program_id(0), tl.program_id(1), tl.arange(0, BLOCK), tl.arange(0, KP)
        v = tl.load(x + r * N + c * BLOCK + j, mask=c * BLOCK + j < N, other=float("-inf")).to(tl.float32)
        v, best, at = v / temperature, tl.full([KP], float("-inf"), tl.float32), tl.zeros([KP], tl.int32)
        for q in tl.static_range(K):
            m, i = tl.max(v, axis=0, return_indices=True)
            best, at, v = tl.where(n == q, m, best), tl.where(n == q, i, at), tl.where(j == i, float("-inf"), v)
        if DRAW:
            p = tl.exp(best - tl.max(best, axis=0))
            kept = (tl.cumsum(p, axis=0) - p < top_p * tl.sum(p, axis=0)) & (n < K)
            g = -tl.log(-tl.log(tl.rand(tl.load(seed), r * KP + n)))
            choice = tl.argmax(tl.where(kept, best + g, float("-inf")), axis=0)
            tl.store(token + r, tl.load(ids + r * N + tl.sum(tl.where(n == choice, at, 0), axis=0)))
        else:
            out = (r * tl.num_programs(1) + c) * K + n
            tl.store(values + out, best, mask=n < K)
            tl.store(ids + out, c * BLOCK + at, mask=n < K)


# Custom ops: torch.compile calls them as they are instead of analysing the kernels at each call site (five a
# layer), which was most of its compile time (measured on the H200, 0.6B, cold: 46 s -> 15 s to the first token).
@torch.library.custom_op("qwen3_fast::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, scale: Tensor | None = None, norm: Tensor | None = None, eps: float = 0.0,
         gated: bool = False, residual: Tensor | None = None) -> Tensor:
    """residual + (weight @ a) * scale for one token x, where a is RMSNorm(x) * norm with `norm`, silu(gate) * up of
    x = [gate, up] with `gated`, else x. weight (N, K) in x's dtype, or int8 (K a multiple of 4) with a row `scale`."""
    N, K = weight.shape
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    # (rows per program, block, warps) for RMSNorm | SiLU gate | neither, bf16 then int8, from sweeps on the H200
    # over the 0.6B-8B shapes: more rows where the fused work on x is costlier, or the weights are int8.
    pack = 4 if weight.dtype == torch.int8 else 1
    BN, BK, warps = ((8, 512, 2), (4, 1024, 8), (2, 512, 2), (16, 128, 4), (8, 512, 8), (8, 512, 4))[
        (0 if norm is not None else 1 if gated else 2) + (3 if pack == 4 else 0)]
    _gemv[(triton.cdiv(N, BN),)](x, weight.view(torch.int32) if pack == 4 else weight, x if scale is None else scale,
                                 x if norm is None else norm, x if residual is None else residual, out, N, K, eps,
                                 NORM=norm is not None, GATED=gated, SCALE=scale is not None,
                                 RES=residual is not None, BN=BN, BK=BK, PACK=pack, num_warps=warps)
    return out


gemv.register_fake(lambda x, weight, *args: x.new_empty(*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("qwen3_fast::decode_attention", mutates_args=("cache_k", "cache_v"))
def decode_attention(qkv: Tensor, cache_k: Tensor, cache_v: Tensor, first_row: int, positions: Tensor, cos: Tensor,
                     sin: Tensor, q_norm: Tensor, k_norm: Tensor, eps: float, heads: int) -> Tensor:
    """One query per row: qkv (R, 1, (heads + 2 kv_heads) * head_dim), the fused projection, at positions (R,)
    of cache rows first_row ... first_row + R - 1 of cache_k/cache_v (slots, kv_heads, capacity, head_dim), which
    get the new key and value there; cos/sin (R, ..., head_dim) at the positions; q_norm/k_norm the RMSNorm
    weights. Attends to keys at positions <= the query's, split over the keys so that one row still fills the
    GPU; returns (R, heads, head_dim)."""
    R, (kv_heads, Dh), splits = qkv.shape[0], cache_k.shape[1::2], 32
    o = torch.empty(R, heads, splits, Dh, dtype=torch.float32, device=qkv.device)
    lse = torch.empty(R, heads, splits, dtype=torch.float32, device=qkv.device)
    group, D = heads // kv_heads, max(16, triton.next_power_of_2(Dh))
    _attention[(R, kv_heads, splits)](qkv, cache_k, cache_v, first_row, positions, cos, sin, q_norm, k_norm, o,
                                      lse, qkv.stride(0), cos.stride(0), *cache_k.stride()[:3], eps=eps,
                                      sm_scale=Dh ** -0.5, GROUP=group, HEAD_DIM=Dh,
                                      G=max(16, triton.next_power_of_2(group)), D=D, BLOCK=32, SPLITS=splits)
    out = torch.empty(R, heads, Dh, dtype=qkv.dtype, device=qkv.device)
    _merge[(R * heads,)](o, lse, out, HEAD_DIM=Dh, D=D, SPLITS=splits)
    return out


decode_attention.register_fake(lambda qkv, cache_k, *args: qkv.new_empty(qkv.shape[0], args[-1], cache_k.shape[-1]))


@torch.library.custom_op("qwen3_fast::sample", mutates_args=())
def sample(logits: Tensor, seed: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Token ids (R,) drawn from softmax(logits / temperature) (R, V) cut to the top_k (<= 64) largest, then to
    top_p, with Gumbel noise from `seed` (a 1-element int tensor): the best top_k of each chunk of 1,024 logits, then
    the draw from those: one kernel twice."""
    (R, V), KP = logits.shape, triton.next_power_of_2(top_k)
    N = triton.cdiv(V, 1024) * top_k  # candidates per row
    values, ids = logits.new_empty(R, N, dtype=torch.float32), logits.new_empty(R, N, dtype=torch.long)
    token = ids.new_empty(R)
    _sample[(R, N // top_k)](logits.contiguous(), values, ids, seed, token, V, temperature, top_p, K=top_k, KP=KP,
                             BLOCK=1024, DRAW=False)
    _sample[(R, 1)](values, values, ids, seed, token, N, 1.0, top_p, K=top_k, KP=KP, BLOCK=triton.next_power_of_2(N),
                    DRAW=True, num_warps=8)
    return token


sample.register_fake(lambda logits, *args: logits.new_empty(len(logits), dtype=torch.long))

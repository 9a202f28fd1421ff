"""Triton kernels for one-token decode steps on CUDA: a matrix-vector product with its neighbours fused in, and
split-KV attention for one query. model.py falls back to plain PyTorch where these don't apply (CPU, several tokens).

Why: at batch 1 every weight is read once per token, and the generic kernels lose time around that read: inductor's
reductions reach about a third of the read bandwidth on 4-13 MB matrices, and cuDNN's attention takes ~8 us per layer
for one query. Fusing the RMSNorm, the SiLU gate and the residual add into the product also removes three kernels
per projection pair, and every kernel costs a launch gap even inside a CUDA graph."""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: model.py then never calls in here
    triton = None

ENABLED = triton is not None  # benchmarks switch it off to measure what the kernels buy


def usable(x: torch.Tensor) -> bool:
    """One token of one row on CUDA: the shape these kernels are written for."""
    return ENABLED and x.is_cuda and x.numel() == x.shape[-1]


if triton is not None:
    @triton.jit
    def _gemv(x, w, scale, norm, res, out, N, K, eps: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
              SCALE: tl.constexpr, RES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # out[n] = res[n] + scale[n] * sum_k w[n, k] * a[k], a = x * norm / rms(x) or silu(x[:K]) * x[K:]
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        acc, squares = tl.zeros([BN, BK], tl.float32), tl.zeros([BK], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)
            if GATED:
                a = a * tl.sigmoid(a) * tl.load(x + K + k, mask=k < K, other=0.0).to(tl.float32)
            if NORM:  # the 1/rms factor is applied at the end: it scales every output alike
                squares += a * a
                a = a * tl.load(norm + k, mask=k < K, other=0.0).to(tl.float32)
            wt = tl.load(w + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0)
            if SCALE:  # int8 -> fp32 by integer add: the float with bits 2^23's + (w + 128) is 2^23 + w + 128,
                # exact, and far cheaper than the hardware's int-to-float conversion, which bounds this loop
                wt = (wt.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
            acc += wt.to(tl.float32) * a[None, :]
        y = tl.sum(acc, axis=1)
        if NORM:
            y = y * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if SCALE:
            y = y * tl.load(scale + n, mask=n < N, other=0.0).to(tl.float32)
        if RES:
            y = y + tl.load(res + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out + n, y.to(out.dtype.element_ty), mask=n < N)

    @triton.jit
    def _attention(q, k, v, pos, o, lse, kv_len, q_row, q_head, k_row, k_head, k_pos, sm_scale: tl.constexpr,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   BLOCK: tl.constexpr, SPLITS: tl.constexpr):
        # Program (row, kv head, split): the GROUP query heads sharing one kv head, against the split's share of
        # the row's live keys (positions <= the query's, so cost follows the live length, not the cache's);
        # writes their softmax-normalised partial output and its log-sum-exp for the merge.
        r, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        heads, d = h * GROUP + tl.arange(0, G), tl.arange(0, D)
        qmask = (tl.arange(0, G)[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
        qt = tl.load(q + r * q_row + heads[:, None] * q_head + d[None, :], mask=qmask, other=0.0)
        live = tl.minimum(kv_len, tl.load(pos + r) + 1)
        chunk = tl.cdiv(tl.cdiv(live, SPLITS), BLOCK) * BLOCK
        lo = s * chunk
        hi = tl.minimum(lo + chunk, live)
        m, l = tl.full([G], -1e30, tl.float32), tl.zeros([G], tl.float32)
        acc = tl.zeros([G, D], tl.float32)
        for start in range(lo, hi, BLOCK):
            j = start + tl.arange(0, BLOCK)
            kvmask = (j[:, None] < hi) & (d[None, :] < HEAD_DIM)
            offsets = r * k_row + h * k_head + j[:, None] * k_pos + d[None, :]
            kt, vt = tl.load(k + offsets, mask=kvmask, other=0.0), tl.load(v + offsets, mask=kvmask, other=0.0)
            scores = tl.dot(qt, tl.trans(kt), input_precision="ieee") * sm_scale
            scores = tl.where(j[None, :] < hi, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p, alpha = tl.exp(scores - m_new[:, None]), tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
            m = m_new
        out = (r * GROUP * tl.num_programs(1) + heads) * SPLITS + s  # index into (rows, heads, SPLITS)
        tl.store(o + out[:, None] * HEAD_DIM + d[None, :], acc / tl.where(l > 0, l, 1.0)[:, None], mask=qmask)
        tl.store(lse + out, m + tl.log(l), mask=tl.arange(0, G) < GROUP)  # -inf for an empty split

    @triton.jit
    def _merge(o, lse, out, HEAD_DIM: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
        # One (row, head): the splits' outputs weighted by exp(lse) over their sum, which is exact.
        i, s, d = tl.program_id(0), tl.arange(0, SPLITS), tl.arange(0, D)
        w = tl.load(lse + i * SPLITS + s)
        w = tl.exp(w - tl.max(w, axis=0))
        parts = tl.load(o + (i * SPLITS + s[:, None]) * HEAD_DIM + d[None, :], mask=d[None, :] < HEAD_DIM)
        y = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out + i * HEAD_DIM + d, y.to(out.dtype.element_ty), mask=d < HEAD_DIM)


def gemv(x: torch.Tensor, weight: torch.Tensor, scale=None, norm=None, eps: float = 0.0, gated: bool = False,
         residual=None) -> torch.Tensor:
    """residual + (weight @ a) * scale for one token x, where a is RMSNorm(x) * norm with `norm`, silu(gate) * up
    of x = [gate, up] with `gated`, else x. weight (N, K) in x's dtype or int8 with per-row fp32 `scale`."""
    N, K = weight.shape
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    # Measured on the H200 over the 0.6B-8B shapes: few rows per program and 16-byte loads per thread; more rows
    # where a fused RMSNorm or SiLU gate makes each program's pass over x costlier.
    e = weight.element_size()
    BN, BK, warps = (8, 512, 4 // e) if norm is not None else (4, 1024, 8) if gated else (2, 512, 4 // e)
    _gemv[(triton.cdiv(N, BN),)](x, weight, x if scale is None else scale, x if norm is None else norm,
                                 x if residual is None else residual, out, N, K, eps, NORM=norm is not None,
                                 GATED=gated, SCALE=scale is not None, RES=residual is not None, BN=BN, BK=BK,
                                 num_warps=warps)
    return out


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     splits: int = 32) -> torch.Tensor:
    """q (R, heads, head_dim) at positions (R,) against keys/values (R, kv_heads, kv_len, head_dim) views of the
    cache, attending to key positions <= the query's. Splits the keys so that a short batch still fills the GPU,
    then merges the splits by their log-sum-exp."""
    R, H, Dh = q.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    o = torch.empty(R, H, splits, Dh, dtype=torch.float32, device=q.device)
    lse = torch.empty(R, H, splits, dtype=torch.float32, device=q.device)
    group, D = H // kv_heads, max(16, triton.next_power_of_2(Dh))
    _attention[(R, kv_heads, splits)](q, keys, values, positions, o, lse, kv_len, q.stride(0), q.stride(1),
                                      keys.stride(0), keys.stride(1), keys.stride(2), sm_scale=Dh ** -0.5,
                                      GROUP=group, HEAD_DIM=Dh, G=max(16, triton.next_power_of_2(group)), D=D,
                                      BLOCK=32, SPLITS=splits)
    out = torch.empty(R, H, Dh, dtype=q.dtype, device=q.device)
    _merge[(R * H,)](o, lse, out, HEAD_DIM=Dh, D=D, SPLITS=splits)
    return out

"""The Triton fast path for steps of up to 16 tokens on CUDA (a decode step of up to 16 rows, a
row's few new tokens): model.py's forward in six kernels a dense layer (seven with several tokens a
row), and the top-k / top-p draw of generate.sample in two launches.

Such a step reads every weight once and is bound by its bandwidth and its many small kernels (each
a launch gap and a ramp-up, even in a CUDA graph). So each product here is one kernel with its
neighbours fused in: the RMSNorm before it, the SiLU gate, int8 or int4 dequantisation, the residual
after it, and for MoE the router's picks and weights; one token's is a matrix-vector product,
several tokens' one on tensor cores that reads each weight once for 16 of them (MoE experts: once
for each token that picks them). Attention is one
split-KV kernel a query, with the q/k norms, RoPE and the cache write fused in, and a merge. On
Hopper GPUs each kernel launches while the one before it finishes (programmatic dependent launch).
Nothing here is needed: generate.py runs PyTorch's ops where this file, or Triton, is missing;
the tests hold every kernel to model.py's ops.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from model import MoE, Transformer


# The most tokens a step of the fast path is for, rows x tokens a row: its products read each
# block of weights once for 16 tokens. The Generator runs larger steps with PyTorch's ops.
STEP_TOKENS = 16


def forward_step(model: Transformer, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
    """model(tokens, positions, kv_len) for a step of R rows of T tokens, tokens and positions (R,
    T): logits (R, T, vocab). Each token is a row of the products, (R x T, 1, hidden). Layer by
    layer: the qkv product with the norm before it, attention, o_proj with the residual, gate-up
    with the norm and the gate, down with the residual (MoE: the router, then the picked experts'
    gate-up and down). Where tp.py split the model (model.tensor_parallel), o_proj and down sum the
    ranks' shares."""
    split = getattr(model, "tensor_parallel", None)
    # (R x T, 1, hidden)
    x = model.embed_tokens(tokens.reshape(-1, 1))
    for layer in model.layers:
        attn = layer.self_attn
        qkv = product(weights(attn.qkv_proj), x, norm=layer.input_layernorm)
        y = decode_attention(qkv, attn.kv_cache.k, attn.kv_cache.v, positions, model.rope_cos,
                             model.rope_sin, attn.q_norm.weight, attn.k_norm.weight,
                             attn.q_norm.eps, attn.n_heads, kv_len)
        x = product(weights(attn.o_proj), y.view(len(x), 1, -1), residual=x, split=split)
        norm = layer.post_attention_layernorm
        mlp = layer.mlp
        moe = isinstance(mlp, MoE)
        # the router's logits (R x T, experts) pick each token's experts in the kernels
        if moe:
            router = product(weights(mlp.gate), x, norm=norm).view(len(x), -1)
            routing = dict(router=router, top_k=mlp.top_k, norm_topk_prob=mlp.norm_topk_prob)
            gate_up_proj = weights(mlp.experts, "gate_up_proj")
            down_proj = weights(mlp.experts, "down_proj")
        else:
            routing = {}
            gate_up_proj, down_proj = weights(mlp.gate_up_proj), weights(mlp.down_proj)
        # silu(gate) * up, (R x T, 1, inner); MoE: (R x T x top_k, 1, inner), an output per pick
        gated = product(gate_up_proj, x, norm=norm, gated=True, **routing)
        x = product(down_proj, gated, residual=x, routed=moe, split=split, **routing)
    logits = product(weights(model.lm_head), x, norm=model.norm)
    return logits.view(*tokens.shape, -1)


def weights(module: torch.nn.Module, name: str = "weight") -> tuple:
    """A module's weight `name`, (N, K) or stacked experts' (experts, N, K), and what quantize.py
    stores beside it, else None: a scale, int8's per row (..., N) or int4's per group (..., N, K /
    group), and int4's offset per group."""
    return tuple(getattr(module, name + part, None) for part in ("", "_scale", "_offset"))


def product(proj: tuple, x: Tensor, norm: torch.nn.RMSNorm | None = None,
            residual: Tensor | None = None, split=None, **options) -> Tensor:
    """x (tokens, 1, K) times proj (from `weights`), plus residual, by gemv; with `norm`, of
    norm(x), normalised as x is read. With `split` (tp.py's: the product's input is split over
    the ranks), each rank's product is a share of the sum: the residual is added on one rank
    alone, then an all-reduce sums the shares."""
    weight, scale, offset = proj
    options.update(scale=scale, offset=offset)
    if norm is not None:
        options.update(norm=norm.weight, eps=norm.eps)
    if split is None:
        return gemv(x, weight, residual=residual, **options)
    share = gemv(x, weight, residual=split.residual(residual), **options)
    return split.all_reduce(share)


def dependent_launch(tensor: Tensor) -> dict:
    """Launch options for a kernel of this file's decode step on tensor's device: programmatic
    dependent launch on Hopper GPUs and later, where a kernel may start while the one before it
    ends (its launch and set-up hidden, in a CUDA graph too); off elsewhere, and in Triton's
    interpreter, which has no such launch."""
    on = tensor.is_cuda and torch.cuda.get_device_capability(tensor.device) >= (9, 0)
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def _wait_for_previous(PDL: tl.constexpr):
    # With programmatic dependent launch: waits until the previous kernel has ended and its writes
    # are seen. Called before the first read of anything a kernel writes (_gemv reads weights
    # first), and before any write: the previous kernel might still read a buffer freed and
    # reused. A kernel lets the next one launch (gdc_launch_dependents) once its main loop is
    # done, or else when it ends; the next one's programs, waiting here, would take the
    # multiprocessors from its loop if let in sooner.
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _largest(values, ids, K: tl.constexpr, KB: tl.constexpr, BITONIC: tl.constexpr):
    # The K largest of fp32 `values` and their int32 `ids`, largest first (ties to the lower id):
    # vectors of KB (K rounded up to a power of two), -inf past K. Found among int64 keys: the
    # value's bits, negative values' magnitude bits flipped so that the keys order as the values
    # do, over 2^31 - 1 - the id. BITONIC: by a bitonic top-k (tl.topk; KB 2 or more), else in K
    # rounds of one maximum each. The H200 takes a MoE router's 8 picks of 128 faster the first
    # way, the sampler's 20 of 2,048 the second (bench/RESULTS.md).
    bits = values.to(tl.int32, bitcast=True)
    keys = (bits ^ (bits >> 31 & 0x7FFFFFFF)).to(tl.int64) << 32 | (0x7FFFFFFF - ids)
    rank = tl.arange(0, KB)
    if BITONIC:
        top = tl.topk(keys, KB)
    else:
        top = tl.zeros([KB], tl.int64)
        for i in range(K):
            best = tl.max(keys, axis=0)
            top = tl.where(rank == i, best, top)
            keys = tl.where(keys == best, -2 ** 63, keys)
    bits = (top >> 32).to(tl.int32)
    values = (bits ^ (bits >> 31 & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return tl.where(rank < K, values, float("-inf")), 0x7FFFFFFF - (top & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _pick(router, j, EXPERTS: tl.constexpr, TOP_K: tl.constexpr, NORM_TOPK: tl.constexpr,
          EB: tl.constexpr, KB: tl.constexpr):
    # A token's pick j from its router logits (EXPERTS,), as MoE.forward picks: softmax in fp32,
    # the TOP_K most probable experts (most probable first, ties to the lower id, as argmax's),
    # their weights renormalised to sum 1 with NORM_TOPK. Returns pick j's expert and weight.
    e = tl.arange(0, EB)
    p = tl.load(router + e, mask=e < EXPERTS, other=float("-inf")).to(tl.float32)
    p = tl.exp(p - tl.max(p, axis=0))
    p = p / tl.sum(p, axis=0)
    # vectors of KB (TOP_K rounded up to a power of two), pick i at index i; weight 0 past TOP_K
    probs, ids = _largest(p, e, TOP_K, KB, BITONIC=True)
    picks = tl.arange(0, KB)
    route_weights = tl.where(picks < TOP_K, probs, 0.0)
    if NORM_TOPK:
        route_weights = route_weights / tl.sum(route_weights, axis=0)
    expert = tl.sum(tl.where(picks == j, ids, 0), axis=0)
    return expert, tl.sum(tl.where(picks == j, route_weights, 0.0), axis=0)


@triton.jit
def _weight_rows(N, BN: tl.constexpr, GATED: tl.constexpr):
    # The BN weight rows of program (tile, ...): GATED, BN / 2 pairs, each a gate row i then its
    # up row N / 2 + i (an output each: silu(gate) * up)
    if GATED:
        pair = tl.program_id(0) * (BN // 2) + tl.arange(0, BN) // 2
        return pair + tl.arange(0, BN) % 2 * (N // 2)
    return tl.program_id(0) * BN + tl.arange(0, BN)


@triton.jit
def _weight_block(w_rows, n, k0, N, row_words, BK: tl.constexpr):
    # Words k0 ... k0 + BK - 1 of weight rows n, 0 past the ends: (BN, BK)
    words = k0 + tl.arange(0, BK)
    mask = (n[:, None] < N) & (words[None, :] < row_words)
    return tl.load(w_rows + n[:, None] * row_words + words[None, :], mask=mask, other=0)


@triton.jit
def _field_weights(w_words, i: tl.constexpr, PACK: tl.constexpr, SIGNED: tl.constexpr):
    # Weight i of each word of a block (BN, BK) in fp32, and the factor its input takes. Float
    # weights, one a word: themselves, and 1. Quantized, int32 words of PACK fields (int8's 4
    # bytes, int4's 8 nibbles; fields PACK / 2 on in the word's high half, shifted down 16): the
    # fp32 whose bits are the field's FIELD_BITS bits at `shift`, masked in place, which is the
    # subnormal u * 2^(shift - 149), exactly, for u the field's unsigned value: one integer
    # operation a weight, where a conversion instruction a weight would be the limit. SIGNED
    # (int8): the sign bit flipped in the same operation, so u = q + 128. Its input takes
    # 2^(85 - shift), for products u * a * 2^-64, scaled back at the end.
    if PACK == 1:
        w, input_factor = w_words.to(tl.float32), 1.0
    else:
        FIELD_BITS: tl.constexpr = 32 // PACK
        shift: tl.constexpr = FIELD_BITS * (i % (PACK // 2))
        half = w_words >> 16 if i >= PACK // 2 else w_words
        bits = half & ((2 ** FIELD_BITS - 1) << shift)
        if SIGNED:
            bits = bits ^ (128 << shift)
        w = bits.to(tl.float32, bitcast=True)
        input_factor = 2.0 ** 85 / (1 << shift)
    return w, input_factor


@triton.jit
def _int4_groups(acc, products, a_sum, scale, offset, expert, n, N, k0, K,
                 GROUP_SIZE: tl.constexpr, GROUP_WORDS: tl.constexpr):
    # int4's w = q * scale + offset per GROUP_SIZE columns: acc (BN, BK / GROUP_WORDS) plus a
    # block's products q * a (BN, BK), of words k0 on of the expert's weight rows n, summed by
    # group, times their groups' scales (and 2^64: _field_weights' inputs took 2^-64), plus their
    # offsets times the group's sum of a
    BN: tl.constexpr = products.shape[0]
    GROUPS: tl.constexpr = products.shape[1] // GROUP_WORDS
    sums = tl.sum(tl.reshape(products, [BN, GROUPS, GROUP_WORDS]), axis=2)
    a_sums = tl.sum(tl.reshape(a_sum, [GROUPS, GROUP_WORDS]), axis=1)
    g = k0 // GROUP_WORDS + tl.arange(0, GROUPS)
    at = (expert * N + n[:, None]) * (K // GROUP_SIZE) + g[None, :]
    g_mask = (n[:, None] < N) & (g[None, :] < K // GROUP_SIZE)
    group_scale = tl.load(scale + at, mask=g_mask, other=0.0).to(tl.float32)
    group_offset = tl.load(offset + at, mask=g_mask, other=0.0).to(tl.float32)
    return acc + sums * (group_scale * 2.0 ** 64) + group_offset * a_sums[None, :]


@triton.jit
def _gemv(x, weight, scale, offset, norm, res, out, router, N, row_words, x_row,
          eps: tl.constexpr, GATED: tl.constexpr, EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
          NORM_TOPK: tl.constexpr, ROUTED: tl.constexpr, EB: tl.constexpr, KB: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, PACK: tl.constexpr, GROUP_SIZE: tl.constexpr,
          PDL: tl.constexpr):
    # out[n] = res[n] + scale[n] * sum_k w[n, k] * a[k], where a = x * norm / rms(x) with a norm,
    # else x; GATED, rows i and N / 2 + i of that are gate i and up i: out[i] = silu(gate) * up.
    # MoE: w and scale hold EXPERTS experts, of which token r's router logits pick TOP_K, and its
    # output for pick j uses pick j, from x[r]; or, ROUTED, from its own input row
    # x[r x TOP_K + j] and weighted by its routing weight, for _add_rows to sum. Weights are
    # float, or int32 words of PACK quantized fields (_field_weights): int8 with a scale per row,
    # int4 with a scale and an offset per GROUP_SIZE columns of a row (_int4_groups).
    #
    # Program (tile, j, r): BN rows of token r's output for pick j, r * TOP_K + j (ROUTED: a
    # program summing the picks would read their weights one after another, too few bytes in
    # flight); without EXPERTS, of the one token's output.
    n = _weight_rows(N, BN, GATED)
    j, r = tl.program_id(1), tl.program_id(2)
    out_row = r * max(TOP_K, 1) + j
    K = row_words * PACK
    # GROUP_WORDS words per int4 group, else 1
    GROUP_WORDS: tl.constexpr = max(GROUP_SIZE // PACK, 1)
    INT8: tl.constexpr = PACK == 4
    # the input row this program reads, and its pick
    x_in = x + (out_row if ROUTED else r) * x_row
    expert = 0
    if EXPERTS:  # the router's logits are the previous kernel's
        _wait_for_previous(PDL)
        expert, route_weight = _pick(router + r * EXPERTS, j, EXPERTS, TOP_K, NORM_TOPK, EB, KB)
    w_rows = weight + expert * N * row_words
    # The first block of weights is read before the wait (no kernel writes weights): its loads are
    # in flight while the previous kernel ends. Each later block's are, during the block before.
    # A MoE product has waited already, for the router's logits.
    w_words = _weight_block(w_rows, n, 0, N, row_words, BK)
    _wait_for_previous(PDL and not EXPERTS)
    acc = tl.zeros([BN, BK // GROUP_WORDS], tl.float32)
    # int8: the sum of a, for its bias of 128
    a_total = tl.zeros([BK], tl.float32)
    squares = tl.zeros([BK], tl.float32)
    for k0 in range(0, row_words, BK):
        words = k0 + tl.arange(0, BK)
        # int4: the block's products apart, to be scaled by group
        products = acc
        if GROUP_SIZE:
            products = tl.zeros([BN, BK], tl.float32)
        a_sum = tl.zeros([BK], tl.float32)
        for i in tl.static_range(PACK):
            k = words * PACK + i
            a = tl.load(x_in + k, mask=k < K, other=0.0).to(tl.float32)
            # 1/rms is applied at the end: it scales every output alike
            if norm is not None:
                squares += a * a
                a = a * tl.load(norm + k, mask=k < K, other=0.0).to(tl.float32)
            w, input_factor = _field_weights(w_words, i, PACK, SIGNED=not GROUP_SIZE)
            a_sum += a
            products += w * (a * input_factor)[None, :]
        if GROUP_SIZE:
            products = _int4_groups(acc, products, a_sum, scale, offset, expert, n, N, k0, K,
                                    GROUP_SIZE, GROUP_WORDS)
        acc = products
        a_total += a_sum
        w_words = _weight_block(w_rows, n, k0 + BK, N, row_words, BK)
    # the next kernel may launch: this one has its stores left
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    # int8: back from 2^-64, less the bias of its u = q + 128
    if INT8:
        y = y * 2.0 ** 64 - 128.0 * tl.sum(a_total, axis=0)
    if norm is not None:
        y = y * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    if INT8:
        y = y * tl.load(scale + expert * N + n, mask=n < N, other=0.0).to(tl.float32)
    if ROUTED:
        y = y * route_weight
    if res is not None:
        y = y + tl.load(res + r * N + n, mask=n < N, other=0.0).to(tl.float32)
    # the output rows, of `count`: the weight rows, or their pairs
    rows, count = n, N
    if GATED:
        # gate and up rounded as the model's product rounds them
        pairs = tl.reshape(y.to(out.dtype.element_ty).to(tl.float32), [BN // 2, 2])
        gate, up = tl.split(pairs)
        y = gate * tl.sigmoid(gate) * up
        rows, count = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2), N // 2
    tl.store(out + out_row * count + rows, y.to(out.dtype.element_ty), mask=rows < count)


@triton.jit
def _add_rows(rows, res, out, N, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Program (tile, r): out[r] = the sum of token r's rows (ROWS, N) in row order, plus res[r]: a
    # routed product's picks
    _wait_for_previous(PDL)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r = tl.program_id(1)
    y = tl.zeros([BLOCK], tl.float32)
    for row in tl.static_range(ROWS):
        y += tl.load(rows + (r * ROWS + row) * N + n, mask=n < N, other=0.0)
    if res is not None:
        y += tl.load(res + r * N + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out + r * N + n, y.to(out.dtype.element_ty), mask=n < N)



@triton.jit
def _field(words, i: tl.constexpr, FIELD_BITS: tl.constexpr, SIGNED: tl.constexpr):
    # Field i (bits FIELD_BITS * i on) of each int32 word as an integer: int8's signed byte (its
    # top bit moved to the word's, then shifted back with the sign), int4's unsigned nibble
    if SIGNED:
        return (words << (32 - FIELD_BITS * (i + 1))) >> (32 - FIELD_BITS)
    return (words >> (FIELD_BITS * i)) & (2 ** FIELD_BITS - 1)


@triton.jit
def _rows_product(x, weight, scale, offset, norm, res, out, M, N, row_words, eps: tl.constexpr,
                  GATED: tl.constexpr, PACK: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    # _gemv's product for M tokens x (M, K), without experts: each block of weights is read once
    # for MB tokens, a product on tensor cores, (BN, BK) weights times (BK, MB) inputs, each
    # rounded to x's dtype (the weights dequantized as quantize.dequantized does), summed in
    # fp32. With a norm, the inputs times the norm's weights; 1 / rms scales the sums at the end.
    # Program (tile, token block): BN weight rows (GATED: BN / 2 pairs) for MB tokens
    n = _weight_rows(N, BN, GATED)
    m = tl.program_id(1) * MB + tl.arange(0, MB)
    K = row_words * PACK
    FIELD_BITS: tl.constexpr = 32 // PACK
    DOT_TYPE: tl.constexpr = x.dtype.element_ty
    INT8: tl.constexpr = PACK == 4
    _wait_for_previous(PDL)
    # (MB,) each token's sum of squares, for its 1 / rms, applied at the end
    squares = tl.zeros([MB], tl.float32)
    if INT8:
        row_scale = tl.load(scale + n, mask=n < N, other=0.0).to(tl.float32)
    acc = tl.zeros([BN, MB], tl.float32)
    for k0 in range(0, row_words, BK):
        words = k0 + tl.arange(0, BK)
        w_words = _weight_block(weight, n, k0, N, row_words, BK)
        if GROUP_SIZE:
            # (BN, BK) each word's group's scale and offset
            at = n[:, None] * (K // GROUP_SIZE) + words[None, :] // (GROUP_SIZE // PACK)
            w_mask = (n[:, None] < N) & (words[None, :] < row_words)
            group_scale = tl.load(scale + at, mask=w_mask, other=0.0).to(tl.float32)
            group_offset = tl.load(offset + at, mask=w_mask, other=0.0).to(tl.float32)
        for i in tl.static_range(PACK):
            k = words * PACK + i
            a_mask = (k[:, None] < K) & (m[None, :] < M)
            a = tl.load(x + m[None, :] * K + k[:, None], mask=a_mask, other=0.0).to(tl.float32)
            if norm is not None:
                squares += tl.sum(a * a, axis=0)
                a = a * tl.load(norm + k, mask=k < K, other=0.0).to(tl.float32)[:, None]
            w = w_words
            if PACK > 1:
                w = _field(w_words, i, FIELD_BITS, SIGNED=not GROUP_SIZE).to(tl.float32)
            if GROUP_SIZE:
                w = w * group_scale + group_offset
            if INT8:
                w = w * row_scale[:, None]
            acc += tl.dot(w.to(DOT_TYPE), a.to(DOT_TYPE), input_precision="ieee")
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = acc
    if norm is not None:
        y = y * tl.rsqrt(squares / K + eps)[None, :]
    if res is not None:
        res_mask = (n[:, None] < N) & (m[None, :] < M)
        y += tl.load(res + m[None, :] * N + n[:, None], mask=res_mask, other=0.0).to(tl.float32)
    rows, count = n, N
    if GATED:
        # (BN / 2, MB, 2): each pair's gate and up, rounded as the model's product rounds them
        pairs = tl.reshape(y.to(out.dtype.element_ty).to(tl.float32), [BN // 2, 2, MB])
        gate, up = tl.split(tl.permute(pairs, (0, 2, 1)))
        y = gate * tl.sigmoid(gate) * up
        rows, count = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2), N // 2
    out_mask = (rows[:, None] < count) & (m[None, :] < M)
    tl.store(out + m[None, :] * count + rows[:, None], y.to(out.dtype.element_ty), mask=out_mask)

# Launch configurations of _gemv by what it fuses into its input and how its weights are stored,
# from sweeps on the H200 over the shapes of 0.6B, 8B, 30B-A3B and 235B-A22B, weighted by their
# count in a step (bench/RESULTS.md): more rows per program where the work on x costs more, or for
# quantized weights.
# BN: weight rows per program, BK: weight words per block
GEMV_CONFIGS = {
    ("norm", "float"): dict(BN=8, BK=512, num_warps=2),
    ("plain", "float"): dict(BN=2, BK=1024, num_warps=4),
    ("norm", "int8"): dict(BN=16, BK=256, num_warps=4),
    ("plain", "int8"): dict(BN=8, BK=512, num_warps=4),
    # MoE gate-up, 30B-A3B's shapes
    ("picked", "float"): dict(BN=8, BK=256, num_warps=1),
    # MoE down
    ("routed", "float"): dict(BN=16, BK=128, num_warps=1),
    ("picked", "int8"): dict(BN=16, BK=64, num_warps=2),
    ("routed", "int8"): dict(BN=32, BK=64, num_warps=2),
    ("norm", "int4"): dict(BN=32, BK=128, num_warps=4),
    ("plain", "int4"): dict(BN=16, BK=512, num_warps=8),
    ("picked", "int4"): dict(BN=32, BK=128, num_warps=4),
    ("routed", "int4"): dict(BN=32, BK=64, num_warps=2),
}
# _rows_product's by how the weights are stored: the best for 8B's shapes at 16 tokens on an H100
# (bench/RESULTS.md)
ROWS_CONFIGS = {"float": dict(BN=64, BK=256, num_warps=4, num_stages=4),
                "int8": dict(BN=64, BK=128, num_warps=4, num_stages=4),
                "int4": dict(BN=64, BK=128, num_warps=8)}
# By the weights' dtype: their kind above, and how many of them a 32-bit word holds
STORAGE = {torch.int8: ("int8", 4), torch.uint8: ("int4", 8)}


def input_kind(norm, router, routed: bool) -> str:
    """What gemv does to its input, which picks its launch configuration: the first that applies."""
    kinds = {"routed": routed, "picked": router is not None, "norm": norm is not None}
    return next((kind for kind, applies in kinds.items() if applies), "plain")


def custom_op(mutates_args=()):
    """Registers a function as the custom op qwen3_fast::<its name> and returns the op:
    torch.compile calls it as it is, instead of analysing its kernels at each of their call sites
    (five a layer), which would be most of its compile time. Not torch.library.custom_op: its first
    call imports torch._dynamo (seconds), compiling or not."""
    def register(function):
        name = f"qwen3_fast::{function.__name__}"
        torch.library.define(name, torch.library.infer_schema(function, mutates_args=mutates_args))
        torch.library.impl(name, "default", function)
        return getattr(torch.ops.qwen3_fast, function.__name__)
    return register


@custom_op()
def gemv(x: Tensor, weight: Tensor, scale: Tensor | None = None, norm: Tensor | None = None,
         eps: float = 0.0, gated: bool = False, residual: Tensor | None = None,
         router: Tensor | None = None, top_k: int = 0, norm_topk_prob: bool = False,
         routed: bool = False, offset: Tensor | None = None) -> Tensor:
    """residual + (weight @ a) * scale for each token of x (tokens, 1, K), where a is RMSNorm(x) *
    norm with `norm`, else x; with `gated`, its rows are [gate; up] (model.MLP's gate_up_proj),
    and the output is silu(gate) * up, N / 2 of them. weight (N, K) in x's dtype; or int8 (K a
    multiple of 4) with a `scale` per row; or int4, (N, K / 2) uint8 packed as
    quantize.quantize_int4 packs it, with a `scale` and an `offset` (N, K / group) per group of
    columns (a multiple of 8). MoE: weight (experts, N, ...), and each token's `router` logits
    (tokens, experts) pick top_k of them as MoE.forward does: (tokens x top_k, 1, N), an output a
    pick; or, `routed`, with x (tokens x top_k, 1, K), each token's picks summed, weighted by their
    routing weights, (tokens, 1, N)."""
    kind, pack = STORAGE.get(weight.dtype, ("float", 1))
    words = weight if kind == "float" else weight.view(torch.int32)
    N, row_words = words.shape[-2:]
    group_size = 0 if offset is None else row_words * pack // offset.shape[-1]
    experts = 0 if router is None else router.shape[-1]
    tokens = x.shape[0] if router is None else router.shape[0]
    out = gemv_output(x, weight, gated=gated, router=router, top_k=top_k, routed=routed)
    if tokens > 1 and router is None:
        config = ROWS_CONFIGS[kind]
        # fp32 tiles (the tests') need twice bf16's shared memory, pipelined: over the
        # GPU's with the bf16 block, in bounds with a quarter of it
        if x.element_size() == 4:
            config = dict(config, BK=config["BK"] // 4)
        # 16 tokens a program: tl.dot's least
        grid = (triton.cdiv(N, config["BN"]), triton.cdiv(tokens, 16))
        _rows_product[grid](x, words, scale, offset, norm, residual, out, tokens, N, row_words,
                            eps, GATED=gated, PACK=pack, GROUP_SIZE=group_size, MB=16, **config,
                            **dependent_launch(x))
        return out
    product_kind = input_kind(norm, router, routed), kind
    config = GEMV_CONFIGS[product_kind]
    # Rows of float weights longer than 8,192 (a large model's down: 8B's 12,288), 8 a program,
    # where 0.6B's shorter ones gain from 2 (bench/RESULTS.md)
    if product_kind == ("plain", "float") and row_words > 8192:
        config = dict(config, BN=8)
    # A product of few rows, as a MoE router's (a row an expert): 2 rows a program and one block,
    # where 8 rows would leave most multiprocessors idle and read 4 blocks in turn
    # (bench/RESULTS.md)
    if N < 256 and router is None:
        config = dict(BN=2, BK=2048, num_warps=2)
    # int4: whole groups a block
    config = dict(config, BK=max(config["BK"], group_size // pack))
    # _pick's vectors: of 2 or more (tl.topk)
    routing = dict(EXPERTS=experts, TOP_K=top_k, NORM_TOPK=norm_topk_prob, ROUTED=routed,
                   EB=triton.next_power_of_2(max(experts, 2)),
                   KB=triton.next_power_of_2(max(top_k, 2)))
    # routed: a program a token's pick, each writing its row of `picks` (tokens x top_k, 1, N) in
    # fp32, which _add_rows then sums with the residual
    picks = x.new_empty(tokens * top_k, 1, N, dtype=torch.float32) if routed else out
    added = None if routed else residual
    grid = (triton.cdiv(N, config["BN"]), max(top_k, 1), tokens)
    # A None argument is a constexpr None to Triton: the branches that would read it are not
    # compiled
    _gemv[grid](x, words, scale, offset, norm, added, picks, router, N, row_words, x.shape[-1],
                eps, GATED=gated, PACK=pack, GROUP_SIZE=group_size, **routing, **config,
                **dependent_launch(x))
    if routed:
        _add_rows[(triton.cdiv(N, 1024), tokens)](picks, residual, out, N, ROWS=top_k,
                                                  BLOCK=1024, **dependent_launch(x))
    return out


@torch.library.register_fake("qwen3_fast::gemv")
def gemv_output(x, weight, scale=None, norm=None, eps=0.0, gated=False, residual=None, router=None,
                top_k=0, norm_topk_prob=False, routed=False, offset=None):
    """gemv's output, uninitialised: (tokens x top_k, 1, N) for the picked experts, else (tokens,
    1, N); N / 2 with `gated`."""
    tokens = x.shape[0] if router is None else router.shape[0]
    picked = router is not None and not routed
    return x.new_empty(tokens * top_k if picked else tokens, 1, weight.shape[-2] // (1 + gated))


@triton.jit
def _norm_rope(x, rows, row_mask, norm_weights, cos, sin, eps, HEAD_DIM: tl.constexpr,
               D: tl.constexpr):
    # RMSNorm over each row's head_dim, times its row's norm weights (a pointer a row), then RoPE
    # in the split-halves layout: model.py's q_norm / k_norm and apply_rope, in fp32.
    d = tl.arange(0, D)
    half = HEAD_DIM // 2
    # The partner of each dimension in rotate_half
    partner = tl.where(d < half, d + half, d - half)
    mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    xd = tl.load(x + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x + rows[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    wd = tl.load(norm_weights[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    wp = tl.load(norm_weights[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xd * xd, axis=1) / HEAD_DIM + eps)[:, None]
    # rotate_half: the first half takes its partner negated
    signs = tl.where(d < half, -1.0, 1.0)
    rotated = xp * wp * (sin * signs)[None, :]
    return (xd * wd * cos[None, :] + rotated) * rstd


@triton.jit
def _attention(qkv, cache_k, cache_v, pos, cos, sin, q_norm, k_norm, partial, lse, T, qkv_row,
               rope_row, k_row, k_head, k_pos, eps: tl.constexpr, sm_scale: tl.constexpr,
               Q_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
               BLOCK: tl.constexpr, SPLITS: tl.constexpr, STORE: tl.constexpr,
               ATTEND: tl.constexpr, PDL: tl.constexpr):
    # Program (token i, kv head h, split s), token i of cache row i // T at position p, from its
    # fused q|k|v product: normalises and rotates the Q_PER_KV query heads of h and its new key
    # together. STORE: the split whose share holds p writes the new key and value there. ATTEND:
    # attends over the split's share of the keys at positions <= p (the cost follows the live
    # length, not the cache's), and writes the normalised partial output and its log-sum-exp for
    # _merge. One token a row stores and attends in one launch (no other program reads position
    # p); T tokens a row store first, in a launch of their own: token i reads the keys of the
    # tokens before it.
    _wait_for_previous(PDL)
    i, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    d_mask = d < HEAD_DIM
    p = tl.load(pos + i)
    KV_HEADS = tl.num_programs(1)
    H = Q_PER_KV * KV_HEADS
    cos_p = tl.load(cos + p * rope_row + d, mask=d_mask, other=0.0).to(tl.float32)
    sin_p = tl.load(sin + p * rope_row + d, mask=d_mask, other=0.0).to(tl.float32)
    row = qkv + i * qkv_row
    # Rows 0 ... Q_PER_KV - 1: kv head h's query heads; row Q_PER_KV: its new key, in the same
    # pass (a pass of its own would be a second chain of loads, reductions and barriers before the
    # keys are read). The rows past it are 0; no row past Q_PER_KV - 1 has its output stored.
    key_row = g == Q_PER_KV
    rows = tl.where(key_row, H + h, h * Q_PER_KV + g) * HEAD_DIM
    norms = tl.where(key_row, k_norm, q_norm)
    qk = _norm_rope(row, rows, g <= Q_PER_KV, norms, cos_p, sin_p, eps, HEAD_DIM, D)
    # rounded as the model's activations are
    q_and_key = qk.to(cache_k.dtype.element_ty)
    cache = i // T * k_row + h * k_head
    chunk = tl.cdiv(tl.cdiv(p + 1, SPLITS), BLOCK) * BLOCK
    lo = s * chunk
    hi = tl.minimum(lo + chunk, p + 1)
    if STORE:
        if (lo <= p) & (p < hi):
            # The new key, row Q_PER_KV of q_and_key: every row's pointers aim at position p and
            # the mask keeps row Q_PER_KV's, so each thread stores its own share of it (no
            # reduction across threads)
            new_k_at = cache + p * k_pos + g[:, None] * 0 + d[None, :]
            tl.store(cache_k + new_k_at, q_and_key, mask=key_row[:, None] & d_mask[None, :])
            new_v = tl.load(row + (H + KV_HEADS + h) * HEAD_DIM + d, mask=d_mask)
            new_v_at = cache + p * k_pos + d
            tl.store(cache_v + new_v_at, new_v.to(cache_v.dtype.element_ty), mask=d_mask)
            # The stores are seen by all of this program's threads before the loads
            tl.debug_barrier()
    if ATTEND:
        m = tl.full([G], -1e30, tl.float32)
        # the softmax's denominator so far
        total = tl.zeros([G], tl.float32)
        acc = tl.zeros([G, D], tl.float32)
        for start in range(lo, hi, BLOCK):
            j = start + tl.arange(0, BLOCK)
            kv_mask = (j[:, None] < hi) & d_mask[None, :]
            offsets = cache + j[:, None] * k_pos + d[None, :]
            kt = tl.load(cache_k + offsets, mask=kv_mask, other=0.0)
            vt = tl.load(cache_v + offsets, mask=kv_mask, other=0.0)
            scores = tl.dot(q_and_key, tl.trans(kt), input_precision="ieee") * sm_scale
            scores = tl.where(j[None, :] < hi, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            e = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(e, axis=1)
            acc = acc * alpha[:, None] + tl.dot(e.to(vt.dtype), vt, input_precision="ieee")
            m = m_new
        # the next kernel may launch: this one has its stores left
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # index into (tokens, heads, SPLITS)
        out = (i * H + h * Q_PER_KV + g) * SPLITS + s
        normalised = acc / tl.where(total > 0, total, 1.0)[:, None]
        out_mask = (g[:, None] < Q_PER_KV) & d_mask[None, :]
        tl.store(partial + out[:, None] * HEAD_DIM + d[None, :], normalised, mask=out_mask)
        # -inf for an empty split
        tl.store(lse + out, m + tl.log(total), mask=g < Q_PER_KV)


@triton.jit
def _merge(partial, lse, out, HEAD_DIM: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
           PDL: tl.constexpr):
    # One (token, head): the splits' outputs weighted by exp(lse) over their sum, which is exact
    _wait_for_previous(PDL)
    i = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    w = tl.load(lse + i * SPLITS + s)
    w = tl.exp(w - tl.max(w, axis=0))
    parts_at = (i * SPLITS + s[:, None]) * HEAD_DIM + d[None, :]
    parts = tl.load(partial + parts_at, mask=d[None, :] < HEAD_DIM)
    y = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out + i * HEAD_DIM + d, y.to(out.dtype.element_ty), mask=d < HEAD_DIM)


@custom_op(mutates_args=("cache_k", "cache_v"))
def decode_attention(qkv: Tensor, cache_k: Tensor, cache_v: Tensor, positions: Tensor, cos: Tensor,
                     sin: Tensor, q_norm: Tensor, k_norm: Tensor, eps: float, heads: int,
                     kv_len: int) -> Tensor:
    """T queries a row: qkv (R x T, 1, (heads + 2 kv_heads) x head_dim), the fused product, at
    positions (R, T) of cache rows 0 ... R - 1 of cache_k / cache_v (slots, kv_heads, capacity,
    head_dim), which get the new keys and values there. cos / sin: the RoPE tables (positions,
    head_dim) of model.rope_tables; q_norm / k_norm: the RMSNorm weights. Each query attends to
    its row's keys at positions <= its own, split into programs per (query, kv head) so that one
    query still fills the GPU; returns (R x T, heads, head_dim). kv_len bounds the positions (the
    attended length) and, with the number of queries, sets the number of splits: a block of keys
    each (32 keys, or 64 past 512) until there are 32, or about 256 programs in all, then more
    blocks each; any kv_len gives the same result."""
    # Keys a block: 32 up to 512 keys (short contexts gain from more, shorter programs), then 64
    # (fewer iterations a split, once the splits reach 32); the best of sweeps (bench/RESULTS.md)
    block = 32 if kv_len <= 512 else 64
    tokens, T = positions.numel(), positions.shape[1]
    _, kv_heads, _, head_dim = cache_k.shape
    # Splits, a power of two (the merge): a block each at least, and about 256 programs in all, as
    # one token's 8 kv heads in 32 splits (each split normalises and rotates its queries anew, and
    # many rows fill the GPU with fewer: bench/RESULTS.md); 1 << fill.bit_length() - 1 is the
    # power of two at or below fill
    fill = max(1, 256 // (tokens * kv_heads))
    splits = min(32, triton.next_power_of_2(triton.cdiv(kv_len, block)), 1 << fill.bit_length() - 1)
    partial = torch.empty(tokens, heads, splits, head_dim, dtype=torch.float32, device=qkv.device)
    lse = torch.empty(tokens, heads, splits, dtype=torch.float32, device=qkv.device)
    # tl.dot wants blocks of at least 16
    D = max(16, triton.next_power_of_2(head_dim))
    q_per_kv = heads // kv_heads
    k_row, k_head, k_pos, _ = cache_k.stride()
    # G rows: the query heads of a kv head and its key, at least 16 (tl.dot). 8 warps: faster than
    # 4 on the H200 (bench/RESULTS.md).
    args = (qkv, cache_k, cache_v, positions.flatten(), cos, sin, q_norm, k_norm, partial, lse, T,
            qkv.stride(0), cos.stride(0), k_row, k_head, k_pos)
    sizes = dict(eps=eps, sm_scale=head_dim ** -0.5, Q_PER_KV=q_per_kv, HEAD_DIM=head_dim,
                 G=max(16, triton.next_power_of_2(q_per_kv + 1)), D=D, BLOCK=block, num_warps=8,
                 **dependent_launch(qkv))
    if T > 1:
        # every new key and value in place before any query reads them: one split a query
        _attention[(tokens, kv_heads, 1)](*args, SPLITS=1, STORE=True, ATTEND=False, **sizes)
    _attention[(tokens, kv_heads, splits)](*args, SPLITS=splits, STORE=T == 1, ATTEND=True,
                                           **sizes)
    out = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _merge[(tokens * heads,)](partial, lse, out, HEAD_DIM=head_dim, D=D, SPLITS=splits,
                              **dependent_launch(qkv))
    return out


@torch.library.register_fake("qwen3_fast::decode_attention")
def _(qkv, cache_k, cache_v, positions, cos, sin, q_norm, k_norm, eps, heads, kv_len):
    return qkv.new_empty(qkv.shape[0], heads, cache_k.shape[-1])


# The sampler: the top-k candidates of each row in two stages (the K largest of each chunk of
# SAMPLE_CHUNK logits, then the K largest of those), then top-p and the Gumbel-max draw over them.
SAMPLE_CHUNK = 2048
# larger top-k filters sample with PyTorch's ops
MAX_TOP_K = 64


@triton.jit
def _chunk_top_k(logits, row_stride, V, top, top_ids, K: tl.constexpr, KB: tl.constexpr,
                 CHUNK: tl.constexpr):
    # Program (row r, chunk c): the K largest logits of the chunk and their ids, into (R, chunks, K)
    r, c = tl.program_id(0), tl.program_id(1)
    ids = c * CHUNK + tl.arange(0, CHUNK)
    values = tl.load(logits + r * row_stride + ids, mask=ids < V, other=float("-inf"))
    best, best_ids = _largest(values, ids, K, KB, BITONIC=False)
    rank = tl.arange(0, KB)
    at = (r * tl.num_programs(1) + c) * K + rank
    tl.store(top + at, best, mask=rank < K)
    tl.store(top_ids + at, best_ids, mask=rank < K)


@triton.jit
def _draw(top, top_ids, count, noise, out, inv_temperature, top_p, K: tl.constexpr,
          KB: tl.constexpr, NB: tl.constexpr, TOP_P: tl.constexpr):
    # Program r: the K largest of the row's `count` candidates, largest first (ties in id order),
    # times 1 / temperature; with TOP_P, those past the smallest head whose mass reaches top_p
    # masked out; then argmax(score - log(-log(uniform))), uniform the row's noise (K,):
    # generate.sample's steps, in its order.
    r = tl.program_id(0)
    at = tl.arange(0, NB)
    mask = at < count
    values = tl.load(top + r * count + at, mask=mask, other=float("-inf"))
    ids = tl.load(top_ids + r * count + at, mask=mask, other=0)
    best, best_ids = _largest(values, ids, K, KB, BITONIC=False)
    rank = tl.arange(0, KB)
    scores = best * inv_temperature
    if TOP_P:
        e = tl.exp(scores - tl.max(scores, axis=0))
        probs = e / tl.sum(e, axis=0)
        # the mass of the candidates ahead of each
        before = tl.cumsum(probs, axis=0) - probs
        scores = tl.where(before >= top_p, float("-inf"), scores)
    uniform = tl.load(noise + r * K + rank, mask=rank < K, other=0.5)
    # -inf past K, as the scores
    gumbel = scores - tl.log(-tl.log(uniform))
    choice = tl.argmax(gumbel, axis=0)
    token = tl.sum(tl.where(rank == choice, best_ids, 0), axis=0)
    tl.store(out + r, token.to(tl.int64))


@custom_op()
def top_k_draw(logits: Tensor, noise: Tensor, temperature: float, top_p: float) -> Tensor:
    """Next ids (R,) from fp32 logits (R, V): the top-k candidates, k = noise.shape[1], top-p and
    the Gumbel-max draw with noise (R, k), uniform in (0, 1)."""
    rows, vocab = logits.shape
    top_k = noise.shape[1]
    kb = triton.next_power_of_2(top_k)
    chunks = triton.cdiv(vocab, SAMPLE_CHUNK)
    top = torch.empty(rows, chunks, top_k, dtype=torch.float32, device=logits.device)
    top_ids = torch.empty(rows, chunks, top_k, dtype=torch.int32, device=logits.device)
    _chunk_top_k[(rows, chunks)](logits, logits.stride(0), vocab, top, top_ids, K=top_k, KB=kb,
                                 CHUNK=SAMPLE_CHUNK)
    count = chunks * top_k
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    _draw[(rows,)](top, top_ids, count, noise, out, 1.0 / temperature, top_p, K=top_k, KB=kb,
                   NB=triton.next_power_of_2(count), TOP_P=top_p < 1)
    return out


@torch.library.register_fake("qwen3_fast::top_k_draw")
def _(logits, noise, temperature, top_p):
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def sample_top_k(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """generate.sample for a top-k filter (0 < top_k <= MAX_TOP_K): the same ids (R,) from logits
    (R, V), from the same noise, drawn here as generate.sample draws it."""
    noise = torch.rand(logits.shape[0], top_k, device=logits.device)
    # fp32 (for bf16 logits a copy: inductor lowers the product's output slowly without one)
    return top_k_draw(logits.float(), noise, temperature, top_p)

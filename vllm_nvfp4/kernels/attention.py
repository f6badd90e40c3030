"""Triton paged attention over a :class:`~vllm_nvfp4.layout.KVPageLayout` cache, dequantizing inline.

One attention core, :func:`_attend_keys`, run by a decode and a prefill kernel: keys on the MMA M
dimension, query columns (a decode token's GQA group padded to 8, or a prefill program's query
tokens x heads) on N. NVFP4 elements are never multiplied by their block scale: each 16-element
chunk is one plane of 16-bit words (:mod:`vllm_nvfp4.layout`), one k=16 MMA per chunk, scaled per
token by the chunk's scale. Words are decoded by one inline asm (9 integer ops per four f16x2
registers) in the MMA operand registers after asynchronous copies; an FP8 K or V splits its words
into two byte planes (one native conversion each). E2M1 code ``n`` becomes fp16 by bit placement,
``(n & 8) << 12 | (n & 7) << 9`` == e2m1(n) * 2^-14; g and 2^14 (FP8: the layer scale) go into
the softmax / output scale.

Decode grid ``(seqs, kv_heads, splits)`` (flash-decoding; ``_reduce_kernel`` merges split
partials); prefill programs take ``BLOCK_Q`` query tokens x one KV head's GQA group, causal
(+ window). Launch shapes: :mod:`vllm_nvfp4.kernels.launch`. Every launch parameter derives from
host ints, never tensor contents, so the decode path is CUDA-graph capturable.

Optional logit corrections (constexpr, off by default): ``key0_shift`` (the sink key stored
uncentered, :func:`_key0_logit_shift`) and ``rot_center`` (K centered on the rotated pre-RoPE
mean, ``k - R(p) b``: each key's ``q . R(p) b`` from two MMAs with constant cos / sin tables,
:func:`_rot_center_setup`).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from vllm_nvfp4.kernels.constants import E2M1_F16_UNSCALE, FMT_FP8, LOG2E, format_code
from vllm_nvfp4.kernels.e2m1_bytes import e2m1_f16_scaled_f32, unpack_e2m1_pair
from vllm_nvfp4.kernels.launch import (DEFAULT_STAGES, LaunchShape, decode_register_cap,
                                       decode_splits, decode_stages, launch_defaults,
                                       rot_rows, RotCenter)


@triton.jit
def _tile_rows(cache_ptr, stride_blk, bt_row, t0, t_end, BLOCK: tl.constexpr, N: tl.constexpr,
               MASKED: tl.constexpr):
    """Token positions ``t0 + [0, N)``, their validity (< t_end), page pointers and offsets.
    Unless ``MASKED`` the caller guarantees ``t0 + N <= t_end`` (no masked loads)."""
    toks = t0 + tl.arange(0, N)
    valid = toks < t_end
    if MASKED:
        blk = tl.load(bt_row + toks // BLOCK, mask=valid, other=0)
    else:
        blk = tl.load(bt_row + toks // BLOCK)
    return toks, valid, cache_ptr + blk.to(tl.int64) * stride_blk, toks % BLOCK


@triton.jit
def _logit_and_output_scales(k_scale_ptr, v_scale_ptr, h, softmax_scale, K_FMT: tl.constexpr,
                             V_FMT: tl.constexpr, USE_SOFTCAP: tl.constexpr):
    """``(qk_scale, vf)`` of KV head ``h``: the logit scale (with log2(e) unless soft-capped)
    and the output factor. Each includes its operand's dequant factor: the layer scale, times
    2^14 for NVFP4 (the kernels' chunk planes are ``e2m1 * 2^-14``, block scales applied
    apart)."""
    kf = tl.load(k_scale_ptr + h)
    vf = tl.load(v_scale_ptr + h)
    if K_FMT != FMT_FP8:
        kf = kf * E2M1_F16_UNSCALE
    if V_FMT != FMT_FP8:
        vf = vf * E2M1_F16_UNSCALE
    qk_scale = softmax_scale * kf
    if not USE_SOFTCAP:
        qk_scale = qk_scale * LOG2E
    return qk_scale, vf


@triton.jit
def _fold_sinks(sinks_ptr, qh, take, m_i, l_i):
    """Fold the sinks of the query heads ``qh [M]`` (where ``take``; a decode split other than the
    first takes none) into a finished online softmax ``(m_i, l_i)`` (log2 units), a logit without
    a value: returns ``(max(m_i, sink), l_i * keep + exp2(sink - m), keep = exp2(m_i - m))``."""
    sink = tl.load(sinks_ptr + qh, mask=take, other=float("-inf")).to(tl.float32) * LOG2E
    m = tl.maximum(m_i, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    keep = tl.exp2(m_i - m_safe)
    return m, l_i * keep + tl.exp2(sink - m_safe), keep


@triton.jit
def _key0_logit_shift(q_cols, col_ok, key0_shift_ptr, h, softmax_scale, covers_key0,
                      D: tl.constexpr, M: tl.constexpr):
    """Per query column (``q_cols [M]`` row pointers, ``col_ok`` masks padding), what the logit of
    the uncentered key at position 0 (stored so by the policy) loses: ``q . key0_shift[h]`` (FP32)
    x ``softmax_scale * log2(e)``; zeros unless ``covers_key0`` (keys from position 0)."""
    out = tl.zeros([M], dtype=tl.float32)
    if covers_key0:
        d = tl.arange(0, D)
        q = tl.load(q_cols[:, None] + d[None, :], mask=col_ok[:, None], other=0.0).to(tl.float32)
        mu = tl.load(key0_shift_ptr + h * D + d)
        out = tl.sum(q * mu[None, :], axis=1) * (softmax_scale * LOG2E)
    return out


@triton.jit
def _row0_operands(page, off, valid, h, FMT: tl.constexpr, DATA: tl.constexpr,
                   SCALE: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, F32: tl.constexpr,
                   PARTS: tl.constexpr):
    """One token's K or V row (``page``, ``off``, ``valid``: ``[1]`` from :func:`_tile_rows`) as
    FP32 column vectors in the operand layout of :func:`_attend_keys` (:func:`_part_cols`):
    ``[16, 1]`` per NVFP4 chunk (``e2m1 * 2^-14`` times its block scale), or the even and odd
    columns ``[D/2, 1]`` of an FP8 row; with ``PARTS > 1`` each ``[PARTS, ., 1]``. The layer
    scale is left out, as in the tile loop."""
    out = ()
    if FMT == FMT_FP8:
        ev, od = _fp8_planes(_tile_words(page, off, valid, h, DATA, D, 0, D // 2 // PARTS, BLOCK,
                                         True, False, PARTS), F32)
        out = (ev.to(tl.float32), od.to(tl.float32))
    else:
        C: tl.constexpr = D // 16
        CP: tl.constexpr = C // PARTS
        sc_row = page + SCALE + (h * BLOCK + off) * C  # [1]
        for gi in tl.static_range(D // 64 // PARTS):
            planes = _planes(_tile_words(page, off, valid, h, DATA, D // 2, 16 * gi, 16, BLOCK,
                                         True, False, PARTS), F32)
            for j in tl.static_range(4):
                if PARTS > 1:
                    k = tl.arange(0, PARTS)[:, None, None] * CP + 4 * gi + j
                    sc = tl.load(tl.reshape(sc_row, [1, 1, 1]) + k)
                else:
                    sc = tl.load(sc_row[None, :] + 4 * gi + j)  # [1, 1]
                sc = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                out = out + (planes[j].to(tl.float32) * sc,)
    return out


@triton.jit
def _key0_correction(qs, q_pos, accs, m_i, l_i, shift0, rot0, cache_ptr, stride_blk, bt_row, h,
                     qk_scale, window, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
                     K_DATA: tl.constexpr, K_SCALE: tl.constexpr, V_DATA: tl.constexpr,
                     V_SCALE: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                     USE_WINDOW: tl.constexpr, F32: tl.constexpr, PARTS: tl.constexpr):
    """After the tile loop of a key range from position 0, which gave the key there its stored
    logit ``l0`` (plus ``rot0 [M]``, its rotating-center term, if any): move its weight to
    ``l0 - shift0`` (the uncentered sink key, no soft-cap).
    ``l_i += d`` and ``acc += d * v0`` with ``d = 2^(l0 - shift0 - m) - 2^(l0 - m)`` per query
    column (0 where position 0 is outside its window or the column saw no key): the loop's result
    with that one logit shifted, from one K and one V row read after the loop (no tile runs
    apart)."""
    toks, valid, page, off = _tile_rows(cache_ptr, stride_blk, bt_row, 0, 1, BLOCK, 1, False)
    ks = _row0_operands(page, off, valid, h, K_FMT, K_DATA, K_SCALE, D, BLOCK, F32, PARTS)
    l0 = tl.zeros_like(m_i)
    for c in tl.static_range(len(qs)):
        prod = ks[c] * qs[c].to(tl.float32)
        if PARTS > 1:
            prod = tl.sum(prod, axis=0)
        l0 += tl.sum(prod, axis=0)
    l0 = l0 * qk_scale + rot0
    seen = m_i > float("-inf")
    if USE_WINDOW:
        seen = seen & (q_pos < window)
    m_safe = tl.where(seen, m_i, 0.0)
    d = tl.where(seen, tl.exp2(l0 - shift0 - m_safe) - tl.exp2(l0 - m_safe), 0.0)
    vs = _row0_operands(page, off, valid, h, V_FMT, V_DATA, V_SCALE, D, BLOCK, F32, PARTS)
    out = ()
    for c in tl.static_range(len(accs)):
        if PARTS > 1:
            out = out + (accs[c] + vs[c] * d[None, None, :],)
        else:
            out = out + (accs[c] + vs[c] * d[None, :],)
    return out, l_i + d


#: 2 pi in two FP32 parts (Cody-Waite) and 1 / (2 pi): :func:`_cos_sin`
_TWO_PI_HI = tl.constexpr(6.2831854820251465)
_TWO_PI_LO = tl.constexpr(-1.7484555314695172e-07)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def _cos_sin(theta, p, F32: tl.constexpr = True):
    """``cos, sin`` of the angle ``theta * p`` (FP32 ``theta``, integer ``p < 2^24``, broadcast)
    to ~1e-6 at any ``p``: the product's rounding error kept (an FMA) and the angle reduced to
    [-pi, pi] by two FMAs (a plain FP32 angle is off by up to 4e-3 rad at ``theta p ~ 1e5``),
    then ``cos.approx`` / ``sin.approx`` (abs. error < 1e-6 there; ``tl.cos`` / ``tl.sin`` when
    ``F32``, the interpreter)."""
    pf = tl.zeros_like(theta) + p  # FP32, exact; tl.fma does not broadcast
    th = theta + tl.zeros_like(pf)
    x = th * pf
    err = tl.fma(th, pf, -x)
    n = tl.floor(x * _INV_TWO_PI + 0.5)
    r = tl.fma(-n, tl.zeros_like(x) + _TWO_PI_HI, x)
    r = tl.fma(-n, tl.zeros_like(x) + _TWO_PI_LO, r) + err
    if F32:
        return tl.cos(r), tl.sin(r)
    else:
        return (tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [r],
                                          dtype=tl.float32, is_pure=True, pack=1),
                tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r],
                                          dtype=tl.float32, is_pure=True, pack=1))


@triton.jit
def _rot_offset(cols, pos, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, h, D: tl.constexpr,
                KP: tl.constexpr):
    """The rotating center ``R(p) b`` (:class:`launch.RotCenter`) of KV head ``h`` at channels
    ``cols`` (ints ``[C]``) of keys at positions ``pos`` (ints ``[T]``, ``< 2^24``): FP32 ``[T,
    C]``, 0 off the ``KP`` rotated pairs. For the dequantization of many tokens (the cache
    write, one token, selects per-pair scalars instead), not the attention loop: the angles of
    all pairs at once by :func:`_cos_sin` with ``tl.cos`` / ``tl.sin`` (``[T, KP]``), then each
    channel gathers its pair's value (``[T, 2 KP]``: column ``2 n`` is pair ``n``'s first channel
    ``i``, ``2 n + 1`` its second ``i + D/2``), whose slot depends on the channel only."""
    n = tl.arange(0, KP)
    idx = tl.load(rot_idx_ptr + h * KP + n)
    b1 = tl.load(rot_b_ptr + 2 * h * KP + n)[None, :]
    b2 = tl.load(rot_b_ptr + (2 * h + 1) * KP + n)[None, :]
    c, s = _cos_sin(tl.load(rot_theta_ptr + h * KP + n)[None, :], pos[:, None], True)  # [T, KP]
    vals = tl.reshape(tl.join(b1 * c - b2 * s, b2 * c + b1 * s), [pos.shape[0], 2 * KP])
    # slot + 1 of each channel (0: not rotated), from [C, KP] compares that do not depend on T
    hit = (tl.where(cols[:, None] == idx[None, :], 2 * n[None, :] + 1, 0)
           + tl.where(cols[:, None] == (idx + D // 2)[None, :], 2 * n[None, :] + 2, 0))
    slot = tl.sum(hit, axis=1)  # [C]
    index = tl.zeros_like(pos)[:, None] + tl.maximum(slot - 1, 0)[None, :]  # [T, C]
    return tl.where(slot[None, :] > 0, tl.gather(vals, index, axis=1), 0.0)


@triton.jit
def _rot_center_setup(q_cols, col_ok, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, h, scale, t_begin,
                      D: tl.constexpr, M: tl.constexpr, TILE_N: tl.constexpr, Q: tl.constexpr,
                      KP: tl.constexpr, F32: tl.constexpr):
    """State of :func:`_rot_center_tile` at the first tile ``t_begin`` for the query columns
    ``q_cols [M]`` of KV head ``h``, whose keys are stored as ``k - R(p) b`` with ``b`` nonzero on
    ``KP`` RoPE pairs only (:class:`launch.RotCenter`: pair ``i = idx[h, n]`` = dims ``(i, i +
    D/2)``, ``b1, b2 = b[h, 0, n], b[h, 1, n]``, turned by ``theta[h, n] p``). Per pair ``q . R(p)
    b = A_n cos(theta_n p) + B_n sin(theta_n p)`` with ``A = q1 b1 + q2 b2``, ``B = q2 b1 - q1
    b2`` (times ``scale``; ``q1, q2`` the query at the pair's dims, gathered). The state: ``(A,
    B)`` turned by ``theta t_begin`` (FP32 ``[KP, M]``), the tables ``cos, sin(theta_n j)`` for
    ``j < Q`` (``[Q, KP]``, MMA operand type; with ``KP < 16`` one ``[Q, 2 KP]`` table of the
    columns ``cos, sin`` interleaved, as an MMA needs 16 rows of reduction), ``cos, sin(theta_n
    TILE_N)`` (FP32 ``[KP, 1]``: one tile's turn) and ``cos, sin(theta_n Q)`` (``[KP, 1]``,
    operand type: the next ``Q`` rows')."""
    KT: tl.constexpr = tl.float32 if F32 else tl.float16
    n = tl.arange(0, KP)
    idx = tl.load(rot_idx_ptr + h * KP + n)
    theta = tl.load(rot_theta_ptr + h * KP + n)
    q1 = tl.load(q_cols[None, :] + idx[:, None], mask=col_ok[None, :], other=0.0).to(tl.float32)
    q2 = tl.load(q_cols[None, :] + (idx + D // 2)[:, None], mask=col_ok[None, :],
                 other=0.0).to(tl.float32)
    b1 = tl.load(rot_b_ptr + h * 2 * KP + n)[:, None]
    b2 = tl.load(rot_b_ptr + h * 2 * KP + KP + n)[:, None]
    a = (q1 * b1 + q2 * b2) * scale
    b = (q2 * b1 - q1 * b2) * scale
    c, s = _cos_sin(theta, t_begin, F32)
    ct, st = _cos_sin(theta[None, :], tl.arange(0, Q)[:, None], F32)
    cn, sn = _cos_sin(theta, TILE_N, F32)
    cq, sq = _cos_sin(theta, Q, F32)
    ct = ct.to(KT)
    st = st.to(KT)
    if KP < 16:  # [Q, KP, 2] -> columns 2n (cos), 2n + 1 (sin)
        ct = tl.reshape(tl.join(ct, st), [Q, 2 * KP])
        st = ct
    return (a * c[:, None] + b * s[:, None], b * c[:, None] - a * s[:, None], ct, st,
            cn[:, None], sn[:, None], cq.to(KT)[:, None], sq.to(KT)[:, None])


@triton.jit
def _rot_center_tile(rot, TILE_N: tl.constexpr, M: tl.constexpr, Q: tl.constexpr,
                     KP: tl.constexpr, F32: tl.constexpr):
    """The logit correction ``q . R(t0 + j) b`` ``[TILE_N, M]`` of the tile at ``t0`` whose state
    ``rot`` (:func:`_rot_center_setup`) holds, and the next tile's state (``(A', B')`` turned by
    ``theta TILE_N`` in FP32). As ``cos(theta (t0 + j)) = cos(theta t0) cos(theta j) -
    sin(theta t0) sin(theta j)``, keys ``t0 + r .. t0 + r + Q - 1`` take two MMAs, ``cos(theta j)
    @ A'' + sin(theta j) @ B''`` with ``(A'', B'')`` = ``(A', B')`` turned by ``theta r`` (one
    MMA over ``2 KP`` with ``KP < 16``: the rows of ``A'', B''`` interleaved as the table's
    columns): with ``Q < TILE_N`` the next row block turns the operands once more (FP16 on the
    GPU), and up to 4 blocks are stacked (fewer table registers, more instructions:
    :func:`launch.rot_rows`). Its cost scales with ``KP``."""
    a, b, ct, st, cn, sn, cq, sq = rot
    wa = a.to(ct.dtype)
    wb = b.to(ct.dtype)
    parts = ()
    for r in tl.static_range(TILE_N // Q):
        if r > 0:
            wa, wb = wa * cq + wb * sq, wb * cq - wa * sq
        if KP < 16:  # [KP, M, 2] -> [KP, 2, M]: rows 2n (A), 2n + 1 (B)
            wab = tl.reshape(tl.permute(tl.join(wa, wb), (0, 2, 1)), [2 * KP, M])
            parts = parts + (_dot_f(ct, wab, tl.zeros([Q, M], dtype=tl.float32), F32),)
        else:
            parts = parts + (_dot_f(ct, wa, _dot_f(st, wb, tl.zeros([Q, M], dtype=tl.float32),
                                                   F32), F32),)
    if TILE_N // Q == 1:
        corr = parts[0]
    elif TILE_N // Q == 2:  # [Q, M, 2] -> rows r * Q + j
        corr = tl.reshape(tl.permute(tl.join(parts[0], parts[1]), (2, 0, 1)), [TILE_N, M])
    else:  # [Q, M, k, i] holds block 2k + i
        corr = tl.reshape(tl.permute(tl.join(tl.join(parts[0], parts[2]),
                                             tl.join(parts[1], parts[3])), (2, 3, 0, 1)),
                          [TILE_N, M])
    return corr, (a * cn + b * sn, b * cn - a * sn, ct, st, cn, sn, cq, sq)


@triton.jit
def _split_range(seq_len, window, split, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr,
                 USE_WINDOW: tl.constexpr):
    """Token range ``[t_begin, t_end)`` of one split-KV program of a decode query at
    ``seq_len - 1``: whole ``TILE_N`` tiles from the window start, divided over the splits; and
    ``t_full``, the end of its whole tiles that need no mask (:func:`_attend_keys`)."""
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0) // TILE_N * TILE_N
    n_tiles = tl.cdiv(seq_len - lo, TILE_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS) * TILE_N
    t_begin = lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, seq_len)
    return t_begin, _unmasked_end(t_begin, t_end, TILE_N, USE_WINDOW), t_end


@triton.jit
def _unmasked_end(t_begin, t_seen, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """End of the whole ``TILE_N`` tiles from ``t_begin`` below ``t_seen`` (the keys every query
    column sees); ``t_begin`` (everything masked) with a sliding window."""
    if USE_WINDOW:
        return t_begin
    return t_begin + tl.maximum(t_seen - t_begin, 0) // TILE_N * TILE_N


@triton.jit
def _decode_program(seq_lens_ptr, qsl_ptr, k_scale_ptr, v_scale_ptr, softmax_scale, window,
                    K_FMT: tl.constexpr, V_FMT: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
                    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr,
                    USE_SOFTCAP: tl.constexpr):
    """What one decode program works on: sequence, KV head ``h``, split, context length, the
    query token's row ``tok``, its ``BG`` (padded) query heads ``qh`` with ``row_ok``, the
    logit scale (log2 units unless soft-capped), the V dequant factor and the token range
    (:func:`_split_range`)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tok = tl.load(qsl_ptr + seq).to(tl.int64)
    g = tl.arange(0, BG)
    row_ok = g < G
    qh = h * G + g
    qk_scale, vf = _logit_and_output_scales(k_scale_ptr, v_scale_ptr, h, softmax_scale, K_FMT,
                                            V_FMT, USE_SOFTCAP)
    t_begin, t_full, t_end = _split_range(seq_len, window, split, NUM_SPLITS, TILE_N, USE_WINDOW)
    return seq, h, split, seq_len, tok, qh, row_ok, qk_scale, vf, t_begin, t_full, t_end


@triton.jit
def _decode_out_rows(out_ptr, part_o_ptr, part_ml_ptr, m_i, l_i, tok, split, qh, row_ok,
                     stride_ot, stride_oh, HQ: tl.constexpr, D: tl.constexpr,
                     NUM_SPLITS: tl.constexpr):
    """Where a decode program's output rows go, one pointer per query head ``qh [BG]``: the
    final output when unsplit, else the FP32 partials of :func:`_reduce_kernel` (this stores
    their ``(m, l)``)."""
    if NUM_SPLITS == 1:
        return out_ptr + tok * stride_ot + qh * stride_oh
    row = (tok * HQ + qh) * NUM_SPLITS + split
    tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
    return part_o_ptr + row * D


# The four chunk planes of two 16-bit words (one 32-bit register $4): plane J = the element of
# chunk J in each half as fp16 e2m1 * 2^-14 (sign << 15 | magnitude << 9), from the layout's bit
# positions (vllm_nvfp4.layout): chunk 2 is in place (one AND), chunk 0 8 bits lower; one LOP3
# (0xE4: t = (a & c) | (b & ~c)) gathers chunk 3's magnitudes (>> 3) and signs (<< 7), so t holds
# chunk 3 in place and chunk 1 8 bits lower - 9 integer ops for four f16x2 registers.
_E2M1_PLANES_ASM = tl.constexpr(
    "{ .reg .b32 a, b, t;"
    " shl.b32 a, $4, 8; and.b32 $0, a, 0x8E008E00; and.b32 $2, $4, 0x8E008E00;"
    " shr.b32 a, $4, 3; shl.b32 b, $4, 7; lop3.b32 t, a, b, 0x0E0E0E0E, 0xE4;"
    " and.b32 $3, t, 0x8E008E00; shl.b32 t, t, 8; and.b32 $1, t, 0x8E008E00; }")


@triton.jit
def _planes(x, F32: tl.constexpr):
    """The four chunk planes of uint16 words ``x`` (any shape): a tuple of ``e2m1 * 2^-14`` as
    fp16 (fp32 when ``F32``), plane ``J`` = the element of chunk ``J`` in each word. One pure inline asm of the
    loaded words, so Triton loads the raw words straight into the MMA operand layout
    (asynchronous copy, no decoded tile in shared memory)."""
    if F32:  # the interpreter: the same bit placement in Triton ops
        u = x.to(tl.uint32)
        return (_e2m1_fp32(u, 0), _e2m1_fp32(u, 1), _e2m1_fp32(u, 2), _e2m1_fp32(u, 3))
    else:
        return tl.inline_asm_elementwise(_E2M1_PLANES_ASM, "=r,=r,=r,=r,r", [x],
                                         dtype=(tl.float16,) * 4, is_pure=True, pack=2)


@triton.jit
def _e2m1_fp32(u, J: tl.constexpr):
    """Chunk ``J``'s element of uint32 words ``u`` (one 16-bit word each) as fp32 ``e2m1 * 2^-14``,
    the value the asm places: byte ``J // 2`` holds chunks ``J - J % 2`` and ``+ 1``."""
    a, b = unpack_e2m1_pair((u >> (8 * (J // 2))) & 0xFF)
    return e2m1_f16_scaled_f32(b if J % 2 else a)


# the E4M3 bytes of two 16-bit words ($2): $0 = f16x2 of their low (even-element) bytes,
# $1 = f16x2 of their high (odd-element) bytes; native conversion (sm_89+)
_E4M3_PLANES_ASM = tl.constexpr(
    "{ .reg .b32 t; .reg .b16 e, o; prmt.b32 t, $2, 0, 0x3120; mov.b32 {e, o}, t;"
    " cvt.rn.f16x2.e4m3x2 $0, e; cvt.rn.f16x2.e4m3x2 $1, o; }")


@triton.jit
def _fp8_planes(x, F32: tl.constexpr):
    """E4M3 pairs in uint16 words ``x`` (any shape) -> ``(even, odd)``: low and high bytes as fp16
    (fp32 when ``F32``), exact. One pure inline asm of the loaded words, so (as for :func:`_planes`)
    the raw words are copied asynchronously and converted in the MMA operand registers."""
    if F32:  # the interpreter
        lo = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        hi = (x >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return lo, hi
    else:
        return tl.inline_asm_elementwise(_E4M3_PLANES_ASM, "=r,=r,r", [x],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _tile_words(page, off, valid, h, DATA: tl.constexpr, ROW_BYTES: tl.constexpr,
                FIRST: tl.constexpr, NW: tl.constexpr, BLOCK: tl.constexpr,
                TRANSPOSED: tl.constexpr, MASKED: tl.constexpr, PARTS: tl.constexpr):
    """Words ``[FIRST, FIRST + NW)`` (uint16) of each token's ``ROW_BYTES``-byte row of a K or V
    plane: ``[N, NW]``, or ``[NW, N]`` when ``TRANSPOSED`` (loaded straight in that orientation:
    the V operand ``V^T``). NVFP4: the 16 words of one 64-element group; FP8: the whole row.
    With ``PARTS > 1`` the row is cut into ``PARTS`` equal parts (:func:`_part_cols`) and
    ``FIRST`` counts from the start of each: ``[PARTS, N, NW]`` or ``[PARTS, NW, N]``.
    Tokens past ``valid`` read 0 when ``MASKED``; unmasked tiles hold valid tokens only."""
    row = (page + DATA + (h * BLOCK + off) * ROW_BYTES).to(tl.pointer_type(tl.uint16))
    i = FIRST + tl.arange(0, NW)
    if PARTS > 1:
        first = tl.arange(0, PARTS) * (ROW_BYTES // 2 // PARTS)
        if TRANSPOSED:
            ptr = row[None, None, :] + (first[:, None, None] + i[None, :, None])
            ok = valid[None, None, :]
        else:
            ptr = row[None, :, None] + (first[:, None, None] + i[None, None, :])
            ok = valid[None, :, None]
    elif TRANSPOSED:
        ptr = row[None, :] + i[:, None]
        ok = valid[None, :]
    else:
        ptr = row[:, None] + i[None, :]
        ok = valid[:, None]
    if MASKED:
        w = tl.load(ptr, mask=ok, other=0)
    else:
        w = tl.load(ptr)
    return w


@triton.constexpr_function
def _bit_reversed(c, n):
    """``c`` with its log2(n) bits reversed: where the halving splits put column ``c``."""
    r = 0
    b = 1
    while b < n:
        r = r * 2 + (c // b) % 2
        b *= 2
    return r


@triton.jit
def _tile_scales(cache_ptr, stride_blk, bt_row, t0, t_end, h, SCALE: tl.constexpr,
                 C: tl.constexpr, BLOCK: tl.constexpr, N: tl.constexpr,
                 MASKED: tl.constexpr, ZERO_PAST_END: tl.constexpr):
    """FP32 block scales of the ``N`` tokens from ``t0``: ``C`` vectors ``[N]`` in chunk order; in a
    ``MASKED`` tile with ``ZERO_PAST_END``, 0 at or past ``t_end`` (stale bytes there could make
    p = 0 NaN). One load of the scale plane's ``BLOCK * C`` contiguous bytes per block (copied
    asynchronously), split into chunks by halving (bit-reversed order, undone when returned)."""
    NB: tl.constexpr = N // BLOCK
    nb = tl.arange(0, NB)
    if MASKED:  # past the sequence: block 0 (a real block: the scale load below stays in bounds)
        blk = tl.load(bt_row + t0 // BLOCK + nb, mask=t0 + nb * BLOCK < t_end, other=0)
    else:
        blk = tl.load(bt_row + t0 // BLOCK + nb)
    j = tl.arange(0, BLOCK)
    k = tl.arange(0, C)
    ptr = (cache_ptr + blk.to(tl.int64) * stride_blk)[:, None, None] + SCALE \
        + (h * BLOCK + j)[None, :, None] * C + k[None, None, :]
    sc = tl.load(ptr)  # [NB, BLOCK, C]
    return _scale_chunks(tl.reshape(sc, [N, C]), t0 + tl.arange(0, N) < t_end, N, C,
                         MASKED and ZERO_PAST_END)


@triton.jit
def _tile_scales_by_token(page, off, valid, h, SCALE: tl.constexpr, C: tl.constexpr,
                          BLOCK: tl.constexpr, N: tl.constexpr, MASKED: tl.constexpr,
                          ZERO_PAST_END: tl.constexpr):
    """:func:`_tile_scales` for any block size (tiles may straddle blocks): each token's ``C``
    scales from its own page (``page``, ``off``, ``valid`` from :func:`_tile_rows`; masked tokens
    read block 0, in bounds)."""
    k = tl.arange(0, C)
    sc = tl.load(page[:, None] + SCALE + (h * BLOCK + off)[:, None] * C + k[None, :])
    return _scale_chunks(sc, valid, N, C, MASKED and ZERO_PAST_END)


@triton.jit
def _tile_scale_parts(page, off, valid, h, SCALE: tl.constexpr, C: tl.constexpr,
                      BLOCK: tl.constexpr, N: tl.constexpr, MASKED: tl.constexpr,
                      ZERO_PAST_END: tl.constexpr, PARTS: tl.constexpr):
    """:func:`_tile_scales_by_token` with the chunks cut into ``PARTS`` parts
    (:func:`_part_cols`): a tuple of ``C / PARTS`` vectors ``[PARTS, N]``, local chunk ``c`` of
    part ``p`` = chunk ``p * C / PARTS + c``."""
    CP: tl.constexpr = C // PARTS
    k = tl.arange(0, PARTS)[:, None, None] * CP + tl.arange(0, CP)[None, None, :]
    sc = tl.load(page[None, :, None] + SCALE + (h * BLOCK + off)[None, :, None] * C + k)
    ok = tl.reshape(tl.broadcast_to(valid[None, :], [PARTS, N]), [PARTS * N])
    chunks = _scale_chunks(tl.reshape(sc, [PARTS * N, CP]), ok, PARTS * N, CP,
                           MASKED and ZERO_PAST_END)
    out = ()
    for c in tl.static_range(CP):
        out = out + (tl.reshape(chunks[c], [PARTS, N]),)
    return out


@triton.jit
def _scales_of_tile(cache_ptr, stride_blk, bt_row, t0, t_end, page, off, valid, h,
                    SCALE: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr, N: tl.constexpr,
                    MASKED: tl.constexpr, ZERO_PAST_END: tl.constexpr, PARTS: tl.constexpr):
    """The tile's block scales: :func:`_tile_scales` when the tile spans whole blocks (a power-of-2
    ``BLOCK`` dividing ``N``), else :func:`_tile_scales_by_token`; with ``PARTS > 1``
    :func:`_tile_scale_parts`."""
    if PARTS > 1:
        scales = _tile_scale_parts(page, off, valid, h, SCALE, C, BLOCK, N, MASKED,
                                   ZERO_PAST_END, PARTS)
    elif N % BLOCK == 0 and (BLOCK & (BLOCK - 1)) == 0:
        scales = _tile_scales(cache_ptr, stride_blk, bt_row, t0, t_end, h, SCALE, C, BLOCK, N,
                              MASKED, ZERO_PAST_END)
    else:
        scales = _tile_scales_by_token(page, off, valid, h, SCALE, C, BLOCK, N, MASKED,
                                       ZERO_PAST_END)
    return scales


@triton.jit
def _scale_chunks(sc, valid, N: tl.constexpr, C: tl.constexpr, ZERO: tl.constexpr):
    """Raw E4M3 scale bytes ``[N, C]`` -> a tuple of ``C`` FP32 vectors ``[N]`` (chunk order);
    ``ZERO``: 0 where not ``valid``."""
    sc = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if ZERO:
        sc = tl.where(valid[:, None], sc, 0.0)
    parts = (sc,)
    for lvl in tl.static_range(5):  # C <= 32 chunks (head_dim 512)
        if (C >> lvl) > 1:
            halves = ()
            for p in tl.static_range(1 << lvl):
                a, b = tl.split(tl.reshape(parts[p], [N, (C >> lvl) // 2, 2]))
                halves = halves + (a, b)
            parts = halves
    out = ()
    for c in tl.static_range(C):
        out = out + (tl.reshape(parts[_bit_reversed(c, C)], [N]),)
    return out


@triton.jit
def _dot_f(a, b, acc, F32: tl.constexpr):
    if F32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _part_cols(c, FMT: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr):
    """Head-dim columns of operand ``c`` of a K or V tile in :func:`_attend_keys`: NVFP4 chunk
    ``c`` (``16c .. 16c + 15``); FP8 byte plane ``c`` (the even columns for 0, the odd ones for
    1). With ``PARTS > 1`` the head dim is cut into ``PARTS`` parts of ``D / PARTS`` columns, each
    taken by its own warps (the leading dimension of every operand), and ``c`` counts inside a
    part: ``[PARTS, 16]`` or ``[PARTS, D / 2 / PARTS]``."""
    if FMT == FMT_FP8:
        cols = 2 * tl.arange(0, D // 2 // PARTS) + c
    else:
        cols = 16 * c + tl.arange(0, 16)
    if PARTS > 1:
        cols = (tl.arange(0, PARTS) * (D // PARTS))[:, None] + cols[None, :]
    return cols


@triton.constexpr_function
def _operand_count(fmt, d, parts):
    """Operands per part of a K or V tile (:func:`_part_cols`): 2 FP8 byte planes, or the NVFP4
    chunks of ``d / parts`` columns."""
    return 2 if fmt == FMT_FP8 else d // 16 // parts


@triton.jit
def _col_ptrs(cols_ptr, c, FMT: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr):
    """Pointers ``[W, M]`` (``[PARTS, W, M]``) to the columns of operand ``c`` (:func:`_part_cols`)
    of ``M`` rows, one pointer per row ``cols_ptr [M]``."""
    cols = _part_cols(c, FMT, D, PARTS)
    if PARTS > 1:
        ptrs = cols_ptr[None, None, :] + cols[:, :, None]
    else:
        ptrs = cols_ptr[None, :] + cols[:, None]
    return ptrs


@triton.jit
def _load_query_parts(q_cols, col_ok, K_FMT: tl.constexpr, D: tl.constexpr, F32: tl.constexpr,
                      PARTS: tl.constexpr):
    """The query operand of :func:`_attend_keys`, from one pointer per column ``q_cols [M]`` (a
    query token's head, ``col_ok`` masks padding): a tuple of the transposed parts
    (:func:`_part_cols`) ``q_c^T [16, M]`` per NVFP4 chunk of K, or even and odd columns
    ``q_c^T [D/2, M]`` for an FP8 K; with ``PARTS > 1`` each ``[PARTS, ., M]``."""
    qs = ()
    for c in tl.static_range(_operand_count(K_FMT, D, PARTS)):
        q = tl.load(_col_ptrs(q_cols, c, K_FMT, D, PARTS), mask=col_ok[None, :], other=0.0)
        qs = qs + ((q.to(tl.float32) if F32 else q.to(tl.float16)),)
    return qs


@triton.jit
def _zero_accumulators(V_FMT: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                       PARTS: tl.constexpr):
    """Zero output accumulators of :func:`_attend_keys`, one per operand of V
    (:func:`_part_cols`): ``acc_c^T [16, M]`` per NVFP4 chunk, or ``acc_c^T [D/2, M]`` for each
    FP8 byte plane; with ``PARTS > 1`` ``[PARTS, 16, M]`` or ``[PARTS, D/2/PARTS, M]``."""
    W: tl.constexpr = D // 2 // PARTS if V_FMT == FMT_FP8 else 16
    accs = ()
    for c in tl.static_range(_operand_count(V_FMT, D, PARTS)):
        if PARTS > 1:
            accs = accs + (tl.zeros([PARTS, W, M], dtype=tl.float32),)
        else:
            accs = accs + (tl.zeros([W, M], dtype=tl.float32),)
    return accs


@triton.jit
def _attend_keys(
    qs, q_pos, accs, m_i, l_i,
    cache_ptr, stride_blk, bt_row, h, t_begin, t_full, t_end,
    qk_scale, softcap, window, shift0, rot,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,
    K_DATA: tl.constexpr, K_SCALE: tl.constexpr, V_DATA: tl.constexpr, V_SCALE: tl.constexpr,
    D: tl.constexpr, BLOCK: tl.constexpr, TILE_N: tl.constexpr, M: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, F32: tl.constexpr,
    HOIST_Q: tl.constexpr, FOLD_K: tl.constexpr, FOLD_V: tl.constexpr, PARTS: tl.constexpr,
    LAZY: tl.constexpr, STAGES: tl.constexpr, SHIFT0: tl.constexpr, KEY0_IN_LOOP: tl.constexpr,
    KEY0_AFTER: tl.constexpr, ROT: tl.constexpr, ROT_ROWS: tl.constexpr, ROT_PAIRS: tl.constexpr,
):
    """:func:`_attend_tiles` over keys ``[t_begin, t_end)``: the whole tiles of ``[t_begin,
    t_full)`` unmasked, then the rest masked. ``SHIFT0`` (the key at position 0 stored
    uncentered): a range from ``t_begin == 0`` runs its first tile alone (unpipelined) with the
    correction, or, ``KEY0_IN_LOOP``, every whole tile checks for position 0, or, ``KEY0_AFTER``,
    the loop runs as without it and :func:`_key0_correction` follows. ``ROT``: ``rot``
    (:func:`_rot_center_setup` at ``t_begin``) adds each key's rotating-center correction.
    ``HOIST_Q``: the score tiles start from ``0 . q_c`` computed once, so the query operands are
    converted to the MMA layout once. Other flags: :func:`_attend_tiles`."""
    W: tl.constexpr = D // 2 // PARTS if K_FMT == FMT_FP8 else 16
    KT: tl.constexpr = tl.float32 if F32 else tl.float16
    if PARTS > 1:
        s0 = tl.zeros([PARTS, TILE_N, M], dtype=tl.float32)
    else:
        s0 = tl.zeros([TILE_N, M], dtype=tl.float32)
    if HOIST_Q:
        for c in tl.static_range(len(qs)):
            if PARTS > 1:
                s0 = _dot_f(tl.zeros([PARTS, TILE_N, W], dtype=KT), qs[c], s0, F32)
            else:
                s0 = _dot_f(tl.zeros([TILE_N, W], dtype=KT), qs[c], s0, F32)
    rot0 = tl.zeros_like(m_i)
    if SHIFT0 and KEY0_AFTER and ROT:  # position 0's term of the first tile (a range from 0):
        rot0 = tl.sum(rot[0].to(KT).to(tl.float32), axis=0)  # cos 0 = 1, sin 0 = 0, operand type
    lo = t_begin
    PEEL: tl.constexpr = SHIFT0 and not KEY0_IN_LOOP and not KEY0_AFTER
    IN_TILES: tl.constexpr = SHIFT0 and not KEY0_AFTER
    if PEEL:  # position 0's whole tile, if this range starts there
        peel_end = tl.where(t_begin == 0, tl.minimum(t_full, TILE_N), t_begin)
        accs, m_i, l_i, rot = _attend_tiles(
            qs, s0, q_pos, accs, m_i, l_i, cache_ptr, stride_blk, bt_row, h, t_begin, peel_end,
            t_end, qk_scale, softcap, window, shift0, rot, K_FMT, V_FMT, K_DATA, K_SCALE, V_DATA,
            V_SCALE, D, BLOCK, TILE_N, M, CAUSAL, USE_WINDOW, USE_SOFTCAP, F32, False, FOLD_K,
            FOLD_V, PARTS, LAZY, 1, True, ROT, ROT_ROWS, ROT_PAIRS)
        lo = peel_end
    accs, m_i, l_i, rot = _attend_tiles(
        qs, s0, q_pos, accs, m_i, l_i, cache_ptr, stride_blk, bt_row, h, lo, t_full, t_end,
        qk_scale, softcap, window, shift0, rot, K_FMT, V_FMT, K_DATA, K_SCALE, V_DATA, V_SCALE,
        D, BLOCK, TILE_N, M, CAUSAL, USE_WINDOW, USE_SOFTCAP, F32, False, FOLD_K, FOLD_V, PARTS,
        LAZY, STAGES, SHIFT0 and KEY0_IN_LOOP, ROT, ROT_ROWS, ROT_PAIRS)
    accs, m_i, l_i, rot = _attend_tiles(
        qs, s0, q_pos, accs, m_i, l_i, cache_ptr, stride_blk, bt_row, h, t_full, t_end, t_end,
        qk_scale, softcap, window, shift0, rot, K_FMT, V_FMT, K_DATA, K_SCALE, V_DATA, V_SCALE,
        D, BLOCK, TILE_N, M, CAUSAL, USE_WINDOW, USE_SOFTCAP, F32, True, FOLD_K, FOLD_V, PARTS,
        LAZY, STAGES, IN_TILES, ROT, ROT_ROWS, ROT_PAIRS)
    if SHIFT0 and KEY0_AFTER:
        if t_begin == 0:
            accs, l_i = _key0_correction(
                qs, q_pos, accs, m_i, l_i, shift0, rot0, cache_ptr, stride_blk, bt_row, h, qk_scale,
                window, K_FMT, V_FMT, K_DATA, K_SCALE, V_DATA, V_SCALE, D, BLOCK, USE_WINDOW,
                F32, PARTS)
    return accs, m_i, l_i


@triton.jit
def _attend_tiles(
    qs, s0, q_pos, accs, m_i, l_i,
    cache_ptr, stride_blk, bt_row, h, lo, hi, t_end,
    qk_scale, softcap, window, shift0, rot,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,
    K_DATA: tl.constexpr, K_SCALE: tl.constexpr, V_DATA: tl.constexpr, V_SCALE: tl.constexpr,
    D: tl.constexpr, BLOCK: tl.constexpr, TILE_N: tl.constexpr, M: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, F32: tl.constexpr,
    MASKED: tl.constexpr, FOLD_K: tl.constexpr, FOLD_V: tl.constexpr, PARTS: tl.constexpr,
    LAZY: tl.constexpr, STAGES: tl.constexpr, SHIFT0: tl.constexpr, ROT: tl.constexpr,
    ROT_ROWS: tl.constexpr, ROT_PAIRS: tl.constexpr,
):
    """Online-softmax attention, keys on the MMA M dimension and the ``M`` query columns (``qs``,
    positions ``q_pos [M]``) on N, over keys ``[lo, hi)`` of one sequence (``MASKED``: tokens at
    or past ``t_end``, causal and window masked). Per chunk ``c``:
    ``s^T = sum_c sk_c * (K_c . q_c^T)`` and ``acc_c^T += V_c^T . (sv_c * p)``; ``FOLD_K`` /
    ``FOLD_V`` scale the planes instead (the fp16 product of an ``e2m1 * 2^-14`` plane and an E4M3
    scale is exact). ``PARTS > 1``: one operand part per warp (:func:`_part_cols`). ``LAZY``:
    rescale only when a column's max rises. FP8 planes: :func:`_fp8_planes`. ``STAGES``: software
    pipeline stages of the raw-word copies. Logits in log2 units (``qk_scale`` includes log2(e)
    but not with a soft-cap ``softcap``). ``SHIFT0``: ``shift0 [M]`` is subtracted from the logits
    of the key at position 0 (:func:`_attend_keys`). ``ROT``: each tile adds the correction of
    :func:`_rot_center_tile` (``rot``: the state at ``lo``, returned at the end)."""
    C: tl.constexpr = D // 16
    # the masked tail is one tile (a few on a prefill's diagonal), so it is not pipelined - unless
    # a sliding window masks every tile
    LOOP_STAGES: tl.constexpr = 1 if MASKED and not USE_WINDOW else STAGES
    for t0 in tl.range(lo, hi, TILE_N, num_stages=LOOP_STAGES):
        toks, valid, page, off = _tile_rows(cache_ptr, stride_blk, bt_row, t0, t_end, BLOCK,
                                            TILE_N, MASKED)
        if V_FMT != FMT_FP8:
            vss = _scales_of_tile(cache_ptr, stride_blk, bt_row, t0, t_end, page, off, valid, h,
                                  V_SCALE, C, BLOCK, TILE_N, MASKED, True, PARTS)
        s = s0  # zeros (:func:`_attend_keys`)
        if K_FMT == FMT_FP8:
            ke, ko = _fp8_planes(_tile_words(page, off, valid, h, K_DATA, D, 0, D // 2 // PARTS,
                                             BLOCK, False, MASKED, PARTS), F32)
            s = _dot_f(ko, qs[1], _dot_f(ke, qs[0], s, F32), F32)
        else:  # stale K scales past t_end only reach masked scores
            kss = _scales_of_tile(cache_ptr, stride_blk, bt_row, t0, t_end, page, off, valid, h,
                                  K_SCALE, C, BLOCK, TILE_N, MASKED, False, PARTS)
            for gi in tl.static_range(D // 64 // PARTS):
                kps = _planes(_tile_words(page, off, valid, h, K_DATA, D // 2, 16 * gi, 16, BLOCK,
                                          False, MASKED, PARTS), F32)
                for j in tl.static_range(4):
                    ks = tl.expand_dims(kss[4 * gi + j], -1)
                    if FOLD_K:  # the fp16 product is exact (see the docstring)
                        s = _dot_f(kps[j] * (ks if F32 else ks.to(tl.float16)), qs[4 * gi + j],
                                   s, F32)
                    else:
                        s += _dot_f(kps[j], qs[4 * gi + j], tl.zeros_like(s0), F32) * ks
        if PARTS > 1:  # the parts' partial scores (one cross-warp sum per tile)
            s = tl.sum(s, axis=0)
        if ROT:  # scaled as the logits (:func:`_rot_center_setup`): after qk_scale
            corr, rot = _rot_center_tile(rot, TILE_N, M, ROT_ROWS, ROT_PAIRS, F32)
        if USE_SOFTCAP:
            z = s * (qk_scale / softcap)
            if ROT:
                z += corr / softcap
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)) * LOG2E
        else:
            s = s * qk_scale
            if ROT:
                s += corr
        if SHIFT0:  # the uncentered key at position 0 (no soft-cap with it: ops checks)
            s = tl.where((toks == 0)[:, None], s - shift0[None, :], s)
        if MASKED:
            mask = valid[:, None]
            if CAUSAL:
                mask = mask & (toks[:, None] <= q_pos[None, :])
            if USE_WINDOW:
                mask = mask & (toks[:, None] > q_pos[None, :] - window)
            s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if LAZY:  # rescale the accumulators now, and only on a new running max
            if tl.max((m_new > m_i).to(tl.int32), axis=0) > 0:
                rescaled = ()
                for c in tl.static_range(len(accs)):
                    rescaled = rescaled + (accs[c] * alpha[None, :],)
                accs = rescaled
        ph = p if F32 else p.to(tl.float16)
        if PARTS > 1:
            ph = tl.broadcast_to(ph[None, :, :], [PARTS, TILE_N, M])
        if V_FMT == FMT_FP8:  # V^T's even and odd columns, [D/2, TILE_N] each
            ve, vo = _fp8_planes(_tile_words(page, off, valid, h, V_DATA, D, 0, D // 2 // PARTS,
                                             BLOCK, True, MASKED, PARTS), F32)
            accs = (_dot_f(ve, ph, _rescale(accs[0], alpha, LAZY), F32),
                    _dot_f(vo, ph, _rescale(accs[1], alpha, LAZY), F32))
        else:
            new_accs = ()
            for gi in tl.static_range(D // 64 // PARTS):
                vps = _planes(_tile_words(page, off, valid, h, V_DATA, D // 2, 16 * gi, 16, BLOCK,
                                          True, MASKED, PARTS), F32)
                for j in tl.static_range(4):
                    sv = vss[4 * gi + j]
                    sv = sv if F32 else sv.to(tl.float16)
                    acc = _rescale(accs[4 * gi + j], alpha, LAZY)
                    if FOLD_V:  # the fp16 product is exact, as for K
                        acc = _dot_f(vps[j] * tl.expand_dims(sv, -2), ph, acc, F32)
                    else:
                        acc = _dot_f(vps[j], ph * tl.expand_dims(sv, -1), acc, F32)
                    new_accs = new_accs + (acc,)
            accs = new_accs
        m_i = m_new
    return accs, m_i, l_i, rot


@triton.jit
def _rescale(acc, alpha, LAZY: tl.constexpr):
    """An accumulator times the tile's rescale factor ``alpha [M]`` right before its dot (unless
    ``LAZY``: :func:`_attend_tiles` rescaled them all already, where the running max grew)."""
    if LAZY:
        out = acc
    else:
        out = acc * alpha[None, :]
    return out


@triton.jit
def _store_output(accs, scale, o_cols, col_ok, V_FMT: tl.constexpr, D: tl.constexpr,
                  PARTS: tl.constexpr):
    """Store the attention output: the transposed accumulators (:func:`_zero_accumulators`) times
    ``scale [M]`` to one output row pointer per column ``o_cols [M]`` (cast to its type)."""
    for c in tl.static_range(_operand_count(V_FMT, D, PARTS)):
        o = accs[c] * scale[None, :]
        tl.store(_col_ptrs(o_cols, c, V_FMT, D, PARTS), o.to(o_cols.dtype.element_ty),
                 mask=col_ok[None, :])


@triton.jit
def _decode_kernel(
    query_ptr, out_ptr, cache_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, key0_shift_ptr,
    rot_idx_ptr, rot_b_ptr, rot_theta_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr,
    part_o_ptr, part_ml_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_blk, stride_bt,
    softmax_scale, softcap, window,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,
    K_DATA: tl.constexpr, K_SCALE: tl.constexpr, V_DATA: tl.constexpr, V_SCALE: tl.constexpr,
    HQ: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
    D: tl.constexpr, BLOCK: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    F32: tl.constexpr, HOIST_Q: tl.constexpr, FOLD_K: tl.constexpr, FOLD_V: tl.constexpr,
    PARTS: tl.constexpr, LAZY: tl.constexpr, STAGES: tl.constexpr, USE_KEY0: tl.constexpr,
    KEY0_IN_LOOP: tl.constexpr, KEY0_AFTER: tl.constexpr, USE_ROT: tl.constexpr,
    ROT_ROWS: tl.constexpr, ROT_PAIRS: tl.constexpr,
):
    """Decode through :func:`_attend_keys`: the ``BG`` query columns are one KV head's GQA group
    (padded, >= 8). Grid ``(seqs, kv_heads, splits)``; with splits, FP32 partials ``(o, m, l)``
    for :func:`_reduce_kernel`. Sinks: :func:`_fold_sinks`; ``USE_KEY0``: :func:`_key0_logit_shift`;
    ``USE_ROT``: :func:`_rot_center_setup`."""
    seq, h, split, seq_len, tok, qh, row_ok, qk_scale, vf, t_begin, t_full, t_end = _decode_program(
        seq_lens_ptr, qsl_ptr, k_scale_ptr, v_scale_ptr, softmax_scale, window, K_FMT, V_FMT,
        G, BG, TILE_N, NUM_SPLITS, USE_WINDOW, USE_SOFTCAP)
    q_cols = query_ptr + tok * stride_qt + qh * stride_qh
    qs = _load_query_parts(q_cols, row_ok, K_FMT, D, F32, PARTS)
    shift0 = tl.zeros([BG], dtype=tl.float32)
    if USE_KEY0:
        shift0 = _key0_logit_shift(q_cols, row_ok, key0_shift_ptr, h, softmax_scale,
                                   t_begin == 0, D, BG)
    rot = ()
    if USE_ROT:
        rot = _rot_center_setup(q_cols, row_ok, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, h,
                                softmax_scale * (1.0 if USE_SOFTCAP else LOG2E), t_begin, D, BG,
                                TILE_N, ROT_ROWS, ROT_PAIRS, F32)
    accs, m_i, l_i = _attend_keys(
        qs, tl.zeros([BG], dtype=tl.int32) + seq_len - 1, _zero_accumulators(V_FMT, D, BG, PARTS),
        tl.full([BG], float("-inf"), tl.float32), tl.zeros([BG], dtype=tl.float32),
        cache_ptr, stride_blk, block_table_ptr + seq * stride_bt, h, t_begin, t_full, t_end,
        qk_scale, softcap, window, shift0, rot, K_FMT, V_FMT, K_DATA, K_SCALE, V_DATA, V_SCALE,
        D, BLOCK, TILE_N, BG, False, USE_WINDOW, USE_SOFTCAP, F32, HOIST_Q, FOLD_K, FOLD_V,
        PARTS, LAZY, STAGES, USE_KEY0, KEY0_IN_LOOP, KEY0_AFTER, USE_ROT, ROT_ROWS,
        ROT_PAIRS)
    if USE_SINKS:  # into the first split's partial only
        first_split = tl.full([BG], split, tl.int32) == 0
        m_i, l_i, keep = _fold_sinks(sinks_ptr, qh, row_ok & first_split, m_i, l_i)
        vf = vf * keep
    o_cols = _decode_out_rows(out_ptr, part_o_ptr, part_ml_ptr, m_i, l_i, tok, split, qh, row_ok,
                              stride_ot, stride_oh, HQ, D, NUM_SPLITS)
    _store_output(accs, vf / tl.where(l_i == 0.0, 1.0, l_i), o_cols, row_ok, V_FMT, D, PARTS)


@triton.jit
def _reduce_kernel(
    out_ptr, part_o_ptr, part_ml_ptr, stride_ot, stride_oh,
    HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    """Merge the split partials of one (query token, head): log-sum-exp weights, then cast.
    ``SPLITS_P2``: ``NUM_SPLITS`` rounded up to a power of 2 (the padded lanes are masked)."""
    tok = tl.program_id(0).to(tl.int64)
    qh = tl.program_id(1)
    split = tl.arange(0, SPLITS_P2)
    ok = split < NUM_SPLITS
    row = (tok * HQ + qh) * NUM_SPLITS + split
    m = tl.load(part_ml_ptr + row * 2, mask=ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(l > 0.0, l * tl.exp2(m - m_max), 0.0)
    o = tl.load(part_o_ptr + row[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None],
                other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + tok * stride_ot + qh * stride_oh + tl.arange(0, D),
             o.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_program(seq_lens_ptr, qsl_ptr, num_seqs, window, G: tl.constexpr,
                     G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
                     USE_WINDOW: tl.constexpr):
    """What one prefill program works on: ``BLOCK_Q`` query tokens x ``G_PAD`` heads of KV head
    ``h`` = program_id(1), as ``BLOCK_Q * G_PAD`` rows: sequence, ``active`` (False for the
    spare programs of the grid), the rows' token index, query head, validity and position, and
    the key range ``[t_begin, t_end)`` (causal, window) with ``t_full`` (:func:`_attend_keys`)."""
    # program -> (sequence, query block): q block b of sequence s has global index
    # qsl[s] // BLOCK_Q + s + b, so a binary search over qsl finds s (as vLLM's unified kernel does)
    pid = tl.program_id(0)
    h = tl.program_id(1)
    lo_s = 0
    hi_s = num_seqs
    while lo_s < hi_s:
        mid = (lo_s + hi_s) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid:
            lo_s = mid + 1
        else:
            hi_s = mid
    seq = lo_s - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    qb = pid - (q_start // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    r = tl.arange(0, BLOCK_Q * G_PAD)
    qi = qb * BLOCK_Q + r // G_PAD  # query index inside the sequence
    g = r % G_PAD
    row_ok = (qi < q_len) & (g < G)
    tok = (q_start + qi).to(tl.int64)
    first = seq_len - q_len + qb * BLOCK_Q  # position of the block's first query
    t_begin = 0
    if USE_WINDOW:
        t_begin = tl.maximum(first - window + 1, 0) // TILE_N * TILE_N
    t_end = tl.minimum(first + BLOCK_Q, seq_len)
    t_full = _unmasked_end(t_begin, tl.minimum(first + 1, t_end), TILE_N, USE_WINDOW)
    return (seq, h, qb * BLOCK_Q < q_len, tok, h * G + g, row_ok, seq_len - q_len + qi,
            t_begin, t_full, t_end)


@triton.jit
def _prefill_kernel(
    query_ptr, out_ptr, cache_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, key0_shift_ptr,
    rot_idx_ptr, rot_b_ptr, rot_theta_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_blk, stride_bt,
    softmax_scale, softcap, window,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,
    K_DATA: tl.constexpr, K_SCALE: tl.constexpr, V_DATA: tl.constexpr, V_SCALE: tl.constexpr,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    D: tl.constexpr, BLOCK: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    F32: tl.constexpr, HOIST_Q: tl.constexpr, FOLD_K: tl.constexpr, FOLD_V: tl.constexpr,
    PARTS: tl.constexpr, LAZY: tl.constexpr, STAGES: tl.constexpr, USE_KEY0: tl.constexpr,
    KEY0_IN_LOOP: tl.constexpr, KEY0_AFTER: tl.constexpr, USE_ROT: tl.constexpr,
    ROT_ROWS: tl.constexpr, ROT_PAIRS: tl.constexpr,
):
    """Prefill through :func:`_attend_keys` (the program's ``BLOCK_Q * G_PAD`` query rows as
    columns, causal); grid ``(query blocks + seqs, kv_heads)`` (:func:`_prefill_program`)."""
    seq, h, active, tok, qh, row_ok, q_pos, t_begin, t_full, t_end = _prefill_program(
        seq_lens_ptr, qsl_ptr, num_seqs, window, G, G_PAD, BLOCK_Q, TILE_N, USE_WINDOW)
    if not active:
        return
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    qk_scale, vf = _logit_and_output_scales(k_scale_ptr, v_scale_ptr, h, softmax_scale, K_FMT,
                                            V_FMT, USE_SOFTCAP)
    q_cols = query_ptr + tok * stride_qt + qh * stride_qh
    qs = _load_query_parts(q_cols, row_ok, K_FMT, D, F32, PARTS)
    shift0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_KEY0:
        shift0 = _key0_logit_shift(q_cols, row_ok, key0_shift_ptr, h, softmax_scale,
                                   t_begin == 0, D, BLOCK_M)
    rot = ()
    if USE_ROT:
        rot = _rot_center_setup(q_cols, row_ok, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, h,
                                softmax_scale * (1.0 if USE_SOFTCAP else LOG2E), t_begin, D,
                                BLOCK_M, TILE_N, ROT_ROWS, ROT_PAIRS, F32)
    accs, m_i, l_i = _attend_keys(
        qs, q_pos, _zero_accumulators(V_FMT, D, BLOCK_M, PARTS),
        tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
        cache_ptr, stride_blk, block_table_ptr + seq * stride_bt, h, t_begin, t_full, t_end,
        qk_scale, softcap, window, shift0, rot, K_FMT, V_FMT, K_DATA, K_SCALE, V_DATA, V_SCALE,
        D, BLOCK, TILE_N, BLOCK_M, True, USE_WINDOW, USE_SOFTCAP, F32, HOIST_Q, FOLD_K, FOLD_V,
        PARTS, LAZY, STAGES, USE_KEY0, KEY0_IN_LOOP, KEY0_AFTER, USE_ROT, ROT_ROWS,
        ROT_PAIRS)
    if USE_SINKS:
        m_i, l_i, keep = _fold_sinks(sinks_ptr, qh, row_ok, m_i, l_i)
        vf = vf * keep
    _store_output(accs, vf / tl.where(l_i == 0.0, 1.0, l_i), out_ptr + tok * stride_ot
                + qh * stride_oh, row_ok, V_FMT, D, PARTS)


def _layout_constexprs(layout, device: torch.device, softcap, window, sinks) -> dict:
    """Kernel constexprs shared by decode and prefill."""
    f32 = device.type != "cuda"  # the interpreter: fp32 math (its fp16/bf16 dots are unreliable)
    return dict(
        K_FMT=format_code(layout.k_format), V_FMT=format_code(layout.v_format),
        K_DATA=layout.k_data_offset, K_SCALE=layout.k_scale_offset,
        V_DATA=layout.v_data_offset, V_SCALE=layout.v_scale_offset,
        D=layout.head_dim, BLOCK=layout.block_size,
        USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None, F32=f32,
    )


def paged_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    layout,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    softmax_scale: float,
    out: torch.Tensor,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    key0_shift: Optional[torch.Tensor] = None,
    launch: Optional[LaunchShape] = None,
    rot_center: Union[RotCenter, tuple[torch.Tensor, torch.Tensor], None] = None,
) -> torch.Tensor:
    """Launch decode (``max_query_len == 1``) or prefill kernels; arguments as in
    :func:`vllm_nvfp4.ops.paged_attention` (checked there). ``launch`` fixes the launch shape
    (benchmarks, tests); ``None`` takes :func:`launch_defaults`. ``rot_center = (b, theta)``: K
    stored centered on the rotated pre-RoPE mean, ``k - R(p) b`` at position ``p`` (the index in
    its sequence), so each key's logit gains ``q . R(p) b``: ``b`` FP32 ``[num_kv_heads,
    head_dim]`` (times the RoPE's attention scaling, if any), ``theta`` FP32 ``[head_dim / 2]``
    the angle per position of the rotate-half pairs ``(i, i + head_dim / 2)`` (``inv_freq``,
    any scaling applied); both contiguous on the cache's device. A :class:`RotCenter` instead
    corrects only its ``k`` pairs per KV head (``b`` zero on the others), at a cost that scales
    with ``k``; ``(b, theta)`` is :meth:`RotCenter.all_pairs` (built per call)."""
    decode = max_query_len == 1
    num_seqs = seq_lens.shape[0]
    d = layout.head_dim
    meta = _layout_constexprs(layout, query.device, logits_soft_cap, sliding_window, sinks)
    g = query.shape[1] // layout.num_kv_heads
    softcap = float(logits_soft_cap or 1.0)
    window = int(sliding_window or 0)
    g_pad = triton.next_power_of_2(g)
    sink_arg = k_scale if sinks is None else sinks  # never read without sinks (USE_SINKS)
    key0_arg = k_scale if key0_shift is None else key0_shift  # never read without (USE_KEY0)
    if rot_center is not None and not isinstance(rot_center, RotCenter):
        rot_center = RotCenter.all_pairs(*rot_center)
    if rot_center is None:  # never read (USE_ROT)
        rot_idx, rot_b, rot_theta, rot_pairs = block_table, k_scale, k_scale, 8
    else:
        rot_center.check(layout.num_kv_heads, d)
        rot_idx, rot_b, rot_theta = rot_center.idx, rot_center.b, rot_center.theta
        rot_pairs = rot_center.pairs
    common_args = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                   cache.stride(0), block_table.stride(0), softmax_scale, softcap, window)
    shape = launch or launch_defaults(layout, decode)
    if d % (64 * shape.dim_parts):
        raise ValueError(f"dim_parts {shape.dim_parts} needs a head_dim multiple of "
                         f"{64 * shape.dim_parts}, got {d}")
    block = layout.block_size
    tn = max(shape.tile_n, block) if block & (block - 1) == 0 else shape.tile_n
    warps = shape.num_warps
    if decode:
        num_tokens, hq = query.shape[0], query.shape[1]
        bg = max(8, g_pad)
        splits = shape.num_splits or decode_splits(num_seqs, layout.num_kv_heads, max_seq_len, tn,
                                                   query.device, warps, shape.dim_parts)
        keys_per_split = -(-max_seq_len // splits)
        maxnreg = decode_register_cap(shape, num_seqs * layout.num_kv_heads * splits,
                                      keys_per_split, query.device)
        stages = decode_stages(shape, keys_per_split)
        if splits > 1:
            part_o = torch.empty(num_tokens * hq * splits, d, dtype=torch.float32,
                                 device=query.device)
            part_ml = torch.empty(num_tokens * hq * splits, 2, dtype=torch.float32,
                                  device=query.device)
        else:
            part_o = part_ml = out  # unused
        _decode_kernel[(num_seqs, layout.num_kv_heads, splits)](
            query, out, cache, k_scale, v_scale, sink_arg, key0_arg, rot_idx, rot_b, rot_theta,
            block_table, seq_lens, query_start_loc, part_o, part_ml, *common_args,
            HQ=hq, G=g, BG=bg, TILE_N=tn, NUM_SPLITS=splits, **meta,
            HOIST_Q=shape.hoist_query, FOLD_K=shape.fold_k_scales, FOLD_V=shape.fold_v_scales,
            PARTS=shape.dim_parts, LAZY=shape.lazy_rescale, STAGES=stages,
            USE_KEY0=key0_shift is not None, KEY0_IN_LOOP=shape.key0_in_loop,
            KEY0_AFTER=shape.key0_after_loop,
            USE_ROT=rot_center is not None, ROT_PAIRS=rot_pairs,
            ROT_ROWS=rot_rows(shape, tn, None if rot_center is None else rot_pairs),
            num_warps=warps, num_stages=stages,
            **({"maxnreg": maxnreg} if maxnreg else {}),
        )
        if splits > 1:
            _reduce_kernel[(num_tokens, hq)](
                out, part_o, part_ml, out.stride(0), out.stride(1),
                HQ=hq, D=d, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
                num_warps=4,
            )
        return out
    block_m = max(shape.query_rows, g_pad)
    block_q = block_m // g_pad
    stages = shape.num_stages or DEFAULT_STAGES
    grid = (query.shape[0] // block_q + num_seqs, layout.num_kv_heads)
    _prefill_kernel[grid](
        query, out, cache, k_scale, v_scale, sink_arg, key0_arg, rot_idx, rot_b, rot_theta,
        block_table, seq_lens, query_start_loc, num_seqs,
        *common_args,
        G=g, G_PAD=g_pad, BLOCK_Q=block_q, TILE_N=tn, **meta,
        HOIST_Q=shape.hoist_query, FOLD_K=shape.fold_k_scales, FOLD_V=shape.fold_v_scales,
        PARTS=shape.dim_parts, LAZY=shape.lazy_rescale, STAGES=stages,
        USE_KEY0=key0_shift is not None, KEY0_IN_LOOP=shape.key0_in_loop,
        KEY0_AFTER=shape.key0_after_loop,
        USE_ROT=rot_center is not None, ROT_PAIRS=rot_pairs,
        ROT_ROWS=rot_rows(shape, tn, None if rot_center is None else rot_pairs),
        num_warps=warps, num_stages=stages,
    )
    return out

"""Triton kernel: quantize this step's K/V and store them into one layer's paged cache.

One program per (token, KV head); it writes the head's K and V rows (and NVFP4 block scales) into
the page layout of :mod:`vllm_nvfp4.layout`. The bytes equal :mod:`vllm_nvfp4.formats` with
``nonfinite="propagate"``: every division is IEEE round-to-nearest (``tl.div_rn``), every E4M3
cast rounds to nearest even after an explicit clamp, and the block-scale choice compares the same
FP64 squared errors summed in the same order, exactly as the torch definition does.

With K centering (policy ``k_center``) the kernel subtracts the center from each key as
:func:`vllm_nvfp4.key_transform.stored_keys` does (FP32, rounded back to the key's dtype), so
the step launches nothing for it. With a rotating center (``rot``, policy ``k_rot``) it then
subtracts ``R(p) b_k`` in FP32 before quantizing, ``p`` the token's position from
``positions``, the angles exactly reduced by :func:`~vllm_nvfp4.kernels.attention._cos_sin`
as in the attention kernels (``cos.approx`` / ``sin.approx`` on a GPU).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from vllm_nvfp4.kernels.attention import _cos_sin
from vllm_nvfp4.kernels.constants import FMT_FP8, format_code
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.kernels.e2m1_bytes import pack_e2m1_pair


@triton.jit
def _e4m3_byte(x, sign_src):
    """FP32 ``x`` (clamped to +-448, or NaN) -> E4M3 byte, round to nearest even, in integer
    arithmetic (bit-exact on GPU and in the interpreter, whose float8 cast mis-rounds carries).
    The sign bit comes from ``sign_src`` (same sign as ``x``; for NaN it keeps the input's sign,
    as torch does)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (sign_src.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal E4M3 (|x| >= 2^-6): round the 23-bit mantissa to 3 bits, carry into the exponent
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal E4M3: round(|x| / 2^-9) to nearest even, from the FP32 significand
    e = (a >> 23).to(tl.int32) - 127
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - e, 25).to(tl.uint32)  # e <= -7 here, so shift >= 21
    one = mant * 0 + 1
    q = mant >> shift
    rem = mant & ((one << shift) - 1)
    half = one << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.uint32)
    code = tl.where(a >= (121 << 23), normal, q)
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def _e4m3_value(b):
    """E4M3 byte (finite, non-negative) -> FP32, in integer arithmetic."""
    b32 = b.to(tl.uint32)
    e = (b32 >> 3) & 0xF
    m = b32 & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _store_fp8_row(x, dst_ptr, scale, D: tl.constexpr):
    """``dst[0:D] = e4m3(clamp(x / scale, +-448))`` of FP32 ``x [D]``; NaN stays NaN."""
    q = tl.div_rn(x, tl.full([D], 1.0, tl.float32) * scale)
    q = tl.where(q != q, q, tl.minimum(tl.maximum(q, -448.0), 448.0))
    tl.store(dst_ptr + tl.arange(0, D), _e4m3_byte(q, x))


@triton.jit
def _e2m1_code(q):
    """E2M1 nibble of FP32 ``q`` (RNE via thresholds, saturating at 6; sign iff q < 0)."""
    m = tl.abs(q)
    c = (
        (m > 0.25).to(tl.uint8)
        + (m >= 0.75).to(tl.uint8)
        + (m > 1.25).to(tl.uint8)
        + (m >= 1.75).to(tl.uint8)
        + (m > 2.5).to(tl.uint8)
        + (m >= 3.5).to(tl.uint8)
        + (m > 5.0).to(tl.uint8)
    )
    return c | ((q < 0).to(tl.uint8) << 3)


@triton.jit
def _e2m1_signed_value(c):
    """FP32 value of E2M1 nibbles ``c`` (uint8): {0, .5, 1, 1.5, 2, 3, 4, 6} with the sign bit."""
    m = (c & 7).to(tl.float32)
    mag = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _chunk_codes(x, s, g):
    """E2M1 codes ``[C2, 16]`` of chunks ``x`` with block scales ``s [C2]`` (FP32 values of E4M3
    numbers) and global scale ``g``; all zero where ``s * g`` is 0 or infinite."""
    inf = float("inf")
    se = s * g
    ok = (se != 0.0) & (tl.abs(se) != inf)
    return tl.where(ok[:, None], _e2m1_code(tl.div_rn(x, tl.where(ok, se, 1.0)[:, None])), 0)


@triton.jit
def _chunk_error(xg, codes, s, C2: tl.constexpr):
    """Squared error ``[C2]`` (FP64) of each chunk in units of ``g``, as
    :func:`vllm_nvfp4.formats.nvfp4_block_error`: ``d = e2m1 * s - x / g`` in FP32 (the product
    is exact, so a fused multiply-add rounds the same), ``d * d`` exact in FP64, summed as a
    pairwise tree of neighbours."""
    d = (_e2m1_signed_value(codes) * s[:, None] - xg).to(tl.float64)
    e = d * d  # [C2, 16]
    a, b = tl.split(tl.reshape(e, [C2, 8, 2]))
    a, b = tl.split(tl.reshape(a + b, [C2, 4, 2]))
    a, b = tl.split(tl.reshape(a + b, [C2, 2, 2]))
    a, b = tl.split(a + b)
    return a + b


@triton.jit
def _max_candidate(amax, g, m: tl.constexpr, C2: tl.constexpr):
    """E4M3 byte ``e4m3(min(amax / (g * m), 448))`` of each chunk ``[C2]``."""
    s_q = tl.minimum(tl.div_rn(amax, tl.full([C2], m, tl.float32) * g), 448.0)
    return _e4m3_byte(s_q, s_q)


@triton.jit
def _try_scale(x, xg, g, s_byte, best_err, best_byte, best_codes, C2: tl.constexpr):
    """Keep the candidate ``s_byte [C2]`` in the chunks where its error is strictly lower."""
    s = _e4m3_value(s_byte)
    codes = _chunk_codes(x, s, g)
    err = _chunk_error(xg, codes, s, C2)
    better = err < best_err
    return (tl.where(better, err, best_err), tl.where(better, s_byte, best_byte),
            tl.where(better[:, None], codes, best_codes))


@triton.jit
def _nvfp4_chunks(x, g, C2: tl.constexpr):
    """NVFP4 of ``C2`` 16-element chunks ``x [C2, 16]`` (FP32) with global scale ``g``: E2M1 codes
    ``[C2, 16]`` (uint8) and E4M3 block-scale bytes ``[C2]``. Each chunk's scale is the candidate
    of lowest squared error of :data:`vllm_nvfp4.formats.NVFP4_SCALE_CANDIDATES`, in its order:
    ``e4m3(amax / (6 g))``, its E4M3 neighbours below and above, ``e4m3(amax / (5 g))``,
    ``e4m3(amax / (4 g))`` (:func:`vllm_nvfp4.formats.nvfp4_quantize`)."""
    inf = float("inf")
    bad_x = (x != x) | (tl.abs(x) == inf)
    bad = tl.max(bad_x.to(tl.int32), axis=1) > 0  # [C2]
    x = tl.where(bad_x, 0.0, x)
    amax = tl.max(tl.abs(x), axis=1)
    xg = tl.div_rn(x, tl.full([C2, 16], 1.0, tl.float32) * g)
    s6_byte = _max_candidate(amax, g, 6.0, C2)
    s6 = _e4m3_value(s6_byte)
    best_codes = _chunk_codes(x, s6, g)
    best_err = _chunk_error(xg, best_codes, s6, C2)
    best_byte = s6_byte
    zero = tl.full([C2], 0, tl.uint8)
    down = tl.where(s6_byte > 0, s6_byte - 1, zero)  # positive E4M3 bytes are ordered by value
    up = tl.minimum(s6_byte + 1, 0x7E)  # 0x7E is 448
    best_err, best_byte, best_codes = _try_scale(x, xg, g, down, best_err, best_byte, best_codes, C2)
    best_err, best_byte, best_codes = _try_scale(x, xg, g, up, best_err, best_byte, best_codes, C2)
    best_err, best_byte, best_codes = _try_scale(x, xg, g, _max_candidate(amax, g, 5.0, C2),
                                                 best_err, best_byte, best_codes, C2)
    best_err, best_byte, best_codes = _try_scale(x, xg, g, _max_candidate(amax, g, 4.0, C2),
                                                 best_err, best_byte, best_codes, C2)
    s_byte = tl.where(bad, tl.full([C2], 0x7F, tl.uint8), best_byte)  # NaN scale: block decodes to NaN
    codes = tl.where(bad[:, None], 0, best_codes)
    return codes, s_byte


@triton.jit
def _row_chunk_cols(D: tl.constexpr):
    """Channels ``[D / 32, 16]`` of the even 16-chunks ``2q`` and of the odd ones ``2q + 1``."""
    q = tl.arange(0, D // 32)
    i = tl.arange(0, 16)
    lo = 32 * q[:, None] + i[None, :]
    return lo, lo + 16


@triton.jit
def _store_nvfp4_row(lo_x, hi_x, data_ptr, scale_ptr, g, D: tl.constexpr):
    """NVFP4 of one head vector (``D`` a multiple of 64), FP32 at the channels of
    :func:`_row_chunk_cols` (``lo_x`` / ``hi_x [D / 32, 16]``: the even / odd 16-chunks):
    ``data[0:D/2]`` the codes in the layout's chunk-planar order - byte ``32 u + 2 i + b`` of
    64-element group ``u`` holds elements ``64 u + 32 b + i`` and ``+ 16``
    (:func:`pack_e2m1_pair`) - and ``scale_ptr[c]`` the block scale of 16-chunk ``c`` (the
    token's row of the token-major scale plane)."""
    C2: tl.constexpr = D // 32  # chunk pairs (2q, 2q + 1) share bytes
    q = tl.arange(0, C2)
    i = tl.arange(0, 16)
    lo, lo_s = _nvfp4_chunks(lo_x, g, C2)
    hi, hi_s = _nvfp4_chunks(hi_x, g, C2)
    byte = 32 * (q[:, None] // 2) + 2 * i[None, :] + q[:, None] % 2
    tl.store(data_ptr + byte, pack_e2m1_pair(lo, hi))
    tl.store(scale_ptr + 2 * q, lo_s)
    tl.store(scale_ptr + 2 * q + 1, hi_s)


@triton.jit
def _bf16_rounded(x):
    """FP32 ``x`` rounded to the nearest bfloat16 (ties to even; NaN kept), as FP32: in integer
    arithmetic, since the interpreter's bfloat16 cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r)


@triton.jit
def _key_values(src, cols, center_row, CENTER: tl.constexpr):
    """The key at channels ``cols`` (ints, any shape) of the row at ``src`` in FP32, with
    ``CENTER`` minus the FP32 row at ``center_row`` rounded to the key's dtype
    (:func:`vllm_nvfp4.key_transform.stored_keys` to the bit)."""
    x = tl.load(src + cols).to(tl.float32)
    if CENTER:
        x = x - tl.load(center_row + cols)
        if src.dtype.element_ty == tl.bfloat16:
            x = _bf16_rounded(x)
        else:
            x = x.to(src.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _key_rot_offset(cols, t, h, pos_ptr, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, key0_plain_ptr,
                    D: tl.constexpr, ROT_PAIRS: tl.constexpr, USE_PLAIN0: tl.constexpr,
                    F32: tl.constexpr):
    """``R(p) b_k`` of token ``t`` (``p = pos[t]``) at channels ``cols`` (ints, any shape), FP32
    of ``cols``' shape; 0 at ``p = 0`` where ``USE_PLAIN0`` and ``key0_plain[h]``. One pair at a
    time: its two values (the expressions of :func:`~vllm_nvfp4.kernels.attention._rot_offset`,
    the angle by :func:`_cos_sin`, ``cos.approx`` / ``sin.approx`` unless ``F32``) are scalars
    that each channel selects by compare, so nothing is gathered across threads."""
    p = tl.load(pos_ptr + t)
    off = tl.zeros(cols.shape, tl.float32)
    for n in tl.static_range(ROT_PAIRS):
        i = tl.load(rot_idx_ptr + h * ROT_PAIRS + n)
        b1 = tl.load(rot_b_ptr + 2 * h * ROT_PAIRS + n)
        b2 = tl.load(rot_b_ptr + (2 * h + 1) * ROT_PAIRS + n)
        c, s = _cos_sin(tl.load(rot_theta_ptr + h * ROT_PAIRS + n), p, F32)
        off = tl.where(cols == i, b1 * c - b2 * s, off)
        off = tl.where(cols == i + D // 2, b2 * c + b1 * s, off)
    if USE_PLAIN0:
        off = tl.where((p == 0) & (tl.load(key0_plain_ptr + h) != 0), 0.0, off)
    return off


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    center_ptr, center0_ptr, first_ptr,
    pos_ptr, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, key0_plain_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_blk,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,
    K_DATA: tl.constexpr, K_SCALE: tl.constexpr, V_DATA: tl.constexpr, V_SCALE: tl.constexpr,
    H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, CENTER: tl.constexpr,
    CENTER0: tl.constexpr, USE_ROT: tl.constexpr, ROT_PAIRS: tl.constexpr,
    USE_PLAIN0: tl.constexpr, F32: tl.constexpr,
):
    """One (token, KV head). ``CENTER``: the key minus ``center[h]`` (``center0[h]`` where
    ``CENTER0`` and ``first[t]``), rounded to the key's dtype; ``USE_ROT``: then minus ``R(p) b_k``
    (``p = pos[t]``) in FP32, none at ``p = 0`` where ``USE_PLAIN0`` and ``key0_plain[h]`` (the
    sink key stored uncentered)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = cache_ptr + (slot // BLOCK) * stride_blk
    off = slot % BLOCK
    C: tl.constexpr = D // 16
    k_src = key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh
    v_src = value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh
    center_row = center_ptr + h * D
    if CENTER0:
        if tl.load(first_ptr + t) != 0:
            center_row = center0_ptr + h * D
    if K_FMT == FMT_FP8:
        d = tl.arange(0, D)
        k = _key_values(k_src, d, center_row, CENTER)
        if USE_ROT:
            k -= _key_rot_offset(d, t, h, pos_ptr, rot_idx_ptr, rot_b_ptr, rot_theta_ptr,
                                 key0_plain_ptr, D, ROT_PAIRS, USE_PLAIN0, F32)
        _store_fp8_row(k, page + K_DATA + (h * BLOCK + off) * D, tl.load(k_scale_ptr + h), D)
    else:
        lo_cols, hi_cols = _row_chunk_cols(D)
        k_lo = _key_values(k_src, lo_cols, center_row, CENTER)
        k_hi = _key_values(k_src, hi_cols, center_row, CENTER)
        if USE_ROT:
            lo_off, hi_off = tl.split(_key_rot_offset(
                tl.join(lo_cols, hi_cols), t, h, pos_ptr, rot_idx_ptr, rot_b_ptr, rot_theta_ptr,
                key0_plain_ptr, D, ROT_PAIRS, USE_PLAIN0, F32))
            k_lo -= lo_off
            k_hi -= hi_off
        _store_nvfp4_row(k_lo, k_hi, page + K_DATA + (h * BLOCK + off) * (D // 2),
                         page + K_SCALE + (h * BLOCK + off) * C, tl.load(k_scale_ptr + h), D)
    if V_FMT == FMT_FP8:
        _store_fp8_row(tl.load(v_src + tl.arange(0, D)).to(tl.float32),
                       page + V_DATA + (h * BLOCK + off) * D, tl.load(v_scale_ptr + h), D)
    else:
        lo_cols, hi_cols = _row_chunk_cols(D)
        _store_nvfp4_row(tl.load(v_src + lo_cols).to(tl.float32),
                         tl.load(v_src + hi_cols).to(tl.float32),
                         page + V_DATA + (h * BLOCK + off) * (D // 2),
                         page + V_SCALE + (h * BLOCK + off) * C, tl.load(v_scale_ptr + h), D)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    rot: Optional[RotCenter] = None,
    positions: Optional[torch.Tensor] = None,
    key0_plain: Optional[torch.Tensor] = None,
    center: Optional[torch.Tensor] = None,
    center0: Optional[torch.Tensor] = None,
    first: Optional[torch.Tensor] = None,
) -> None:
    """Launch the write kernel (inputs checked by :func:`vllm_nvfp4.ops.write_kv_cache`).

    ``key``/``value [T, H, D]``, ``cache uint8 [N, page_bytes]``, ``slot_mapping [T]``,
    ``k_scale``/``v_scale`` FP32 ``[H]``; ``layout`` a :class:`~vllm_nvfp4.layout.KVPageLayout`.
    ``center`` (FP32 ``[H, D]``): keys are stored minus it, rounded back to the key's dtype;
    ``center0`` (FP32 ``[H, D]``, with ``center`` and ``first``, bool ``[T]``): the center of the
    tokens where ``first`` is set instead. ``rot`` (with ``positions`` int32 ``[T]``, each token's
    index in its sequence): keys are then stored minus ``R(p) b_k``, except at position 0 of the
    heads where ``key0_plain`` (int32 ``[H]``, or None) is nonzero.
    """
    num_tokens, h, d = key.shape
    unused = k_scale  # pointer never read without its constexpr flag
    _write_kv_kernel[(num_tokens, h)](
        key, value, cache, slot_mapping, k_scale, v_scale,
        unused if center is None else center, unused if center0 is None else center0,
        unused if center0 is None else first,
        unused if rot is None else positions, *((unused,) * 3 if rot is None else
                                                (rot.idx, rot.b, rot.theta)),
        unused if key0_plain is None else key0_plain,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), cache.stride(0),
        K_FMT=format_code(layout.k_format), V_FMT=format_code(layout.v_format),
        K_DATA=layout.k_data_offset, K_SCALE=layout.k_scale_offset,
        V_DATA=layout.v_data_offset, V_SCALE=layout.v_scale_offset,
        H=h, D=d, BLOCK=layout.block_size, CENTER=center is not None,
        CENTER0=center is not None and center0 is not None,
        USE_ROT=rot is not None, ROT_PAIRS=1 if rot is None else rot.pairs,
        USE_PLAIN0=rot is not None and key0_plain is not None,
        F32=key.device.type != "cuda",  # the interpreter: tl.cos / tl.sin, bit-equal to torch
        num_warps=1,
    )

"""Triton kernel: dequantize whole sequences of one layer's paged cache into dense K/V.

Long prefills are compute-bound: re-decoding every NVFP4 key tile for each 16-row query block
(what the fused prefill kernel does) costs more than the attention itself at 8k-32k context. The
integration therefore decodes each prefill sequence's context ONCE per layer into dense
``[total_tokens, num_kv_heads, head_dim]`` tensors and hands them to a tensor-core attention
kernel (FlashAttention in vLLM). This kernel is that decode: one program per (sequence, tile of
``TILE_T`` positions, KV head), reading through the block table.

Values equal :func:`vllm_nvfp4.paged_torch.dequantize_tokens` in FP32 bit for bit (same products
in the same order: E4M3 scale times the per-head scale first, then the E2M1 value), then cast to
the output dtype. With a rotating center (``rot``, policy ``k_rot``) each key gets ``R(p) b_k``
added in FP32 before the cast (after the key0 shift), the angles exactly reduced
(:func:`~vllm_nvfp4.kernels.attention._rot_offset`); that sum is then close to, not bit-equal
with, the torch path's float64 offset.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from vllm_nvfp4.kernels.attention import _rot_offset
from vllm_nvfp4.kernels.constants import E2M1_F16_UNSCALE, FMT_FP8, format_code
from vllm_nvfp4.kernels.e2m1_bytes import e2m1_f16_scaled_f32, unpack_e2m1_pair
from vllm_nvfp4.kernels.launch import RotCenter


@triton.jit
def _dequant_plane(page, off, valid, h, scale, out_rows, pos, shift_row, rot_idx_ptr, rot_b_ptr,
                   rot_theta_ptr, FMT: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr,
                   D: tl.constexpr, BLOCK: tl.constexpr, SHIFT0: tl.constexpr,
                   ROT: tl.constexpr, ROT_PAIRS: tl.constexpr):
    """Write K or V of head ``h`` for ``TILE_T`` tokens (``page [T]`` uint8 page pointers, ``off
    [T]`` offsets in block, ``valid [T]``) to ``out_rows [T]`` pointers (row start of head ``h``).
    ``SHIFT0``: the token at position 0 (``pos [T]``) gets ``shift_row`` (pointer to the head's
    FP32 ``[D]`` key0 shift) subtracted after decoding, before the cast; ``ROT``: then every
    token gets ``R(pos) b_k`` added (:func:`_rot_offset`)."""
    if FMT == FMT_FP8:
        d = tl.arange(0, D)
        raw = tl.load(page[:, None] + DATA + (h * BLOCK + off[:, None]) * D + d[None, :],
                      mask=valid[:, None], other=0)
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        if SHIFT0:
            x = tl.where((pos == 0)[:, None], x - tl.load(shift_row + d)[None, :], x)
        if ROT:
            x += _rot_offset(d, pos, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, h, D, ROT_PAIRS)
        tl.store(out_rows[:, None] + d[None, :], x.to(out_rows.dtype.element_ty),
                 mask=valid[:, None])
    else:
        # k enumerates the even-position elements e = 64 u + 32 b + i (u = k // 32, b = k // 16 % 2,
        # i = k % 16) in order; byte 32 u + 2 i + b holds e (even position) and e + 16 (odd)
        k = tl.arange(0, D // 2)
        e = 2 * k - k % 16
        byte = (k // 32) * 32 + 2 * (k % 16) + (k // 16) % 2
        raw = tl.load(page[:, None] + DATA + (h * BLOCK + off[:, None]) * (D // 2) + byte[None, :],
                      mask=valid[:, None], other=0).to(tl.int32)
        sptr = page[:, None] + SCALE + (h * BLOCK + off[:, None]) * (D // 16) + e[None, :] // 16
        s_lo = tl.load(sptr, mask=valid[:, None], other=0)
        s_hi = tl.load(sptr + 1, mask=valid[:, None], other=0)  # chunk e // 16 + 1
        a, b = unpack_e2m1_pair(raw)
        lo = (e2m1_f16_scaled_f32(a) * E2M1_F16_UNSCALE) * (
            s_lo.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale)
        hi = (e2m1_f16_scaled_f32(b) * E2M1_F16_UNSCALE) * (
            s_hi.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale)
        if SHIFT0:
            first = (pos == 0)[:, None]
            lo = tl.where(first, lo - tl.load(shift_row + e)[None, :], lo)
            hi = tl.where(first, hi - tl.load(shift_row + 16 + e)[None, :], hi)
        if ROT:
            lo += _rot_offset(e, pos, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, h, D, ROT_PAIRS)
            hi += _rot_offset(16 + e, pos, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, h, D, ROT_PAIRS)
        ty = out_rows.dtype.element_ty
        tl.store(out_rows[:, None] + e[None, :], lo.to(ty), mask=valid[:, None])
        tl.store(out_rows[:, None] + 16 + e[None, :], hi.to(ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["first_seq"])
def _dequant_kv_kernel(
    cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr, cu_ptr, starts_ptr,
    key0_shift_ptr, rot_idx_ptr, rot_b_ptr, rot_theta_ptr, k_out, v_out,
    first_seq, stride_blk, stride_bt, stride_kt, stride_kh, stride_vt, stride_vh,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,
    K_DATA: tl.constexpr, K_SCALE: tl.constexpr, V_DATA: tl.constexpr, V_SCALE: tl.constexpr,
    D: tl.constexpr, BLOCK: tl.constexpr, TILE_T: tl.constexpr, HAS_STARTS: tl.constexpr,
    USE_KEY0: tl.constexpr, USE_ROT: tl.constexpr, ROT_PAIRS: tl.constexpr,
):
    i = tl.program_id(0)  # i-th sequence of the launch = sequence first_seq + i of the batch
    seq = first_seq + i
    start = 0
    if HAS_STARTS:
        start = tl.load(starts_ptr + i)
    pos = start + tl.program_id(1) * TILE_T + tl.arange(0, TILE_T)
    h = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if start + tl.program_id(1) * TILE_T >= seq_len:
        return
    valid = pos < seq_len
    blk = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + pos // BLOCK, mask=valid,
                  other=0)
    page = cache_ptr + blk.to(tl.int64) * stride_blk
    off = pos % BLOCK
    row = (tl.load(cu_ptr + i) + pos - start).to(tl.int64)
    k_rows = k_out + row * stride_kt + h * stride_kh
    k_scale = tl.load(k_scale_ptr + h)
    shift_row = key0_shift_ptr + h * D
    rot = (rot_idx_ptr, rot_b_ptr, rot_theta_ptr)
    if USE_KEY0 and start + tl.program_id(1) * TILE_T == 0:  # position 0: the first tile only
        _dequant_plane(page, off, valid, h, k_scale, k_rows, pos, shift_row, *rot, K_FMT, K_DATA,
                       K_SCALE, D, BLOCK, True, USE_ROT, ROT_PAIRS)
    else:
        _dequant_plane(page, off, valid, h, k_scale, k_rows, pos, shift_row, *rot, K_FMT, K_DATA,
                       K_SCALE, D, BLOCK, False, USE_ROT, ROT_PAIRS)
    _dequant_plane(page, off, valid, h, tl.load(v_scale_ptr + h), v_out + row * stride_vt
                   + h * stride_vh, pos, shift_row, *rot, V_FMT, V_DATA, V_SCALE, D, BLOCK, False,
                   False, ROT_PAIRS)


def dequantize_kv(cache: torch.Tensor, layout, k_scale: torch.Tensor, v_scale: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seq_len: int, k_out: torch.Tensor, v_out: torch.Tensor,
                  first_seq: int = 0, seq_starts: Optional[torch.Tensor] = None,
                  tile_t: int = 32, key0_shift: Optional[torch.Tensor] = None,
                  rot: Optional[RotCenter] = None) -> None:
    """Dequantize positions ``[a_i, seq_lens[s])`` of sequences ``s = first_seq + i`` into rows
    ``cu_seqlens[i] + pos - a_i`` of ``k_out``/``v_out [rows, H, D]`` (``a_i = seq_starts[i]``,
    or 0 without); ``key0_shift`` (FP32 ``[H, D]``) is subtracted from position 0's key, then
    ``R(p) b_k`` of ``rot`` (if given) added to every key; arguments
    checked by :func:`vllm_nvfp4.ops.dequantize_kv`. ``max_seq_len``:
    host upper bound of the positions per sequence (launch grid).
    The batch tensors are passed whole with ``first_seq`` (not specialized on), rather than
    sliced, so pointer alignment never triggers a new compilation while serving."""
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs == 0 or max_seq_len <= 0:
        return
    grid = (num_seqs, triton.cdiv(max_seq_len, tile_t), layout.num_kv_heads)
    _dequant_kv_kernel[grid](
        cache, k_scale, v_scale, block_table, seq_lens, cu_seqlens,
        cu_seqlens if seq_starts is None else seq_starts,  # not read without starts
        k_scale if key0_shift is None else key0_shift,  # not read without (USE_KEY0)
        *((k_scale,) * 3 if rot is None else (rot.idx, rot.b, rot.theta)),  # nor these (USE_ROT)
        k_out, v_out, first_seq,
        cache.stride(0), block_table.stride(0), k_out.stride(0), k_out.stride(1),
        v_out.stride(0), v_out.stride(1),
        K_FMT=format_code(layout.k_format), V_FMT=format_code(layout.v_format),
        K_DATA=layout.k_data_offset, K_SCALE=layout.k_scale_offset,
        V_DATA=layout.v_data_offset, V_SCALE=layout.v_scale_offset,
        D=layout.head_dim, BLOCK=layout.block_size, TILE_T=tile_t,
        HAS_STARTS=seq_starts is not None, USE_KEY0=key0_shift is not None,
        USE_ROT=rot is not None, ROT_PAIRS=1 if rot is None else rot.pairs, num_warps=4,
    )

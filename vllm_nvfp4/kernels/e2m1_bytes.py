"""Triton twins of :func:`vllm_nvfp4.layout.pack_e2m1_pair` / :func:`~vllm_nvfp4.layout.unpack_e2m1_pair`:
the data-plane byte of two E2M1 codes and back, and a code as the fp16 it is placed into."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pack_e2m1_pair(a, b):
    """Byte (uint8) of codes ``a`` (even nibble position) and ``b`` (odd): ``a``'s magnitude at
    bits 1-3 and sign at bit 7, ``b``'s magnitude at bits 4-6 and sign at bit 0."""
    return (((a & 7) << 1) | ((a & 8) << 4) | ((b & 7) << 4) | (b >> 3)).to(tl.uint8)


@triton.jit
def unpack_e2m1_pair(byte):
    """Integer bytes (any int type, values 0..255) -> their codes ``(a, b)``, same type."""
    return ((byte >> 1) & 7) | ((byte >> 4) & 8), ((byte >> 4) & 7) | ((byte & 1) << 3)


@triton.jit
def e2m1_f16_scaled_f32(code):
    """E2M1 codes (int32/uint32 0..15) -> FP32 ``e2m1 * 2^-14``: the bit placement of the decode,
    ``sign << 15 | magnitude << 9`` read as fp16 (subnormal code 1 included)."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

"""Constants shared by the Triton kernels (``tl.constexpr``, so ``@triton.jit`` code may read them)."""

from __future__ import annotations

import triton.language as tl

from vllm_nvfp4.formats import KVFormat

#: kernel constexpr of each KV format (``K_FMT`` / ``V_FMT`` / ``FMT`` arguments)
FMT_FP8 = tl.constexpr(0)
FMT_NVFP4 = tl.constexpr(1)

#: 2^14: an E2M1 nibble placed into fp16 bits (``sign << 15 | code << 9``) reads as
#: ``e2m1 * 2^-14``; this factor restores the element value
E2M1_F16_UNSCALE = tl.constexpr(16384.0)

#: log2(e): the softmax runs in base 2 (``exp2``), so logits are scaled by it
LOG2E = tl.constexpr(1.4426950408889634)


def format_code(fmt: str) -> int:
    """Kernel constexpr of a KV format name (``ValueError`` for an unknown name)."""
    return int(FMT_FP8.value) if KVFormat.parse(fmt) is KVFormat.FP8 else int(FMT_NVFP4.value)

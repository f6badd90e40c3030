"""Bit-exact definitions of the two KV-cache formats: NVFP4 and FP8 (E4M3).

This torch code is the *definition*: every kernel that writes a cache must produce the same bytes,
on CPU and CUDA alike. All arithmetic below is IEEE float32 with round-to-nearest-even.

NVFP4 (per head vector of ``D`` elements, ``D % 16 == 0``)
-----------------------------------------------------------
* Values are FP4 E2M1: a sign bit and a 3-bit magnitude code ``c`` whose value is
  ``E2M1_VALUES[c]`` = {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Nibble = ``sign << 3 | c``.
* Packing: byte ``i`` holds element ``2i`` in its LOW nibble and element ``2i+1`` in its HIGH
  nibble (the convention of vLLM, FlashInfer and ModelOpt). ``packed`` is uint8 ``[..., D/2]``.
* Global scale ``g``: FP32, positive and finite, per layer and per K/V (optionally per head).
  Calibrated convention: ``g = amax / (6 * 448)`` (see :func:`nvfp4_global_scale`), so that the
  largest block of the calibration data gets the largest E4M3 block scale, 448.
* Block scale: one E4M3 (float8_e4m3fn) per 16 consecutive elements of a head vector, chosen
  by the write among five candidates (:data:`NVFP4_SCALE_CANDIDATES`), in this order:
  ``s6 = e4m3(min(amax16 / (g * 6), 448))`` (the block's largest element maps to 6, the plain
  NVFP4 scale), the E4M3 values one step below and one step above ``s6`` (byte - 1 and byte + 1,
  kept within 0 .. 448), ``e4m3(min(amax16 / (g * 5), 448))`` and
  ``e4m3(min(amax16 / (g * 4), 448))``. The block gets the candidate of the lowest squared
  error; on equal errors the earlier one. ``amax16`` is the block's max ``|x|`` in FP32,
  ``g * m`` and the divisions are FP32 and the E4M3 cast rounds to nearest even (subnormal E4M3
  scales, down to 2^-9, are used as they come; a quotient below 2^-10 becomes scale 0). The
  squared error of candidate ``s`` (:func:`nvfp4_block_error`), in units of ``g``:
  ``d = E2M1_VALUES[c] * float(s) - x / g`` in FP32 (the product is exact, the division and the
  difference round once), ``d * d`` in FP64 (exact), summed over the 16 elements as a pairwise
  tree of neighbours ``((d0 + d1) + (d2 + d3)) + ...`` in FP64. The decoding does not depend on
  how ``s`` was chosen; the choice lowers the error: on SmolLM2-135M's K/V it cuts the squared
  error of the plain ``s6`` by 23% and the damage of all-NVFP4 K/V by about a third
  (``results/2026-12-02-block-scale-choice-cpu``).
* Element code: with ``se = float(s) * g`` (FP32), ``q = x / se`` (FP32 division) rounded to the
  nearest E2M1 magnitude with ties to the even code, saturating at 6. In thresholds:
  ``c = (m > .25) + (m >= .75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5) + (m > 5)``
  for ``m = |q|``. The sign bit is set iff ``q < 0`` (so tiny negatives become ``-0``). Each
  candidate's codes are computed this way from its own ``s``.
* Zero scale: a block whose scale is 0 (all zeros, or underflow) stores codes 0 and scale 0 and
  decodes to +-0.
* Dequantization: ``x = E2M1_VALUES[c] * (float(s) * g)`` in FP32 with the sign applied.
* Bytes per head: ``D/2 + D/16`` (= 1.125 D / 2 ... i.e. 0.5625 bytes per element).
* Scale-folded decoding (:func:`nvfp4_dequantize_folded`, the input of an FP8 tensor-core route,
  not what the kernels do today): each element becomes ONE E4M3 value,
  ``f = e4m3(E2M1_VALUES[c] * float(s) * 2^-NVFP4_FOLD_EXPONENT)``, and decodes to
  ``f * (2^NVFP4_FOLD_EXPONENT * g)``. ``e2m1 * s`` reaches 6 * 448 = 2688, so the power of two
  keeps it below 448 (no saturation); the E4M3 rounding (RNE, 3 mantissa bits, subnormals from
  2^-9) is the only difference from the exact decoding.

FP8 (E4M3, vLLM's convention)
-----------------------------
``q = e4m3(clamp(x / scale, -448, 448))`` with FP32 division and RNE; ``x = float(q) * scale``.
``scale = amax / 448`` when calibrated (``layer._k_scale`` in vLLM). Bytes per head: ``D``.

Non-finite input
----------------
The reference functions raise ``ValueError`` on NaN/Inf in ``x`` (``nonfinite="raise"``, the
default). The kernels cannot raise, so they implement ``nonfinite="propagate"``, which this
module also offers so tests can check them bit for bit:

* NVFP4: a 16-element block holding any NaN or Inf gets block scale NaN (byte 0x7F) and codes 0,
  so exactly that block decodes to NaN. Other blocks, heads and tokens are unaffected (the global
  scale is static, never derived from the data being written).
* FP8: per element. NaN stays NaN (0x7F / 0xFF); +-Inf saturates to +-448 like any large value.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal, Union

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK_SIZE = 16
NVFP4_SCALE_NAN_BYTE = 0x7F
#: the block-scale candidates in order of preference (module doc): an E2M1 value the block's
#: largest element maps to (``e4m3(amax16 / (g * m))``), or a step in E4M3 bytes from the first
NVFP4_SCALE_CANDIDATES = (("max", 6.0), ("step", -1), ("step", 1), ("max", 5.0), ("max", 4.0))
#: ``e2m1 * block_scale`` is stored folded as E4M3 times ``2^NVFP4_FOLD_EXPONENT``: 6 * 448 / 8 < 448
NVFP4_FOLD_EXPONENT = 3



class KVFormat(str, Enum):
    """A KV-cache element format. The value is its spelling in policies and logs.

    A ``str`` subclass: ``KVFormat.FP8 == "fp8"``, and it serializes to JSON as its value.
    """

    FP8 = "fp8"
    NVFP4 = "nvfp4"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, fmt: str) -> "KVFormat":
        """The format named ``fmt``; ``ValueError`` listing the valid names otherwise."""
        try:
            return cls(fmt)
        except ValueError:
            raise ValueError(
                f"unknown KV format {fmt!r}; expected one of {', '.join(KV_FORMATS)}"
            ) from None

    @property
    def has_block_scales(self) -> bool:
        """True for NVFP4, whose head vectors carry one E4M3 scale per 16 elements."""
        return self is KVFormat.NVFP4

    @property
    def bytes_per_element(self) -> float:
        """Cache bytes per K/V element, block scales included: 1.0 (FP8) or 0.5625 (NVFP4)."""
        return 1.0 if self is KVFormat.FP8 else 0.5 + 1.0 / NVFP4_BLOCK_SIZE

    @property
    def default_scale(self) -> float:
        """Scale used without calibration: FP8 scale 1.0 (vLLM's default) or NVFP4 global 1/6.

        Both represent |x| <= 448: 448 * 1.0 for FP8, 6 * 448 * (1/6) for NVFP4.
        """
        return 1.0 if self is KVFormat.FP8 else 1.0 / E2M1_MAX

    def data_width(self, head_dim: int) -> int:
        """Bytes of one head vector's element data (scales excluded): D or D/2."""
        return head_dim if self is KVFormat.FP8 else head_dim // 2

    def bytes_per_head(self, head_dim: int) -> int:
        """Cache bytes for one head vector (K or V) of ``head_dim`` elements, scales included."""
        if head_dim <= 0 or head_dim % NVFP4_BLOCK_SIZE != 0:
            raise ValueError(f"head_dim must be a positive multiple of 16, got {head_dim}")
        scales = head_dim // NVFP4_BLOCK_SIZE if self.has_block_scales else 0
        return self.data_width(head_dim) + scales


KV_FORMATS: tuple[str, ...] = tuple(f.value for f in KVFormat)
NonFinite = Literal["raise", "propagate"]
ScaleLike = Union[float, torch.Tensor]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_float_input(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")


def _check_nonfinite(x: torch.Tensor, nonfinite: NonFinite) -> None:
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    if nonfinite == "raise" and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"input holds {bad} NaN/Inf value(s); KV quantization needs finite K/V "
            "(check the model's activations, or pass nonfinite='propagate')"
        )


def _as_scale_tensor(scale: ScaleLike, x: torch.Tensor, name: str) -> torch.Tensor:
    """Return ``scale`` as FP32 on ``x.device``, validated finite and positive."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"{name} must be finite and > 0, got {scale!r}")
    return s


def nvfp4_global_scale(amax: ScaleLike) -> torch.Tensor:
    """Calibrated NVFP4 global scale ``amax / (6 * 448)`` (FP32). ``amax`` must be > 0."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    if not bool(torch.isfinite(a).all()) or not bool((a > 0).all()):
        raise ValueError(f"amax must be finite and > 0 to derive a global scale, got {amax!r}")
    return a / (E2M1_MAX * E4M3_MAX)


def fp8_scale_from_amax(amax: ScaleLike) -> torch.Tensor:
    """vLLM's FP8 KV scale ``amax / 448`` (FP32). ``amax`` must be > 0."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    if not bool(torch.isfinite(a).all()) or not bool((a > 0).all()):
        raise ValueError(f"amax must be finite and > 0 to derive an FP8 scale, got {amax!r}")
    return a / E4M3_MAX


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """FP32 ``x`` rounded to E4M3 (RNE, saturating at +-448, NaN kept): ``float8_e4m3fn``."""
    return torch.clamp(x.float(), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_code(q: torch.Tensor) -> torch.Tensor:
    """Round FP32 ``q`` to E2M1 nibbles (RNE, ties to even code, saturate at 6). Returns uint8."""
    m = q.abs()
    code = (
        (m > 0.25).to(torch.uint8)
        + (m >= 0.75).to(torch.uint8)
        + (m > 1.25).to(torch.uint8)
        + (m >= 1.75).to(torch.uint8)
        + (m > 2.5).to(torch.uint8)
        + (m >= 3.5).to(torch.uint8)
        + (m > 5.0).to(torch.uint8)
    )
    sign = (q < 0).to(torch.uint8) << 3
    return code | sign


def e2m1_value(nibble: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 nibbles (uint8, low 4 bits used) to FP32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=nibble.device)
    mag = table[(nibble & 0x7).long()]
    return torch.where((nibble & 0x8) != 0, -mag, mag)


def nvfp4_quantize(
    x: torch.Tensor, global_scale: ScaleLike, nonfinite: NonFinite = "raise"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` to NVFP4.

    Args:
        x: float32/float16/bfloat16 ``[..., D]`` with ``D % 16 == 0``.
        global_scale: python float or FP32 tensor broadcastable to ``x.shape[:-1]``; > 0.
        nonfinite: ``"raise"`` (default) or ``"propagate"`` (the kernels' behaviour, see module doc).
    Returns:
        ``(packed uint8 [..., D/2], block_scales float8_e4m3fn [..., D/16])``.
    """
    _check_float_input(x)
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK_SIZE != 0 or x.shape[-1] == 0:
        raise ValueError(
            f"NVFP4 needs the last dim to be a positive multiple of {NVFP4_BLOCK_SIZE}, "
            f"got shape {tuple(x.shape)}"
        )
    _check_nonfinite(x, nonfinite)
    g = _as_scale_tensor(global_scale, x, "global_scale")
    try:
        g = torch.broadcast_to(g, x.shape[:-1]).unsqueeze(-1)  # [..., 1]
    except RuntimeError as e:
        raise ValueError(
            f"global_scale of shape {tuple(g.shape)} does not broadcast to {tuple(x.shape[:-1])}"
        ) from e

    d = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], d // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    bad = ~torch.isfinite(xb).all(dim=-1)  # [..., D/16]
    xb = torch.where(bad.unsqueeze(-1), 0.0, xb)
    amax = xb.abs().amax(dim=-1)
    xg = xb / g.unsqueeze(-1)
    s6_byte = e4m3_round(amax / (g * E2M1_MAX)).view(torch.uint8).to(torch.int16)
    best_err = scales = codes = None
    for kind, arg in NVFP4_SCALE_CANDIDATES:
        if kind == "max":
            s = e4m3_round(amax / (g * arg)).float()  # e4m3_round clamps at 448
        else:  # positive E4M3 bytes are ordered like their values; 0x7E is 448
            s = torch.clamp(s6_byte + arg, 0, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn).float()
        c = _e2m1_block_codes(xb, s, g)
        err = nvfp4_block_error(xg, c, s)
        if best_err is None:
            best_err, scales, codes = err, s, c
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        scales = torch.where(better, s, scales)
        codes = torch.where(better.unsqueeze(-1), c, codes)
    codes = torch.where(bad.unsqueeze(-1), 0, codes.to(torch.int32)).to(torch.uint8)
    scales = torch.where(bad, torch.full_like(scales, float("nan")), scales).to(torch.float8_e4m3fn)
    codes = codes.reshape(*x.shape[:-1], d // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, scales


def _e2m1_block_codes(xb: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 ``[..., D/16, 16]`` of finite blocks ``xb`` with block scales ``s``
    (FP32 values of E4M3 numbers, ``[..., D/16]``) and global scale ``g [..., 1]``; all zero
    where ``s * g`` is 0."""
    se = (s * g).unsqueeze(-1)  # [..., D/16, 1]
    zero = se == 0
    q = xb / torch.where(zero, 1.0, se)
    return torch.where(zero, 0, e2m1_code(q).to(torch.int32)).to(torch.uint8)


def nvfp4_block_error(xg: torch.Tensor, codes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Squared error (FP64 ``[..., D/16]``) of NVFP4 blocks in units of the global scale, the
    quantity the block-scale choice compares (module doc).

    ``xg``: the input divided by ``g``, FP32 ``[..., D/16, 16]``; ``codes``: E2M1 nibbles
    ``[..., D/16, 16]``; ``s``: the block scales as FP32 ``[..., D/16]``. ``e2m1 * s`` is exact
    in FP32 (2 and 4 significant bits) and the difference rounds once, so a fused multiply-add
    gives the same ``d``; ``d * d`` is exact in FP64; the sum is a fixed pairwise tree.
    """
    e = (e2m1_value(codes) * s.unsqueeze(-1) - xg).double() ** 2
    while e.shape[-1] > 1:
        e = e[..., 0::2] + e[..., 1::2]
    return e.squeeze(-1)


def _nvfp4_blocks(
    packed: torch.Tensor, block_scales: torch.Tensor, global_scale: ScaleLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked NVFP4 operands as ``(e2m1 values FP32 [..., D/16, 16], block scales FP32
    [..., D/16, 1], global scale FP32 broadcast to [..., 1, 1])``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if block_scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"block_scales must be float8_e4m3fn, got {block_scales.dtype}")
    d = packed.shape[-1] * 2
    if d % NVFP4_BLOCK_SIZE != 0 or block_scales.shape[-1] * NVFP4_BLOCK_SIZE != d:
        raise ValueError(
            f"shapes do not match: packed [..., {packed.shape[-1]}] means D={d}, which needs "
            f"block_scales [..., {d // NVFP4_BLOCK_SIZE}], got {tuple(block_scales.shape)}"
        )
    if packed.shape[:-1] != block_scales.shape[:-1]:
        raise ValueError(
            f"leading dims differ: packed {tuple(packed.shape)} vs scales {tuple(block_scales.shape)}"
        )
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    g = torch.broadcast_to(g, packed.shape[:-1]).unsqueeze(-1).unsqueeze(-1)
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], d)
    vals = e2m1_value(nibbles).reshape(*packed.shape[:-1], d // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    return vals, block_scales.float().unsqueeze(-1), g


def nvfp4_dequantize(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: ScaleLike,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode NVFP4 ``packed uint8 [..., D/2]`` + ``block_scales e4m3 [..., D/16]`` to ``[..., D]``."""
    vals, s, g = _nvfp4_blocks(packed, block_scales, global_scale)
    return (vals * (s * g)).reshape(*packed.shape[:-1], -1).to(dtype)


def nvfp4_dequantize_folded(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: ScaleLike,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Scale-folded NVFP4 decoding (module doc): ``e4m3(e2m1 * s * 2^-3) * (8 * g)``.

    Same arguments and shapes as :func:`nvfp4_dequantize`; differs from it only where
    ``e2m1 * s`` needs more than E4M3's 3 mantissa bits or falls below its subnormal step 2^-9
    (after the 2^-3).
    """
    vals, s, g = _nvfp4_blocks(packed, block_scales, global_scale)
    fold = 2.0 ** NVFP4_FOLD_EXPONENT
    folded = e4m3_round(vals * s / fold).float()
    return (folded * (fold * g)).reshape(*packed.shape[:-1], -1).to(dtype)


def fp8_quantize(x: torch.Tensor, scale: ScaleLike, nonfinite: NonFinite = "raise") -> torch.Tensor:
    """vLLM FP8 KV quantization: ``e4m3(clamp(x / scale, +-448))``; ``scale`` > 0, broadcastable."""
    _check_float_input(x)
    _check_nonfinite(x, nonfinite)
    s = _as_scale_tensor(scale, x, "scale")
    return e4m3_round(x.float() / s)


def fp8_dequantize(
    q: torch.Tensor, scale: ScaleLike, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode FP8 E4M3 ``q`` to ``dtype``: ``float(q) * scale`` in FP32."""
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"q must be float8_e4m3fn, got {q.dtype}")
    s = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q.float() * s).to(dtype)


def check_kv_format(fmt: str) -> KVFormat:
    """The :class:`KVFormat` named ``fmt``; ``ValueError`` listing the valid ones otherwise."""
    return KVFormat.parse(fmt)


def bytes_per_head(fmt: str, head_dim: int) -> int:
    """Cache bytes for one head vector (K or V) of ``head_dim`` elements, scales included."""
    return KVFormat.parse(fmt).bytes_per_head(head_dim)


def pack_nvfp4_head(packed: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """Join data and scales into vLLM's ``nvfp4`` row layout: uint8 ``[..., D/2 | D/16]``."""
    if packed.shape[-1] != block_scales.shape[-1] * (NVFP4_BLOCK_SIZE // 2):
        raise ValueError(
            f"packed [..., {packed.shape[-1]}] and scales [..., {block_scales.shape[-1]}] "
            "do not describe the same head_dim"
        )
    return torch.cat([packed, block_scales.view(torch.uint8)], dim=-1)


def unpack_nvfp4_head(row: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a vLLM ``nvfp4`` row ``uint8 [..., D/2 + D/16]`` into ``(packed, block_scales)``."""
    width = KVFormat.NVFP4.bytes_per_head(head_dim)
    if row.dtype != torch.uint8 or row.shape[-1] != width:
        raise ValueError(
            f"expected uint8 rows of {width} bytes for head_dim {head_dim}, "
            f"got {row.dtype} [..., {row.shape[-1]}]"
        )
    packed = row[..., : head_dim // 2]
    scales = row[..., head_dim // 2 :].contiguous().view(torch.float8_e4m3fn)
    return packed, scales

"""One policy row: the formats and (optional) calibrated scales of a decoder layer's K and V.

Each scale is optional, a positive finite number or a per-KV-head tuple of them; a layer without
one uses :data:`DEFAULT_FP8_SCALE` (1.0, vLLM's own default) or
:data:`DEFAULT_NVFP4_GLOBAL_SCALE` (1/6: the same representable range, |x| <= 448, as FP8 at
scale 1.0), with a warning from the integration.

Optional ``k_smooth``: per KV head, ``head_dim`` positive factors ``lam`` (K smoothing, as in
SmoothAttention): the cache stores ``K / lam`` (the K scale calibrated on ``K / lam``) and every
query is multiplied by ``lam`` of its KV head, so ``q . k`` is unchanged before quantization while
outlier channels no longer set the 16-value NVFP4 block scales of their neighbours.

Optional ``k_center``: per KV head, ``head_dim`` finite offsets ``mu`` (the calibration mean of
each post-RoPE K channel): the cache stores ``K - mu`` (then ``/ lam`` if smoothed; scales
calibrated on that), which moves every logit of a query by the same ``q . mu``, so softmax and the
attention output are unchanged before quantization, while a channel's constant part (Qwen2's K
bias) no longer spends the format's resolution. Not valid with a logits soft-cap, nor with learned
attention sinks (a logit without a key, which the shift misses).

Optional ``k_perm``: per KV head, a permutation of ``range(head_dim)``: the cache stores channel
``k_perm[h][j]`` of K at position ``j`` and every query of head ``h`` is permuted alike, so
``q . k`` is exact. Calibration orders the channels by their RMS, so each 16-value NVFP4 block
holds channels of similar magnitude and one block scale fits all of them. The permutation comes
first: ``k_center`` and ``k_smooth`` are given in the permuted channel order.

Optional ``k_sink_uncentered`` (with ``k_center``): ``true``, or one flag per KV head: the key at
position 0 of every sequence (the attention sink) is stored without ``mu`` (``K[perm] / lam``),
where calibration found it to fit the layer's K range; centering makes that key one of the
largest, so it loses the most precision centered. The readers subtract ``mu / lam`` from it after
decoding, which gives it the logit ``q . (k - mu)`` of every other key: no extra bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from vllm_nvfp4.formats import KVFormat, check_kv_format
from vllm_nvfp4.policy.errors import PolicyError
from vllm_nvfp4.policy.layer_types import FULL_ATTENTION, LayerType

DEFAULT_FP8_SCALE = KVFormat.FP8.default_scale
DEFAULT_NVFP4_GLOBAL_SCALE = KVFormat.NVFP4.default_scale
SCALE_FIELDS = ("k_scale", "v_scale", "k_global_scale", "v_global_scale")
#: per KV head and channel: K smoothing factors, K centering offsets, K channel permutation
CHANNEL_FIELDS = ("k_smooth", "k_center", "k_perm")
#: per KV head flags (a bool for all heads, or one per head): the sink key stored uncentered
HEAD_FLAG_FIELDS = ("k_sink_uncentered",)

Scale = Union[float, tuple[float, ...]]
Smooth = tuple[tuple[float, ...], ...]  # [kv_heads][head_dim]
Permutation = tuple[tuple[int, ...], ...]  # [kv_heads][head_dim]
HeadFlags = Union[bool, tuple[bool, ...]]  # all KV heads, or [kv_heads]


def _check_scale(value: Any, where: str) -> Optional[Scale]:
    if value is None:
        return None
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise PolicyError(f"{where}: empty per-head scale list")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise PolicyError(f"{where}: scale must be a number, got {v!r}")
        if not math.isfinite(v) or v <= 0:
            raise PolicyError(f"{where}: scale must be finite and > 0, got {v!r}")
        out.append(float(v))
    return tuple(out) if isinstance(value, (list, tuple)) else out[0]


def _check_channels(value: Any, name: str, positive: bool) -> Optional[Smooth]:
    """Per KV head, one number per channel (``k_smooth``: factors > 0; ``k_center``: any finite
    offsets), as tuples."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(h, (list, tuple)) and h for h in value):
        raise PolicyError(f"{name}: {name} must be a non-empty list (one per KV head) of "
                          f"non-empty lists (one value per channel)")
    if len({len(h) for h in value}) != 1:
        raise PolicyError(f"{name}: {name} lists differ in length {sorted({len(h) for h in value})}")
    heads = []
    for h in value:
        for v in h:
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or (positive and v <= 0)):
                raise PolicyError(f"{name}: {name} values must be finite numbers"
                                  f"{' > 0' if positive else ''}, got {v!r}")
        heads.append(tuple(float(v) for v in h))
    return tuple(heads)


def _check_permutation(value: Any) -> Optional[Permutation]:
    """Per KV head, a permutation of ``range(head_dim)`` (``k_perm``), as tuples."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(h, (list, tuple)) and h for h in value):
        raise PolicyError("k_perm: k_perm must be a non-empty list (one per KV head) of "
                          "non-empty lists (one channel index per channel)")
    heads = []
    for i, h in enumerate(value):
        if any(isinstance(c, bool) or not isinstance(c, int) for c in h) \
                or sorted(h) != list(range(len(value[0]))):
            raise PolicyError(f"k_perm: head {i} is not a permutation of 0..{len(value[0]) - 1} "
                              f"(each channel index exactly once)")
        heads.append(tuple(h))
    return tuple(heads)


def _check_head_flags(value: Any, name: str) -> Optional[HeadFlags]:
    """``true``/``false`` or a non-empty list of them (one per KV head); ``false`` and a list of
    ``false`` read as None (the field's absence)."""
    if value is None:
        return None
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, bool) for v in values):
        raise PolicyError(f"{name}: {name} must be true/false or a non-empty list of them "
                          f"(one per KV head), got {value!r}")
    if not any(values):
        return None
    return tuple(values) if isinstance(value, (list, tuple)) else True


@dataclass(frozen=True)
class LayerPolicy:
    """Formats and (optional) calibrated scales of one decoder layer's K and V.

    A row of type ``none`` (no KV cache) has ``k = v = None`` and nothing else."""

    k: Optional[KVFormat]
    v: Optional[KVFormat]
    k_scale: Optional[Scale] = None
    v_scale: Optional[Scale] = None
    k_global_scale: Optional[Scale] = None
    v_global_scale: Optional[Scale] = None
    k_smooth: Optional[Smooth] = None
    k_center: Optional[Smooth] = None
    k_perm: Optional[Permutation] = None
    k_sink_uncentered: Optional[HeadFlags] = None
    layer_type: LayerType = FULL_ATTENTION

    def __post_init__(self) -> None:
        if not isinstance(self.layer_type, LayerType):
            raise PolicyError(f"layer_type must be a LayerType, got {self.layer_type!r}")
        if not self.layer_type.holds_kv:
            extra = [n for n in ("k", "v", *SCALE_FIELDS, *CHANNEL_FIELDS, *HEAD_FLAG_FIELDS)
                     if getattr(self, n) is not None]
            if extra:
                raise PolicyError(f"a layer without KV cache (type none) takes no {', '.join(extra)}")
            return
        for name in ("k", "v"):
            try:
                object.__setattr__(self, name, check_kv_format(getattr(self, name)))
            except ValueError as e:
                raise PolicyError(str(e)) from None
        for name in SCALE_FIELDS:
            object.__setattr__(self, name, _check_scale(getattr(self, name), name))
        object.__setattr__(self, "k_smooth", _check_channels(self.k_smooth, "k_smooth", True))
        object.__setattr__(self, "k_center", _check_channels(self.k_center, "k_center", False))
        object.__setattr__(self, "k_perm", _check_permutation(self.k_perm))
        if self.k_center is not None and self.layer_type.sinks:
            raise PolicyError("k_center on a layer with learned attention sinks: centering shifts "
                              "every key's logit by q . mu but not the sink logit, so the softmax "
                              "changes; drop k_center from this layer")
        sink = _check_head_flags(self.k_sink_uncentered, "k_sink_uncentered")
        object.__setattr__(self, "k_sink_uncentered", sink)
        if sink is not None and self.k_center is None:
            raise PolicyError("k_sink_uncentered: storing the sink key uncentered needs k_center "
                              "(the offsets the readers subtract); drop it or add k_center")
        if isinstance(sink, tuple) and self.k_center is not None and len(sink) != len(self.k_center):
            raise PolicyError(f"k_sink_uncentered: {len(sink)} per-head flags, k_center has "
                              f"{len(self.k_center)} KV heads")

    def sink_heads(self, num_kv_heads: int) -> Optional[tuple[bool, ...]]:
        """Per KV head, whether its sink key is stored uncentered (None: no head's is)."""
        flags = self.k_sink_uncentered
        if flags is None:
            return None
        return (True,) * num_kv_heads if flags is True else flags

    def format_of(self, kv: str) -> KVFormat:
        """Format of ``"k"`` or ``"v"``."""
        return self.k if kv == "k" else self.v

    def quant_scale(self, kv: str) -> Optional[Scale]:
        """The scale the layer's format uses for ``kv``: FP8 scale or NVFP4 global scale."""
        if self.format_of(kv) is KVFormat.FP8:
            return self.k_scale if kv == "k" else self.v_scale
        return self.k_global_scale if kv == "k" else self.v_global_scale

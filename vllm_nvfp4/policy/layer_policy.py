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

Optional ``k_rot`` (with ``k_center``; docs/design/rotating_centering.md): K centered on a
rotating offset on ``k`` RoPE pairs per KV head, pair ``i`` = channels ``(i, i + head_dim / 2)``:
``pairs`` ``[kv_heads][k]`` (indices in ``[0, head_dim / 2)``, none twice in a head), ``b``
``[kv_heads][2][k]`` (the mean pre-RoPE key on those channels, times the RoPE's attention
scaling), ``theta`` ``[kv_heads][k]`` (radians per position, > 0). The cache is to store ``K - mu
- R(p) b`` and readers add ``q . R(p) b``; ``k_center`` must be 0 on the rotated channels (the
constant offset of the other pairs). Not with ``k_smooth`` or ``k_perm``. Not served yet: the
integration refuses it.
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
#: the keys of ``k_rot``
K_ROT_KEYS = ("pairs", "b", "theta")


@dataclass(frozen=True)
class KRot:
    """``k_rot`` of a layer (module doc): per KV head the rotated pairs, ``b`` of both halves and
    the pairs' angles per position; build with :func:`check_k_rot`."""

    pairs: tuple[tuple[int, ...], ...]  # [kv_heads][k]
    b: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]  # [kv_heads][2][k]
    theta: tuple[tuple[float, ...], ...]  # [kv_heads][k]

    @property
    def num_pairs(self) -> int:
        return len(self.pairs[0])


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


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def check_k_rot(value: Any, center: Optional[Smooth]) -> Optional[KRot]:
    """``k_rot`` (a :class:`KRot` or its JSON object) checked against the layer's ``k_center``
    (which it needs: the KV heads, ``head_dim`` and 0 on the rotated channels)."""
    if value is None:
        return None
    if isinstance(value, KRot):
        value = {"pairs": value.pairs, "b": value.b, "theta": value.theta}
    if not isinstance(value, dict) or set(value) != set(K_ROT_KEYS):
        raise PolicyError(f"k_rot: k_rot must be an object with exactly the keys "
                          f"{', '.join(K_ROT_KEYS)}, got {value!r:.80}")
    if center is None:
        raise PolicyError("k_rot: the rotating offset needs k_center (the constant offset of the "
                          "other RoPE pairs, 0 on the rotated ones); drop k_rot or add k_center")
    heads, dim = len(center), len(center[0])
    if dim % 2:
        raise PolicyError(f"k_rot: head_dim {dim} (from k_center) is odd; RoPE pairs need an even one")
    half = dim // 2
    pairs, b, theta = (value[k] for k in K_ROT_KEYS)
    for name, rows in (("pairs", pairs), ("b", b), ("theta", theta)):
        if not isinstance(rows, (list, tuple)) or len(rows) != heads:
            raise PolicyError(f"k_rot: {name} must be a list of {heads} entries (one per KV head, "
                              f"as k_center), got {len(rows) if isinstance(rows, (list, tuple)) else rows!r}")
    k = len(pairs[0]) if isinstance(pairs[0], (list, tuple)) else 0
    if not 1 <= k <= half:
        raise PolicyError(f"k_rot: pairs of KV head 0 must list 1 to {half} pair indices, got {pairs[0]!r:.80}")
    out_pairs, out_b, out_theta = [], [], []
    for h in range(heads):
        p, bh, th = pairs[h], b[h], theta[h]
        if not isinstance(p, (list, tuple)) or len(p) != k:
            raise PolicyError(f"k_rot: pairs of KV head {h} must list {k} indices (as head 0)")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < half for i in p):
            raise PolicyError(f"k_rot: pairs of KV head {h} must be integers in [0, {half}) "
                              f"(pair i = channels i, i + {half}), got {list(p)}")
        if len(set(p)) != k:
            raise PolicyError(f"k_rot: pairs of KV head {h} lists a pair twice: {list(p)}")
        if not (isinstance(bh, (list, tuple)) and len(bh) == 2 and all(
                isinstance(r, (list, tuple)) and len(r) == k for r in bh)):
            raise PolicyError(f"k_rot: b of KV head {h} must be 2 lists (the pairs' first and "
                              f"second channels) of {k} values")
        if not all(_number(v) for r in bh for v in r):
            raise PolicyError(f"k_rot: b of KV head {h} must hold finite numbers")
        if not isinstance(th, (list, tuple)) or len(th) != k:
            raise PolicyError(f"k_rot: theta of KV head {h} must list {k} angles (one per pair)")
        if not all(_number(v) and v > 0 for v in th):
            raise PolicyError(f"k_rot: theta of KV head {h} must be finite numbers > 0 "
                              f"(radians per position), got {list(th)}")
        nonzero = [c for i in p for c in (i, i + half) if center[h][c] != 0.0]
        if nonzero:
            raise PolicyError(f"k_rot: k_center of KV head {h} must be 0 on the rotated channels "
                              f"(the offset there is R(p) b), channel {nonzero[0]} is "
                              f"{center[h][nonzero[0]]!r}")
        out_pairs.append(tuple(p))
        out_b.append(tuple(tuple(float(v) for v in r) for r in bh))
        out_theta.append(tuple(float(v) for v in th))
    return KRot(tuple(out_pairs), tuple(out_b), tuple(out_theta))


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
    k_rot: Optional[KRot] = None
    layer_type: LayerType = FULL_ATTENTION

    def __post_init__(self) -> None:
        if not isinstance(self.layer_type, LayerType):
            raise PolicyError(f"layer_type must be a LayerType, got {self.layer_type!r}")
        if not self.layer_type.holds_kv:
            extra = [n for n in ("k", "v", *SCALE_FIELDS, *CHANNEL_FIELDS, *HEAD_FLAG_FIELDS, "k_rot")
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
        object.__setattr__(self, "k_rot", check_k_rot(self.k_rot, self.k_center))
        if self.k_rot is not None and (self.k_smooth is not None or self.k_perm is not None):
            raise PolicyError("k_rot: the rotating offset is not defined with k_smooth or k_perm "
                              "(the queries are smoothed or permuted, the RoPE pairs are not "
                              "(i, i + head_dim/2) in the cache's order); drop one of them")

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

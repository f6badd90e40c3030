"""Calibration of the rotating K center (policy ``k_rot``, docs/design/rotating_centering.md).

Per centered layer and KV head: ``b`` = the mean pre-RoPE key (RoPE inverted on the hooked keys
of the windows run from position 0, :meth:`~vllm_nvfp4.calibration.kv_hooks.KVObserver.k_pre_mean`,
times the RoPE's attention scaling); the ``k`` RoPE pairs of largest ``|b_pair|``
(:meth:`~vllm_nvfp4.kernels.launch.RotCenter.top_pairs`) with ``theta`` = the model's
``inv_freq`` of those pairs; ``k_center`` = ``mu'``, the mean post-RoPE key with those pairs'
channels zeroed. The K range is then the amax of the stored key ``K - mu' - R(p) b_k``, which
depends on ``p``: a second pass over the same runs (the windows from position 0, then at the
range offsets, :mod:`~vllm_nvfp4.calibration.position_range`) once ``mu'`` and ``b_k`` are fixed
(:class:`~vllm_nvfp4.calibration.kv_hooks.RotRangeObserver`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from vllm_nvfp4.calibration.kv_hooks import KVObserver, RotRangeObserver
from vllm_nvfp4.calibration.rope import Rope, model_rope
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.policy import KRot, LayerType

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RotFit:
    """One layer's rotating K center: ``center`` = ``mu'`` FP32 ``[kv_heads, head_dim]`` (0 on
    the rotated channels), ``rot`` the pairs, ``b`` and ``theta``, ``amax`` FP32 ``[kv_heads]``
    the largest ``|K - mu' - R(p) b_k|`` (None before the second pass)."""

    center: torch.Tensor
    rot: RotCenter
    amax: Optional[torch.Tensor] = None

    def k_rot(self) -> KRot:
        """The policy field of :attr:`rot` (unchecked; :class:`~vllm_nvfp4.policy.LayerPolicy`
        checks it against ``k_center``)."""
        r = self.rot
        return KRot(tuple(tuple(int(i) for i in row) for row in r.idx),
                    tuple(tuple(tuple(float(x) for x in half) for half in head) for head in r.b),
                    tuple(tuple(float(t) for t in row) for row in r.theta))


def check_pairs(pairs: int, head_dim: int) -> None:
    """``ValueError`` unless ``0 <= pairs <= head_dim / 2`` (0: no rotating center)."""
    if not isinstance(pairs, int) or isinstance(pairs, bool) or not 0 <= pairs <= head_dim // 2:
        raise ValueError(f"--k-rot-pairs must be 0 (off) or 1 .. {head_dim // 2} (the RoPE pairs "
                         f"of a head of dimension {head_dim}), got {pairs!r}")


def rope_for(model: torch.nn.Module, head_dim: int, pairs: int,
             find: Callable[[torch.nn.Module, int], Union[Rope, str]] = model_rope,
             ) -> Optional[Rope]:
    """The model's :class:`~vllm_nvfp4.calibration.rope.Rope` when ``pairs`` asks for a
    rotating center and the model's RoPE fits it; else None (logged where it does not fit).
    ``find(model, head_dim)``: the RoPE or why it does not fit (a Hugging Face model's by
    default; the start-up calibration passes vLLM's,
    :func:`~vllm_nvfp4.integration.calibration_rope.vllm_rope`)."""
    check_pairs(pairs, head_dim)
    if not pairs:
        return None
    rope = find(model, head_dim)
    if isinstance(rope, str):
        logger.warning("no rotating K center (%d RoPE pairs asked): %s; K is centered on a "
                       "constant offset", pairs, rope)
        return None
    return rope


def fit_layer(observer: KVObserver, layer: int, pairs: int) -> RotFit:
    """``mu'`` and the rotating center of ``layer`` from the first pass (module doc)."""
    rope = observer.rope
    if rope is None:
        raise ValueError("the observer has no RoPE: it saw no pre-RoPE keys")
    b = observer.k_pre_mean(layer) * rope.scaling  # [kv_heads, head_dim]
    rot = RotCenter.top_pairs(b, rope.inv_freq, pairs)
    half = b.shape[-1] // 2
    idx = rot.idx.long()
    rotated = torch.zeros_like(b, dtype=torch.bool)
    rotated.scatter_(1, idx, True)
    rotated.scatter_(1, idx + half, True)
    center = torch.where(rotated, 0.0, observer.k_channel_mean(layer))
    return RotFit(center, rot)


def centered_layers(layer_types: Sequence[LayerType]) -> list[int]:
    """The layers K centering applies to: KV layers without learned attention sinks."""
    return [i for i, t in enumerate(layer_types) if t.holds_kv and not t.sinks]


def fit(observer: KVObserver, layers: Sequence[int], pairs: int) -> dict[int, RotFit]:
    """:func:`fit_layer` of each of ``layers``."""
    return {i: fit_layer(observer, i, pairs) for i in layers}


def with_range(fits: dict[int, RotFit], observer: RotRangeObserver) -> dict[int, RotFit]:
    """``fits`` with the amax of the second pass (``observer`` ran with their centers)."""
    missing = [i for i in fits if observer.k_amax[i] is None]
    if missing:
        raise RuntimeError(f"layers {missing} never went through the KV hook in the second pass")
    return {i: RotFit(f.center, f.rot, observer.k_amax[i]) for i, f in fits.items()}


def range_observer(fits: dict[int, RotFit], num_layers: int,
                   kv_layers: Optional[Sequence[int]] = None) -> RotRangeObserver:
    """The second pass' observer of ``fits``' centers."""
    return RotRangeObserver(num_layers, {i: (f.center, f.rot) for i, f in fits.items()}, kv_layers)

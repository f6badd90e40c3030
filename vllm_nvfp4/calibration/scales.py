"""Calibration: per-layer (optionally per-head) K/V amax -> FP8 scales and NVFP4 global scales.

Conventions (:mod:`vllm_nvfp4.formats`): FP8 ``scale = amax / 448``, NVFP4
``global_scale = amax / (6 * 448)``. Every layer gets both kinds for K and V, whatever its format,
so a policy can switch a layer's format later without recalibrating. ``amax`` is the largest
``|K|`` (post-RoPE) or ``|V|`` seen over the calibration windows - per KV head with ``per_head``,
else over all heads of the layer. A layer whose amax is 0 keeps the defaults (no scale written).

K smoothing (``k_smooth_alpha``): per KV head and channel ``c``, ``lam_c = max(1, (a_c /
mean(a))^alpha)`` from the channel amax ``a_c`` of K, so channels far above the head's typical
magnitude are divided down (the query is multiplied back, :mod:`vllm_nvfp4.policy.layer_policy`); the K scales
are then calibrated on ``K / lam`` (its amax per head is ``max_c a_c / lam_c``).

K centering (``k_center``): ``mu_c`` = the mean of each K channel over the calibration tokens;
the cache stores ``K - mu`` (softmax-invariant, :mod:`vllm_nvfp4.policy.layer_policy`; not with
learned attention sinks, whose layers stay uncentered), so ``a_c`` above becomes the largest
``|K_c - mu_c|`` for the smoothing factors and the K scales.

Sink key (``k_sink_uncentered``, with centering): per KV head, whether the first key of the
calibration sequences (position 0 as served requests hold it, :func:`~vllm_nvfp4.calibration.data.served_prefixes`:
the BOS, or text and the chat template's first token in turn) fits the K range the scales were calibrated for without centering (``max_c |K_0c| / lam_c``
at most the amax behind the layer's K scale); where it does, the policy stores that key
uncentered (:mod:`vllm_nvfp4.policy.layer_policy`).

K channel permutation (``k_permute``): per KV head, the channels in order of falling RMS (of
``K - mu`` with centering), so each 16-value NVFP4 block holds channels of similar magnitude; the
offsets and smoothing factors are written in that order, and the K scales, which depend only on
the largest value per head, do not change.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence, TypeVar, Union

import torch

from vllm_nvfp4.calibration import rot_center
from vllm_nvfp4.calibration.kv_hooks import KVObserver, KVOption, RotRangeObserver, kv_cache_quantization
from vllm_nvfp4.calibration.modeling import ModelInfo, input_device, shifted_position_ids
from vllm_nvfp4.calibration.progress import progress
from vllm_nvfp4.calibration.rope import Rope
from vllm_nvfp4.calibration.rot_center import RotFit
from vllm_nvfp4.formats import fp8_scale_from_amax, nvfp4_global_scale
from vllm_nvfp4.policy import KVPolicy, LayerPolicy, Scale

logger = logging.getLogger(__name__)
ObserverT = TypeVar("ObserverT", bound=Union[KVObserver, RotRangeObserver])


@torch.no_grad()
def observe_amax(model: torch.nn.Module, windows: torch.Tensor, num_layers: int,
                 desc: str = "calibrate", kv_layers: Optional[Sequence[int]] = None,
                 options: Sequence[KVOption] = (), offsets: Sequence[int] = (),
                 rope: Optional[Rope] = None) -> KVObserver:
    """Run ``windows [n, T]`` one at a time and return the per-layer, per-head K/V amax
    (``num_layers`` decoder layers, of which ``kv_layers`` (default: all) hold a KV cache),
    of the K/V as ``options`` change them (e.g. a study's rotation, ``studies/kv_options.py``).
    Then every window again at each position offset of ``offsets``
    (:func:`~vllm_nvfp4.calibration.position_range.range_offsets`), which widen the range
    statistics only (:mod:`~vllm_nvfp4.calibration.position_range`). With the model's ``rope``
    the observer also sums the pre-RoPE keys (:class:`KVObserver`)."""
    return run_windows(model, windows, KVObserver(num_layers, kv_layers, rope), desc, options,
                       offsets)


@torch.no_grad()
def observe_rot_range(model: torch.nn.Module, windows: torch.Tensor, fits: dict[int, RotFit],
                      num_layers: int, kv_layers: Optional[Sequence[int]] = None,
                      offsets: Sequence[int] = ()) -> dict[int, RotFit]:
    """``fits`` with the amax of the keys their rotating centers store, over the same runs as
    :func:`observe_amax` (the second pass, :mod:`~vllm_nvfp4.calibration.rot_center`)."""
    observer = run_windows(model, windows, rot_center.range_observer(fits, num_layers, kv_layers),
                           "calibrate: rotating K range", offsets=offsets)
    return rot_center.with_range(fits, observer)


def observe_calibration(model: torch.nn.Module, windows: torch.Tensor, info: ModelInfo,
                        offsets: Sequence[int] = (), k_rot_pairs: int = 0,
                        ) -> tuple[KVObserver, Optional[dict[int, RotFit]]]:
    """The statistics a calibrated policy is built from (:func:`scaled_policy`): the observer of
    ``windows [n, T]`` (from position 0, then at ``offsets``) and, with ``k_rot_pairs`` > 0 where
    the model's RoPE allows it (:func:`~vllm_nvfp4.calibration.rot_center.rope_for`), each
    centered layer's rotating K center with its range (a second pass; else None)."""
    rope = rot_center.rope_for(model, info.head_dim, k_rot_pairs)
    observer = observe_amax(model, windows, info.num_layers, kv_layers=info.kv_layers,
                            offsets=offsets, rope=rope)
    if rope is None:
        return observer, None
    fits = rot_center.fit(observer, rot_center.centered_layers(info.layer_types), k_rot_pairs)
    return observer, observe_rot_range(model, windows, fits, info.num_layers, info.kv_layers,
                                       offsets)


def run_windows(model: torch.nn.Module, windows: torch.Tensor, observer: ObserverT,
                desc: str, options: Sequence[KVOption] = (),
                offsets: Sequence[int] = ()) -> ObserverT:
    """Run ``windows [n, T]`` one at a time from position 0, then each again from every offset
    of ``offsets`` inside ``observer.range_only()``; returns ``observer``. ``RuntimeError`` when
    a KV layer never went through the hook."""
    device = input_device(model)
    runs = [(row, o) for o in (0, *offsets) for row in windows]
    with kv_cache_quantization(model, observer=observer, options=options):
        for row, offset in progress(runs, desc=desc, unit="fwd"):
            ids = row.unsqueeze(0).to(device)
            if not offset:
                model(ids, use_cache=False)
                continue
            with observer.range_only():
                model(ids, position_ids=shifted_position_ids(model, ids.shape[1], offset),
                      use_cache=False)
    missing = observer.missing_layers()
    if missing:
        raise RuntimeError(f"layers {missing} never went through the KV hook; unsupported model")
    return observer


def _scales(amax: torch.Tensor, per_head: bool) -> tuple[Optional[Scale], Optional[Scale]]:
    """``(fp8_scale, nvfp4_global_scale)`` from amax ``[kv_heads]``; ``None`` where amax is 0."""
    if not per_head:
        a = float(amax.max())
        if a <= 0:
            return None, None
        return float(fp8_scale_from_amax(a)), float(nvfp4_global_scale(a))
    if bool((amax <= 0).any()):
        return None, None
    return (tuple(float(s) for s in fp8_scale_from_amax(amax)),
            tuple(float(s) for s in nvfp4_global_scale(amax)))


def smoothing_factors(channel_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """K smoothing factors ``[kv_heads, head_dim]`` from the channel amax of K (module doc)."""
    if alpha <= 0:
        raise ValueError(f"the K smoothing exponent must be > 0, got {alpha}")
    mean = channel_amax.mean(dim=1, keepdim=True)
    ratio = torch.where(mean > 0, channel_amax / mean.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    return ratio.pow(alpha).clamp(min=1.0)


def _rows(t: torch.Tensor) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(x) for x in row) for row in t)


def channel_permutation(channel_rms: torch.Tensor) -> torch.Tensor:
    """Per KV head, the channel indices by falling RMS (ties by index): int64 ``[kv_heads,
    head_dim]`` from ``channel_rms [kv_heads, head_dim]``."""
    return torch.sort(channel_rms, dim=1, descending=True, stable=True).indices


def scaled_policy(formats: KVPolicy, observer: KVObserver, per_head: bool = False,
                  provenance: Optional[Mapping[str, Any]] = None,
                  k_smooth_alpha: Optional[float] = None, k_center: bool = False,
                  k_permute: bool = False, k_sink_uncentered: bool = False,
                  k_rot: Optional[Mapping[int, RotFit]] = None) -> KVPolicy:
    """``formats`` (formats only) with calibrated scales from ``observer`` for every layer, K
    centering offsets when ``k_center``, K smoothing factors when ``k_smooth_alpha`` is given,
    a K channel permutation when ``k_permute``, the sink key uncentered where it fits when
    ``k_sink_uncentered`` (needs ``k_center``; module doc), the rotating K center of the layers
    of ``k_rot`` (after its second pass, :func:`observe_rot_range`: ``k_center`` is then its
    ``mu'`` and the K range its amax; needs ``k_center``, not with smoothing or permutation).
    Layers with learned attention sinks are never centered (their softmax would change:
    :class:`LayerPolicy` refuses it)."""
    if k_sink_uncentered and not k_center:
        raise ValueError("k_sink_uncentered stores the sink key without the K centering offsets; "
                         "it needs k_center")
    k_rot = dict(k_rot or {})
    if k_rot and (not k_center or k_smooth_alpha is not None or k_permute):
        raise ValueError("k_rot (the rotating K center) needs k_center, and neither K smoothing "
                         "nor a K channel permutation")
    if formats.num_layers != observer.num_layers:
        raise ValueError(f"formats cover {formats.num_layers} layers, amax {observer.num_layers}")
    layers = []
    for i, lp in enumerate(formats.layers):
        if not lp.layer_type.holds_kv:
            layers.append(lp)
            continue
        k_amax, smooth, center, perm, lam = observer.k_amax[i], None, None, None, None
        channel_amax = observer.k_channel_amax[i]
        centered = k_center and not lp.layer_type.sinks  # not softmax-invariant with sinks
        order = channel_permutation(observer.k_channel_rms(i, centered)) if k_permute else None

        def ordered(t: torch.Tensor) -> torch.Tensor:
            return t if order is None else t.gather(1, order)
        rot = k_rot.get(i) if centered else None
        if rot is not None:
            if rot.amax is None:
                raise ValueError(f"layer {i}: the rotating K center has no range (second pass)")
            k_amax, center = rot.amax, _rows(rot.center)
        elif centered:
            channel_amax = observer.k_centered_channel_amax(i)
            k_amax = channel_amax.amax(dim=1)
            center = _rows(ordered(observer.k_channel_mean(i)))
        if k_smooth_alpha is not None:
            lam = smoothing_factors(channel_amax, k_smooth_alpha)  # type: ignore[arg-type]
            k_amax = (channel_amax / lam).amax(dim=1)  # type: ignore[operator]
            smooth = _rows(ordered(lam))
        if order is not None:
            perm = tuple(tuple(int(c) for c in row) for row in order)
        sink = (_sink_fits(observer.k_first_amax(i, lam), k_amax, per_head)
                if k_sink_uncentered and centered else None)
        k8, k4 = _scales(k_amax, per_head)  # type: ignore[arg-type]
        v8, v4 = _scales(observer.v_amax[i], per_head)  # type: ignore[arg-type]
        if None in (k8, v8):
            logger.warning("layer %d: K or V was all zeros during calibration; keeping default scales", i)
        layers.append(LayerPolicy(lp.k, lp.v, k_scale=k8, v_scale=v8, k_global_scale=k4,
                                  v_global_scale=v4, k_smooth=smooth, k_center=center,
                                  k_perm=perm, k_sink_uncentered=sink,
                                  k_rot=None if rot is None else rot.k_rot(),
                                  layer_type=lp.layer_type))
    return KVPolicy(tuple(layers), provenance=dict(provenance or {}), source="calibration")


def _sink_fits(first_amax: torch.Tensor, k_amax: torch.Tensor, per_head: bool) -> Any:
    """The ``k_sink_uncentered`` entry: per KV head whether the uncentered first key's amax
    (``first_amax [kv_heads]``) stays within the K range the scales come from (``k_amax`` per
    head, or its max with one scale per layer): True (all), a per-head tuple, or None (none)."""
    limit = k_amax if per_head else k_amax.max()
    fits = [bool(f) for f in first_amax <= limit]
    return True if all(fits) else (tuple(fits) if any(fits) else None)


def amax_table(observer: KVObserver) -> list[dict[str, list[float]]]:
    """Per-layer ``{"k": [amax per head], "v": [...]}`` for reports."""
    return [{"k": [round(float(a), 6) for a in k], "v": [round(float(a), 6) for a in v]}  # type: ignore[union-attr]
            if k is not None else {} for k, v in zip(observer.k_amax, observer.v_amax)]


def with_formats(scaled: KVPolicy, formats: KVPolicy, provenance: Optional[Mapping[str, Any]] = None,
                 source: str = "selection") -> KVPolicy:
    """``formats``' per-layer formats combined with ``scaled``'s calibrated scales."""
    if scaled.num_layers != formats.num_layers:
        raise ValueError(f"scales cover {scaled.num_layers} layers, formats {formats.num_layers}")
    if scaled.layer_types != formats.layer_types:
        raise ValueError("the scales and the formats were made for different layer types")
    layers = tuple(replace(s, k=f.k, v=f.v) for s, f in zip(scaled.layers, formats.layers))
    return KVPolicy(layers, provenance=dict(provenance or {}), source=source)

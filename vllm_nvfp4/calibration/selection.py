"""Choose per-layer FP8/NVFP4 for K and V under a KV-bytes budget (``vllm-nvfp4 select``).

Model of the damage (additivity): with a sensitivity report swept from all-FP8,
``D(policy) ~ D(all-FP8) + sum over NVFP4 slots of m(slot)``; swept from all-NVFP4,
``D(policy) ~ D(all-NVFP4) - sum over FP8 slots of m(slot)``. A *slot* is one layer's K or V,
``D`` the mean KL (default), delta NLL or top-1 disagreement from the report and ``m`` the slot's
marginal there (damage with the slot in NVFP4 minus with it in FP8, the rest at the sweep's
base; see :mod:`~vllm_nvfp4.calibration.sensitivity`). Every slot costs the same bytes (FP8 1.0,
NVFP4 0.5625 of an FP8 slot: all layers share head count and head size), so a budget is a number
``n`` of FP8 slots, and keeping in FP8 the at most ``n`` slots with the largest POSITIVE marginal
damage minimises the predicted damage exactly (any other choice swaps a larger marginal for a
smaller one; a slot whose NVFP4 measured no worse than FP8 - e.g. with K smoothing on an
outlier-heavy model, where per-16 block scales beat one FP8 scale - stays NVFP4 and the budget is
left unspent rather than spent on damage).

The naive rule at the same budget keeps whole layers in FP8 from both ends: the first
``ceil(m/2)`` and last ``floor(m/2)`` layers for ``m = n // 2``, plus the K of the next front
layer when ``n`` is odd.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

from vllm_nvfp4.formats import KVFormat
from vllm_nvfp4.policy import FULL_ATTENTION, KVPolicy, LayerPolicy, LayerType

#: bytes of an NVFP4 slot relative to an FP8 slot (D/2 + D/16 vs D)
NVFP4_SLOT = KVFormat.NVFP4.bytes_per_element / KVFormat.FP8.bytes_per_element
METRICS = ("kl", "dnll", "top1")
#: the policies an analysis can sweep from (:mod:`~vllm_nvfp4.calibration.sensitivity`)
BASES = ("fp8", "nvfp4")
DEFAULT_BASE = "fp8"
#: KV bytes (fraction of all-FP8) that ``tune`` and the start-up selection spend by default
DEFAULT_BUDGET = 0.62


def fraction_for_slots(num_layers: int, fp8_slots: int) -> float:
    """KV bytes relative to all-FP8 when ``fp8_slots`` of the ``2 * num_layers`` slots are FP8."""
    total = 2 * num_layers
    return (fp8_slots + NVFP4_SLOT * (total - fp8_slots)) / total


def fp8_slots_for_budget(num_layers: int, budget: float) -> int:
    """The most FP8 slots whose bytes stay within ``budget`` (fraction of all-FP8 bytes)."""
    if not (isinstance(budget, (int, float)) and math.isfinite(budget)):
        raise ValueError(f"budget must be a number, got {budget!r}")
    if budget < NVFP4_SLOT or budget > 1.0:
        raise ValueError(f"budget must lie between {NVFP4_SLOT} (all NVFP4) and 1.0 (all FP8), got {budget}")
    total = 2 * num_layers
    n = int(math.floor((budget - NVFP4_SLOT) * total / (1.0 - NVFP4_SLOT) + 1e-9))
    n = min(max(n, 0), total)
    while n > 0 and fraction_for_slots(num_layers, n) > budget + 1e-12:  # guard rounding
        n -= 1
    return n


def check_slots(num_layers: int, fp8_slots: int) -> int:
    """Validate an explicit number of FP8 slots."""
    if not isinstance(fp8_slots, int) or not 0 <= fp8_slots <= 2 * num_layers:
        raise ValueError(f"--fp8-slots must be an integer in [0, {2 * num_layers}] for {num_layers} layers, got {fp8_slots!r}")
    return fp8_slots


def sweep_base(report: dict[str, Any]) -> str:
    """The policy the analysis moved one slot away from: ``"fp8"`` (also reports before the
    choice existed) or ``"nvfp4"``."""
    return report.get("settings", {}).get("base", "fp8")


def marginals(report: dict[str, Any], metric: str) -> list[tuple[float, int, str]]:
    """``(marginal damage, layer, "k"|"v")`` for every slot, largest damage first (ties: K, low
    layer): the report's ``<metric>_marginal`` (top-1: agreement lost in NVFP4)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    key = f"{metric}_marginal"
    if any(key not in entry[kv] for entry in report["layers"] for kv in ("k", "v")):
        raise ValueError(f"the sensitivity report has no {key} (an analysis from before that metric); "
                         "re-run analyze or choose --metric kl")
    slots = [(entry[kv][key], entry["index"], kv) for entry in report["layers"] for kv in ("k", "v")]
    return sorted(slots, key=lambda s: (-s[0], s[1], s[2]))


def keep_largest(slots: Iterable[tuple[float, int, str]], fp8_slots: int) -> list[tuple[int, str]]:
    """``(layer, "k"|"v")`` of the at most ``fp8_slots`` slots of ``(damage, layer, kv)`` with the
    largest POSITIVE damage (ties: K, low layer); the FP8 slots that minimise the predicted
    damage (module doc)."""
    ranked = sorted(slots, key=lambda s: (-s[0], s[1], s[2]))
    return [(layer, kv) for d, layer, kv in ranked[:fp8_slots] if d > 0]


def report_layer_types(report: dict[str, Any]) -> tuple[LayerType, ...]:
    """The decoder layers' types an analysis was made for (reports of dense models written
    before the types: all full attention, one per analysed layer)."""
    types = report.get("model", {}).get("layer_types")
    if not types:
        return (FULL_ATTENTION,) * len(report["layers"])
    return tuple(LayerType(t["type"], t.get("window"), t.get("sinks", False)) for t in types)


def policy_from_fp8(layer_types: Sequence[LayerType], fp8: Iterable[tuple[int, str]],
                    source: str) -> KVPolicy:
    """Formats only: the ``fp8`` slots ``(layer, "k"|"v")`` FP8, every other K/V NVFP4."""
    keep = set(fp8)
    layers = tuple(
        LayerPolicy(*(KVFormat.FP8 if (i, kv) in keep else KVFormat.NVFP4 for kv in ("k", "v")),
                    layer_type=t) if t.holds_kv else LayerPolicy(None, None, layer_type=t)
        for i, t in enumerate(layer_types)
    )
    return KVPolicy(layers, source=source)


def select_formats(report: dict[str, Any], fp8_slots: int, metric: str = "kl") -> KVPolicy:
    """Formats minimising the predicted damage with at most ``fp8_slots`` FP8 slots: the slots of
    largest positive marginal damage (fewer when fewer slots lose anything in NVFP4)."""
    check_slots(len(report["layers"]), fp8_slots)  # one entry per KV layer
    chosen = keep_largest(marginals(report, metric), fp8_slots)
    return policy_from_fp8(report_layer_types(report), chosen,
                            source=f"selected ({len(chosen)} of {fp8_slots} FP8 slots, {metric})")


def count_fp8_slots(formats: KVPolicy) -> int:
    """Number of FP8 slots (a layer's K or V) in ``formats``."""
    return sum(lp.format_of(kv) is KVFormat.FP8 for _, lp in formats.kv_layers() for kv in ("k", "v"))


def naive_formats(num_layers: int, fp8_slots: int,
                  layer_types: Optional[Sequence[LayerType]] = None) -> KVPolicy:
    """The first/last-N rule with ``fp8_slots`` FP8 slots (see module docstring), over the layers
    that hold a KV cache (``layer_types``; default: ``num_layers`` full-attention layers)."""
    types = tuple(layer_types) if layer_types is not None else (FULL_ATTENTION,) * num_layers
    kv_layers = [i for i, t in enumerate(types) if t.holds_kv]
    n = len(kv_layers)
    check_slots(n, fp8_slots)
    m = fp8_slots // 2
    front, back = (m + 1) // 2, m // 2
    keep = [(kv_layers[j], kv) for j in [*range(front), *range(n - back, n)] for kv in ("k", "v")]
    if fp8_slots % 2:
        keep.append((kv_layers[front], "k"))
    return policy_from_fp8(types, keep, source=f"naive first/last ({fp8_slots} FP8 slots)")


def predict(report: dict[str, Any], formats: KVPolicy, metric: str) -> float:
    """Additive prediction of ``metric`` (KL, delta NLL or top-1 agreement) for ``formats`` from
    single-slot measurements, anchored at the sweep's base."""
    table = {(layer, kv): d for d, layer, kv in marginals(report, metric)}
    sign = -1.0 if metric == "top1" else 1.0  # agreement falls as damage rises
    fmt = KVFormat.NVFP4 if sweep_base(report) == "fp8" else KVFormat.FP8
    moved = sum(table[(i, kv)] for i, lp in enumerate(formats.layers)
                for kv in ("k", "v") if lp.format_of(kv) is fmt)
    if fmt is KVFormat.NVFP4:
        return report["configs"]["all_fp8"][metric] + sign * moved
    return report["configs"]["all_nvfp4"][metric] - sign * moved


def predicted_curve(report: dict[str, Any], metric: str, rank_by: str = "kl") -> list[tuple[float, float]]:
    """``(fraction of FP8 bytes, predicted metric)`` of the policy selected by ``rank_by``, for
    every FP8 slot budget (the curve stops where more FP8 slots would add damage)."""
    num_layers = len(report["layers"])
    points = []
    for n in range(2 * num_layers + 1):
        chosen = select_formats(report, n, rank_by)
        if count_fp8_slots(chosen) < n:
            break
        points.append((fraction_for_slots(num_layers, n), predict(report, chosen, metric)))
    return points

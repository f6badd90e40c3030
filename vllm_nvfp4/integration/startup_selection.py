"""Start-up selection: which K/V slots of a model calibrated at start-up stay FP8.

The candidate slots are the K and the V of every layer whose cache grows with the context
(:func:`~vllm_nvfp4.policy.growing_layers`: the full-attention layers; sliding layers stay FP8
as in the default rule). :mod:`.startup_calibration` measures each candidate's damage (the mean
next-token KL of the final logits with only that slot in NVFP4,
:func:`~vllm_nvfp4.integration.calibration_forward.slot_damage`); this module turns the damage
into formats: the :func:`fp8_slot_count` slots of largest damage stay FP8
(:func:`~vllm_nvfp4.calibration.selection.keep_largest`), the other candidates go NVFP4, and
the choice is recorded in the policy's provenance (``"sensitivity"``, read by
:func:`formats_line`). No vLLM API is used here.
"""

from __future__ import annotations

from typing import Any, Sequence

from vllm_nvfp4.calibration.scales import with_formats
from vllm_nvfp4.calibration.selection import (
    DEFAULT_BUDGET,
    fp8_slots_for_budget,
    keep_largest,
    policy_from_fp8,
)
from vllm_nvfp4.formats import KVFormat
from vllm_nvfp4.policy import KVPolicy, LayerType, default_policy, growing_layers

#: what the sensitivity measures (recorded in the provenance and the cache key's recipe)
METRIC = "kl"


def fp8_slot_count(layer_types: Sequence[LayerType]) -> tuple[list[int], int]:
    """``(candidate layers, FP8 slots among their K/V)``: the growing layers
    (:func:`~vllm_nvfp4.policy.growing_layers`) and ``max(FP8 slots of`` :data:`DEFAULT_BUDGET`
    ``over them, the default rule's FP8 slots among them)``, at most all of them."""
    types = tuple(layer_types)
    candidates = growing_layers(types)
    rule = default_policy(len(types), types)
    rule_fp8 = sum(rule.layers[i].format_of(kv) is KVFormat.FP8 for i in candidates for kv in "kv")
    return candidates, min(max(fp8_slots_for_budget(len(candidates), DEFAULT_BUDGET), rule_fp8),
                           2 * len(candidates))


def candidate_slots(candidates: Sequence[int]) -> list[tuple[int, str]]:
    """``(layer, "k"|"v")`` of every candidate layer, the slots whose damage is measured."""
    return [(i, kv) for i in candidates for kv in ("k", "v")]


def _slot_name(layer: int, kv: str) -> str:
    return f"{layer}.{kv}"


def sensitivity_policy(scaled: KVPolicy, damage: dict[tuple[int, str], float],
                       candidates: Sequence[int], fp8_slots: int, provenance: dict[str, Any],
                       tokens: int, seconds: float) -> KVPolicy:
    """``scaled`` with the ``fp8_slots`` candidate slots of largest ``damage`` (nats, by
    ``(layer, "k"|"v")``, measured on ``tokens`` tokens in ``seconds``) in FP8, the other
    candidates' slots NVFP4 and the other KV layers' formats kept. Records the choice in
    ``provenance`` (updated in place) and returns the policy."""
    chosen = keep_largest([(d, layer, kv) for (layer, kv), d in damage.items()], fp8_slots)
    provenance.update(formats_from="start-up sensitivity", sensitivity={
        "tokens": tokens, "metric": METRIC, "budget": DEFAULT_BUDGET,
        "candidates": len(candidates), "fp8_slots": fp8_slots,
        "fp8": [_slot_name(*slot) for slot in chosen],
        "kl": {_slot_name(*slot): round(d, 8) for slot, d in sorted(damage.items())},
        "seconds": round(seconds, 1)})
    keep = set(candidates)
    fixed = [(i, kv) for i, lp in scaled.kv_layers() if i not in keep for kv in ("k", "v")
             if lp.format_of(kv) is KVFormat.FP8]
    formats = policy_from_fp8(scaled.layer_types, [*chosen, *fixed], source="start-up sensitivity")
    return with_formats(scaled, formats, provenance, source="start-up calibration")


def formats_line(provenance: dict[str, Any]) -> str:
    """What chose the formats, for the log: the rule, or the FP8 slots by measured KL."""
    sens = provenance.get("sensitivity")
    if sens is None:
        return str(provenance.get("formats_from", "default rule"))
    kl = sens["kl"]
    picked = ", ".join(f"{slot} ({kl[slot]:.3g})" for slot in sens["fp8"]) or "none"
    median = sorted(kl.values())[len(kl) // 2]
    return (f"FP8 by measured KL on {sens['tokens']} tokens: {picked} (the {len(sens['fp8'])} of "
            f"{2 * sens['candidates']} candidate slots with the largest next-token KL in NVFP4; "
            f"median {median:.3g})")

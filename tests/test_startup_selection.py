"""The start-up selection (``integration/startup_selection.py``): how many slots stay FP8, which
ones by measured damage, and what the policy records. No engine."""

from __future__ import annotations

from vllm_nvfp4.integration.startup_selection import (
    candidate_slots,
    formats_line,
    fp8_slot_count,
    sensitivity_policy,
)
from vllm_nvfp4.policy import FULL_ATTENTION, LayerType, default_policy

SLIDING = LayerType("sliding", 512)


def test_fp8_slot_count_takes_the_budget_or_the_rule():
    assert fp8_slot_count([FULL_ATTENTION] * 30) == (list(range(30)), 7)  # 7 of 60 slots: 0.614x
    assert fp8_slot_count([FULL_ATTENTION] * 64) == (list(range(64)), 16)
    assert fp8_slot_count([FULL_ATTENTION] * 6) == (list(range(6)), 4)  # the rule's first/last
    assert fp8_slot_count([FULL_ATTENTION] * 2) == ([0, 1], 4)  # all FP8: nothing to measure
    gemma = [FULL_ATTENTION if i % 6 == 5 else SLIDING for i in range(18)]
    assert fp8_slot_count(gemma) == ([5, 11, 17], 4)  # sliding layers are no candidates
    assert fp8_slot_count([SLIDING] * 8) == (list(range(8)), 4)  # all sliding: the candidates


def test_sensitivity_policy_keeps_the_largest_damage_in_fp8_and_the_sliding_layers():
    types = [FULL_ATTENTION if i % 3 == 2 else SLIDING for i in range(12)]  # full: 2, 5, 8, 11
    candidates, fp8_slots = fp8_slot_count(types)
    assert (candidates, fp8_slots) == ([2, 5, 8, 11], 4)
    damage = {slot: 0.001 for slot in candidate_slots(candidates)}
    damage.update({(5, "k"): 0.03, (8, "v"): 0.02, (2, "k"): 0.01})
    damage[(11, "v")] = 0.0  # no damage never spends the budget
    provenance: dict = {}
    policy = sensitivity_policy(default_policy(len(types), types), damage, candidates, fp8_slots,
                                provenance, tokens=2048, seconds=1.25)
    fp8 = {(i, kv) for i, lp in enumerate(policy.layers) for kv in "kv" if lp.format_of(kv) == "fp8"}
    sliding = {(i, kv) for i, t in enumerate(types) if t is SLIDING for kv in "kv"}
    assert fp8 - sliding == {(5, "k"), (8, "v"), (2, "k"), (2, "v")}  # ties: K, then low layer
    assert sliding <= fp8
    sens = provenance["sensitivity"]
    assert provenance["formats_from"] == "start-up sensitivity"
    assert sens["fp8"] == ["5.k", "8.v", "2.k", "2.v"] and sens["candidates"] == 4
    assert sens["tokens"] == 2048 and sens["seconds"] == 1.2 and sens["kl"]["11.v"] == 0.0
    assert formats_line(provenance).startswith("FP8 by measured KL on 2048 tokens: 5.k (0.03), ")
    assert formats_line({"formats_from": "default rule"}) == "default rule"

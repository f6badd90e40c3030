"""studies/default_rule_candidates.py: the candidate rules it compares, by hand on small layer patterns,
and its summary statistics."""

from __future__ import annotations

import math

import pytest

from studies.default_rule_candidates import CANDIDATES, candidate_policies, candidate_text, summarize_runs
from vllm_nvfp4.policy import KVPolicy, LayerType, default_policy

SWA, FULL, NONE = LayerType("sliding", 32), LayerType("full"), LayerType("none")
GEMMA_LIKE = (SWA, SWA, FULL) * 3  # full attention at 2, 5, 8


def _formats(text: str, types) -> str:
    return KVPolicy.from_compact(text, len(types), layer_types=types).to_compact()


@pytest.mark.parametrize("name,expected", [
    ("a", "0-2:fp8,3-4:fp8,5:nvfp4,6-8:fp8"),
    ("b", "0-1:nvfp4,2:fp8,3-7:nvfp4,8:fp8"),
    ("c", "0-1:fp8,2:nvfp4,3-4:fp8,5:nvfp4,6-7:fp8,8:nvfp4"),
    ("d", "0-2:fp8,3-4:fp8,5:nvfp4,6-7:fp8,8:nvfp4"),
    ("e", "0-8:nvfp4"),
    ("f", "0-1:nvfp4,2:fp8,3-8:nvfp4"),
    ("fp8", "0-8:fp8"),
])
def test_candidates_on_a_gemma_like_pattern(name, expected):
    assert _formats(candidate_text(name, GEMMA_LIKE), GEMMA_LIKE) == _formats(expected, GEMMA_LIKE)


def test_candidate_a_is_the_library_default():
    for types in (GEMMA_LIKE, (SWA,) * 5, (NONE, FULL, NONE, FULL, NONE, FULL)):
        a = KVPolicy.from_compact(candidate_text("a", types), len(types), layer_types=types)
        assert a.layers == default_policy(len(types), types).layers


def test_identical_candidates_are_measured_once():
    """All sliding (Mistral: every KV layer is a growing one): a and b are the first/last rule,
    c is all NVFP4, d and f first FP8.
    Linear attention + two full layers (tiny Qwen3-Next): a is all FP8 (two growing layers)."""
    groups = {tuple(g): p.to_compact() for g, p in candidate_policies(CANDIDATES, (SWA,) * 4)}
    assert groups == {("a", "b"): "0:fp8,1-2:nvfp4,3:fp8", ("c", "e"): "0-3:nvfp4",
                      ("d", "f"): "0:fp8,1-3:nvfp4", ("fp8",): "0-3:fp8"}
    qwen = (NONE, FULL, NONE, FULL)
    groups = {tuple(g) for g, _ in candidate_policies(CANDIDATES, qwen)}
    assert groups == {("a", "b", "fp8"), ("c", "e"), ("d", "f")}


def test_summary_is_mean_and_sample_sd_over_runs():
    def run(a_kl, e_kl):
        row = {"policy": "p", "dnll": 0.0, "top1": 1.0, "fraction_of_fp8": 1.0}
        return {"results": {"a": dict(row, kl=a_kl), "e": dict(row, policy="q", kl=e_kl)}}

    s = summarize_runs([run(1.0, 2.0), run(3.0, 3.0)], ["a", "e"])
    assert s["e"]["kl"] == 2.5 and math.isclose(s["e"]["kl_sd"], math.sqrt(0.5))
    assert s["e"]["kl_vs_a"] == 1.5 and s["e"]["runs_kl_below_a"] == 0
    assert s["a"]["same_as"] == [] and s["e"]["same_as"] == []

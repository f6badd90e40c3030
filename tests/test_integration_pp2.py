"""Pipeline parallel 2 on CPU (two worker processes, one core each, gloo): same greedy tokens as
PP=1, and each stage resolves the policy rows of its own layers by their global layer number.

Both engines run compiled (no ``enforce_eager``): vLLM 0.32's CPU runner allocates the tensors a
later pipeline stage receives only in its compile warm-up, so an eager PP=2 engine dies at its
first step (``assert self.intermediate_tensors is not None``), whatever the KV-cache dtype."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel_engines import run_size_1_and_2

pytestmark = pytest.mark.vllm

POLICY = "0:fp8,1:k=fp8,v=nvfp4,2:nvfp4,3:k=nvfp4,v=fp8"  # a different pair on every layer


def test_pp2_matches_pp1_and_stages_take_global_policy_rows(tmp_path: Path) -> None:
    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.models import build_tiny_llama

    model = build_tiny_llama(tmp_path / "m", dtype="float32")  # 4 layers
    policy = KVPolicy.from_compact(POLICY, 4)
    policy.save(model / "nvfp4_policy.json")
    out = run_size_1_and_2(model, tmp_path, "pipeline_parallel_size",
                           "[l.impl.layout.k_format, l.impl.layout.v_format]",
                           enforce_eager=False, timeout=1200)
    assert out["1"]["tokens"] == out["2"]["tokens"]
    expected = {f"model.layers.{i}.self_attn.attn": [row.k, row.v]
                for i, row in enumerate(policy.layers)}
    assert out["1"]["probe"] == [expected]
    stage0, stage1 = out["2"]["probe"]
    assert sorted(stage0) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1)]
    assert sorted(stage1) == [f"model.layers.{i}.self_attn.attn" for i in (2, 3)]
    assert {**stage0, **stage1} == expected

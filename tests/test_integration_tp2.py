"""Tensor parallel 2 on CPU (two worker processes, one core each, gloo): same greedy tokens as
TP=1, and each rank holds its own KV heads' per-head scales and K channel permutations from the
policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel_engines import run_size_1_and_2

pytestmark = pytest.mark.vllm


def test_tp2_matches_tp1_and_splits_per_head_scales(tmp_path: Path):
    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.models import build_tiny_llama

    model = build_tiny_llama(tmp_path / "m", dtype="float32")  # 2 KV heads
    policy = KVPolicy.from_compact("0:fp8,1:k=fp8,v=nvfp4,*:nvfp4", 4)
    policy = policy.with_layer(1, k_scale=(0.5, 0.25), v_global_scale=(0.125, 0.0625))
    perm = [list(range(31, -1, -1)), list(range(16, 32)) + list(range(16))]  # head_dim 32
    policy = policy.with_layer(2, k_perm=perm)
    policy.save(model / "nvfp4_policy.json")
    out = run_size_1_and_2(model, tmp_path, "tensor_parallel_size",
                           "[l.impl.k_scale.tolist(), l.impl.v_scale.tolist(), "
                           "None if l.impl.k_perm is None else l.impl.k_perm.tolist(), "
                           "None if l.impl.q_perm is None else l.impl.q_perm.tolist()]",
                           enforce_eager=True, timeout=900)
    assert out["1"]["tokens"] == out["2"]["tokens"]
    layer1 = "model.layers.1.self_attn.attn"
    assert out["1"]["probe"][0][layer1] == [[0.5, 0.25], [0.125, 0.0625], None, None]
    rank0, rank1 = out["2"]["probe"]
    assert rank0[layer1][:2] == [[0.5], [0.125]] and rank1[layer1][:2] == [[0.25], [0.0625]]
    layer2 = "model.layers.2.self_attn.attn"
    assert rank0[layer2][:2] == [[pytest.approx(1 / 6)]] * 2  # defaults
    assert out["1"]["probe"][0][layer2][2:] == [perm, [perm[0], perm[0], perm[1], perm[1]]]
    # each rank its KV head's permutation, and its two query heads take it
    assert rank0[layer2][2:] == [[perm[0]], [perm[0]] * 2] and rank1[layer2][2:] == [[perm[1]], [perm[1]] * 2]

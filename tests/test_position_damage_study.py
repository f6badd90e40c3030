"""``studies/position_damage_study.py``: damage per position range against the unquantized cache."""

from __future__ import annotations

import torch

from studies.position_damage_study import configurations, position_damage, table

from tests.test_kv_hooks import _calibrated, _ids, tiny_model


def test_damage_per_range_adds_up_and_fp8_does_less_harm():
    model = tiny_model(num_layers=2)
    windows = torch.cat([_ids(40, seed=1), _ids(40, seed=2)])
    policy = _calibrated(model, windows[:1], "nvfp4")
    result = position_damage(model, windows, configurations(policy), edges=[8, 24, 99])
    assert set(result) == {"served", "centered", "all-FP8", "all-FP8, K scale x4",
                           "all-FP8, not centered", "FP8, scale 1"}
    for m in result.values():
        assert list(m["kl_by_pos"]) == ["0-8", "8-24", "24-40"]
        widths = [8, 16, 16]
        pooled = sum(w * v for w, v in zip(widths, m["kl_by_pos"].values())) / 40
        assert abs(pooled - m["kl"]) < 1e-5 and m["kl"] >= 0
        assert 0 <= m["top1"] <= 1
    # no sink flags in the policy: served and centered are the same policy
    assert result["served"] == result["centered"]
    assert 0 < result["all-FP8"]["kl"] < result["served"]["kl"]
    md = table(result)
    assert md.count("\n") == 2 + 6 and "| all-FP8 |" in md and "KL 24-40" in md

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


def test_k_range_is_the_calibrated_amax_on_the_calibration_tokens_and_grows_after():
    from studies.k_range_study import k_range, table as range_table

    model = tiny_model(num_layers=2)
    ids = _ids(40, seed=4)
    policy = _calibrated(model, ids[:, :16], "fp8")
    rows = k_range(model, ids[0].tolist(), policy, [16, 40])
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        assert abs(r["observed"]["16"] / r["calibrated"] - 1) < 1e-4
        assert r["observed"]["40"] >= r["observed"]["16"]
    assert range_table(rows).count("\n") == 2 + 2


def test_range_offsets_study_shifted_runs_bring_the_held_out_keys_into_range():
    """``studies/range_offsets_study.py``: keys of a held-out sequence as long as the served
    length exceed the K amax of short windows (> 1 in some layer) and are covered once those
    windows also run at the offsets (every layer's ratio at most the unshifted one's)."""
    from studies.range_offsets_study import study, table as offsets_table

    model = tiny_model(num_layers=2)
    calib = torch.cat([_ids(64, seed=5), _ids(64, seed=6)])
    held = _ids(1008, seed=7)
    result = study(model, calib, held, 1024, [0, 2], [2])
    plain, ranged = result["plans"]
    assert plain["offsets"] == [] and ranged["offsets"] == [480, 960] and ranged["forwards"] == 4
    assert plain["worst"] > 1.1 and ranged["worst"] < plain["worst"]
    assert all(r <= p + 1e-6 for r, p in zip(ranged["ratios"], plain["ratios"]))
    assert offsets_table(result).count("\n") == 2 + 2

"""studies/kv_rounding_sensitivity.py on a tiny random bf16 Llama: the FP32 projection
hook, the seeded perturbation, the comparison and its pooling over windows."""

from __future__ import annotations

import pytest
import torch

from studies import kv_rounding_sensitivity as krs
from vllm_nvfp4.calibration.modeling import load_model
from vllm_nvfp4.policy import KVPolicy
from vllm_nvfp4.testing.models import build_tiny_llama


@pytest.fixture(scope="module")
def tiny():
    model, _, info = load_model(build_tiny_llama(num_layers=2, dtype="bfloat16"))
    window = torch.randint(5, 4000, (96,), generator=torch.Generator().manual_seed(1))
    return model, info, window


def test_unperturbed_fp32_projections_match_the_model(tiny):
    model, _, window = tiny
    with torch.no_grad():
        plain = torch.log_softmax(model(window.view(1, -1)).logits[0, :-1].float(), -1)
    ref = krs.log_probs(model, window, None, None, 2.0 ** -16)
    assert (plain.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95
    assert (plain - ref).abs().mean() < 2e-3 * plain.abs().mean()  # bf16 vs FP32 rounding


def test_perturbation_is_seeded_and_grows_with_its_size(tiny):
    model, info, window = tiny
    policy = KVPolicy.from_compact("*:nvfp4", info.num_layers)
    ref = krs.log_probs(model, window, policy, None, 2.0 ** -16)
    a = krs.log_probs(model, window, policy, 3, 2.0 ** -6)
    b = krs.log_probs(model, window, policy, 3, 2.0 ** -6)
    assert torch.equal(a, b)
    targets = window[1:].long()
    same = krs.compare(ref, ref, targets)
    assert same["argmax_agreement"] == 1.0 and same["max_abs_dlogprob"] == 0.0
    small = krs.compare(ref, krs.log_probs(model, window, policy, 3, 2.0 ** -20), targets)
    big = krs.compare(ref, a, targets)
    assert 0.0 < big["mean_abs_dlogprob"] and small["mean_abs_dlogprob"] < big["mean_abs_dlogprob"]
    assert big["tokens"] == 95


def test_measure_pools_the_windows_by_tokens(tiny):
    model, info, window = tiny
    policy = KVPolicy.from_compact("*:nvfp4", info.num_layers)
    short = window[:40]
    rows = [krs.compare(krs.log_probs(model, w, policy, None, 2.0 ** -6),
                        krs.log_probs(model, w, policy, 5 + i, 2.0 ** -6), w[1:].long())
            for i, w in enumerate((window, short))]
    pooled = krs.measure(model, [window, short], policy, 5, 2.0 ** -6)
    assert pooled["tokens"] == 95 + 39
    assert pooled["mean_abs_dlogprob"] == pytest.approx(
        (95 * rows[0]["mean_abs_dlogprob"] + 39 * rows[1]["mean_abs_dlogprob"]) / 134)
    assert pooled["max_abs_dlogprob"] == max(r["max_abs_dlogprob"] for r in rows) > 0.0
    table = krs.markdown({"rows": [{"name": "nvfp4", "fp8_fraction": 0.5625, **pooled}]})
    assert table.splitlines()[2].startswith("| nvfp4 | 0.5625 | 134 | ")

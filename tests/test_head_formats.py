"""Per-head formats of the reference path: single KV heads of a K or V slot stored in the other
format (:class:`~studies.kv_options.HeadFormats`), everything else as the policy
stores it."""

from __future__ import annotations

import pytest
import torch

from studies.kv_options import HeadFormats
from vllm_nvfp4.calibration.kv_hooks import fake_quantize, kv_cache_quantization
from vllm_nvfp4.calibration.sensitivity import upgrade
from vllm_nvfp4.policy import KVPolicy

from tests.test_kv_hooks import _calibrated, _ids, _logits, _manual_forward, tiny_model


def _nvfp4_with_fp8_scales(model, ids) -> KVPolicy:
    """All-NVFP4 with calibrated FP8 scales kept next to the global scales (as ``all_format``)."""
    nv, f8 = _calibrated(model, ids, "nvfp4"), _calibrated(model, ids, "fp8")
    return KVPolicy(tuple(type(a)("nvfp4", "nvfp4", k_scale=b.k_scale, v_scale=b.v_scale,
                                  k_global_scale=a.k_global_scale, v_global_scale=a.v_global_scale)
                          for a, b in zip(nv.layers, f8.layers)))


def test_one_fp8_head_matches_the_hand_written_forward():
    """Head 1 of layer 0's K in FP8, head 0 and V NVFP4: the hooked forward equals the manual
    one that quantizes each head in its own format with the layer's scale for that format."""
    model = tiny_model(num_layers=1)
    ids = _ids()
    policy = _nvfp4_with_fp8_scales(model, ids)
    lp = policy.layers[0]

    def mixed_heads(i, k, v):
        ks = fake_quantize(k, "nvfp4", lp.k_global_scale).clone()
        ks[:, 1:2] = fake_quantize(k[:, 1:2], "fp8", lp.k_scale)
        return ks, fake_quantize(v, "nvfp4", lp.v_global_scale)

    with torch.no_grad():
        manual, _ = _manual_forward(model, ids, mixed_heads)
        with kv_cache_quantization(model, policy, options=[HeadFormats({(0, "k"): {1: "fp8"}})]):
            hooked = model(ids, use_cache=False).logits.float()
    torch.testing.assert_close(hooked, manual, atol=2e-5, rtol=2e-5)
    assert (hooked - _logits(model, ids, policy)).abs().max() > 1e-4  # the head's format changed


@pytest.mark.parametrize("kv", ["k", "v"])
def test_every_head_overridden_equals_the_slot_in_that_format(kv):
    model = tiny_model(num_layers=2)
    ids = _ids()
    policy = _nvfp4_with_fp8_scales(model, ids)
    every = HeadFormats({(1, kv): {0: "fp8", 1: "fp8"}})
    with torch.no_grad(), kv_cache_quantization(model, policy, options=[every]):
        hooked = model(ids, use_cache=False).logits.float()
    assert torch.equal(hooked, _logits(model, ids, upgrade(policy, 1, kv)))


def test_evaluator_resumes_at_the_first_overridden_layer():
    """With prefix reuse from the all-NVFP4 baseline, a head override in layer 1 scores exactly as
    the full forward does."""
    from vllm_nvfp4.calibration.evaluator import Evaluator

    model = tiny_model(num_layers=3)
    ids = _ids(n=40)
    policy = _nvfp4_with_fp8_scales(model, ids)
    heads = HeadFormats({(1, "k"): {0: "fp8"}})
    full = Evaluator(model, ids, reuse_prefix=False)
    full.reference()
    full.options = (heads,)
    reused = Evaluator(model, ids)
    reused.reference()
    base = reused.set_baseline(policy)
    reused.options = (heads,)
    assert reused.first_difference(policy) == 1
    with pytest.raises(ValueError, match="a baseline is the policy alone"):
        reused.set_baseline(policy)
    got, want = reused.measure(policy), full.measure(policy)
    assert got.kl == pytest.approx(want.kl, rel=1e-6) and got.kl != base.kl


def test_bad_head_formats_are_clear_errors():
    model = tiny_model(num_layers=1)
    ids = _ids()
    policy = _nvfp4_with_fp8_scales(model, ids)
    with pytest.raises(ValueError, match="'k' or 'v'"):
        HeadFormats({(0, "q"): {0: "fp8"}})
    with pytest.raises(ValueError, match="head must be an int"):
        HeadFormats({(0, "k"): {-1: "fp8"}})
    with pytest.raises(ValueError):
        HeadFormats({(0, "k"): {0: "int4"}})
    with pytest.raises(ValueError, match="the model has 2 KV heads"):
        with kv_cache_quantization(model, policy, options=[HeadFormats({(0, "k"): {2: "fp8"}})]):
            pass
    with pytest.raises(ValueError, match="the policy has 1 layers"):
        with kv_cache_quantization(model, policy, options=[HeadFormats({(1, "v"): {0: "fp8"}})]):
            pass
    with pytest.raises(ValueError, match="needs a policy"):
        with kv_cache_quantization(model, None, options=[HeadFormats({(0, "k"): {0: "fp8"}})]):
            pass


def test_study_reads_head_slots_and_ranks_by_kl_rise():
    from studies.head_format_study import _head_formats, _largest

    assert _head_formats(["14k2", "3v0", "14k0"], "fp8") == HeadFormats(
        {(14, "k"): {2: "fp8", 0: "fp8"}, (3, "v"): {0: "fp8"}})
    sweep = {"base": {"kl": 0.01},
             "slots": {"0k0": {"kl": 0.05}, "0k1": {"kl": 0.02}, "1v0": {"kl": 0.009}, "2k0": {"kl": 0.03}}}
    assert _largest(sweep, 2) == ["0k0", "2k0"]
    assert _largest(sweep, 10) == ["0k0", "2k0", "0k1"]  # a slot that lowered KL stays NVFP4

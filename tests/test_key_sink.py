"""Key sink of the reference path: the first keys of each sequence stored in FP8 (or exact) in
NVFP4-K layers, everything else as the policy stores it."""

from __future__ import annotations

import pytest
import torch

from studies.kv_options import KeySink
from vllm_nvfp4.calibration.kv_hooks import LayerQuant, fake_quantize, kv_cache_quantization
from vllm_nvfp4.policy import KVPolicy

from tests.test_kv_hooks import _calibrated, _ids, _logits, _manual_forward, tiny_model


def _keys_and_quant(center: bool):
    g = torch.Generator().manual_seed(3)
    key = torch.randn(1, 2, 9, 32, generator=g) * 3 + 2
    gs = torch.tensor([0.004, 0.002])  # NVFP4 global scale per KV head
    mu = torch.randn(2, 32, generator=g) if center else None
    return key, LayerQuant("nvfp4", "nvfp4", gs, gs, None, mu)


@pytest.mark.parametrize("center", [False, True])
def test_apply_replaces_only_the_first_keys(center):
    key, lq = _keys_and_quant(center)
    gs, mu = lq.k_scale, (torch.zeros(2, 32) if lq.k_center is None else lq.k_center)[:, None, :]
    centered = key - mu
    stored = fake_quantize(centered, "nvfp4", gs)

    def sunk(store, n=3):
        return KeySink(n, store).apply(stored, key, lq, "propagate")

    got = sunk("fp8")
    fp8 = fake_quantize(centered[..., :3, :], "fp8", gs * 6)
    assert torch.equal(got[..., :3, :], fp8)
    assert torch.equal(got[..., 3:, :], stored[..., 3:, :])
    assert not torch.equal(fp8, stored[..., :3, :])  # FP8 stores other values than NVFP4
    torch.testing.assert_close(sunk("exact")[..., :3, :], centered[..., :3, :], atol=1e-6, rtol=0)
    uncentered = fake_quantize(key[..., :3, :], "nvfp4", gs) - mu
    assert torch.equal(sunk("uncentered")[..., :3, :], uncentered)
    assert torch.equal(sunk("uncentered")[..., 3:, :], stored[..., 3:, :])
    if center:
        assert not torch.equal(uncentered, stored[..., :3, :])
    assert torch.equal(sunk("fp8", 50), fake_quantize(centered, "fp8", gs * 6))


def test_bad_sink_is_a_clear_error():
    with pytest.raises(ValueError, match="tokens >= 1"):
        KeySink(0)
    with pytest.raises(ValueError, match="fp8, exact, uncentered"):
        KeySink(1, "bf16")


@pytest.mark.parametrize("k_fmt", ["nvfp4", "fp8"])
def test_hooked_forward_stores_the_sink_keys_in_fp8(k_fmt):
    """Hooked forward with a key sink = the hand-written forward whose first 4 keys are FP8 at
    6x the NVFP4 global scale in NVFP4-K layers; FP8-K layers are not touched. One layer, so
    rounding-level input differences cannot flip a code downstream."""
    model = tiny_model(num_layers=1)
    ids = _ids()
    nv = _calibrated(model, ids, "nvfp4")
    lp = nv.layers[0]
    policy = KVPolicy((type(lp)(k_fmt, "nvfp4", k_scale=lp.k_scale, v_scale=lp.v_scale,
                                k_global_scale=lp.k_global_scale, v_global_scale=lp.v_global_scale),))
    g_k, g_v = lp.k_global_scale, lp.v_global_scale

    def sunk(i, k, v):
        ks = fake_quantize(k, k_fmt, g_k if k_fmt == "nvfp4" else lp.k_scale)
        if k_fmt == "nvfp4":
            ks = ks.clone()
            ks[..., :4, :] = fake_quantize(k[..., :4, :], "fp8", g_k * 6)
        return ks, fake_quantize(v, "nvfp4", g_v)

    with torch.no_grad():
        manual, _ = _manual_forward(model, ids, sunk)
        with kv_cache_quantization(model, policy, options=[KeySink(4)]):
            hooked = model(ids, use_cache=False).logits.float()
    torch.testing.assert_close(hooked, manual, atol=2e-5, rtol=2e-5)
    plain = _logits(model, ids, policy)
    if k_fmt == "nvfp4":
        assert (hooked - plain).abs().max() > 1e-4  # the sink changed the stored keys
    else:
        torch.testing.assert_close(hooked, plain, atol=0, rtol=0)


def test_evaluator_scores_with_the_sink():
    from vllm_nvfp4.calibration.evaluator import Evaluator

    model = tiny_model(num_layers=2)
    ids = _ids(n=40)
    policy = _calibrated(model, ids, "nvfp4")
    ev = Evaluator(model, ids, reuse_prefix=False, options=[KeySink(40, "exact")])
    ev.reference()
    exact_keys = ev.measure(policy).kl
    ev.options = ()
    assert ev.measure(policy).kl > exact_keys  # unquantized keys: less damage


def test_study_parses_sink_entries():
    from studies.sink_token_study import parse_sink

    assert parse_sink("uncentered:16") == (KeySink(16, "uncentered"),)
    assert parse_sink("uncentered-fit:1", frozenset({2})) == (KeySink(1, "uncentered", frozenset({2})),)
    assert parse_sink("uncentered-fit+fp8:1", frozenset({2}), range(4)) == (
        KeySink(1, "uncentered", frozenset({2})), KeySink(1, "fp8", frozenset({0, 1, 3})))
    for bad in ("bf16:1", "fp8", "fp8:x", "exact:0", "uncentered-fit+fp8:0"):
        with pytest.raises(SystemExit, match="expected STORE:N"):
            parse_sink(bad)


def test_sink_applies_only_to_its_layers():
    model = tiny_model(num_layers=2)
    ids = _ids()
    policy = _calibrated(model, ids, "nvfp4")
    with torch.no_grad():
        plain = _logits(model, ids, policy)
        with kv_cache_quantization(model, policy, options=[KeySink(4, "fp8", frozenset())]):
            none = model(ids, use_cache=False).logits.float()
        with kv_cache_quantization(model, policy, options=[KeySink(4, "fp8", frozenset({1}))]):
            last = model(ids, use_cache=False).logits.float()
    assert torch.equal(none, plain)
    assert (last - plain).abs().max() > 1e-4

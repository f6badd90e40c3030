"""``studies.kv_options.RotatingCenter`` and ``studies/rotating_center_study.py``: K centered on
the pre-RoPE key mean rotated to each key's position."""

from __future__ import annotations

import pytest
import torch

import studies.kv_options as kv_options
from studies.kv_options import RotatingCenter, rope_frequencies, rope_rotate, rope_unrotate
from studies.rotating_center_study import calibrate, check_rope
from vllm_nvfp4.calibration.kv_hooks import kv_cache_quantization

from tests.test_kv_hooks import _calibrated, _ids, tiny_model


def test_rotation_is_the_models_rope_and_inverts(monkeypatch):
    model = tiny_model(num_layers=2)
    ids = _ids(40, seed=3)
    assert check_rope(model, ids) < 1e-5
    assert check_rope(model, ids, offset=900) < 1e-5
    x = torch.randn(2, 40, 32)
    pos = torch.arange(500, 540)
    inv_freq, scaling = rope_frequencies(model)
    assert torch.allclose(rope_unrotate(rope_rotate(x, pos, inv_freq, scaling), pos, inv_freq, scaling),
                          x, atol=1e-5)
    # a slightly wrong frequency no longer reproduces the model's keys
    monkeypatch.setattr(kv_options, "rope_frequencies", lambda m: (inv_freq * 1.01, scaling))
    with pytest.raises(AssertionError):
        check_rope(model, ids, offset=900)


def _option(model, heads: int, seed: int = 0) -> RotatingCenter:
    g = torch.Generator().manual_seed(seed)
    inv_freq, scaling = rope_frequencies(model)
    layers = range(len(model.model.layers))
    return RotatingCenter(inv_freq, scaling,
                          {i: 3 * torch.randn(heads, 32, generator=g) for i in layers},
                          {i: torch.tensor([True] + [False] * (heads - 1)) for i in layers})


def test_with_exact_storage_the_option_changes_no_logits(monkeypatch):
    model = tiny_model(num_layers=2)
    ids = _ids(40, seed=5)
    policy = _calibrated(model, ids, "nvfp4")
    option = _option(model, heads=2)
    import vllm_nvfp4.calibration.kv_hooks as kv_hooks

    with torch.no_grad():
        ref = model(ids).logits
        with kv_cache_quantization(model, policy):
            plain = model(ids).logits
        with kv_cache_quantization(model, policy, options=[option]):
            quantized = model(ids).logits
        # the cache stores K and V exactly: only the option's offsets could move the logits
        exact_store = lambda x, fmt, scale, *a, dtype=None, **k: x.to(dtype or x.dtype)  # noqa: E731
        monkeypatch.setattr(kv_options, "fake_quantize", exact_store)
        monkeypatch.setattr(kv_hooks, "fake_quantize", exact_store)
        with kv_cache_quantization(model, policy, options=[option]):
            exact = model(ids).logits
    assert not torch.allclose(quantized, plain, atol=1e-3)  # the option stores other keys
    assert not torch.allclose(quantized, ref, atol=1e-3)  # and NVFP4 changes them
    torch.testing.assert_close(exact, ref, atol=1e-4, rtol=1e-4)


def test_the_option_refuses_a_centered_policy():
    from dataclasses import replace

    model = tiny_model(num_layers=2)
    policy = _calibrated(model, _ids(40, seed=5), "fp8")
    centered = replace(policy, layers=(replace(policy.layers[0], k_center=((0.0,) * 32,) * 2),
                                       policy.layers[1]))
    with pytest.raises(ValueError, match="replaces the K centering"):
        with kv_cache_quantization(model, centered, options=[_option(model, heads=2)]):
            pass


def _planted_runs() -> tuple[torch.Tensor, torch.Tensor, list]:
    """``(inv_freq, b, runs)``: keys ``R(p) b`` plus small noise (2 KV heads, head_dim 32) of one
    layer at positions 0 (twice), 500 and 900, 64 tokens each, as :func:`calibrate` takes them."""
    torch.manual_seed(0)
    inv_freq = 10000.0 ** (-torch.arange(0, 16) / 16)
    b = 4 * torch.randn(2, 32)
    seq, runs = 64, []
    for offset in (0, 0, 500, 900):
        pos = torch.arange(offset, offset + seq)
        keys = rope_rotate(b[:, None, :].expand(-1, seq, -1), pos, inv_freq) + 0.01 * torch.randn(2, seq, 32)
        runs.append((offset, {0: keys}))
    return inv_freq, b, runs


def test_calibration_recovers_a_planted_pre_rope_mean():
    inv_freq, b, runs = _planted_runs()
    cal = calibrate(runs, inv_freq, 1.0, served=1000, thetas=[0.5])
    assert torch.allclose(cal["b"][0], b, atol=0.02)
    # the rotating offset leaves only the noise; a constant mean leaves the far keys' drift
    assert cal["amax"]["rotating"][0] < 0.1 < cal["amax"]["policy mu"][0]
    kept = (torch.cat([inv_freq, inv_freq]) * 1000 < 0.5)
    assert cal["pairs_kept"][0.5] == int(kept[:16].sum()) > 0
    assert torch.equal(cal["slow_mu"][0.5][0] == 0, ~kept.expand(2, -1) | (cal["mu"][0] == 0))


def test_hybrid_with_every_pair_is_the_rotating_option_and_with_none_the_constant_centering():
    from dataclasses import replace

    from studies.kv_options import hybrid_offsets

    model = tiny_model(num_layers=2)
    ids = _ids(40, seed=5)
    policy = _calibrated(model, ids, "nvfp4")
    full = _option(model, heads=2)
    g = torch.Generator().manual_seed(1)
    mu = {i: torch.randn(2, 32, generator=g) for i in full.offsets}

    def hybrid(k: int) -> RotatingCenter:
        h = {i: hybrid_offsets(b, mu[i], k) for i, b in full.offsets.items()}
        return replace(full, offsets={i: x[0] for i, x in h.items()}, constant={i: x[1] for i, x in h.items()})

    with pytest.raises(ValueError, match="16 RoPE pairs"):
        hybrid_offsets(full.offsets[0], mu[0], 17)
    # k pairs per head, the (i, i + 16) pairs of largest |b_pair|
    b4, c4 = hybrid_offsets(full.offsets[0], mu[0], 4)
    norm = full.offsets[0].view(2, 2, 16).norm(dim=1)
    for h in range(2):
        kept = (b4[h, :16] != 0)
        assert torch.equal(kept, b4[h, 16:] != 0) and int(kept.sum()) == 4
        assert float(norm[h][kept].min()) >= float(norm[h][~kept].max())
        assert torch.equal(c4[h] == 0, torch.cat([kept, kept]))
    none = replace(hybrid(0), sink={i: torch.zeros(2, dtype=torch.bool) for i in full.offsets})
    centered = replace(policy, layers=tuple(replace(lp, k_center=tuple(tuple(map(float, r)) for r in mu[i]))
                                            for i, lp in enumerate(policy.layers)))
    with torch.no_grad():
        with kv_cache_quantization(model, policy, options=[full]):
            rotating = model(ids).logits
        with kv_cache_quantization(model, policy, options=[hybrid(16)]):
            every = model(ids).logits
        with kv_cache_quantization(model, policy, options=[none]):
            constant = model(ids).logits
        with kv_cache_quantization(model, centered):
            ref = model(ids).logits
    assert torch.equal(every, rotating)
    # the two paths sum in another order: ~1e-5 apart on some CPUs (no AVX-512)
    torch.testing.assert_close(constant, ref, atol=5e-5, rtol=1e-5)
    assert not torch.allclose(constant, rotating, atol=1e-3)


def test_calibration_of_the_hybrid_ends():
    inv_freq, _, runs = _planted_runs()
    cal = calibrate(runs, inv_freq, 1.0, served=1000, thetas=[], rot_pairs=[0, 4, 16])
    assert cal["amax"]["rotating 16"][0] == cal["amax"]["rotating"][0]
    assert cal["amax"]["rotating 0"][0] == cal["amax"]["policy mu"][0]
    assert cal["amax"]["rotating"][0] < cal["amax"]["rotating 4"][0] < cal["amax"]["policy mu"][0]

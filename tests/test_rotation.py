"""Rotations along head_dim: orthogonal matrices of the documented shape, and the calibration hook
stores rotated K/V while attention stays exact."""

from __future__ import annotations

import pytest
import torch

from studies.kv_options import KVRotation
from vllm_nvfp4.calibration.kv_hooks import KVObserver, fake_quantize, kv_cache_quantization
from vllm_nvfp4.policy import KVPolicy
from studies.rotation import ROTATIONS, rotate, rotation_matrix, unrotate

from tests.test_kv_hooks import _calibrated, _ids, _logits, _manual_forward, tiny_model


@pytest.mark.parametrize("kind", ROTATIONS)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_matrices_are_orthogonal_hadamards(kind, d):
    r = rotation_matrix(kind, d).double()
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    n = 16 if kind == "hadamard16" else d
    nonzero = r[r != 0].abs()
    assert nonzero.numel() == d * n  # block-diagonal: 16 non-zeros per row
    torch.testing.assert_close(nonzero, torch.full_like(nonzero, n ** -0.5))
    if kind == "hadamard16":
        assert bool((r[:16, 16:] == 0).all()) and bool((r[16:32, :16] == 0).all())


def test_sylvester_entries_and_random_signs():
    r = rotation_matrix("hadamard", 16) * 4
    assert r[0].tolist() == [1.0] * 16
    assert r[1].tolist() == [1.0, -1.0] * 8
    assert r[2].tolist() == [1.0, 1.0, -1.0, -1.0] * 4
    s = rotation_matrix("random_hadamard", 16) * 4
    signs = s[0]  # row 0 of H is all ones: it shows diag(s)
    assert set(signs.tolist()) == {1.0, -1.0}
    torch.testing.assert_close(s, r * signs)


@pytest.mark.parametrize("kind,d", [("hadamard", 48), ("hadamard16", 40), ("bogus", 64)])
def test_bad_rotation_is_a_clear_error(kind, d):
    with pytest.raises(ValueError, match="rotation|power of two|multiple"):
        rotation_matrix(kind, d)


def test_rotate_spreads_an_outlier_and_unrotate_inverts():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    r = rotation_matrix("hadamard", 64)
    torch.testing.assert_close(unrotate(rotate(x, r), r), x, atol=1e-5, rtol=1e-5)
    spike = torch.zeros(64)
    spike[7] = 8.0
    assert rotate(spike, r).abs().max().item() == pytest.approx(1.0)  # 8 / sqrt(64) everywhere


def test_rotation_without_quantization_leaves_the_model_unchanged():
    model = tiny_model(num_layers=2)
    ids = _ids()
    rot = KVRotation.every_layer("random_hadamard", 2)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with kv_cache_quantization(model, options=[rot]) as state:
            rotated = model(ids, use_cache=False).logits
    assert state.calls == 2
    torch.testing.assert_close(rotated, plain, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("rotate_v", [False, True])
@pytest.mark.parametrize("kind", ROTATIONS)
def test_rotated_nvfp4_stores_quant_of_rotated_kv(kind, rotate_v):
    """Hooked forward with K (and V) rotated = the hand-written forward whose K (V) is
    R^T deq(quant(R x)) - the rotated query and the back-rotated output are exactly that - and
    the observer sees the rotated vectors. One layer: in a deeper model, rounding-level input
    differences can flip an NVFP4 code in the next layer."""
    model = tiny_model(num_layers=1)
    ids = _ids()
    policy = _calibrated(model, ids, "nvfp4")
    g_k, g_v = policy.layers[0].k_global_scale, policy.layers[0].v_global_scale
    r = rotation_matrix(kind, 32)
    rot = KVRotation.every_layer(kind, 1, k=True, v=rotate_v)

    def rotated(i, k, v):
        v = unrotate(fake_quantize(rotate(v, r), "nvfp4", g_v), r) if rotate_v else fake_quantize(v, "nvfp4", g_v)
        return unrotate(fake_quantize(rotate(k, r), "nvfp4", g_k), r), v

    with torch.no_grad():
        manual, keys = _manual_forward(model, ids, rotated)
        obs = KVObserver(1)
        with kv_cache_quantization(model, policy, observer=obs, options=[rot]):
            hooked = model(ids, use_cache=False).logits.float()
    torch.testing.assert_close(hooked, manual, atol=2e-5, rtol=2e-5)
    assert (hooked - _logits(model, ids, policy)).abs().max() > 1e-3  # rotation changed the bytes
    torch.testing.assert_close(obs.k_amax[0], rotate(keys[0], r).abs().amax(dim=(0, 2, 3)))


def test_calibration_and_evaluator_see_the_rotation():
    """``observe_amax`` with a rotation calibrates on the rotated K/V, and an Evaluator with a
    rotation scores exactly the rotated hooked forward."""
    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.metrics import per_token_damage, reference_from_logits
    from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy

    model = tiny_model(num_layers=2)
    ids = _ids(n=40)
    rot = KVRotation.every_layer("hadamard", 2, k=True, v=False)
    r = rotation_matrix("hadamard", 32)
    plain_obs, rot_obs = observe_amax(model, ids, 2), observe_amax(model, ids, 2, options=[rot])
    with torch.no_grad():
        _, keys = _manual_forward(model, ids, lambda i, k, v: (k, v))
    torch.testing.assert_close(rot_obs.k_amax[1], rotate(keys[1], r).abs().amax(dim=(0, 2, 3)))
    torch.testing.assert_close(rot_obs.v_amax[1], plain_obs.v_amax[1])  # V not rotated
    policy = scaled_policy(KVPolicy.from_compact("*:nvfp4", 2), rot_obs, k_center=True)
    ev = Evaluator(model, ids, reuse_prefix=False, options=[rot])
    ev.reference()
    got = ev.measure(policy)
    with torch.no_grad():
        ref = reference_from_logits(model(ids, use_cache=False).logits[0], ids[0])
        with kv_cache_quantization(model, policy, options=[rot]):
            kl, _, _ = per_token_damage(model(ids, use_cache=False).logits[0], ref)
    assert got.kl == pytest.approx(float(kl.double().mean()), rel=1e-9)
    ev.options = ()
    assert ev.measure(policy).kl != pytest.approx(got.kl, rel=1e-3)  # unrotated: other damage

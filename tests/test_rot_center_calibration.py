"""Calibration of the rotating K center (policy ``k_rot``): the observer and the second pass against
the study's reference calibration, the fake-quantized reference against the study's option, the
CLI flag and the written policy."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from studies.kv_options import RotatingCenter, rope_frequencies
from studies.rotating_center_study import calibrate, collect_keys
from vllm_nvfp4.calibration import rot_center
from vllm_nvfp4.calibration.kv_hooks import (KVOption, LayerQuant, kv_cache_quantization,
                                             stored_keys_read_back)
from vllm_nvfp4.calibration.modeling import load_model
from vllm_nvfp4.calibration.rope import Rope, key_positions, model_rope
from vllm_nvfp4.calibration.scales import observe_calibration, scaled_policy
from vllm_nvfp4.cli import main
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.policy import KVPolicy, PolicyError, default_policy
from vllm_nvfp4.testing.models import build_tiny_llama

from test_calibration import make_text

#: an odd geometry: 3 KV heads of 48 channels (24 RoPE pairs), 5 rotated pairs
HEADS, DIM, PAIRS = 3, 48, 5


@pytest.fixture(scope="module")
def odd_model_dir() -> Path:
    return build_tiny_llama(num_layers=2, hidden=144, heads=6, kv_heads=HEADS, head_dim=DIM,
                            dtype="float32", max_pos=2048, seed=3)


@pytest.fixture(scope="module")
def odd_model(odd_model_dir: Path):
    model, _, info = load_model(odd_model_dir, "float32", "cpu")
    return model, info


def _windows(n: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 4096, (n, length), generator=g)


def test_key_positions_follow_the_forward_and_extend_a_cache():
    assert torch.equal(key_positions(torch.arange(7, 12)[None], 5), torch.arange(7, 12))
    # a cache of 3 earlier keys before 2 queries at 10, 11
    assert torch.equal(key_positions(torch.tensor([[10, 11]]), 5), torch.arange(7, 12))
    with pytest.raises(ValueError, match="position_ids"):
        key_positions(None, 4)
    with pytest.raises(ValueError, match="differ"):
        key_positions(torch.stack([torch.arange(4), torch.arange(1, 5)]), 4)


def test_rot_offset_is_exact_at_far_positions():
    """R(p) b_k with float64 angles: the float64 rotation to FP32 rounding at p ~ 1e5, where
    the model's FP32 angles (the study's rope_rotate) are off by ~1e-3 of |b|."""
    from studies.kv_options import rope_rotate
    from vllm_nvfp4.key_transform import rot_offset

    mu, rot, inv_freq = _random_rot(HEADS, DIM, PAIRS, seed=8)
    pos = torch.arange(100_000, 100_037)
    got = rot_offset(rot.idx, rot.b, rot.theta, pos, DIM).transpose(0, 1)  # [H, T, D]
    b = _scatter(rot, DIM).double()
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    half = DIM // 2
    rotated = torch.cat([-b[:, half:], b[:, :half]], dim=-1)
    exact = b[:, None] * ang.cos() + rotated[:, None] * ang.sin()
    assert float((got.double() - exact).abs().max()) < 1e-5 * float(b.abs().max())
    fp32 = rope_rotate(_scatter(rot, DIM)[:, None].expand(-1, len(pos), -1), pos, inv_freq)
    assert float((fp32.double() - exact).abs().max()) > 1e-4 * float(b.abs().max())
    assert torch.equal(got == 0, exact == 0)  # zero off the rotated pairs


def test_observer_and_second_pass_equal_the_study_calibration(odd_model):
    """b, the pairs, mu' and the K amax of the calibration equal calibrate() of
    studies/rotating_center_study.py on the same runs (2 windows at 0, then at 2 offsets)."""
    model, info = odd_model
    windows, offsets = _windows(2, 37, seed=1), (300, 901)
    observer, fits = observe_calibration(model, windows, info, offsets, k_rot_pairs=PAIRS)
    inv_freq, scaling = rope_frequencies(model)
    cal = calibrate(collect_keys(model, windows, offsets), inv_freq, scaling, served=1000,
                    thetas=[], rot_pairs=[PAIRS])
    assert fits is not None and sorted(fits) == [0, 1]
    for i, f in fits.items():
        b = cal["b"][i]
        assert b.abs().min() > 0  # random keys: no channel is 0
        torch.testing.assert_close(observer.k_pre_mean(i), b, atol=1e-5, rtol=1e-5)
        b_k, mu_k = cal["hybrid"][PAIRS][i]
        for h in range(HEADS):
            study_pairs = set(torch.nonzero(b_k[h, : DIM // 2]).flatten().tolist())
            assert set(f.rot.idx[h].tolist()) == study_pairs and len(study_pairs) == PAIRS
        torch.testing.assert_close(f.center, mu_k, atol=1e-5, rtol=1e-5)
        half = DIM // 2
        idx = f.rot.idx.long()
        torch.testing.assert_close(f.rot.b[:, 0], b.gather(1, idx) * scaling)
        torch.testing.assert_close(f.rot.b[:, 1], b.gather(1, idx + half) * scaling)
        assert torch.equal(f.rot.theta, inv_freq[idx])
        study_amax = cal["amax"][f"rotating {PAIRS}"][i]
        assert f.amax.shape == (HEADS,) and float(f.amax.max()) == pytest.approx(study_amax, rel=1e-5)
        # the rotating center stores no larger keys than the constant one (random weights: the
        # largest key may sit on a pair it does not rotate)
        assert study_amax <= cal["amax"]["policy mu"][i]


def _random_rot(heads: int, dim: int, pairs: int,
                seed: int) -> tuple[torch.Tensor, RotCenter, torch.Tensor]:
    """``(mu' [heads, dim], RotCenter, inv_freq [dim / 2])``: never-zero random offsets, ``mu'`` 0
    on the rotated pairs."""
    g = torch.Generator().manual_seed(seed)
    b = (torch.rand(heads, dim, generator=g) + 0.5) * torch.randn(heads, dim, generator=g).sign() * 2
    inv_freq = 10000.0 ** (-torch.arange(dim // 2) / (dim // 2))
    rot = RotCenter.top_pairs(b, inv_freq, pairs)
    mu = torch.rand(heads, dim, generator=g) + 0.5
    for h in range(heads):
        for i in rot.idx[h].tolist():
            mu[h, i] = mu[h, i + dim // 2] = 0.0
    return mu, rot, inv_freq


def _scatter(rot: RotCenter, dim: int) -> torch.Tensor:
    """``b_k`` of ``rot`` as a full ``[kv_heads, dim]`` tensor (0 off the pairs)."""
    idx = rot.idx.long()
    out = torch.zeros(rot.b.shape[0], dim)
    return out.scatter_(1, idx, rot.b[:, 0]).scatter_(1, idx + dim // 2, rot.b[:, 1])


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_fake_quantized_reference_is_the_study_option(fmt):
    """The hook's read-back of a k_rot layer is RotatingCenter.stored_key of the study (which
    holds K itself: the reference holds K - mu', the softmax-invariant constant)."""
    seq = 41
    mu, rot, inv_freq = _random_rot(HEADS, DIM, PAIRS, seed=2)
    g = torch.Generator().manual_seed(4)
    key = 3 * torch.randn(1, HEADS, seq, DIM, generator=g) + mu[:, None] + 1e-3
    query = torch.randn(1, 2 * HEADS, seq, DIM, generator=g)
    scale = 0.9 if fmt == "nvfp4" else 0.03
    sink = torch.tensor([True, False, True])
    quant = LayerQuant(fmt, fmt, scale, scale, k_center=mu, k_sink=sink, k_rot=rot)
    q, transformed, read_back = stored_keys_read_back(quant, query, key, torch.arange(seq))
    assert torch.equal(q, query)
    option = RotatingCenter(inv_freq, 1.0, {0: _scatter(rot, DIM)}, {0: sink}, {0: mu})
    plain = LayerQuant(fmt, fmt, scale, scale)
    study = option.stored_key(0, key.clone(), key, key, plain, "propagate", "exact")
    torch.testing.assert_close(read_back + mu[:, None], study, atol=1e-5, rtol=1e-5)
    # what is quantized is K - mu' - R(p) b_k, and quantization changes it
    off = option.rotated_offset(0, seq, key.device)  # R(p) b_k + mu'
    torch.testing.assert_close(transformed, key - off, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(read_back + mu[:, None], key, atol=1e-3)
    # position 0 of the flagged heads holds K_0 stored as computed (minus mu'), the others not
    from vllm_nvfp4.calibration.kv_hooks import fake_quantize

    k0 = fake_quantize(key[:, :, :1], fmt, scale) - mu[:, None]
    assert torch.allclose(read_back[:, sink, :1], k0[:, sink], atol=1e-6)
    assert not torch.allclose(read_back[:, 1, :1], k0[:, 1], atol=1e-3)


class _ReadBackTap(KVOption):
    """Records each layer's ``(raw key, read-back)`` of the last forward."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def stored_key(self, layer, stored, key, raw_key, quant,  # type: ignore[no-untyped-def]
                   nonfinite, nvfp4_decoding):
        self.seen[layer] = (raw_key, stored)
        return stored


def test_model_forwards_store_keys_as_the_study_option(odd_model):
    """In a model's forward (as the sensitivity and sink-choice forwards run it) a k_rot policy's
    layers read back RotatingCenter.stored_key of the study on the same keys, and the logits
    differ from the constant centering's."""
    model, info = odd_model
    ids = _windows(1, 40, seed=7)
    observer, fits = observe_calibration(model, ids, info, (), k_rot_pairs=PAIRS)
    fmt = KVPolicy.from_compact("*:nvfp4", info.num_layers)
    rot_policy = scaled_policy(fmt, observer, k_center=True, k_sink_uncentered=True, k_rot=fits)
    const = KVPolicy(tuple(replace(lp, k_rot=None) for lp in rot_policy.layers))
    inv_freq, scaling = rope_frequencies(model)
    sink = {i: torch.tensor(lp.sink_heads(HEADS) or (False,) * HEADS)
            for i, lp in enumerate(rot_policy.layers)}
    option = RotatingCenter(inv_freq, scaling, {i: _scatter(f.rot, DIM) / scaling for i, f in fits.items()},
                            sink, {i: f.center for i, f in fits.items()})
    tap = _ReadBackTap()
    with torch.no_grad():
        with kv_cache_quantization(model, rot_policy, options=[tap]):
            served = model(ids).logits
        with kv_cache_quantization(model, const):
            constant = model(ids).logits
    assert sorted(tap.seen) == [0, 1]
    for i, (raw, read_back) in tap.seen.items():
        plain = LayerQuant("nvfp4", "nvfp4", rot_policy.layers[i].k_global_scale, 1.0)
        study = option.stored_key(i, raw, raw, raw, plain, "propagate", "exact")
        torch.testing.assert_close(read_back + fits[i].center[:, None], study, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(served, constant, atol=1e-3)


def test_written_policy_validates_and_round_trips(odd_model, tmp_path: Path):
    model, info = odd_model
    observer, fits = observe_calibration(model, _windows(2, 33, seed=5), info, (500,),
                                         k_rot_pairs=PAIRS)
    policy = scaled_policy(default_policy(info.num_layers), observer, per_head=True,
                           k_center=True, k_sink_uncentered=True, k_rot=fits)
    for i, lp in enumerate(policy.layers):
        assert lp.k_rot is not None and lp.k_rot.num_pairs == PAIRS
        assert lp.k_center == tuple(tuple(float(x) for x in r) for r in fits[i].center)
        assert lp.k_scale == pytest.approx(tuple((fits[i].amax / 448).tolist()))
    path = tmp_path / "p.json"
    policy.save(path)
    again = KVPolicy.load(path)
    assert again.layers == policy.layers
    # the policy check refuses mu (not mu') under k_rot
    mu = observer.k_channel_mean(0)
    with pytest.raises(PolicyError, match="k_rot"):
        replace(policy.layers[0], k_center=tuple(tuple(float(x) for x in r) for r in mu))
    with pytest.raises(ValueError, match="needs k_center"):
        scaled_policy(default_policy(info.num_layers), observer, k_rot=fits)


def test_models_whose_rope_does_not_fit_get_no_k_rot(odd_model, caplog, monkeypatch):
    model, info = odd_model
    assert isinstance(model_rope(model, DIM), Rope)
    assert "partial" in model_rope(model, 2 * DIM)
    cfg = model.config
    monkeypatch.setattr(cfg, "rope_parameters", {**cfg.rope_parameters, "mrope_section": [4, 10, 10]})
    assert "M-RoPE" in model_rope(model, DIM)
    with caplog.at_level("WARNING"):
        observer, fits = observe_calibration(model, _windows(1, 20, seed=1), info, (), k_rot_pairs=4)
    assert fits is None and observer.rope is None
    assert "no rotating K center" in caplog.text and "M-RoPE" in caplog.text
    with pytest.raises(ValueError, match="1 .. 24"):
        rot_center.check_pairs(25, DIM)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_text(tmp_path_factory.mktemp("rot-data") / "text.txt", kb=20)


WIN = ["--window", "48", "--windows", "1", "--dtype", "float32", "--max-model-len", "400"]


@pytest.mark.parametrize("args, message", [
    (["--k-rot-pairs", "4"], "needs --k-center"),
    (["--k-center", "--k-rot-pairs", "4", "--k-smooth", "1"], "--k-smooth"),
    (["--k-center", "--k-rot-pairs", "4", "--k-permute"], "--k-permute"),
    (["--k-center", "--k-rot-pairs", "25"], "1 .. 24"),
])
def test_calibrate_flag_errors(odd_model_dir: Path, text: Path, tmp_path: Path, capsys, args, message):
    out = tmp_path / "p.json"
    rc = main(["-q", "calibrate", str(odd_model_dir), "--data", str(text), "--out", str(out), *WIN, *args])
    assert rc == 2 and message in capsys.readouterr().err and not out.exists()


def test_tune_refuses_k_rot_without_centering(odd_model_dir: Path, text: Path, tmp_path: Path, capsys):
    rc = main(["-q", "tune", str(odd_model_dir), "--data", str(text), "--report", str(tmp_path / "r"),
               "--no-k-center", "--k-rot-pairs", "4", *WIN])
    assert rc == 2 and "needs --k-center" in capsys.readouterr().err


def test_calibrate_writes_k_rot(odd_model_dir: Path, text: Path, tmp_path: Path):
    out = tmp_path / "p.json"
    assert main(["-q", "calibrate", str(odd_model_dir), "--data", str(text), "--out", str(out),
                 "--k-center", "--k-rot-pairs", "3", *WIN]) == 0
    policy = KVPolicy.load(out)
    assert policy.provenance["k_rot_pairs"] == 3
    assert all(lp.k_rot is not None and lp.k_rot.num_pairs == 3 for lp in policy.layers)
    raw = json.loads(out.read_text())
    assert "k_rot" in json.dumps(raw)


def test_tune_with_k_rot_pairs_serves_its_choices_with_the_rotating_center(text: Path, tmp_path: Path):
    model_dir = build_tiny_llama(tmp_path / "m", num_layers=2, hidden=144, heads=6, kv_heads=HEADS,
                                 head_dim=DIM, dtype="float32", max_pos=2048, seed=3)
    report = tmp_path / "r"
    assert main(["-q", "tune", str(model_dir), "--data", str(text), "--report", str(report),
                 "--k-rot-pairs", "4", *WIN]) == 0
    policy = KVPolicy.load(model_dir / "nvfp4_policy.json")
    assert all(lp.k_rot is not None and lp.k_rot.num_pairs == 4 for lp in policy.layers)
    settings = json.loads((report / "sensitivity.json").read_text())["settings"]
    assert settings["k_rot_pairs"] == 4 and settings["k_center"] is True
    assert KVPolicy.load(report / "scales.json").layers[0].k_rot == policy.layers[0].k_rot
    assert "--k-center --k-rot-pairs 4" in (report / "REPORT.md").read_text()


def test_smollm2_calibrate_writes_k_rot_rows(tmp_path: Path, text: Path):
    from vllm_nvfp4.testing.assets import assets_dir

    model_dir = assets_dir() / "SmolLM2-135M-Instruct"
    if not (model_dir / "config.json").is_file():
        pytest.skip("asset smollm2 not prepared (python scripts/prepare_assets.py smollm2)")
    out = tmp_path / "p.json"
    assert main(["-q", "calibrate", str(model_dir), "--data", str(text), "--out", str(out),
                 "--k-center", "--k-rot-pairs", "8", "--window", "64", "--windows", "1",
                 "--max-model-len", "256", "--device", "cpu"]) == 0
    policy = KVPolicy.load(out)
    rows = [lp for lp in policy.layers if lp.layer_type.holds_kv]
    assert rows and all(lp.k_rot is not None and lp.k_rot.num_pairs == 8 for lp in rows)
    theta = 100000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)  # SmolLM2: rope_theta 1e5, D 64
    for lp in rows:
        for pairs, th in zip(lp.k_rot.pairs, lp.k_rot.theta):
            torch.testing.assert_close(torch.tensor(th, dtype=torch.float64), theta[list(pairs)],
                                       rtol=1e-6, atol=0)

"""Position-shifted range calibration: the offsets, the observer's range-only statistics, and the
shifted windows of a tiny random Llama in transformers (RoPE: the keys a window stores at an
offset are those of the positions it is shifted to)."""

from __future__ import annotations

from dataclasses import replace

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_nvfp4.calibration.kv_hooks import KVObserver, kv_cache_quantization
from vllm_nvfp4.calibration.position_range import describe, range_offsets, served_length
from vllm_nvfp4.testing.models import build_tiny_llama


def test_offsets_are_evenly_spaced_up_to_the_served_length():
    assert range_offsets(8192, 1024) == (1792, 3584, 5376, 7168)
    assert range_offsets(8192, 1024, 7) == (1024, 2048, 3072, 4096, 5120, 6144, 7168)
    assert range_offsets(1100, 1024, 4) == (19, 38, 57, 76)
    assert range_offsets(1027, 1024, 4) == (1, 2, 3)  # fewer distinct offsets than asked
    assert range_offsets(1024, 1024) == range_offsets(512, 1024) == range_offsets(0, 1024) == ()
    assert range_offsets(8192, 1024, 0) == ()
    for max_len, window, count in ((4096, 1000, 3), (131072, 2048, 4), (5000, 17, 9)):
        offsets = range_offsets(max_len, window, count)
        assert len(offsets) == count and offsets == tuple(sorted(set(offsets)))
        assert offsets[0] > 0 and offsets[-1] + window == max_len  # the last run ends at max_len - 1


@pytest.mark.parametrize("args", [(8192, 0), (-1, 1024), (8192, 1024, -1)])
def test_offsets_refuse_bad_arguments(args):
    with pytest.raises(ValueError, match="range_offsets needs"):
        range_offsets(*args)


def test_served_length_defaults_to_the_model_positions_and_stays_within_them():
    assert served_length(None, 8192) == 8192 and served_length(None, None) == 0
    assert served_length(4096, 8192) == 4096 and served_length(0, 8192) == 0
    with pytest.raises(ValueError, match="exceeds the model's 8192 positions"):
        served_length(9000, 8192)
    with pytest.raises(ValueError, match=">= 0"):
        served_length(-5, 8192)
    assert describe(8192, (7168,)) == {"max_model_len": 8192, "offsets": [7168]}


def _kv(seed: int, scale: float, seq: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, seq, 16, generator=g) * scale + 0.5,
            torch.randn(2, 3, seq, 16, generator=g) * scale)


def test_range_only_observations_widen_the_range_and_nothing_else():
    """Inside ``range_only`` the amax and channel max/min take in the wider keys (not the first
    one of each sequence); the mean, sum of squares, first-key statistics and token count stay
    those of the position-0 windows."""
    obs, plain = KVObserver(1), KVObserver(1)
    k, v = _kv(0, 1.0)
    obs.observe(0, k, v)
    plain.observe(0, k, v)
    wide_k, wide_v = _kv(1, 5.0)
    wide_k[:, :, 0] = 1e4  # a sink key at a shifted position: never a served key
    with obs.range_only():
        obs.observe(0, wide_k, wide_v)
        with pytest.raises(RuntimeError, match="nested"):
            with obs.range_only():
                pass
    for name in ("k_channel_sum", "k_channel_sumsq", "k_first_max", "k_first_min"):
        assert torch.equal(getattr(obs, name)[0], getattr(plain, name)[0]), name
    assert obs.tokens == plain.tokens == [2 * 12] and obs.range_tokens == [2 * 11]
    assert torch.equal(obs.k_channel_mean(0), plain.k_channel_mean(0))
    assert torch.equal(obs.k_channel_rms(0, centered=True), plain.k_channel_rms(0, centered=True))
    rest_k, rest_v = wide_k[:, :, 1:].float(), wide_v[:, :, 1:].float()
    torch.testing.assert_close(obs.k_amax[0], torch.maximum(plain.k_amax[0], rest_k.abs().amax(dim=(0, 2, 3))))
    torch.testing.assert_close(obs.v_amax[0], torch.maximum(plain.v_amax[0], rest_v.abs().amax(dim=(0, 2, 3))))
    torch.testing.assert_close(obs.k_channel_max[0], torch.maximum(plain.k_channel_max[0], rest_k.amax(dim=(0, 2))))
    torch.testing.assert_close(obs.k_channel_min[0], torch.minimum(plain.k_channel_min[0], rest_k.amin(dim=(0, 2))))
    assert bool((obs.k_amax[0] > plain.k_amax[0]).all()) and float(obs.k_amax[0].max()) < 1e3
    assert bool((obs.k_centered_channel_amax(0) > plain.k_centered_channel_amax(0)).all())
    assert obs._range_only is False


def test_range_only_windows_do_not_count_as_observed():
    obs = KVObserver(2)
    k, v = _kv(2, 1.0)
    with obs.range_only():
        obs.observe(0, k, v)
        obs.observe(1, k[:, :, :1], v[:, :, :1])  # one key: the sink alone, nothing to take in
    assert obs.missing_layers() == [0, 1] and obs.k_amax[1] is None


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    path = build_tiny_llama(num_layers=3, dtype="float32")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 4096, (1, n), generator=torch.Generator().manual_seed(seed))


def _keys(model, ids: torch.Tensor, offset: int = 0) -> dict[int, torch.Tensor]:
    """Post-RoPE keys ``[1, kv_heads, T, D]`` per layer of ``ids`` run from position ``offset``."""
    from vllm_nvfp4.calibration.modeling import shifted_position_ids

    class Keys(KVObserver):
        def observe(self, layer, key, value):
            self.seen[layer] = key.clone()

    obs = Keys(3)
    obs.seen = {}
    with torch.no_grad(), kv_cache_quantization(model, observer=obs):
        model(ids, position_ids=shifted_position_ids(model, ids.shape[1], offset), use_cache=False)
    return obs.seen


def test_a_shifted_window_stores_the_keys_of_the_positions_it_is_shifted_to(tiny):
    """RoPE: the logits of a window do not depend on its offset, its layer-0 keys at offset o
    are those a long sequence holding its tokens at positions o.. stores there, and they differ
    from the unshifted window's (the offset reaches the rotation)."""
    from vllm_nvfp4.calibration.modeling import shifted_position_ids

    _, model = tiny
    window, offset = _ids(64, 1), 1500
    long = torch.cat([_ids(offset, 2), window, _ids(30, 3)], dim=1)
    with torch.no_grad():
        plain = model(window, use_cache=False).logits
        shifted = model(window, position_ids=shifted_position_ids(model, 64, offset), use_cache=False).logits
    # FP32 rounding of the rotation angles (1500 x theta): ~1e-5 relative
    assert float((shifted - plain).norm() / plain.norm()) < 1e-4
    at_offset, unshifted = _keys(model, window, offset), _keys(model, window)
    in_long = _keys(model, long)[0][:, :, offset:offset + 64]
    torch.testing.assert_close(at_offset[0], in_long, rtol=1e-5, atol=1e-5)
    for layer in range(3):
        assert float((at_offset[layer] - unshifted[layer]).norm() / unshifted[layer].norm()) > 0.1
    with pytest.raises(ValueError, match="outside the model's 4096 positions"):
        shifted_position_ids(model, 64, 4096 - 63)


def test_observe_amax_with_offsets_widens_only_the_range(tiny):
    """Offsets widen the K amax (>= everywhere, > somewhere) and leave the mean, RMS and first
    key as the windows at position 0 give them."""
    from vllm_nvfp4.calibration.scales import observe_amax

    _, model = tiny
    windows = torch.cat([_ids(128, 4), _ids(128, 5)])
    plain = observe_amax(model, windows, 3)
    ranged = observe_amax(model, windows, 3, offsets=range_offsets(4096, 128))
    widened = False
    for i in range(3):
        for name in ("k_channel_sum", "k_channel_sumsq", "k_first_max", "k_first_min"):
            torch.testing.assert_close(getattr(ranged, name)[i], getattr(plain, name)[i])
        assert bool((ranged.k_amax[i] >= plain.k_amax[i]).all())
        assert bool((ranged.k_centered_channel_amax(i) >= plain.k_centered_channel_amax(i)).all())
        widened |= bool((ranged.k_centered_channel_amax(i).amax(dim=1)
                         > 1.05 * plain.k_centered_channel_amax(i).amax(dim=1)).any())
    assert widened and ranged.tokens == plain.tokens == [256] * 3
    assert ranged.range_tokens == [4 * 2 * 127] * 3


def test_calibrate_covers_the_served_length(tiny, tmp_path: Path):
    """``run_calibrate``: by default the model's positions (4096), recorded in the provenance;
    the K scales at least those of ``max_model_len=0`` (off), the centering offsets equal."""
    from vllm_nvfp4.calibration.commands import run_calibrate

    path, _ = tiny
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 97} item{i % 13}." for i in range(3000)))
    args = dict(window=128, windows=2, dtype="float32", k_center=True)
    full, off = run_calibrate(path, [text], **args), run_calibrate(path, [text], max_model_len=0, **args)
    assert full.provenance["position_range"] == {"max_model_len": 4096,
                                                 "offsets": list(range_offsets(4096, 128))}
    assert off.provenance["position_range"] == {"max_model_len": 0, "offsets": []}
    assert all(f.k_scale >= o.k_scale for f, o in zip(full.layers, off.layers))
    assert any(f.k_scale > 1.05 * o.k_scale for f, o in zip(full.layers, off.layers))
    assert [f.k_center for f in full.layers] == [o.k_center for o in off.layers]
    with pytest.raises(ValueError, match="exceeds the model's 4096 positions"):
        run_calibrate(path, [text], max_model_len=5000, **args)


def test_cli_checks_the_served_length_before_loading(tiny, tmp_path: Path, capsys):
    from vllm_nvfp4.cli import main

    path, _ = tiny
    text = tmp_path / "t.txt"
    text.write_text("some words " * 50)
    assert main(["calibrate", str(path), "--data", str(text), "--out", str(tmp_path / "p.json"),
                 "--max-model-len", "5000"]) == 2
    assert "--max-model-len 5000 exceeds the model's 4096 positions" in capsys.readouterr().err
    assert main(["analyze", str(path), "--data", str(text), "--out", str(tmp_path / "r"),
                 "--scales", str(tmp_path / "p.json"), "--max-model-len", "1024"]) == 2
    assert "--max-model-len shape the calibration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", str(path), "--data", str(text), "--max-model-len", "-1"])


def test_startup_recipe_covers_max_model_len():
    """The start-up recipe runs its windows at the offsets up to vLLM's max_model_len, says so,
    counts them in its cost, and keys its cache on them (recipe version 9, with k_rot_pairs)."""
    from vllm_nvfp4.integration.startup_recipe import RECIPE_VERSION, describe_recipe, recipe_for, tokens_run
    from vllm_nvfp4.model_shape import ModelShape

    def config(max_len: int) -> SimpleNamespace:
        return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
                               model_config=SimpleNamespace(max_model_len=max_len))

    long, short = recipe_for(config(8192), 100_000, False), recipe_for(config(1024), 100_000, False)
    assert (long.window, long.windows, long.offsets) == (1024, 4, (1792, 3584, 5376, 7168))
    assert short.offsets == () and RECIPE_VERSION == 9
    assert short.k_rot_pairs == 0 and short.describe()["k_rot_pairs"] == 0
    assert long.describe()["position_range"] == {"max_model_len": 8192, "offsets": [1792, 3584, 5376, 7168]}
    assert long.describe() != recipe_for(config(4096), 100_000, False).describe()
    assert replace(long, k_rot_pairs=8).describe() != long.describe()
    shape = ModelShape(num_layers=4, total_num_kv_heads=2, num_kv_heads=2, head_dim=32,
                       dtype="float32", max_positions=8192)
    assert tokens_run(long, shape) - tokens_run(short, shape) == 4 * 4096
    assert "K/V range also at 4 position offsets up to max_model_len 8192" in describe_recipe(long, shape)


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_shifted_windows_run_on_local_global_and_sink_models(arch: str, tmp_path: Path):
    """Gemma 3 (local and global RoPE) and gpt-oss (sliding window, learned sinks) take the
    shifted position ids: the logits of a window stay those of the unshifted run, and the
    offsets widen the K range of every layer (>=) and of some (>)."""
    from transformers import AutoModelForCausalLM

    from vllm_nvfp4.calibration.hf_model import model_layer_types
    from vllm_nvfp4.calibration.modeling import shifted_position_ids
    from vllm_nvfp4.calibration.scales import observe_amax
    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid

    path = build_tiny_hybrid(arch, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = len(model_layer_types(model))
    window = _ids(48, 6)
    with torch.no_grad():
        plain = model(window, use_cache=False).logits
        shifted = model(window, position_ids=shifted_position_ids(model, 48, 700), use_cache=False).logits
    assert float((shifted - plain).norm() / plain.norm()) < 1e-3  # FP32 angles (gpt-oss: 2e-4)
    base = observe_amax(model, window, layers)
    ranged = observe_amax(model, window, layers, offsets=(300, 700))
    assert all(bool((r >= b).all()) for r, b in zip(ranged.k_channel_max, base.k_channel_max))
    assert any(bool((r > b).any()) for r, b in zip(ranged.k_channel_max, base.k_channel_max))

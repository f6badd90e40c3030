"""``vllm-nvfp4 tune`` (calibrate + analyze + select into the model directory) and the
``--device`` option with its memory check, on the tiny model on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT
from vllm_nvfp4.cli import main
from vllm_nvfp4.policy import KVPolicy

SMALL = ["--window", "64", "--windows", "1", "--dtype", "float32", "--device", "cpu"]


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    from vllm_nvfp4.testing.models import build_tiny_llama

    return build_tiny_llama(tmp_path / "llama", dtype="float32")


def test_tune_writes_the_policy_into_the_model_and_never_overwrites_it(model: Path, capsys):
    assert main(["-q", "tune", str(model), "--data", str(BUILTIN_TEXT), *SMALL]) == 0
    out = capsys.readouterr().out
    policy = KVPolicy.load(model / "nvfp4_policy.json")
    assert policy.fraction_of_fp8() <= 0.62 and policy.provenance["tool"]["command"] == "tune"
    assert all(lp.k_scale and lp.v_global_scale and lp.k_center for lp in policy.layers)
    assert policy.to_compact() in out and "measured delta NLL: selected" in out
    assert (model / "nvfp4_report" / "REPORT.md").is_file()
    first = (model / "nvfp4_policy.json").read_text()

    assert main(["-q", "tune", str(model), "--data", str(BUILTIN_TEXT), *SMALL]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (model / "nvfp4_policy.json").read_text() == first

    assert main(["-q", "tune", str(model), "--data", str(BUILTIN_TEXT), *SMALL, "--force",
                 "--no-measure", "--no-k-center", "--budget", "0.5625"]) == 0
    again = KVPolicy.load(model / "nvfp4_policy.json")
    assert again.to_compact() == "0-3:nvfp4" and all(lp.k_center is None for lp in again.layers)


def test_tune_rejects_a_budget_out_of_range_before_loading(model: Path, capsys):
    assert main(["-q", "tune", str(model), "--data", str(BUILTIN_TEXT), "--budget", "0.3"]) == 2
    assert "budget must lie between" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's error")
def test_device_cuda_without_cuda_is_a_usage_error(model: Path, tmp_path: Path, capsys):
    argv = ["calibrate", str(model), "--data", str(BUILTIN_TEXT), "--out", str(tmp_path / "p.json")]
    assert main([*argv, "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert main([*argv, "--device", "gpu0"]) == 2
    assert "--device must be one of" in capsys.readouterr().err


def test_memory_check_refuses_with_the_numbers(model: Path, tmp_path: Path, capsys, monkeypatch):
    from vllm_nvfp4.calibration import modeling

    est = modeling.memory_estimate(model, "float32", 256, 2)
    size = (model / "model.safetensors").stat().st_size / 2**30
    assert est["weights"] == pytest.approx(size)  # stored float32
    assert modeling.memory_estimate(model, "bfloat16", 256, 2)["weights"] == pytest.approx(size / 2)
    assert est["work"] > 2 * 256 * 4096 * 4 / 2**30  # at least the reference log-probs
    monkeypatch.setattr(modeling, "free_memory", lambda device: 1e-4)
    argv = ["analyze", str(model), "--data", str(BUILTIN_TEXT), "--out", str(tmp_path / "r"), *SMALL]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs about" in err and "GiB" in err and "only 0.0 GiB are free" in err


def _scored(monkeypatch, centered_shift: float = 0.0) -> list[bool]:
    """Record, per policy ``Evaluator.measure`` scores, whether its sink key is flagged; shift
    the KL of every policy without flags by ``centered_shift`` (the sink-key choice's centered
    variant: the analysis' scales flag the key where it fits)."""
    from dataclasses import replace

    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.sink_choice import has_sink_key

    seen: list[bool] = []
    real = Evaluator.measure

    def measure(self, policy, desc_progress=None):
        m = real(self, policy, desc_progress)
        if policy is None:
            return m
        seen.append(has_sink_key(policy))
        return m if seen[-1] else replace(m, kl=m.kl + centered_shift)

    monkeypatch.setattr(Evaluator, "measure", measure)
    return seen


def _selection(model: Path) -> dict:
    import json

    (path,) = (model / "nvfp4_report").glob("selection-*.json")
    return json.loads(path.read_text())


@pytest.mark.parametrize("centered_shift, kept", [(1.0, "uncentered"), (-1.0, "centered")])
def test_tune_measures_the_sink_key_both_ways_and_keeps_the_better(model: Path, capsys, monkeypatch,
                                                                   centered_shift, kept):
    """Unless the user chose, the selected policy is measured with its sink-key flags and without
    them; the lower KL is kept (each variant made to win once), recorded and printed."""
    seen = _scored(monkeypatch, centered_shift)
    assert main(["-q", "tune", str(model), "--data", str(BUILTIN_TEXT), *SMALL]) == 0
    sel = _selection(model)
    record = sel["sink_key"]
    assert record["chosen"] == kept and record["metric"] == "kl" and record["windows"] == 1
    assert seen.count(False) == 1  # the centered variant, once; the analysis' sweep: all flagged
    assert abs(record["centered"] - record["uncentered"]) > 0.5  # the shift, plus what they measured
    policy = KVPolicy.load(model / "nvfp4_policy.json")
    flags = [lp.k_sink_uncentered for lp in policy.layers]
    assert any(flags) if kept == "uncentered" else not any(flags)
    assert policy.provenance["selection"]["sink_key"] == record
    assert sel["selected"]["measured"]["kl"] == pytest.approx(record[kept], abs=1e-7)
    assert f"sink key {kept} (measured kl: uncentered " in capsys.readouterr().out
    assert f"- sink key {kept} (measured kl" in (model / "nvfp4_report" / "REPORT.md").read_text()


def test_tune_sink_key_scores_are_those_of_the_two_policies(model: Path):
    """Unpatched: the two recorded scores are the KL of the written policy with and without the
    analysis' flags, measured again by ``Evaluator`` on the same held-out window; they differ
    (the flags change the forward) and the lower one was kept."""
    from vllm_nvfp4.calibration.data import load_windows
    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.modeling import load_model
    from vllm_nvfp4.calibration.scales import with_formats
    from vllm_nvfp4.calibration.sink_choice import without_sink_key

    assert main(["-q", "tune", str(model), "--data", str(BUILTIN_TEXT), *SMALL, "--no-measure"]) == 0
    record = _selection(model)["sink_key"]
    assert "measured" not in _selection(model)["selected"]  # --no-measure: the sink key only
    flagged = with_formats(KVPolicy.load(model / "nvfp4_report" / "scales.json"),
                           KVPolicy.load(model / "nvfp4_policy.json"))
    lm, tokenizer, info = load_model(model, "float32", "cpu", 64, 1)
    toks = load_windows([BUILTIN_TEXT], tokenizer, 64, 1, 1, info.max_positions)
    ev = Evaluator(lm, toks.eval, reuse_prefix=False)
    ev.reference()
    measured = {"uncentered": ev.measure(flagged).kl, "centered": ev.measure(without_sink_key(flagged)).kl}
    assert measured == pytest.approx({k: record[k] for k in measured}, abs=1e-7)
    assert measured["uncentered"] != pytest.approx(measured["centered"], rel=1e-3)
    assert record["chosen"] == min(measured, key=measured.get)


@pytest.mark.parametrize("flag", ["--k-sink-uncentered", "--no-k-sink-uncentered"])
def test_tune_keeps_an_explicit_sink_key_flag_without_measuring_it(model: Path, monkeypatch, flag):
    seen = _scored(monkeypatch)
    assert main(["-q", "tune", str(model), "--data", str(BUILTIN_TEXT), *SMALL, flag]) == 0
    assert "sink_key" not in _selection(model)
    flags = [lp.k_sink_uncentered for lp in KVPolicy.load(model / "nvfp4_policy.json").layers]
    on = flag == "--k-sink-uncentered"
    assert any(flags) if on else not any(flags)
    assert all(seen) if on else not any(seen)  # no policy measured without the asked-for flags
    assert len(seen) == 1 + 2 * 4 + 2  # analysis: all-NVFP4, 8 slots; select: selected, naive

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

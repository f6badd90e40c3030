"""``vllm-nvfp4 doctor``: says why ``nvfp4_mixed`` would be refused, where vLLM cannot."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import vllm_subprocess_env
from vllm_nvfp4.cli import DOCTOR_BLOCKED, main
from vllm_nvfp4.doctor import FAIL, OK, WARN, Finding, report


def _lines(text: str, status: str) -> dict[str, str]:
    """``topic -> detail`` of the report lines with ``status``."""
    rows = [(line[2:6].strip(), line[8:26].strip(), line[27:]) for line in text.splitlines()]
    return {topic: detail for s, topic, detail in rows if s == status}


def test_plugin_left_out_of_vllm_plugins_is_the_named_cause():
    """``VLLM_PLUGINS=foo``: vLLM itself would only say "invalid choice"; doctor names the cause
    and exits 3. (A fresh process: nothing has registered the dtype yet.)"""
    env = vllm_subprocess_env(VLLM_PLUGINS="foo")
    run = subprocess.run([sys.executable, "-m", "vllm_nvfp4.cli", "doctor"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == DOCTOR_BLOCKED, run.stdout + run.stderr
    fails = _lines(run.stdout, FAIL)
    assert set(fails) == {"VLLM_PLUGINS", "kv_cache_dtype"}, run.stdout
    assert "VLLM_PLUGINS='foo' leaves it out; add nvfp4_mixed to VLLM_PLUGINS" in fails["VLLM_PLUGINS"]
    assert fails["kv_cache_dtype"].startswith("the plugin was not loaded (see above), so this vLLM")
    # in full: pydantic's message to its last accepted dtype and the input it refused
    assert "refuses nvfp4_mixed: ValidationError: cache_dtype: Input should be 'auto'" in fails["kv_cache_dtype"]
    assert fails["kv_cache_dtype"].endswith(" or 'nvfp4_4over6' (got 'nvfp4_mixed')"), fails["kv_cache_dtype"]
    assert run.stdout.splitlines()[-1] == "2 problems block kv_cache_dtype=nvfp4_mixed: see FAIL above"
    assert "Traceback" not in run.stderr


def test_healthy_setup_reports_the_policy_the_model_would_get(tiny_model_dir: Path, tmp_path: Path,
                                                           monkeypatch, capsys):
    """A model without a policy: doctor says that start-up calibrates and selects (what it runs,
    where it caches the result, an estimate of the cost), not the default rule; once that cache
    file exists, that it is reused, with its table. A given policy is reported as it is."""
    from vllm_nvfp4.policy import KVPolicy

    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_NVFP4_STARTUP_CALIBRATION", raising=False)
    monkeypatch.setenv("VLLM_NVFP4_CACHE", str(tmp_path / "cache"))
    assert main(["doctor", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert not _lines(out, FAIL) and not _lines(out, WARN)
    oks = _lines(out, OK)
    assert {"vllm-nvfp4", "torch", "vllm", "entry point", "VLLM_PLUGINS", "plugin", "kv_cache_dtype",
            "model", "start-up cost"} <= set(oks)
    assert oks["entry point"].startswith("vllm.general_plugins: nvfp4_mixed -> vllm_nvfp4.plugin:register")
    # 4 layers: 8 candidate slots; the budget allows 1 FP8 slot, the default rule has 4
    assert oks["model"].startswith(
        f"{tiny_model_dir}: no policy given, so start-up calibrates: K/V scales on 4096 tokens of "
        "the built-in text, 4 windows of 1024, their K/V range also at 4 position offsets up to "
        "max_model_len 4096 (4 more forwards of each window); then 9 forwards of 2048 tokens measure the 8 "
        "candidate K/V slots, and the 4 most sensitive stay FP8 (as many as the 0.62x FP8-bytes "
        "budget allows, at least as many as the default rule has there); 2 forwards of 2048 "
        "tokens choose whether the sink key is stored uncentered (by KL); the policy is cached in "
        f"{tmp_path / 'cache' / 'startup-calibration'}/"), oks["model"]
    assert "0:fp8" not in oks["model"]  # not the default rule's formats: start-up chooses them
    assert oks["start-up cost"].startswith("estimate: ~")
    assert "x 43008 tokens, scaled from SmolLM2-135M on a 2-core CPU: 637.8 s" in oks["start-up cost"]
    assert out.splitlines()[-1] == "nothing blocks kv_cache_dtype=nvfp4_mixed"

    cache_file = Path(oks["model"].split("the policy is cached in ")[1].split(" ")[0])
    cache_file.parent.mkdir(parents=True)
    KVPolicy.from_compact("0:k=fp8,v=nvfp4,*:nvfp4", 4).with_layer(0, k_scale=0.02).save(cache_file)
    assert main(["doctor", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert _lines(out, OK)["model"] == (
        f"{tiny_model_dir}: no policy given; start-up reuses its cached calibration. KV policy in "
        "force: 0:k=fp8,v=nvfp4,1-3:nvfp4 (0.617x FP8 bytes; 7 of 8 K/V scales default (not "
        f"calibrated); from start-up calibration (cached {cache_file}))")
    rows = out.split(f"(cached {cache_file}))")[1].splitlines()[1:5]
    assert rows == [f"{'':26s}   layer   0: K fp8   scale 0.02  V nvfp4 scale default",
                    *(f"{'':26s}   layer   {i}: K nvfp4 scale default  V nvfp4 scale default"
                      for i in (1, 2, 3))]
    assert "start-up cost" not in _lines(out, OK)

    monkeypatch.setenv("VLLM_NVFP4_POLICY", "*:fp8")
    assert main(["doctor", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert _lines(out, OK)["model"] == (f"{tiny_model_dir}: KV policy: 0-3:fp8 (1.000x FP8 bytes; "
                                        "default K/V scales (not calibrated); from $VLLM_NVFP4_POLICY)")
    assert "8 of 8 K/V slots have no calibrated scale" in _lines(out, WARN)["scales"]


def test_startup_cost_scales_from_the_measured_runs():
    """The estimate is the measured run's seconds times the ratio of parameters x tokens."""
    from vllm_nvfp4.doctor import startup_seconds

    seconds, ref = startup_seconds(134_515_008, 4 * 1024 + 61 * 2048, cuda=False)
    assert seconds == pytest.approx(637.8) and ref == "SmolLM2-135M on a 2-core CPU: 637.8 s"
    assert startup_seconds(2 * 134_515_008, 3 * 129_024, cuda=False)[0] == pytest.approx(6 * 637.8)
    seconds, ref = startup_seconds(8_030_261_248 / 2, 4 * 1024 + 65 * 2048, cuda=True)
    assert seconds == pytest.approx(2.45) and ref == "a Llama-3.1-8B-shaped model on one H200: 4.9 s"


def test_vllm_plugins_hint_reaches_the_cli(tmp_path: Path, monkeypatch, capsys):
    """Where vLLM cannot speak (it never loads the plugin), the ``vllm-nvfp4`` commands warn with
    the fix and point to ``doctor``; nothing when VLLM_PLUGINS is unset or names the plugin."""
    from vllm_nvfp4.doctor import vllm_plugins_hint

    assert vllm_plugins_hint({}) is None and vllm_plugins_hint({"VLLM_PLUGINS": "foo,nvfp4_mixed"}) is None
    monkeypatch.setenv("VLLM_PLUGINS", "foo,bar")
    assert main(["select", str(tmp_path), "--budget", "0.62"]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning == ("vllm-nvfp4 select: warning: kv_cache_dtype=nvfp4_mixed needs the vLLM plugin "
                       "'nvfp4_mixed' in every vLLM process, but VLLM_PLUGINS='foo,bar' leaves it "
                       "out; add nvfp4_mixed to VLLM_PLUGINS (or unset it). As it is, vLLM refuses "
                       "--kv-cache-dtype nvfp4_mixed (vllm serve: 'invalid choice'; LLM(): pydantic's "
                       "literal_error listing the dtypes it knows). `vllm-nvfp4 doctor` checks the "
                       "whole set-up")
    assert error.startswith("vllm-nvfp4 select: error: ")


def test_refusals_of_the_model_and_policy_are_named(tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_NVFP4_POLICY", str(tmp_path / "typo.json"))
    monkeypatch.setenv("VLLM_NVFP4_POLCY", "0:fp8,*:nvfp4")  # a misspelt name: nothing reads it
    assert main(["doctor", str(tiny_model_dir)]) == DOCTOR_BLOCKED
    out = capsys.readouterr().out
    assert f"policy file {tmp_path / 'typo.json'} (from $VLLM_NVFP4_POLICY) does not exist" in _lines(out, FAIL)["model"]
    assert "set, but vllm-nvfp4 reads no such variable" in _lines(out, WARN)["VLLM_NVFP4_POLCY"]
    monkeypatch.delenv("VLLM_NVFP4_POLICY")
    model = tmp_path / "hd40"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "head_dim": 40}))
    assert main(["doctor", str(model)]) == DOCTOR_BLOCKED
    assert "needs head_dim to be a multiple of 16" in _lines(capsys.readouterr().out, FAIL)["model"]


def test_not_a_model_directory_is_a_usage_error(tmp_path: Path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"vllm-nvfp4 doctor: error: {tmp_path} is not a model "
                                               "directory (no config.json)")


@pytest.mark.parametrize("statuses, verdict", [
    ([OK, WARN], "nothing blocks kv_cache_dtype=nvfp4_mixed"),
    ([OK, FAIL], "1 problem blocks kv_cache_dtype=nvfp4_mixed: see FAIL above"),
    ([FAIL, WARN, FAIL], "2 problems block kv_cache_dtype=nvfp4_mixed: see FAIL above"),
])
def test_report_counts_only_failures(statuses, verdict):
    text, blocking = report([Finding(s, f"t{i}", "detail") for i, s in enumerate(statuses)])
    assert blocking == statuses.count(FAIL) and text.splitlines()[-1] == verdict
    assert text.splitlines()[1] == f"  {statuses[0]:4s}  t0                 detail"

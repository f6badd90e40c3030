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
    assert "nvfp4_mixed" in fails["kv_cache_dtype"]
    assert run.stdout.splitlines()[-1] == "2 problems block kv_cache_dtype=nvfp4_mixed: see FAIL above"
    assert "Traceback" not in run.stderr


def test_healthy_setup_reports_the_policy_the_model_would_get(tiny_model_dir: Path, monkeypatch, capsys):
    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert main(["doctor", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert not _lines(out, FAIL)
    oks = _lines(out, OK)
    assert {"vllm-nvfp4", "torch", "vllm", "entry point", "VLLM_PLUGINS", "plugin", "kv_cache_dtype",
            "model"} <= set(oks)
    assert oks["entry point"].startswith("vllm.general_plugins: nvfp4_mixed -> vllm_nvfp4.plugin:register")
    assert oks["model"] == (f"{tiny_model_dir}: KV policy from default rule (first/last FP8): "
                            "0:fp8,1-2:nvfp4,3:fp8 (0.781x FP8 bytes)")
    assert "8 of 8 K/V slots have no calibrated scale" in _lines(out, WARN)["scales"]
    assert out.splitlines()[-1] == "nothing blocks kv_cache_dtype=nvfp4_mixed"


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

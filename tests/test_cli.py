"""The vllm-nvfp4 command line: clear failures on bad input, never overwriting without --force."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_nvfp4.cli import main
from vllm_nvfp4.policy import POLICY_FILENAME, KVPolicy

from test_calibration import make_text

WIN = ["--window", "64", "--windows", "1", "--dtype", "float32"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_text(tmp_path_factory.mktemp("cli-data") / "text.txt", kb=30)


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli-report") / "rep"
    assert main(["-q", "analyze", str(tiny_model_dir), "--data", str(data), "--out", str(out), *WIN]) == 0
    return out


def _err(capsys: pytest.CaptureFixture) -> str:
    return capsys.readouterr().err


def test_analyze_writes_report_and_refuses_to_overwrite(report: Path, tiny_model_dir: Path, data: Path, capsys):
    for name in ("sensitivity.json", "scales.json", "sensitivity.png", "damage_vs_bytes.png", "REPORT.md"):
        assert (report / name).is_file(), name
    before = (report / "sensitivity.json").read_bytes()
    rc = main(["-q", "analyze", str(tiny_model_dir), "--data", str(data), "--out", str(report), *WIN])
    err = _err(capsys)
    assert rc == 2 and "already holds a report" in err and "--force" in err
    assert (report / "sensitivity.json").read_bytes() == before


def test_calibrate_refuses_to_overwrite_without_force(tmp_path: Path, tiny_model_dir: Path, data: Path, capsys):
    out = tmp_path / "policy.json"
    out.write_text("my precious policy")
    args = ["-q", "calibrate", str(tiny_model_dir), "--data", str(data), "--out", str(out), *WIN]
    assert main(args) == 2
    assert "exists; refusing to overwrite" in _err(capsys)
    assert out.read_text() == "my precious policy"
    assert main([*args, "--force", "--policy", "0:fp8,*:nvfp4"]) == 0
    policy = KVPolicy.load(out)
    assert policy.to_compact() == "0:fp8,1-3:nvfp4" and policy.layers[1].k_global_scale is not None


def test_calibrate_k_center_and_analyze_refuses_flags_next_to_scales(tmp_path: Path, tiny_model_dir: Path,
                                                                     data: Path, capsys):
    """calibrate --k-center writes one offset per KV head and channel; analyze --scales with a
    calibration flag stops with a message (the policy's own calibration would silently win)."""
    out = tmp_path / "policy.json"
    assert main(["-q", "calibrate", str(tiny_model_dir), "--data", str(data), "--out", str(out),
                 "--k-center", "--k-smooth", "1", *WIN]) == 0
    policy = KVPolicy.load(out)
    assert all(lp.k_center is not None and lp.k_smooth is not None for lp in policy.layers)
    assert policy.provenance["k_center"] is True
    rc = main(["-q", "analyze", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "rep"),
               "--scales", str(out), "--k-center", *WIN])
    assert rc == 2 and "--k-center shape the calibration, which --scales replaces" in _err(capsys)


def test_calibrate_sink_key_option(tmp_path: Path, tiny_model_dir: Path, data: Path, capsys):
    """calibrate --k-center --k-sink-uncentered flags heads whose first key fits (recorded in the
    provenance); without K centering the option is refused; without the option no layer is
    flagged."""
    out = tmp_path / "policy.json"
    base = ["-q", "calibrate", str(tiny_model_dir), "--data", str(data), "--out", str(out), *WIN]
    assert main([*base, "--k-center"]) == 0
    assert all(lp.k_sink_uncentered is None for lp in KVPolicy.load(out).layers)
    assert main([*base, "--k-center", "--k-sink-uncentered", "--force"]) == 0
    policy = KVPolicy.load(out)
    assert policy.provenance["k_sink_uncentered"] is True
    assert any(lp.k_sink_uncentered is not None for lp in policy.layers)
    assert main([*base, "--k-sink-uncentered", "--force"]) == 2
    assert "--k-sink-uncentered stores the sink key without the K centering offsets" in _err(capsys)


@pytest.mark.parametrize("args, message", [
    (["calibrate", "/nonexistent/model", "--data", "x.txt", "--out", "p.json"], "not a model directory"),
    (["select", "/nonexistent/report", "--budget", "0.62", "--out", "{tmp}/p.json"], "run `vllm-nvfp4 analyze"),
    (["select", "{report}", "--budget", "0.3", "--out", "{tmp}/p.json"], "between 0.5625"),
    (["select", "{report}", "--fp8-slots", "99", "--out", "{tmp}/p.json"], "--fp8-slots must be"),
    (["select", "{report}", "--budget", "0.62"], "--out POLICY.json and/or --write-to-model"),
    (["select", "{report}", "--budget", "0.7", "--out", "{tmp}/nodir/p.json"], "does not exist"),
    (["calibrate", "{model}", "--data", "{tmp}/missing.txt", "--out", "{tmp}/p.json"], "data file"),
    (["calibrate", "{model}", "--data", "{data}", "--out", "{tmp}/p.json", "--policy", "0:fp9"], "unknown KV format"),
    (["calibrate", "{model}", "--data", "{data}", "--out", "{tmp}/p.json", "--window", "8192"], "exceeds"),
])
def test_bad_arguments_fail_clearly(args, message, tmp_path, report, tiny_model_dir, data, capsys):
    fill = dict(tmp=tmp_path, report=report, model=tiny_model_dir, data=data)
    rc = main(["-q", *[a.format(**fill) for a in args]])
    assert rc == 2
    err = _err(capsys)
    assert message in err and err.startswith(f"vllm-nvfp4 {args[0]}: error:"), err  # before any model load


@pytest.mark.parametrize("args", [
    ["select", "REPORT", "--budget", "0.62", "--fp8-slots", "3", "--out", "p.json"],  # exclusive
    ["select", "REPORT", "--out", "p.json"],  # budget or slots required
    ["analyze", "MODEL", "--out", "x"],  # --data required
    ["analyze", "MODEL", "--data", "d", "--out", "x", "--windows", "0"],
    ["frobnicate"],
])
def test_argparse_errors_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_select_writes_policy_and_model_dir_only_with_force(report: Path, tiny_model_dir: Path, tmp_path: Path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    out = tmp_path / "sel.json"
    base = ["-q", "select", str(report), "--budget", "0.7", "--no-measure"]
    assert main([*base, "--out", str(out), "--write-to-model", str(model)]) == 0
    policy = KVPolicy.load(model / POLICY_FILENAME)
    assert policy.fraction_of_fp8() <= 0.7
    assert json.loads(out.read_text()) == json.loads((model / POLICY_FILENAME).read_text())
    (model / POLICY_FILENAME).write_text("user edited")
    assert main([*base, "--write-to-model", str(model)]) == 2
    assert "refusing to overwrite" in _err(capsys)
    assert (model / POLICY_FILENAME).read_text() == "user edited"
    assert main([*base, "--write-to-model", str(model), "--force"]) == 0
    assert KVPolicy.load(model / POLICY_FILENAME).to_compact() == policy.to_compact()
    # a different model is refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 9}))
    assert main([*base, "--write-to-model", str(other)]) == 2
    assert "not the model that was analyzed" in _err(capsys)


def test_console_script_runs():
    exe = Path(sys.executable).parent / "vllm-nvfp4"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm_nvfp4.cli"]
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for sub in ("calibrate", "analyze", "select", "doctor"):
        assert sub in proc.stdout


# ------------------------------------------------------------------ malformed or partial input files
def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_json(path: Path, edit) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def _model_with_config(tiny_model_dir: Path, dest: Path, text: str) -> Path:
    shutil.copytree(tiny_model_dir, dest)
    (dest / "config.json").write_text(text)
    return dest


SELECT = ["--budget", "0.7", "--no-measure", "--out", "{tmp}/p.json"]


@pytest.mark.parametrize("command, damage, args, names, problem", [
    ("select", lambda rep: _truncate(rep / "sensitivity.json"), SELECT,
     "sensitivity.json", "malformed JSON at line"),
    ("select", lambda rep: (rep / "sensitivity.json").write_text(""), SELECT,
     "sensitivity.json", "malformed JSON at line 1 column 1: Expecting value"),
    ("select", lambda rep: _edit_json(rep / "sensitivity.json", lambda r: r.pop("configs")), SELECT,
     "sensitivity.json", "configs is missing"),
    ("select", lambda rep: _edit_json(rep / "sensitivity.json", lambda r: r["layers"].pop()), SELECT,
     "sensitivity.json", "model.num_layers is 4 but 3 layers are listed"),
    ("select", lambda rep: _edit_json(rep / "sensitivity.json", lambda r: r["layers"][2]["v"].update(kl="x")),
     SELECT, "sensitivity.json", "layers[2].v.kl must be a number, got 'x'"),
    ("select", lambda rep: _truncate(rep / "scales.json"), SELECT, "scales.json", "malformed JSON at line"),
    ("select", lambda rep: (rep / "scales.json").unlink(), SELECT, "scales.json", "does not exist"),
    ("select", lambda rep: (rep / "selection-3.json").write_text('{"fp8_slots": 3, "sel'), SELECT,
     "selection-3.json", "malformed JSON at line 1 column 18: Unterminated string"),
    ("select", lambda rep: (rep / "selection-3.json").write_text('{"fp8_slots": 3}'), SELECT,
     "selection-3.json", "metric is missing"),
    ("calibrate", None, ["{cut_model}", "--data", "{data}", "--out", "{tmp}/p.json", *WIN],
     "config.json", "cannot read config.json"),
    ("calibrate", None, ["{layerless_model}", "--data", "{data}", "--out", "{tmp}/p.json", *WIN],
     "config.json", "has no integer num_hidden_layers"),
    ("calibrate", None, ["{model}", "--data", "{tmp}/bin.txt", "--out", "{tmp}/p.json", *WIN],
     "bin.txt", "'utf-8' codec can't decode"),
    ("calibrate", None, ["{model}", "--data", "{tmp}/cut.jsonl", "--out", "{tmp}/p.json", *WIN],
     "cut.jsonl:2", "malformed JSON at column 10: Unterminated string"),
    ("calibrate", None, ["{model}", "--data", "{tmp}", "--out", "{tmp}/p.json", *WIN],
     "", "is a directory; name the files in it"),
    ("analyze", None, ["{model}", "--data", "{data}", "--out", "{tmp}/rep", "--scales", "{tmp}/cut.json", *WIN],
     "cut.json", "malformed JSON at line"),
    ("analyze", None, ["{model}", "--data", "{data}", "--out", "{tmp}/rep", "--scales", "{tmp}/headerless.json", *WIN],
     "headerless.json", "not a vllm-nvfp4 policy: it has no 'format' header; a policy file starts "
     '{{"format": "vllm-nvfp4-policy", "version": 1, ...}}; the policy file format is documented in '
     "vllm_nvfp4/policy/json_form.py; `vllm-nvfp4 calibrate`, `select` and `tune` write one"),
    ("analyze", None, ["{model}", "--data", "{data}", "--out", "{tmp}/rep", "--scales", "{tmp}/none.json", *WIN],
     "none.json", "policy file {tmp}/none.json does not exist"),
    ("analyze", None, ["{model}", "--data", "{data}", "--out", "{tmp}/rep", "--scales", "{tmp}/three.json", *WIN],
     "three.json", "describes 3 attention layers, but the model has 4"),
])
def test_malformed_input_files_exit_2_with_one_line(command, damage, args, names, problem, report: Path,
                                                    tiny_model_dir: Path, data: Path, tmp_path: Path, capsys):
    """Truncated, partial or foreign files: exit 2 and one line naming the file and the problem."""
    rep = tmp_path / "report"
    shutil.copytree(report, rep)
    if damage is not None:
        damage(rep)
    cfg = (tiny_model_dir / "config.json").read_text()
    fill = dict(tmp=tmp_path, data=data, model=tiny_model_dir, report=rep,
                cut_model=_model_with_config(tiny_model_dir, tmp_path / "cut_model", cfg[:60]),
                layerless_model=_model_with_config(
                    tiny_model_dir, tmp_path / "layerless",
                    json.dumps({k: v for k, v in json.loads(cfg).items() if k != "num_hidden_layers"})))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x81" * 64)
    (tmp_path / "cut.jsonl").write_text('{"text": "a complete record"}\n{"text": "cut\n')
    (tmp_path / "cut.json").write_text((report / "scales.json").read_text()[:150])
    (tmp_path / "headerless.json").write_text('{"layers": 3}')
    three = json.loads((report / "scales.json").read_text())
    three.update(num_layers=3, layers=three["layers"][:3])
    (tmp_path / "three.json").write_text(json.dumps(three))
    argv = [command, *([str(rep)] if command == "select" else []), *[a.format(**fill) for a in args]]
    assert main(["-q", *argv]) == 2
    err = _err(capsys).strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"vllm-nvfp4 {command}: error: "), err
    assert names in err and problem.format(tmp=tmp_path) in err, err
    assert "at at" not in err and not (tmp_path / "p.json").exists()

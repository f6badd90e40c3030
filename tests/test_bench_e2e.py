"""Fast CPU tests of the end-to-end benchmark's pieces (issue 7): no engine is started.

Covers argument parsing, the KV-capacity arithmetic (bytes per token, largest batch, stage
plan), the ratio targets and the table from synthetic records, the profile-trace classification,
the weight-less model directory and the driver's plugin metadata (entry-point discovery from a
clean PYTHONPATH-only interpreter). The full path (engines, stepping, serve) is exercised by
``python scripts/bench_e2e.py --out DIR --cpu-tiny`` (~2-3 min on 2 cores, too slow for here).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


mrm = _load("make_random_model")
be = _load("bench_e2e")

L8B = dict(num_layers=32, kv_heads=8, head_dim=128)


# ---------------------------------------------------------------- arguments

def test_parse_contexts_and_dtypes():
    assert be.parse_contexts("32k, 8192") == [32768, 8192]
    assert be.parse_contexts("0.5k") == [512]
    with pytest.raises(ValueError):
        be.parse_contexts("")
    with pytest.raises(ValueError):
        be.parse_contexts("-5")
    assert be.parse_dtypes("fp8,nvfp4-mixed") == ["fp8", "nvfp4-mixed"]
    assert be.parse_dtypes("all")[0] == be.REFERENCE
    with pytest.raises(ValueError, match="unknown"):
        be.parse_dtypes("fp4")


def test_parse_args_defaults_and_cpu_tiny():
    a = be.parse_args(["--out", "/tmp/x"])
    assert a.contexts == [32768, 8192] and a.dtypes[0] == "fp8"
    assert a.max_model_len == 32768 + a.headroom
    assert a.serve == [] and not a.cpu
    t = be.parse_args(["--out", "/tmp/x", "--cpu-tiny", "--steps", "7"])
    assert t.cpu and t.eager and t.preset == "tiny" and t.contexts == [64]
    assert t.steps == 7  # an explicit flag wins over the smoke defaults
    assert be.parse_args(["--out", "/x", "--serve", "none"]).serve == []
    assert be.parse_args(["--out", "/x", "--serve", "fp8,nvfp4-mixed"]).serve == ["fp8", "nvfp4-mixed"]
    with pytest.raises(SystemExit):
        be.parse_args(["--out", "/x", "--max-model-len", "1000"])
    b = be.parse_args(["--out", "/x", "--contexts", "8k", "--ttft-contexts", "32k"])
    assert b.max_model_len == 32768 + b.headroom  # TTFT-only contexts count too


def test_worker_command_round_trips():
    a = be.parse_args(["--out", "/tmp/x", "--contexts", "8k", "--profile", "--steps", "9",
                       "--mixed-policy", "0-1:fp8,*:nvfp4", "--model", "/m", "--ttft-contexts", "32k"])
    cmd = be.worker_command(a, "nvfp4-mixed", 123.0, {"8192": 40}, soft=100.0)
    assert cmd[1].endswith("bench_e2e.py")
    w = be.parse_args(cmd[2:])
    assert w.worker == "nvfp4-mixed" and w.deadline == 123.0 and w.ref_batches == {"8192": 40}
    assert w.soft_deadline == 100.0
    for k in ("contexts", "ttft_contexts", "steps", "profile", "mixed_policy", "model",
              "max_model_len", "headroom", "gpu_mem", "max_batch"):
        assert getattr(w, k) == getattr(a, k), k


# ---------------------------------------------------------------- capacity arithmetic

def test_kv_bytes_per_token_llama8b():
    fp8 = be.kv_bytes_per_token("fp8", **L8B)
    assert fp8 == 64 * 1024  # the 64 KiB per token
    assert be.kv_bytes_per_token("auto", **L8B) == 128 * 1024
    pol = be.mixed_policy(32)
    assert pol == "0-3:fp8,*:nvfp4"
    mixed = be.kv_bytes_per_token("nvfp4_mixed", formats=be.layer_formats(pol, 32), **L8B)
    assert mixed == 8 * (4 * 256 + 28 * 144)
    # 2 / (0.125 * 2 + 0.875 * 1.125) = 1.620 (the "1.67" is an arithmetic slip)
    assert fp8 / mixed == pytest.approx(1.6203, abs=1e-4)
    allnv = be.kv_bytes_per_token("nvfp4_mixed", formats=be.layer_formats("*:nvfp4", 32), **L8B)
    assert fp8 / allnv == pytest.approx(1 / 0.5625)
    with pytest.raises(ValueError):
        be.kv_bytes_per_token("nvfp4_mixed", **L8B)


def test_mixed_policy_small_models():
    assert be.mixed_policy(2) == "0:fp8,*:nvfp4"
    assert be.mixed_policy(8) == "0:fp8,*:nvfp4"
    assert be.mixed_policy(16) == "0-1:fp8,*:nvfp4"
    cfg = be.CONFIGS["nvfp4-mixed"]
    assert be.policy_for(cfg, 32) == "0-3:fp8,*:nvfp4"
    assert be.policy_for(cfg, 32, "0:fp8,31:fp8,*:nvfp4") == "0:fp8,31:fp8,*:nvfp4"
    assert be.policy_for(be.CONFIGS["fp8"], 32) is None
    assert be.policy_for(be.CONFIGS["nvfp4-all"], 32) == "*:nvfp4"


def test_max_batch_and_estimate():
    tokens = 100 * 2**30 // (64 * 1024)  # ~100 GiB of fp8 KV on the H200
    assert be.max_batch(tokens, 32768, 512, 16) == 49  # "about 48 sequences" (issue 7)
    assert be.max_batch(tokens, 8192, 512, 16) == 188
    assert be.max_batch(tokens, 8192, 512, 16, cap=128) == 128
    assert be.max_batch(100, 32768, 512, 16) == 0
    # the same KV bytes seen from an nvfp4_mixed engine give the same fp8 batch
    mixed_bpt = 40448
    kv = int(tokens * 1.6203) * mixed_bpt
    assert be.estimate_batch(kv, 64 * 1024, 32768, 512, 16) == 49


def test_plan_stages():
    assert be.plan_stages(80, 48) == [("16", 16), ("ref", 48), ("max", 80)]
    assert be.plan_stages(48, 48) == [("16", 16), ("ref+max", 48)]
    assert be.plan_stages(24, 48) == [("16", 16), ("max", 24)]
    assert be.plan_stages(10, 48) == [("max", 10)]
    assert be.plan_stages(16, None) == [("16+max", 16)]
    assert be.plan_stages(0, 48) == []


def test_capture_sizes_cover_every_stage_batch():
    sizes = be.capture_sizes_for(512)
    assert sizes == be.CAPTURE_SIZES and sizes == sorted(set(sizes))
    assert be.capture_sizes_for(80)[-1] == 80 and be.capture_sizes_for(0) == [1]


def test_deadline_share_and_percentile():
    assert be.deadline_share(0.0, 100.0, [1.0, 1.0, 2.0]) == pytest.approx(25.0)
    assert be.deadline_share(50.0, 40.0, [1.0]) == 50.0  # nothing left
    # hard: all but 100 s per later configuration; soft: the proportional share
    assert be.deadlines(0.0, 500.0, [1.0, 1.5, 0.7], 100.0) == (300.0, pytest.approx(156.25))
    assert be.deadlines(0.0, 500.0, [1.0], 100.0) == (500.0, 500.0)
    assert be.deadlines(0.0, 150.0, [1.0, 1.0, 1.0], 100.0) == (0.0, 0.0)
    assert be.percentile([], 50) is None
    assert be.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert be.percentile([0.0, 10.0], 99) == pytest.approx(9.9)


# ---------------------------------------------------------------- records, targets, table

def _records() -> list[dict]:
    def eng(c, cap, start=70.0):
        return dict(kind="engine", config=c, capacity_tokens=cap, engine_start_s=start,
                    max_batch={"32768": cap // 33280, "8192": cap // 8704})
    def dec(c, ctx, b, label, tps):
        return dict(kind="decode", config=c, context=ctx, batch=b, label=label, tok_per_s=tps,
                    tpot_ms=1000 * b / tps)
    return [
        eng("fp8", 1_600_000), eng("nvfp4-mixed", 2_592_000), eng("fp8-triton", 1_600_000),
        dict(kind="ttft", config="fp8", context=32768, ttft_s=2.0),
        dict(kind="ttft", config="nvfp4-mixed", context=32768, ttft_s=2.1),
        dict(kind="ttft", config="fp8", context=8192, ttft_s=0.5),
        dict(kind="ttft", config="nvfp4-mixed", context=8192, ttft_s=0.6),
        dec("fp8", 32768, 16, "16", 500.0), dec("fp8", 32768, 48, "ref+max", 1000.0),
        dec("fp8-triton", 32768, 48, "ref+max", 800.0),
        dec("nvfp4-mixed", 32768, 48, "ref", 1400.0), dec("nvfp4-mixed", 32768, 77, "max", 1900.0),
        dict(kind="error", config="auto", what="worker", error="boom"),
        dict(kind="serve", config="fp8", output_tok_per_s=5000.0, requests_done=64,
             latency_p50_s=1.0, latency_p99_s=2.0, ttft_p50_s=0.1, ttft_p99_s=0.3),
    ]


def test_compute_targets():
    t = be.compute_targets(_records(), [32768, 8192])
    assert t["capacity_vs_fp8"]["nvfp4-mixed"] == pytest.approx(1.62)
    assert t["target_capacity"]["met"] is False
    row = t["decode_vs_best_fp8"]["32768"]
    assert row["batch"] == 48 and row["best_fp8"] == "fp8" and row["nvfp4-mixed"] == 1.4
    assert row["nvfp4-mixed_at_own_max_batch"]["batch"] == 77
    assert row["nvfp4-mixed_at_own_max_batch"]["vs_best_fp8"] == 1.9
    assert t["target_decode_32k"] == dict(target=1.3, value=1.4, met=True)
    assert t["ttft_vs_fp8"]["8192"]["nvfp4-mixed"] == 1.2
    assert t["target_ttft"]["value"] == 1.2 and t["target_ttft"]["met"] is False


def test_compute_targets_without_fp8():
    recs = [r for r in _records() if r.get("config") not in ("fp8", "fp8-triton")]
    t = be.compute_targets(recs, [32768])
    assert t["target_capacity"]["value"] is None and t["target_decode_32k"]["met"] is None
    assert t["target_ttft"]["met"] is None


def test_summary_table_mentions_everything():
    recs = _records()
    text = be.summary_table(recs, be.compute_targets(recs, [32768, 8192]))
    assert "nvfp4-mixed" in text and "48:1400" in text and "ERROR" in text
    assert "serve fp8" in text and "target_decode_32k" in text


def test_summary_table_shows_the_newest_ttft():
    """A configuration re-measured after a prior run: the table (like the targets) takes the
    newest TTFT record, not the first one."""
    recs = [dict(kind="ttft", config="nvfp4-mixed", context=8192, ttft_s=5.195)] + _records()
    text = be.summary_table(recs, be.compute_targets(recs, [32768, 8192]))
    assert "   600.0" in text and "5195.0" not in text


def test_compute_targets_take_the_newest_decode():
    """A merged summary (an older run's records first): the decode ratios come from the newest
    fp8 reference and the newest nvfp4-mixed records, not the first ones."""
    old = [dict(kind="decode", config=c, context=32768, batch=48, label=lab, tok_per_s=tps,
                tpot_ms=1.0) for c, lab, tps in (("fp8", "ref+max", 2000.0),
                                                  ("nvfp4-mixed", "ref", 1000.0),
                                                  ("nvfp4-mixed", "max", 1100.0))]
    row = be.compute_targets(old + _records(), [32768])["decode_vs_best_fp8"]["32768"]
    assert row["nvfp4-mixed"] == 1.4 and row["nvfp4-mixed_at_own_max_batch"]["vs_best_fp8"] == 1.9


def test_recorder_round_trip_skips_cut_line(tmp_path):
    rec = be.Recorder(tmp_path / "r.jsonl", config="fp8")
    rec.write("ttft", context=8, ttft_s=0.1)
    with open(tmp_path / "r.jsonl", "a") as f:
        f.write('{"kind": "decode", "conf')  # a line cut by a kill
    got = be.read_records(tmp_path / "r.jsonl")
    assert len(got) == 1 and got[0]["config"] == "fp8" and got[0]["kind"] == "ttft"
    assert be.read_records(tmp_path / "missing.jsonl") == []


# ---------------------------------------------------------------- profile classification

def test_kernel_categories(tmp_path):
    names = {
        "flash_fwd_splitkv_kernel": "attention", "_decode_kernel": "attention",
        "kernel_unified_attention_2d": "attention", "_reduce_kernel": "attention",
        "_decode_keys_kernel": "attention", "_dequant_kv_kernel": "attention",
        "reshape_and_cache_flash_kernel": "kv_write", "_write_kv_kernel": "kv_write",
        "nvjet_tst_128x256_64x4_2x1_v_bz_TNT": "gemm", "sm90_xmma_gemm_bf16bf16": "gemm",
        "triton_red_fused_rms_norm_0": "other", "act_and_mul_kernel": "other",
    }
    for n, cat in names.items():
        assert be.kernel_category(n) == cat, n
    events = [dict(ph="X", cat="kernel", name=n, dur=10.0) for n in names]
    events.append(dict(ph="X", cat="cpu_op", name="aten::mm", dur=99.0))
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    cats = be.kernel_time_by_category(be.load_trace_events(path))
    assert cats == dict(attention=60.0, kv_write=20.0, gemm=20.0, other=20.0, total=120.0)


# ---------------------------------------------------------------- model directory

def test_make_random_model_llama8b(tmp_path):
    out = mrm.make_random_model(tmp_path / "m", "llama8b")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]) == \
        (32, 32, 8, 128, 4096, 14336, 128256)
    assert not list(out.glob("*.safetensors"))  # weights come from load_format="dummy"
    assert mrm.weight_bytes("llama8b") == pytest.approx(16.06e9, rel=1e-3)
    assert mrm.make_random_model(out, "llama8b") == out  # reused


def test_random_model_tokenizer_decodes_every_id(tmp_path):
    from tokenizers import Tokenizer

    out = mrm.make_random_model(tmp_path / "t", "tiny")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert tok.get_vocab_size() == vocab
    ids = tok.encode("def f(x): return x + 1").ids
    assert tok.decode(ids) == "def f(x): return x + 1"
    assert tok.decode([vocab - 1]).startswith("tok")
    assert tok.token_to_id("</s>") == 2


# ---------------------------------------------------------------- driver: plugin metadata

def test_driver_plugin_metadata_is_discovered(tmp_path):
    """The dist-info the GPU driver writes makes the entry point visible from PYTHONPATH alone."""
    script = (SCRIPTS / "gpu_bench_e2e.sh").read_text()
    start = script.index("write_plugin_meta() {")
    func = script[start:script.index("\n}\n", start) + 3]
    meta, clean = tmp_path / "meta", tmp_path / "repo"
    shutil.copytree(REPO / "vllm_nvfp4", clean / "vllm_nvfp4",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(PATH=os.environ.get("PATH", "/usr/bin:/bin"), REPO=str(REPO), PYTHON=sys.executable)
    subprocess.run(["bash", "-c", func + f'\nwrite_plugin_meta "{meta}"'], check=True, env=env)
    probe = ("from importlib.metadata import entry_points, version\n"
             "eps = [e for e in entry_points(group='vllm.general_plugins')]\n"
             "print([(e.name, e.value) for e in eps])\n"
             "fn = eps[0].load() if eps else None\n"
             "print(fn.__module__ if fn else None, version('vllm-nvfp4') if eps else None)\n")
    for path, expect in ((f"{clean}", "[]"),
                         (f"{clean}{os.pathsep}{meta}", "[('nvfp4_mixed', 'vllm_nvfp4.plugin:register')]")):
        # -S: no site-packages (the dev venv has the package installed); cwd: a folder without metadata
        res = subprocess.run([sys.executable, "-S", "-c", probe], env=dict(env, PYTHONPATH=path),
                             cwd=tmp_path, capture_output=True, text=True, check=True)
        assert res.stdout.splitlines()[0] == expect, res.stdout + res.stderr
    assert res.stdout.splitlines()[1] == "vllm_nvfp4.plugin 0.1.0"


def test_plot_summary(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"records": _records()}))
    files = be.plot_summary(path, tmp_path / "img")
    assert [f.name for f in files] == ["e2e_capacity.png", "e2e_decode.png"]
    assert all(f.stat().st_size > 1000 for f in files)
    assert be.parse_args(["--plot", str(path)]).plot == str(path)
    with pytest.raises(SystemExit):
        be.parse_args([])  # --out is required without --plot


def test_compute_targets_ref_batch_estimated_differently():
    recs = [r for r in _records() if not (r.get("config") == "nvfp4-mixed" and r["kind"] == "decode")]
    recs.append(dict(kind="decode", config="nvfp4-mixed", context=32768, batch=49, label="ref",
                     tok_per_s=1500.0, tpot_ms=32.0))
    row = be.compute_targets(recs, [32768])["decode_vs_best_fp8"]["32768"]
    assert row["nvfp4-mixed"] == 1.5 and row["nvfp4-mixed_batch"] == 49

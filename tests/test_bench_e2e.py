"""CPU tests of the end-to-end benchmark package ``benchmarks.e2e`` (no engine is started).

Covers the command line (and a ``--dry-run`` of the entry point), the capacity arithmetic against
the library's, the stage plan, the optional budget, records and their merging, ratios, targets
from the shipped TOML file, the table, the kernel split of a generated trace, the ``vllm bench
serve`` command (parsed by vLLM's own parser) and result fields, the model shape of a weight-less
model directory, the plugin dist-info for a vLLM without pip, the plots, engine stepping against a
scripted engine, and the server health poll and process-group stop. The real engine path is
exercised by ``python -m benchmarks.e2e --out DIR --cpu-tiny`` (minutes on 2 cores).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import time
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.e2e import budget, capacity, configs, orchestrate, records, report, serve, trace
from benchmarks.e2e.cli import DEFAULT_TARGETS, parse_args
from benchmarks.e2e.worker import engine_kwargs
from vllm_nvfp4.integration.block_sizes import hybrid_plan
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.policy import FULL_ATTENTION, KVPolicy, LayerType
from vllm_nvfp4.testing.weightless import build_weightless_model

REPO = Path(__file__).resolve().parent.parent
L8B = ModelShape(num_layers=32, total_num_kv_heads=8, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                 max_positions=131072, layer_types=(FULL_ATTENTION,) * 32)
#: gpt-oss-20b's attention: sliding 128 on even layers, full on odd, sinks (a config has no flag)
GPT_OSS = ModelShape(
    num_layers=24, total_num_kv_heads=8, num_kv_heads=8, head_dim=64, dtype="bfloat16",
    max_positions=131072, layer_types=tuple(LayerType("sliding", 128, True) if i % 2 == 0
                                        else LayerType("full", None, True) for i in range(24)))


# ---------------------------------------------------------------- command line

def test_parse_contexts_and_dtypes():
    assert configs.parse_contexts("32k, 8192") == [32768, 8192]
    assert configs.parse_contexts("0.5k") == [512]
    for bad in ("", "-5", "abc"):
        with pytest.raises(ValueError):
            configs.parse_contexts(bad)
    assert configs.parse_dtypes("fp8,nvfp4-mixed") == ["fp8", "nvfp4-mixed"]
    assert configs.parse_dtypes("all")[0] == configs.REFERENCE
    assert configs.parse_dtypes("none") == []
    with pytest.raises(ValueError, match="unknown configuration"):
        configs.parse_dtypes("fp4")


def test_parse_args_defaults_and_cpu_tiny(capsys):
    a = parse_args(["--out", "/tmp/x"])
    assert a.contexts == [32768, 8192] and a.dtypes == ["fp8", "nvfp4-mixed", "auto"]
    assert a.max_model_len == 32768 + a.headroom and a.serve == [] and not a.cpu
    assert a.budget_s is None and a.targets == str(DEFAULT_TARGETS)
    t = parse_args(["--out", "/tmp/x", "--cpu-tiny", "--steps", "7"])
    assert t.cpu and t.eager and t.preset == "tiny" and t.contexts == [64] and t.gpu_mem == 0.3
    assert t.steps == 7  # an explicit flag wins over the smoke defaults
    assert parse_args(["--out", "/x", "--serve", "fp8,nvfp4-mixed"]).serve == ["fp8", "nvfp4-mixed"]
    assert parse_args(["--out", "/x", "--targets", "none"]).targets is None
    b = parse_args(["--out", "/x", "--contexts", "8k", "--ttft-contexts", "32k"])
    assert b.max_model_len == 32768 + b.headroom  # TTFT-only contexts count too
    for argv, msg in ((["--out", "/x", "--max-model-len", "1000"], "largest context"),
                      (["--out", "/x", "--dtypes", "fp4"], "unknown configuration"),
                      ([], "--out is required")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert msg in capsys.readouterr().err


def test_worker_spec_round_trips_through_json(tmp_path):
    a = parse_args(["--out", str(tmp_path), "--contexts", "8k", "--profile", "--mixed-policy",
                    "0-1:fp8,*:nvfp4", "--model", "/m", "--ttft-contexts", "32k"])
    spec = orchestrate.worker_spec(a, "nvfp4-mixed", math.inf, 100.0, {"8192": 40})
    w = Namespace(**json.loads(json.dumps(spec)))
    assert w.config == "nvfp4-mixed" and w.deadline == math.inf and w.soft_deadline == 100.0
    assert w.ref_batches == {"8192": 40}
    for k in ("contexts", "ttft_contexts", "steps", "profile", "mixed_policy", "model", "max_model_len",
              "headroom", "gpu_mem", "max_batch", "out"):
        assert getattr(w, k) == getattr(a, k), k
    assert orchestrate.worker_command(tmp_path / "s.json")[1:3] == ["-m", "benchmarks.e2e.worker"]


def test_engine_kwargs():
    a = parse_args(["--out", "/x", "--model", "/m", "--max-batch", "80", "--profile"])
    kw = engine_kwargs(a, "fp8", "FLASH_ATTN")
    assert kw["compilation_config"]["cudagraph_capture_sizes"][-1] == 80
    assert kw["attention_backend"] == "FLASH_ATTN" and kw["load_format"] == "dummy"
    assert kw["profiler_config"]["profiler"] == "torch" and not kw["enable_prefix_caching"]
    cpu = engine_kwargs(parse_args(["--out", "/x", "--model", "/m", "--cpu-tiny"]), "fp8", "FLASH_ATTN")
    assert cpu["enforce_eager"] and "attention_backend" not in cpu and "compilation_config" not in cpu
    extra = parse_args(["--out", "/x", "--model", "/m", "--engine-args",
                        '{"async_scheduling": false, "enable_prefix_caching": true}'])
    kw = engine_kwargs(extra, "nvfp4_mixed", None)
    assert kw["async_scheduling"] is False and kw["enable_prefix_caching"] is True
    for bad in ("[1]", "{oops", '{"kv_cache_dtype": "fp8"}'):
        with pytest.raises(SystemExit):
            parse_args(["--out", "/x", "--engine-args", bad])


def test_dry_run_prints_the_plan(tmp_path):
    """The entry point end to end without an engine: model written, bytes per token, commands."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.e2e", "--out", str(tmp_path / "o"),
                          "--cpu-tiny", "--model-dir", str(tmp_path / "m"), "--serve", "nvfp4-mixed",
                          "--dry-run"], cwd=REPO, capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    assert plan["model"]["num_layers"] == 2 and plan["model"]["head_dim"] == 32
    mixed = plan["configs"]["nvfp4-mixed"]
    assert mixed["policy"] == "0:fp8,*:nvfp4"
    assert mixed["kv_bytes_per_token"] == 2 * (2 * 32 + 2 * 18)  # layer 0 FP8, layer 1 NVFP4
    assert plan["configs"]["auto"]["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 2
    assert "--kv-cache-dtype nvfp4_mixed" in plan["serve"]["nvfp4-mixed"]["server"]
    assert not (tmp_path / "o" / records.RECORDS).exists()


def test_a_merge_only_run_summarizes_earlier_records(tmp_path):
    """``--dtypes none --prior-records``: no engine, the records merged, each run's machine kept."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    engine = dict(kind="engine", engine_start_s=5.0)
    recs = [dict(engine, config="fp8", capacity_tokens=100, max_batch={"64": 4}),
            dict(engine, config="nvfp4-mixed", capacity_tokens=162, max_batch={"64": 6}),
            dict(kind="decode", config="fp8", context=64, batch=4, label="ref+max", tok_per_s=10.0,
                 tpot_ms=400.0),
            dict(kind="decode", config="nvfp4-mixed", context=64, batch=4, label="ref", tok_per_s=15.0,
                 tpot_ms=266.7)]
    (run_dir / records.RECORDS).write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run_dir / orchestrate.SUMMARY).write_text(json.dumps({"versions": {"gpu": "NVIDIA H100, 1"}}))
    subprocess.run([sys.executable, "-m", "benchmarks.e2e", "--out", str(tmp_path / "o"), "--cpu-tiny",
                    "--model-dir", str(tmp_path / "m"), "--dtypes", "none", "--contexts", "64",
                    "--prior-records", str(run_dir / records.RECORDS)],
                   cwd=REPO, capture_output=True, text=True, check=True)
    summary = json.loads((tmp_path / "o" / orchestrate.SUMMARY).read_text())
    assert summary["ratios"]["decode_vs_fp8"]["64"]["nvfp4-mixed"] == 1.5
    assert summary["prior_versions"] == {str(run_dir / records.RECORDS): {"gpu": "NVIDIA H100, 1"}}
    assert summary["model"]["preset"] == "tiny"  # the preset whose model it wrote


# ---------------------------------------------------------------- capacity arithmetic

def test_kv_bytes_per_token_llama8b_matches_the_library():
    fp8 = capacity.kv_bytes_per_token("fp8", L8B)
    assert fp8 == 64 * 1024
    assert capacity.kv_bytes_per_token("auto", L8B) == 128 * 1024  # bf16
    pol = configs.mixed_policy(32)
    assert pol == "0-3:fp8,*:nvfp4"
    mixed = capacity.kv_bytes_per_token("nvfp4_mixed", L8B, pol)
    assert mixed == 8 * (4 * 256 + 28 * 144)  # 8 KV heads x (FP8 2 x 128, NVFP4 2 x (64 + 8)) B
    lib = KVPolicy.from_compact(pol, 32)
    assert mixed == lib.kv_bytes_per_token(num_kv_heads=8, head_dim=128)
    assert mixed / fp8 == pytest.approx(lib.fraction_of_fp8())
    allnv = capacity.kv_bytes_per_token("nvfp4_mixed", L8B, "*:nvfp4")
    assert allnv / fp8 == pytest.approx(KVPolicy.from_compact("*:nvfp4", 32).fraction_of_fp8())
    by = capacity.bytes_per_token_by_config(L8B)
    # vLLM's own nvfp4: the same bytes as all-NVFP4; with layers 0 and 31 skipped those two store
    # bf16: 30 x (2 x 8 heads x 128 x 0.5625 B) + 2 x (2 x 8 x 128 x 2 B)
    assert by == {"fp8": fp8, "nvfp4-mixed": mixed, "auto": 2 * fp8, "fp8-triton": fp8,
                  "nvfp4-all": allnv, "nvfp4": allnv, "nvfp4-skip": 30 * 1152 + 2 * 4096}
    assert configs.CONFIGS["nvfp4-skip"].skipped(32) == ["0", "31"]
    with pytest.raises(ValueError, match="needs a policy"):
        capacity.kv_bytes_per_token("nvfp4_mixed", L8B)
    with pytest.raises(ValueError, match="no bytes-per-token rule"):
        capacity.kv_bytes_per_token("fp8_e5m2", L8B)


def test_synthetic_rot_policy_file_is_a_mixed_policy_the_benchmark_counts(tmp_path, capsys):
    from benchmarks import synthetic_rot_policy

    path = tmp_path / "rot8.json"
    assert synthetic_rot_policy.main(["--preset", "llama8b", "--pairs", "8", "--out", str(path)]) == 0
    assert "0-3:fp8,4-31:nvfp4" in capsys.readouterr().out
    pol = KVPolicy.load(path)
    assert pol.to_compact() == "0-3:fp8,4-31:nvfp4"
    for row in pol.layers:
        assert row.k_rot.num_pairs == 8 and len(row.k_rot.pairs) == 8  # 8 KV heads
        for h, pairs in enumerate(row.k_rot.pairs):  # k_center is 0 on both dims of a rotated pair
            assert all(row.k_center[h][i] == 0.0 and row.k_center[h][i + 64] == 0.0 for i in pairs)
        assert row.k_rot.theta[0][0] == pytest.approx(500000.0 ** (-2 * row.k_rot.pairs[0][0] / 128))
    # the benchmark's byte count reads the file as $VLLM_NVFP4_POLICY does
    assert capacity.kv_bytes_per_token("nvfp4_mixed", L8B, str(path)) == \
        capacity.kv_bytes_per_token("nvfp4_mixed", L8B, "0-3:fp8,*:nvfp4")
    base = tmp_path / "center.json"  # the timing's baseline: the same k_center, no k_rot
    assert synthetic_rot_policy.main(["--preset", "llama8b", "--without-k-rot", "--out", str(base)]) == 0
    center = KVPolicy.load(base)
    assert all(r.k_rot is None for r in center.layers)
    assert [r.k_center for r in center.layers] == [r.k_center for r in pol.layers]
    with pytest.raises(SystemExit):  # the file is not overwritten
        synthetic_rot_policy.main(["--preset", "llama8b", "--out", str(path)])
    for bad in (["--preset", "gemma3-tiny"], ["--pairs", "12"], ["--pairs", "128"],
                ["--compact", "0-3:fp4,*:nvfp4"]):  # a hybrid, pairs the kernels refuse, a bad format
        capsys.readouterr()
        with pytest.raises(SystemExit):
            synthetic_rot_policy.main(bad + ["--out", str(tmp_path / "bad.json")])
        assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "bad.json").exists()


def test_mixed_policy_and_policy_for():
    assert configs.mixed_policy(2) == "0:fp8,*:nvfp4" and configs.mixed_policy(8) == "0:fp8,*:nvfp4"
    assert configs.mixed_policy(16) == "0-1:fp8,*:nvfp4"
    mixed = configs.CONFIGS["nvfp4-mixed"]
    dense = L8B.layer_types
    assert configs.policy_for(mixed, dense, "0:fp8,31:fp8,*:nvfp4") == "0:fp8,31:fp8,*:nvfp4"
    assert configs.policy_for(mixed, dense) == "0-3:fp8,*:nvfp4"
    assert configs.policy_for(configs.CONFIGS["fp8"], dense) is None
    assert configs.policy_for(configs.CONFIGS["nvfp4-all"], dense) == "*:nvfp4"


def test_max_batch_estimate_and_stages():
    fp8 = capacity.pool_layout("fp8", L8B, None, 16, 33280, 8192)
    assert fp8 == capacity.PoolLayout(16 * 64 * 1024, (capacity.KVGroup("full", 16),))
    blocks = 100 * 2**30 // fp8.block_bytes  # ~100 GiB of fp8 KV
    assert capacity.max_batch(blocks, fp8, 32768 + 512, 8192) == 49
    assert capacity.max_batch(blocks, fp8, 8192 + 512, 8192) == 188
    assert capacity.max_batch(blocks, fp8, 8192 + 512, 8192, cap=128) == 128
    assert capacity.max_batch(6, fp8, 32768 + 512, 8192) == 0
    assert capacity.capacity_tokens(blocks, fp8, 33280) == blocks * 16  # dense: blocks x block
    mixed = capacity.pool_layout("nvfp4_mixed", L8B, "0-3:fp8,*:nvfp4", 16, 33280, 8192)
    kv = int(blocks * 1.6203) * mixed.block_bytes  # the same bytes seen from an nvfp4_mixed engine
    assert capacity.estimate_batch(kv, fp8, 32768 + 512, 8192) == 49
    assert capacity.plan_stages(80, 48) == [("16", 16), ("ref", 48), ("max", 80)]
    assert capacity.plan_stages(48, 48) == [("16", 16), ("ref+max", 48)]
    assert capacity.plan_stages(24, 48) == [("16", 16), ("max", 24)]
    assert capacity.plan_stages(10, 48) == [("max", 10)]
    assert capacity.plan_stages(16, None) == [("16+max", 16)]
    assert capacity.plan_stages(0, 48) == []
    assert configs.capture_sizes_for(512) == configs.CAPTURE_SIZES
    assert configs.capture_sizes_for(80)[-1] == 80 and configs.capture_sizes_for(0) == [1]


def test_model_shape_from_a_written_model(tmp_path):
    model_dir = build_weightless_model(tmp_path / "m", "llama8b")
    assert ModelShape.from_model_dir(model_dir) == replace(L8B, model_dir=str(model_dir))


# ---------------------------------------------------------------- budget

def test_budget_deadlines():
    assert budget.deadline_share(0.0, 100.0, [1.0, 1.0, 2.0]) == pytest.approx(25.0)
    assert budget.deadline_share(50.0, 40.0, [1.0]) == 50.0  # nothing left
    assert budget.deadlines(0.0, 500.0, [1.0, 1.5, 0.7], 100.0) == (300.0, pytest.approx(156.25))
    assert budget.deadlines(0.0, 500.0, [1.0], 100.0) == (500.0, 500.0)
    assert budget.deadlines(0.0, 150.0, [1.0, 1.0, 1.0], 100.0) == (0.0, 0.0)
    free = budget.Budget.start(None, 150.0, 100.0)
    assert not free.limited and free.config_deadlines([1.0, 2.0], True) == (math.inf, math.inf)
    b = budget.Budget.start(600.0, 150.0, 100.0)
    hard, soft = b.config_deadlines([1.0, 1.0], reserve_serve=True)
    assert b.limited and soft <= hard and hard - b.end == pytest.approx(-250.0, abs=1.0)


# ---------------------------------------------------------------- records, ratios, targets, table

def _records() -> list[dict]:
    def eng(c, cap):
        return dict(kind="engine", config=c, capacity_tokens=cap, engine_start_s=70.0,
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
        dict(kind="bench_serve", config="fp8", completed=64, output_throughput=5000.0,
             median_ttft_ms=100.0, p99_ttft_ms=300.0, median_tpot_ms=12.0, median_e2el_ms=1600.0),
    ]


def test_recorder_round_trip_skips_cut_line(tmp_path):
    rec = records.Recorder(tmp_path / "r.jsonl", config="fp8")
    rec.write("ttft", context=8, ttft_s=0.1)
    with open(tmp_path / "r.jsonl", "a") as f:
        f.write('{"kind": "decode", "conf')  # a line cut by a kill
    got = records.read_records(tmp_path / "r.jsonl")
    assert len(got) == 1 and got[0]["config"] == "fp8" and got[0]["kind"] == "ttft"
    assert records.read_records(tmp_path / "missing.jsonl") == []
    assert records.prior_records([tmp_path / "r.jsonl"])[0]["prior"] == str(tmp_path / "r.jsonl")


def test_prior_versions_come_from_the_summary_beside_each_records_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "e2e_records.jsonl").write_text("")
    (tmp_path / "a" / orchestrate.SUMMARY).write_text(json.dumps({"versions": {"gpu": "H100, 1"}}))
    paths = [str(tmp_path / "a" / "e2e_records.jsonl"), str(tmp_path / "b.jsonl")]  # b: no summary
    assert orchestrate.prior_versions(paths) == {paths[0]: {"gpu": "H100, 1"}}


def test_latest_and_merge_records():
    old = [dict(kind="ttft", config="fp8", context=1, ttft_s=9.0),
           dict(kind="ttft", config="auto", context=1, ttft_s=8.0),
           dict(kind="bench_serve", config="fp8", completed=1),
           dict(kind="bench_serve", config="auto", completed=2)]
    now = [dict(kind="engine", config="fp8", capacity_tokens=5),
           dict(kind="ttft", config="fp8", context=1, ttft_s=1.0)]
    merged = records.merge_records(old, now, measured_now=["fp8"], served_now=["auto"])
    assert [r for r in merged if r["kind"] == "ttft"] == [old[1], now[1]]  # fp8's old TTFT replaced
    assert [r["config"] for r in merged if r["kind"] == "bench_serve"] == ["fp8"]  # auto served again
    assert records.latest(merged + [dict(kind="ttft", config="fp8", context=1, ttft_s=2.0)],
                          kind="ttft", config="fp8")["ttft_s"] == 2.0
    assert records.latest(merged, kind="decode") is None
    per_ctx = records.merge_records(old + [dict(kind="ttft", config="fp8", context=2, ttft_s=7.0)], now,
                                    measured_now=["fp8"], contexts_now=[1])
    assert [(r["config"], r["context"], r["ttft_s"]) for r in per_ctx if r["kind"] == "ttft"] == [
        ("auto", 1, 8.0), ("fp8", 2, 7.0), ("fp8", 1, 1.0)]  # context 2 was not measured again


def test_compute_ratios_and_shipped_targets():
    ratios = report.compute_ratios(_records(), [32768, 8192])
    assert ratios["capacity_vs_fp8"]["nvfp4-mixed"] == pytest.approx(1.62)
    row = ratios["decode_vs_fp8"]["32768"]
    assert row["batch"] == 48 and row["best_fp8"] == "fp8" and row["nvfp4-mixed"] == 1.4
    assert row["nvfp4-mixed_at_own_max_batch"] == dict(batch=77, tok_per_s=1900.0, vs_best_fp8=1.9)
    assert ratios["ttft_vs_fp8"]["8192"] == {"fp8": 1.0, "nvfp4-mixed": 1.2}
    targets = report.check_targets(ratios, report.load_targets(DEFAULT_TARGETS), "llama8b")
    assert targets == {"capacity": dict(min=1.65, value=1.62, met=False),
                       "decode_32k": dict(min=1.3, value=1.4, met=True),
                       "ttft": dict(max=1.1, value=1.2, met=False)}


def test_ratios_take_the_newest_records_and_a_different_ref_batch():
    old = [dict(kind="decode", config=c, context=32768, batch=48, label=lab, tok_per_s=tps, tpot_ms=1.0)
           for c, lab, tps in (("fp8", "ref+max", 2000.0), ("nvfp4-mixed", "ref", 1000.0),
                               ("nvfp4-mixed", "max", 1100.0))]
    row = report.compute_ratios(old + _records(), [32768])["decode_vs_fp8"]["32768"]
    assert row["nvfp4-mixed"] == 1.4 and row["nvfp4-mixed_at_own_max_batch"]["vs_best_fp8"] == 1.9
    recs = [r for r in _records() if not (r.get("config") == "nvfp4-mixed" and r["kind"] == "decode")]
    recs.append(dict(kind="decode", config="nvfp4-mixed", context=32768, batch=49, label="ref",
                     tok_per_s=1500.0, tpot_ms=32.0))
    row = report.compute_ratios(recs, [32768])["decode_vs_fp8"]["32768"]
    assert row["nvfp4-mixed"] == 1.5 and row["nvfp4-mixed_batch"] == 49


def test_targets_without_fp8_and_bad_targets_files(tmp_path):
    recs = [r for r in _records() if r.get("config") not in ("fp8", "fp8-triton")]
    targets = report.check_targets(report.compute_ratios(recs, [32768]), report.load_targets(DEFAULT_TARGETS),
                                   "llama8b")
    assert all(t["met"] is None and t["value"] is None for t in targets.values())
    assert report.load_targets(None) == []
    for body, msg in (('[[target]]\nmetric = "speed"\nconfig = "x"\nmin = 1', "metric must be"),
                      ('[[target]]\nmetric = "decode_vs_fp8"\nconfig = "x"\nmin = 1', "needs a 'context'"),
                      ('[[target]]\nmetric = "ttft_vs_fp8"\nconfig = "x"', "at least one of")):
        (tmp_path / "t.toml").write_text(body)
        with pytest.raises(ValueError, match=msg):
            report.load_targets(tmp_path / "t.toml")


def test_summary_table_mentions_everything():
    recs = [dict(kind="ttft", config="nvfp4-mixed", context=8192, ttft_s=5.195)] + _records()
    ratios = report.compute_ratios(recs, [32768, 8192])
    targets = report.check_targets(ratios, report.load_targets(DEFAULT_TARGETS), "llama8b")
    text = report.summary_table(recs, ratios, targets)
    assert "nvfp4-mixed" in text and "48:1400(34.3)" in text and "ERROR: worker boom" in text
    assert "serve fp8: 64 requests, 5000.0 output tok/s, TTFT median/p99 100.0/300.0 ms" in text
    assert "target decode_32k: value 1.4 (min 1.3) met True" in text
    assert "   600.0" in text and "5195.0" not in text  # the newest TTFT, not the first


# ---------------------------------------------------------------- kernel split of a trace

KERNELS = {
    "flash_fwd_splitkv_kernel": "attention", "_decode_kernel": "attention",
    "kernel_unified_attention_2d": "attention", "_reduce_kernel": "attention",
    "_dequant_kv_kernel": "attention", "reshape_and_cache_flash_kernel": "kv_write",
    "_write_kv_kernel": "kv_write", "nvjet_tst_128x256_64x4_2x1_v_bz_TNT": "gemm",
    "sm90_xmma_gemm_bf16bf16": "gemm", "triton_red_fused_rms_norm_0": "other",
    "act_and_mul_kernel": "other",
}


@pytest.mark.parametrize("gz", [False, True])
def test_kernel_split_of_a_generated_trace(tmp_path, gz):
    for name, cat in KERNELS.items():
        assert trace.kernel_category(name) == cat, name
    events = [dict(ph="X", cat="kernel", name=n, dur=10.0 * (i + 1)) for i, n in enumerate(KERNELS)]
    events += [dict(ph="X", cat="cpu_op", name="aten::mm", dur=99.0), dict(ph="i", cat="kernel", name="x")]
    body = json.dumps({"traceEvents": events})
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(body)
    else:
        path.write_text(body)
    us = trace.kernel_time_by_category(trace.load_trace_events(path))
    assert us == dict(attention=10.0 + 20 + 30 + 40 + 50, kv_write=60.0 + 70, gemm=80.0 + 90,
                      other=100.0 + 110, total=660.0)
    assert trace.wait_for_trace(tmp_path, set(), timeout=5) == path
    frac, per_step = trace.split_per_step(us, tpot_ms=33.0)
    assert frac["attention"] == pytest.approx(150 / 660, abs=1e-4)
    assert per_step["gemm"] == pytest.approx(33.0 * 170 / 660, abs=1e-3)


def test_idle_gaps_of_a_generated_trace():
    k = lambda name, ts, dur: dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur)  # noqa: E731
    events = [k("a", 0.0, 10.0), k("b", 5.0, 10.0),  # overlapping: busy 0-15
              k("c", 115.0, 5.0),  # 100 us gap after b
              dict(ph="X", cat="gpu_memcpy", name="Memcpy HtoD", ts=130.0, dur=10.0),  # 10 us gap
              k("d", 140.0, 10.0),
              dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=10.0, dur=95.0),
              dict(ph="X", cat="cpu_op", name="aten::copy_", ts=60.0, dur=100.0),
              dict(ph="X", cat="cpu_op", name="elsewhere", ts=200.0, dur=5.0)]
    got = trace.idle_gaps(events, iterations=2, min_gap_us=20.0, top=2)
    assert got["idle_us"] == 110.0 and got["idle_ms_per_iteration"] == 0.055
    assert got["busy_ms_per_iteration"] == pytest.approx((15 + 5 + 10 + 10) / 2 / 1000)
    assert got["gaps"] == 1
    first, second = got["largest"]
    assert (first["us"], first["after"], first["before"]) == (100.0, "b", "c")
    assert first["host"] == [("cudaStreamSynchronize", 90.0), ("aten::copy_", 55.0)]
    assert (second["us"], second["after"], second["before"]) == (10.0, "c", "Memcpy HtoD")
    assert second["host"] == [("aten::copy_", 10.0)]


# ---------------------------------------------------------------- vllm bench serve

def test_bench_serve_command_parses_with_vllms_own_parser():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    a = parse_args(["--out", "/tmp/o", "--model", "/m", "--clients", "7", "--serve-requests", "21",
                    "--bench-serve-args", "--num-warmups 2"])
    cmd = serve.bench_serve_command(a, configs.CONFIGS["nvfp4-mixed"], "bench_serve_x.json")
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(cmd[5:])
    assert (ns.max_concurrency, ns.num_prompts) == (7, 21)
    assert (ns.random_input_len, ns.random_output_len) == (2048, 128)
    assert ns.ignore_eos and ns.save_result and ns.result_filename == "bench_serve_x.json"
    assert ns.request_rate == math.inf and ns.num_warmups == 2 and ns.base_url == "http://127.0.0.1:8123"
    server = serve.serve_command(a, configs.CONFIGS["fp8"])
    assert server[3:5] == ["serve", "/m"] and "--attention-backend" in server


def test_skip_configuration_names_the_first_and_last_layer(tmp_path):
    """nvfp4-skip keeps layers 0 and L-1 in bf16: LLM(kv_cache_dtype_skip_layers=...) and
    --kv-cache-dtype-skip-layers of `vllm serve` name them for the model's layer count."""
    model = build_weightless_model(tmp_path / "m", "llama8b")
    a = parse_args(["--out", str(tmp_path / "o"), "--model", str(model)])
    cfg = configs.CONFIGS["nvfp4-skip"]
    assert engine_kwargs(a, cfg.kv_cache_dtype, "FLASHINFER", cfg.skipped(32))[
        "kv_cache_dtype_skip_layers"] == ["0", "31"]
    server = serve.serve_command(a, cfg)
    i = server.index("--kv-cache-dtype-skip-layers")
    assert server[i + 1:i + 3] == ["0", "31"] and server[server.index("--kv-cache-dtype") + 1] == "nvfp4"
    assert "--kv-cache-dtype-skip-layers" not in serve.serve_command(a, configs.CONFIGS["nvfp4"])


def test_result_record_keeps_vllms_fields():
    result = dict(duration=10.0, completed=128, failed=0, output_throughput=1234.5, date="x",
                  mean_ttft_ms=50.0, median_ttft_ms=45.0, p99_ttft_ms=90.0, p99_9_ttft_ms=1.0,
                  std_itl_ms=2.0, median_e2el_ms=800.0, ttfts=[0.1], model_id="m")
    rec = serve.result_record(result)
    assert rec == dict(duration=10.0, completed=128, failed=0, output_throughput=1234.5,
                       mean_ttft_ms=50.0, median_ttft_ms=45.0, p99_ttft_ms=90.0, std_itl_ms=2.0,
                       median_e2el_ms=800.0)


# ---------------------------------------------------------------- plugin metadata, plots

def test_plugin_dist_info_is_discovered_from_pythonpath_alone(tmp_path):
    """scripts/plugin_dist_info.py makes the entry point visible where vllm-nvfp4 is not installed."""
    meta = tmp_path / "meta"
    subprocess.run([sys.executable, str(REPO / "scripts" / "plugin_dist_info.py"), str(meta)], check=True,
                   capture_output=True)
    probe = ("from importlib.metadata import entry_points, version\n"
             "eps = [e for e in entry_points(group='vllm.general_plugins')]\n"
             "print([(e.name, e.value) for e in eps])\n"
             "fn = eps[0].load() if eps else None\n"
             "print(fn.__module__ if fn else None, version('vllm-nvfp4') if eps else None)\n")
    env = dict(PATH=os.environ.get("PATH", "/usr/bin:/bin"))
    for path, expect in ((str(REPO), "[]"),
                         (f"{REPO}{os.pathsep}{meta}", "[('nvfp4_mixed', 'vllm_nvfp4.plugin:register')]")):
        # -S: no site-packages (the dev venv has the package installed); cwd without metadata
        res = subprocess.run([sys.executable, "-S", "-c", probe], env=dict(env, PYTHONPATH=path),
                             cwd=tmp_path, capture_output=True, text=True, check=True)
        assert res.stdout.splitlines()[0] == expect, res.stdout + res.stderr
    assert res.stdout.splitlines()[1] == "vllm_nvfp4.plugin 0.1.0"


def test_plot_summary(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.e2e.plots import plot_summary, title_suffix

    path = tmp_path / "s.json"
    summary = {"records": _records(), "versions": {"gpu": "NVIDIA H200, 143771 MiB"},
               "model": {"preset": "llama8b"}}
    path.write_text(json.dumps(summary))
    assert title_suffix(summary) == " (H200, llama8b shape)" and title_suffix({}) == ""
    merged = {"versions": {"gpu": None}, "prior_versions": {"a": {"gpu": "NVIDIA H100 80GB HBM3, 1"},
                                                             "b": {"gpu": "NVIDIA H100 80GB HBM3, 1"}}}
    assert title_suffix(merged) == " (H100 80GB HBM3)"  # a merge made off the GPU names the priors'
    merged["prior_versions"]["c"] = {"gpu": "NVIDIA H200, 2"}
    assert title_suffix(merged) == ""  # no one GPU to name
    files = plot_summary(path, tmp_path / "img")
    assert [f.name for f in files] == ["e2e_capacity.png", "e2e_decode.png", "e2e_context.png"]
    assert all(f.stat().st_size > 1000 for f in files)
    assert parse_args(["--plot", str(path)]).plot == str(path)


# ---------------------------------------------------------------- engine stepping, server handling

class _ScriptedEngine:
    """An engine double with LLMEngine's stepping interface: a request gets its first token two
    steps after it was added, then one token per step until ``max_tokens``."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}  # id -> [steps seen, tokens made, max_tokens]

    def add_request(self, rid, prompt, params) -> None:
        assert len(prompt["prompt_token_ids"]) == 12 and params.ignore_eos
        self.requests[rid] = [0, 0, params.max_tokens]

    def step(self) -> list:
        outs = []
        for rid, r in list(self.requests.items()):
            r[0] += 1
            new = 1 if r[0] >= 2 else 0
            r[1] += new
            done = r[1] >= r[2]
            outs.append(Namespace(request_id=rid, finished=done,
                                  outputs=[Namespace(token_ids=[7] * new)]))
            if done:
                del self.requests[rid]
        return outs

    def abort_request(self, ids) -> None:
        for rid in ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)


def test_stepper_prefill_stage_and_decode_window():
    pytest.importorskip("vllm")
    from benchmarks.e2e.stepping import Stepper, decode_window, measure_ttft, prefill_stage

    st = Stepper(_ScriptedEngine(), vocab=100, seed=0)
    assert measure_ttft(st, 12) > 0 and not st.running()  # max_tokens=1: finished with its token
    ids, _, steps = prefill_stage(st, 3, 12, max_tokens=50, deadline=math.inf)
    assert steps == 2 and st.all_started(ids)
    more, _, _ = prefill_stage(st, 2, 12, max_tokens=50, deadline=math.inf)
    assert [st.tokens[i] for i in ids] == [3, 3, 3] and [st.tokens[i] for i in more] == [1, 1]
    w = decode_window(st, warm=1, steps=4)
    assert (w["steps"], w["tokens"], w["min_batch"], w["max_batch"]) == (4, 20, 5, 5)
    assert w["tpot_ms"] > 0 and w["tok_per_s"] > 0
    st.abort_all()
    assert not st.running() and not st.engine.has_unfinished_requests()
    with pytest.raises(TimeoutError):
        prefill_stage(st, 1, 12, max_tokens=5, deadline=0.0)


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_wait_healthy_and_stop_group(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER, str(port)], start_new_session=True)
    try:
        assert serve.wait_healthy(port, proc, deadline=time.time() + 60)
    finally:
        serve.stop_group(proc, grace=5)
    assert proc.poll() is not None
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait()
    t0 = time.time()
    assert not serve.wait_healthy(port, gone, deadline=time.time() + 60) and time.time() - t0 < 5


# ---------------------------------------------------------------- hybrid models

def test_hybrid_pool_layouts_and_batches_by_hand():
    """gpt-oss-20b: 12 sliding (128) + 12 full layers, 8 KV heads x 64. fp8 in vLLM's groups of
    12 equal pages; nvfp4_mixed (default rule) in the plugin's plan; batches by hand."""
    mixed = configs.policy_for(configs.CONFIGS["nvfp4-mixed"], GPT_OSS.layer_types)
    assert mixed == "1:fp8,23:fp8,swa:fp8,full:nvfp4"
    fp8 = capacity.pool_layout("fp8", GPT_OSS, None, 16, 33792, 16384)
    page = 16 * 8 * 2 * 64  # one fp8 layer's block: 16 tokens x 8 heads x K+V x 64 B
    assert fp8 == capacity.PoolLayout(12 * page, (capacity.KVGroup("full", 16),
                                                  capacity.KVGroup("sliding", 16, 128)))
    blocks = 64 * 2**30 // fp8.block_bytes
    per_seq = 33792 // 16 + (128 // 16 + 1)  # full blocks + the window's blocks
    assert fp8.blocks_per_sequence(33792) == per_seq
    assert capacity.max_batch(blocks, fp8, 33792, 16384) == (blocks - 16384 // 16) // per_seq == 164
    assert capacity.capacity_tokens(blocks, fp8, 33792) == blocks * 33792 // per_seq
    nv = capacity.pool_layout("nvfp4_mixed", GPT_OSS, mixed, 16, 33792, 16384)
    plan = hybrid_plan(KVPolicy.from_compact(mixed, 24, layer_types=GPT_OSS.layer_types), 8, 64, 16, 33792, 16384)
    assert nv.block_bytes == plan.block_bytes
    assert nv.groups == ((capacity.KVGroup("full", plan.full_block),)
                         + (capacity.KVGroup("sliding", plan.sliding_block, 128),) * plan.sliding_groups)
    full_bytes = 8 * (2 * 2 * 64 + 10 * 2 * (32 + 4))  # per token: 2 FP8 + 10 NVFP4 full layers
    assert nv.block_bytes == max(plan.full_block * full_bytes, 3 * plan.sliding_block * 8 * 2 * 64)
    nv_blocks = 64 * 2**30 // nv.block_bytes
    nv_per_seq = -(-33792 // plan.full_block) + plan.sliding_groups * (-(-128 // plan.sliding_block) + 1)
    kept = plan.sliding_groups * -(-16384 // plan.sliding_block)
    assert capacity.max_batch(nv_blocks, nv, 33792, 16384) == (nv_blocks - kept) // nv_per_seq
    assert capacity.estimate_batch(64 * 2**30, fp8, 33792, 16384) == 164
    # one sliding layer NVFP4, 11 FP8 (unequal numbers): planned in one sliding group
    swa_mix = capacity.pool_layout("nvfp4_mixed", GPT_OSS, "0:nvfp4,swa:fp8,full:nvfp4", 16, 33792,
                                   16384)
    assert [g.kind for g in swa_mix.groups] == ["full", "sliding"]


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gemma3-27b", "gpt-oss-tiny", "gemma3-tiny"])
def test_hybrid_presets_have_the_real_geometry(tmp_path, preset):
    from transformers import AutoConfig

    from vllm_nvfp4.testing.weightless import PRESETS

    p = PRESETS[preset]
    out = build_weightless_model(tmp_path / preset, preset)
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.sliding_window) == (p["layers"], p["hidden"], p["heads"], p["kv_heads"],
                                                  p["head_dim"], p["window"])
    shape = ModelShape.from_model_dir(out)
    full = [i for i, t in enumerate(shape.layer_types) if t.kind == "full"]
    if p["arch"] == "gpt_oss":
        assert cfg.num_local_experts == p["experts"] and full == list(range(1, p["layers"], 2))
        assert all(t.sinks for t in shape.layer_types)
    else:
        assert full == list(range(5, p["layers"], 6)) and cfg.query_pre_attn_scalar == p["query_pre_attn_scalar"]
    assert shape.needs_packed_groups and len(full) >= 3  # the default policy has NVFP4 layers
    if preset == "gpt-oss-20b":
        assert (cfg.num_experts_per_tok, cfg.vocab_size) == (4, 201088)
    if preset == "gemma3-27b":
        assert len(full) == 10 and cfg.rope_parameters["full_attention"]["factor"] == 8.0


def test_dry_run_of_the_gpt_oss_preset(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.e2e", "--out", str(tmp_path / "o"),
                          "--preset", "gpt-oss-20b", "--model-dir", str(tmp_path / "m"),
                          "--dtypes", "fp8,nvfp4-mixed", "--contexts", "32k", "--dry-run"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    assert plan["model"]["hybrid"] and plan["model"]["layer_types"] == {
        "sliding(128)+sinks": 12, "full+sinks": 12}
    assert plan["configs"]["nvfp4-mixed"]["policy"] == "1:fp8,23:fp8,swa:fp8,full:nvfp4"
    assert plan["configs"]["fp8"]["max_batch_at_plan_kv_bytes"] == {"32768": 164}  # by hand above
    assert plan["configs"]["nvfp4-mixed"]["max_batch_at_plan_kv_bytes"]["32768"] > 164
    t = report.check_targets({"capacity_vs_fp8": {}, "ttft_vs_fp8": {}, "decode_vs_fp8": {
        "32768": {"nvfp4-mixed": 1.4}}}, report.load_targets(DEFAULT_TARGETS), "gpt-oss-20b")
    assert t == {"decode_32k_gpt_oss": {"min": 1.3, "value": 1.4, "met": True}}

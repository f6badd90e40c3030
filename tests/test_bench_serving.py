"""Tests of the serving benchmark ``benchmarks.serving`` and its soak ``benchmarks.serving.soak``.

Without an engine: length ranges against vLLM's own random-dataset sampler, every client command
parsed by vLLM's own ``vllm bench serve`` parser, the rate bisection on a known threshold, the
objective, ratios / table / merge, the time estimate, the plots, the soak's request set, its
comparison on hand-made outputs and its engine arguments. With an engine (marker ``vllm``, CPU):
one ``vllm serve`` with one rate probe of ``--cpu-tiny`` end to end, and one soak configuration
of ``--cpu-tiny`` whose pressure pass preempts.
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.e2e import configs
from benchmarks.e2e.serve import SERVER_KEEP_ALIVE_S, server_env
from benchmarks.serving import orchestrate, rate_search, report, workloads
from benchmarks.serving.cli import parse_args
from benchmarks.serving.soak import compare, worker
from benchmarks.serving.soak.cli import parse_args as soak_args
from benchmarks.serving.soak.requests import SoakParams, make_requests
from benchmarks.serving.workloads import LengthRange, parse_range

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- workloads and commands

def test_parse_range_and_tokens():
    assert parse_range("16k-32k") == LengthRange(16384, 32768)
    assert parse_range("512") == LengthRange(512, 512)
    assert workloads.parse_ints("16,64") == [16, 64]
    for bad in ("32k-16k", "a-b", "1-2-3", "0"):
        with pytest.raises(ValueError):
            parse_range(bad)
    with pytest.raises(ValueError, match="positive"):
        workloads.parse_ints("0,4")


class _NoSpecialTokens:
    vocab_size = 1000

    def num_special_tokens_to_add(self) -> int:
        return 0


@pytest.mark.parametrize("text", ["16k-32k", "256-1024", "4-8", "100-100"])
def test_length_range_is_what_vllms_random_dataset_draws(text):
    from vllm.benchmarks.datasets.utils import get_sampling_params

    r = parse_range(text)
    ins, outs, _ = get_sampling_params(np.random.default_rng(0), 200_000, {"input": r.ratio, "output": r.ratio},
                                       r.mid, r.mid, _NoSpecialTokens())
    for drawn in (ins, outs):  # vLLM's ceil of a float product may add one token at the top
        assert r.lo <= drawn.min() <= r.lo + 1 and r.hi - 1 <= drawn.max() <= r.hi + 1


def _vllm_parse(cmd: list[str]):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(cmd[5:])


def test_client_commands_parse_with_vllms_own_parser(tmp_path):
    a = parse_args(["--out", str(tmp_path), "--model", "/m", "--bench-serve-args", "--num-warmups 2"])
    fp8 = configs.CONFIGS["fp8"]
    chat = workloads.chat_runs(a)
    assert [r.max_concurrency for r in chat] == [16, 64, 128, 256]
    ns = _vllm_parse(orchestrate.client_command(a, fp8, chat[1]))
    assert ns.dataset_name == "random" and ns.max_concurrency == 64 and ns.num_prompts == 64
    assert (ns.random_input_len, ns.random_output_len) == (24576, 640)
    assert json.loads(ns.random_range_ratio) == {"input": pytest.approx(1 / 3, abs=1e-6), "output": 0.6}
    assert ns.ignore_eos and ns.save_result and ns.num_warmups == 2 and ns.request_rate == math.inf
    assert ns.result_dir == str((tmp_path / "raw" / "fp8").resolve()) and ns.result_filename == "chat_c64.json"
    prefix = workloads.prefix_runs(a)
    assert [(r.extra["prefix_len"], r.max_concurrency) for r in prefix] == [
        (8192, 64), (8192, 128), (16384, 64), (16384, 128)]
    ns = _vllm_parse(orchestrate.client_command(a, fp8, prefix[2]))
    assert ns.dataset_name == "prefix_repetition" and ns.prefix_repetition_prefix_len == 16384
    assert ns.prefix_repetition_num_prefixes == 8 and ns.num_prompts % 8 == 0
    probe = workloads.rate_run(a, 0.75, 2)
    ns = _vllm_parse(orchestrate.client_command(a, fp8, probe))
    assert ns.request_rate == 0.75 and ns.max_concurrency is None and ns.num_prompts == 68  # 0.75 x 90 s
    seeds = {r.seed for r in chat + prefix + [probe]}
    assert len(seeds) == len(chat) + len(prefix) + 1  # no prompt repeated between runs (prefix cache)
    assert workloads.chat_runs(a)[0].seed == chat[0].seed  # the same prompts for every configuration


def test_parse_args_defaults_cpu_tiny_and_errors(capsys):
    a = parse_args(["--out", "/x"])
    assert a.configs == ["fp8", "nvfp4-mixed", "nvfp4"] and a.workloads == ["chat", "prefix", "rate"]
    assert a.max_model_len == 32768 + 1024 + 256 and a.tpot_p99_ms == 50.0 and a.budget_s is None
    assert parse_args(["--out", "/x", "--workloads", "prefix"]).max_model_len == 16384 + 1024 + 512 + 256
    t = parse_args(["--out", "/x", "--cpu-tiny", "--max-probes", "3"])
    assert t.cpu and t.eager and t.preset == "tiny" and t.configs == ["auto", "nvfp4-mixed"]
    assert t.max_probes == 3 and t.chat_concurrency == [2, 4] and t.gpu_mem == 0.3
    for argv, msg in ((["--out", "/x", "--workloads", "chat,batch"], "workloads must be"),
                      (["--out", "/x", "--max-model-len", "1000"], "longest request"),
                      (["--out", "/x", "--configs", "fp4"], "unknown configuration"),
                      (["--out", "/x", "--rate-start", "0"], "request rate must be > 0"),
                      ([], "--out is required")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert msg in capsys.readouterr().err


def test_dry_run_prints_servers_and_clients(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--out", str(tmp_path / "o"),
                          "--cpu-tiny", "--model-dir", str(tmp_path / "m"), "--dry-run"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    mixed = plan["configs"]["nvfp4-mixed"]
    assert "--kv-cache-dtype nvfp4_mixed" in mixed["server"] and "--enable-prefix-caching" in mixed["server"]
    assert set(mixed["clients"]) == {"chat_c2", "chat_c4", "prefix_p64_c4", "rate_4"}
    assert not (tmp_path / "o" / orchestrate.RECORDS).exists()


def test_flashinfer_config_reports_why_it_cannot_run():
    cfg = configs.CONFIGS["nvfp4"]
    assert cfg.kv_cache_dtype == "nvfp4" and cfg.attention_backend == "FLASHINFER"
    from vllm.config.cache import CacheDType
    import importlib.util
    import typing

    why = configs.unavailable_reason(cfg)
    if "nvfp4" not in typing.get_args(CacheDType):
        assert "no kv_cache_dtype 'nvfp4'" in why
    elif importlib.util.find_spec("flashinfer") is None:
        assert "flashinfer" in why
    else:
        assert why is None
    assert configs.unavailable_reason(configs.CONFIGS["fp8"]) is None


# ---------------------------------------------------------------- rate search

def _search(threshold: float, start: float, max_probes: int = 12) -> tuple[list[float], dict]:
    passed: dict[float, bool] = {}
    order = []
    while len(passed) < max_probes and (r := rate_search.next_rate(passed, start)) is not None:
        order.append(r)
        passed[r] = r <= threshold
    return order, rate_search.summarize(passed)


def test_rate_search_brackets_then_bisects_geometrically():
    order, res = _search(1.3, 0.5)
    assert order[:4] == [0.5, 1.0, 2.0, pytest.approx(math.sqrt(2))]
    assert res["max_rate"] <= 1.3 < res["lowest_failing_rate"]
    assert res["lowest_failing_rate"] / res["max_rate"] <= 1.15 and res["probes"] == len(order)
    order, res = _search(0.1, 1.0)  # the start fails: halves until a pass
    assert order[:5] == [1.0, 0.5, 0.25, 0.125, 0.0625]
    assert res["max_rate"] <= 0.1 < res["lowest_failing_rate"]
    assert rate_search.next_rate({0.0015: False}, 1.0) is None  # below the floor: give up
    assert _search(0.0001, 0.001)[1]["max_rate"] is None


def test_rate_search_ignores_a_pass_above_a_failure():
    assert rate_search.bracket({1.0: True, 2.0: False, 4.0: True}) == (1.0, 2.0)
    assert rate_search.next_rate({1.0: True, 2.0: False, 4.0: True}, 1.0) == pytest.approx(math.sqrt(2))


def test_objective_checks_completion_tpot_and_ttft():
    obj = rate_search.Objective(50.0, p99_ttft_ms=2000.0)
    good = dict(completed=10, num_prompts=10, failed=0, p99_tpot_ms=49.9, p99_ttft_ms=1500.0)
    assert obj.check(good)[0]
    assert not obj.check(dict(good, p99_tpot_ms=50.1))[0]
    assert "TTFT" in obj.check(dict(good, p99_ttft_ms=2500.0))[1]
    assert "failed" in obj.check(dict(good, completed=9, failed=1))[1]
    assert not obj.check(dict(good, p99_tpot_ms=None))[0]
    assert rate_search.Objective(50.0).check(dict(good, p99_ttft_ms=1e9))[0]


# ---------------------------------------------------------------- report, estimate, plots

def _bench(config, label, workload, tok_s, ttft, tpot, **extra):
    return dict(kind="bench", config=config, label=label, workload=workload, output_throughput=tok_s,
                p50_ttft_ms=ttft, p99_ttft_ms=2 * ttft, p50_tpot_ms=tpot / 2, p99_tpot_ms=tpot,
                request_throughput=tok_s / 100, completed=16, failed=0, preemptions=0, **extra)


OBJECTIVE = dict(p99_tpot_ms=50.0, p99_ttft_ms=None)
RECORDS = [
    _bench("fp8", "chat_c16", "chat", 1000.0, 800.0, 40.0, concurrency=16),
    _bench("nvfp4-mixed", "chat_c16", "chat", 1500.0, 840.0, 30.0, concurrency=16),
    _bench("fp8", "chat_c64", "chat", 1200.0, 900.0, 80.0, concurrency=64),
    _bench("nvfp4-mixed", "chat_c64", "chat", 2400.0, 990.0, 45.0, concurrency=64),
    _bench("fp8", "rate_0.5", "rate", 300.0, 700.0, 45.0, rate=0.5),
    _bench("nvfp4-mixed", "rate_1", "rate", 600.0, 770.0, 48.0, rate=1.0),
    *[dict(kind="rate_probe", config=c, label=workloads.rate_label(r), rate=r, passed=ok, objective=OBJECTIVE)
      for c, probes in (("fp8", ((0.25, True), (0.5, True), (0.7, False), (1.0, False))),
                        ("nvfp4-mixed", ((0.5, True), (0.75, True), (1.0, True), (1.1, False), (2.0, False))))
      for r, ok in probes],
    dict(kind="rate_search", config="fp8", objective=OBJECTIVE),
    dict(kind="rate_search", config="nvfp4-mixed", objective=OBJECTIVE),
    dict(kind="skip", config="nvfp4-mixed", label="chat_c256", reason="budget: needs ~300s"),
]


def test_tables_ratios_and_markdown():
    t = report.tables(RECORDS)
    assert t["reference"] == "fp8"
    rows = {(r["config"], r["label"]): r for r in t["runs"]}
    c64 = rows[("nvfp4-mixed", "chat_c64")]
    assert c64["output_tok_s_vs_ref"] == 2.0 and c64["ttft_p50_vs_ref"] == 1.1 and c64["tpot_p99_vs_ref"] == 0.562
    assert rows[("fp8", "chat_c16")]["output_tok_s_vs_ref"] == 1.0
    rs = t["rate_search"]["nvfp4-mixed"]
    assert rs["max_rate_vs_ref"] == 2.0 and rs["ttft_p50_vs_ref"] == 1.1 and rs["p99_tpot_ms_at_max_rate"] == 48.0
    md = report.markdown(dict(t, records=RECORDS))
    assert "| chat_c64 | nvfp4-mixed | 2400.0 |" in md and "| nvfp4-mixed | 1.000 | 1.100 | 5 | 2.000 |" in md
    assert "chat_c256 budget: needs ~300s" in md and "p99 TPOT <= 50.0 ms" in md


def test_rate_search_answer_counts_every_probe_of_merged_runs():
    """Probes measured apart (an earlier run's labels carried the probe's index) make one search;
    a rate probed again keeps its newest result, and the TTFT there is that probe's."""
    assert workloads.rate_label(3.557) == workloads.rate_label(3.5573) == "rate_3.557"
    old = [dict(kind="rate_probe", config="fp8", label=f"rate_{i}_{r:g}", rate=r, passed=ok,
                objective=OBJECTIVE, prior="a") for i, (r, ok) in enumerate(((2.4, True), (3.12, True), (4.056, False)))]
    old.append(dict(kind="rate_search", config="fp8", objective=OBJECTIVE, prior="a"))
    retry = [dict(kind="rate_probe", config="fp8", label="rate_3.557", rate=3.557, passed=True, objective=OBJECTIVE),
             dict(kind="rate_probe", config="fp8", label="rate_4.056", rate=4.056, passed=True, objective=OBJECTIVE),
             dict(kind="rate_probe", config="fp8", label="rate_5.273", rate=5.2728, passed=False, objective=OBJECTIVE),
             _bench("fp8", "rate_2_4.056", "rate", 100.0, 999.0, 60.0, rate=4.056),
             _bench("fp8", "rate_4.056", "rate", 300.0, 250.0, 40.0, rate=4.056),
             dict(kind="rate_search", config="fp8", objective=OBJECTIVE)]
    s = report.tables(report.merge(old, retry))["rate_search"]["fp8"]
    assert (s["max_rate"], s["lowest_failing_rate"], s["probes"]) == (4.056, 5.2728, 5)
    assert s["p50_ttft_ms_at_max_rate"] == 250.0 and s["p99_tpot_ms_at_max_rate"] == 40.0


def test_rate_search_cut_off_before_its_record_still_answers():
    """A run stopped mid-search writes its probes but no ``rate_search`` record: the answer comes
    from the probes under the newest probe's objective (an older objective's probes left out)."""
    strict = dict(OBJECTIVE, p99_tpot_ms=OBJECTIVE["p99_tpot_ms"] / 2)
    probes = [dict(kind="rate_probe", config="nvfp4", label=f"rate_{r:g}", rate=r, passed=ok,
                   objective=obj) for r, ok, obj in ((4.0, True, OBJECTIVE), (2.736, True, strict),
                                                     (3.557, False, strict))]
    s = report.tables(probes)["rate_search"]["nvfp4"]
    assert (s["max_rate"], s["lowest_failing_rate"], s["probes"]) == (2.736, 3.557, 2)
    assert s["objective"] == strict


def test_merge_only_summarizes_runs_measured_apart(tmp_path, capsys):
    """--merge-only serves nothing: one summary, table and rate plot of two runs' records, the
    lengths taken from the newest summary beside them; without --prior-records it is an error."""
    runs = {"fp8": [r for r in RECORDS if r.get("config") == "fp8"],
            "mixed": [r for r in RECORDS if r.get("config") == "nvfp4-mixed"]}
    files = []
    for name, recs in runs.items():
        (tmp_path / name).mkdir()
        files.append(tmp_path / name / orchestrate.RECORDS)
        files[-1].write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    (tmp_path / "mixed" / orchestrate.SUMMARY).write_text(json.dumps(
        dict(args=dict(chat_input="2048-8192", chat_output="512-1024"), policies={"nvfp4-mixed": "p"})))
    out = tmp_path / "all"
    from benchmarks.serving.cli import main

    assert main(["--merge-only", "--out", str(out), "--prior-records", ",".join(map(str, files))]) == 0
    summary = json.loads((out / orchestrate.SUMMARY).read_text())
    assert summary["rate_search"]["nvfp4-mixed"]["max_rate_vs_ref"] == 2.0
    assert summary["args"]["chat_input"] == "2048-8192" and summary["policies"] == {"nvfp4-mixed": "p"}
    assert "| chat_c64 | nvfp4-mixed | 2400.0 |" in (out / orchestrate.TABLE).read_text()
    assert (out / "serving_rate.png").stat().st_size > 0 and not (out / orchestrate.RECORDS).exists()
    with pytest.raises(SystemExit):
        parse_args(["--merge-only", "--out", str(out)])
    assert "--merge-only writes a summary of --prior-records" in capsys.readouterr().err
    before = (tmp_path / "mixed" / orchestrate.SUMMARY).read_text()  # a run's folder is not overwritten
    with pytest.raises(SystemExit, match="exists; a run's summary there would be replaced"):
        main(["--merge-only", "--out", str(tmp_path / "mixed"), "--prior-records", str(files[0])])
    assert (tmp_path / "mixed" / orchestrate.SUMMARY).read_text() == before


def test_merge_replaces_a_configuration_served_again():
    prior = [dict(r, prior="old") for r in RECORDS[:4]]
    now = [_bench("nvfp4-mixed", "chat_c16", "chat", 1600.0, 800.0, 30.0, concurrency=16)]
    merged = report.merge(prior, now)  # the same config and label replaced, the other level kept
    assert [(r["config"], r["label"]) for r in merged] == [
        ("fp8", "chat_c16"), ("fp8", "chat_c64"), ("nvfp4-mixed", "chat_c64"), ("nvfp4-mixed", "chat_c16")]
    assert merged[-1]["output_throughput"] == 1600.0 and "prior" not in merged[-1]


def test_merge_drops_a_skip_that_a_later_run_measured():
    skip = dict(kind="skip", config="fp8", workload="chat", label="chat_c256", reason="budget", prior="a")
    other = dict(skip, label="chat_c512")
    later = _bench("fp8", "chat_c256", "chat", 1500.0, 900.0, 40.0, concurrency=256)
    merged = report.merge([skip, other], [later])
    assert [(r["kind"], r["label"]) for r in merged] == [("skip", "chat_c512"), ("bench", "chat_c256")]


def test_rate_search_resumes_from_earlier_probes(tmp_path, monkeypatch):
    """Probes of an earlier call (same objective) seed the bisection; the new probes continue it."""
    obj = dict(p99_tpot_ms=50.0, p99_ttft_ms=None)
    prior = tmp_path / "prior.jsonl"
    prior.write_text("\n".join(json.dumps(dict(kind="rate_probe", config="fp8", rate=r, passed=ok, objective=o))
                               for r, ok, o in ((0.5, True, obj), (1.0, True, obj), (2.0, False, obj),
                                                (0.25, False, dict(obj, p99_tpot_ms=20.0)))))
    a = parse_args(["--out", str(tmp_path), "--model", "/m", "--prior-records", str(prior), "--max-probes", "2"])
    probed = []

    def fake_bench(self, run):
        probed.append(run.request_rate)
        return dict(completed=run.num_prompts, num_prompts=run.num_prompts, failed=0,
                    p99_tpot_ms=40.0 if run.request_rate <= 1.3 else 60.0)

    monkeypatch.setattr(orchestrate.ConfigRun, "bench", fake_bench)
    orchestrate.ConfigRun(a, configs.CONFIGS["fp8"], math.inf, orchestrate.Estimator(1, 1)).rate_search()
    assert probed == [pytest.approx(1.4142), pytest.approx(1.1892)]  # the 20 ms probe is not reused
    recs = [json.loads(x) for x in (tmp_path / orchestrate.RECORDS).read_text().splitlines()]
    assert [r["label"] for r in recs if r["kind"] == "rate_probe"] == ["rate_1.414", "rate_1.189"]
    final = recs[-1]
    assert final["kind"] == "rate_search" and final["max_rate"] == 1.1892 and final["lowest_failing_rate"] == 1.4142


def test_skip_measured_serves_only_what_prior_records_lack(tmp_path, monkeypatch, capsys):
    """A resumed call with ``--skip-measured`` starts no server whose runs the earlier records all
    hold (a skip record says why) and gives the others only their missing runs."""
    prior = tmp_path / "prior.jsonl"
    prior.write_text("\n".join(json.dumps(r) for r in (
        _bench("auto", "chat_c2", "chat", 10.0, 80.0, 4.0, concurrency=2),
        _bench("auto", "chat_c4", "chat", 12.0, 90.0, 8.0, concurrency=4),
        _bench("nvfp4-mixed", "chat_c2", "chat", 15.0, 84.0, 3.0, concurrency=2))))
    argv = ["--out", str(tmp_path / "o"), "--cpu-tiny", "--model-dir", str(tmp_path / "m"),
            "--workloads", "chat", "--prior-records", str(prior)]
    served = []

    def fake_run(self, policy):
        served.append((self.cfg.name, [r.label for r in orchestrate.pending_runs(self.a, "chat", self.done)]))

    monkeypatch.setattr(orchestrate.ConfigRun, "run", fake_run)
    assert orchestrate.run(parse_args(argv + ["--skip-measured"])) == 0
    assert served == [("nvfp4-mixed", ["chat_c4"])]
    recs = [json.loads(x) for x in (tmp_path / "o" / orchestrate.RECORDS).read_text().splitlines()]
    assert [(r["config"], r["reason"]) for r in recs if r["kind"] == "skip"] == [
        ("auto", "every run is in --prior-records (--skip-measured)")]
    served.clear()
    assert orchestrate.run(parse_args(argv)) == 0  # without the flag: every run again
    assert served == [("auto", ["chat_c2", "chat_c4"]), ("nvfp4-mixed", ["chat_c2", "chat_c4"])]
    with pytest.raises(SystemExit):
        parse_args(argv[:-2] + ["--skip-measured"])
    assert "--skip-measured leaves out what --prior-records holds" in capsys.readouterr().err


def test_a_missing_prior_records_file_is_an_error(tmp_path, capsys):
    """A mistyped path would merge nothing: both benchmarks refuse it, naming it."""
    from benchmarks.e2e.cli import parse_args as e2e_args

    there = tmp_path / "a.jsonl"
    there.write_text("")
    for parse in (parse_args, e2e_args):
        assert parse(["--out", "o", "--model", "/m", "--prior-records", str(there)]).prior_records == [str(there)]
        with pytest.raises(SystemExit):
            parse(["--out", "o", "--model", "/m", "--prior-records", f"{there},{tmp_path}/typo.jsonl"])
        assert f"no such file: {tmp_path}/typo.jsonl" in capsys.readouterr().err


def test_the_server_keeps_idle_connections_longer_than_vllms_benchmark_client():
    """A server that closes a connection the client still pools fails the request sent on it."""
    import re

    vllm_serve = pytest.importorskip("vllm.benchmarks.serve")
    client_s = int(re.search(r"keepalive_timeout=(\d+)", inspect.getsource(vllm_serve)).group(1))
    env = server_env({"HOME": "/h"}, "0:fp8,*:nvfp4")
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > client_s
    assert env["VLLM_NVFP4_POLICY"] == "0:fp8,*:nvfp4" and env["HOME"] == "/h"
    mine = server_env({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "7"}, None)
    assert mine == {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "7"}  # the user's setting stands


def test_client_errors_name_why_requests_failed():
    """The exception lines ``vllm bench serve`` prints for failed requests (as it printed them
    for a keep-alive race on an H100), deduplicated; none where nothing failed."""
    from benchmarks.e2e.serve import client_errors

    trace = ("Error {i}: Traceback (most recent call last):\n"
             '  File "/x/vllm/benchmarks/lib/endpoint_request_func.py", line 252, in f\n'
             "    async with session.post(url=api_url) as response:\n"
             "    await self._waiter\n"
             "aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected\n")
    out = ("INFO: 200 OK\nValueError: a line before the failures is not theirs\n"
           "Failed requests during benchmark run detected (capping to 10):\n"
           + trace.format(i=0) + trace.format(i=1) + "Error 2: TimeoutError\n"
           "============ Serving Benchmark Result ============\nFailed requests: 3\n")
    assert client_errors(out) == ["aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected",
                                  "TimeoutError"]
    assert client_errors(out, limit=1) == ["aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected"]
    assert client_errors("Successful requests: 8\nFailed requests: 0\n") == []
    ok, why = rate_search.Objective(50.0).check(
        dict(completed=304, num_prompts=305, failed=1, p99_tpot_ms=41.4,
             failed_errors=["aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected"]))
    assert not ok and why == ("1 failed, 304 of 305 completed "
                              "(aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected)")


def test_estimator_corrects_itself_with_measured_runs():
    est = orchestrate.Estimator(prefill_tok_s=10000.0, decode_tok_s=1000.0)
    run = workloads.BenchRun("chat", "x", (), 10, 20000.0, 500.0, max_concurrency=10)
    assert est.seconds(run) == pytest.approx(10 * (2.0 + 0.5) + 20.0)
    est.measured(run, 90.0)
    assert est.seconds(run) == pytest.approx(90.0)
    probe = workloads.BenchRun("rate", "r", (), 30, 1.0, 1.0, request_rate=0.5)
    assert orchestrate.Estimator(1e9, 1e9).seconds(probe) == pytest.approx(60 + 0.05 + 20.0)


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.serving.plots import plot_summary

    path = tmp_path / "serving_summary.json"
    path.write_text(json.dumps(dict(report.tables(RECORDS), records=RECORDS, versions={}, model={})))
    files = plot_summary(path, tmp_path)
    assert [f.name for f in files] == ["serving_chat.png", "serving_rate.png"]
    assert all(f.stat().st_size > 10000 for f in files)


def test_chat_title_names_the_lengths_a_summary_stores():
    from benchmarks.serving.plots import chat_title, lengths_label

    a = parse_args(["--out", "o", "--model", "/m", "--chat-input", "2k-8k", "--chat-output", "512-1024"])
    stored = json.loads(json.dumps(vars(a), default=str))  # as the summary writes them
    assert chat_title(stored) == "Chat, 2048-8192 prompt / 512-1024 output tokens"
    assert lengths_label(stored) == "2048-8192 prompt / 512-1024 output tokens" and lengths_label({}) == ""
    assert chat_title({"chat_input": "LengthRange(lo=1, hi=2)"}) == "Chat" and chat_title({}) == "Chat"


def test_scrape_counter_sums_label_sets(monkeypatch):
    text = ('# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{engine="0"} 3.0\n'
            'vllm:num_preemptions_total{engine="1"} 2.0\nvllm:num_preemptions_created 1.7e9\n')

    class _Resp:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return text.encode()

    monkeypatch.setattr(orchestrate.urllib.request, "urlopen", lambda *a, **k: _Resp())
    assert orchestrate.scrape_counter(1, orchestrate.PREEMPTIONS) == 5.0
    assert orchestrate.scrape_counter(1, "vllm:absent") is None


# ---------------------------------------------------------------- soak: requests, comparison, engines

PARAMS = SoakParams(num_requests=400, prompt=LengthRange(1, 4096), output=LengthRange(4, 12),
                    prefix_len=LengthRange(64, 256), prefix_fraction=0.3, num_prefixes=4,
                    spec_fraction=0.25, vocab=1000, seed=3)


def test_soak_requests_are_deterministic_and_have_their_mix():
    reqs = make_requests(PARAMS)
    assert reqs == make_requests(PARAMS) and reqs != make_requests(SoakParams(**dict(vars(PARAMS), seed=4)))
    lens = [len(r.prompt) for r in reqs]
    assert min(lens) >= 1 and max(lens) <= 4096 and np.median(lens) < 1024  # log-uniform: mostly short
    assert 0.22 < np.mean([r.prefix >= 0 for r in reqs]) < 0.38
    assert 0.18 < np.mean([r.spec for r in reqs]) < 0.32
    assert all(4 <= r.max_tokens <= 12 and 10 <= min(r.prompt) and max(r.prompt) < 1000 for r in reqs)
    by_prefix: dict[int, list] = {}
    for r in reqs:
        if r.prefix >= 0 and len(r.prompt) >= 256:
            by_prefix.setdefault(r.prefix, []).append(r.prompt)
    for prompts in by_prefix.values():  # the same first 64 tokens (the shortest prefix) at least
        assert len({p[:64] for p in prompts}) == 1
    assert len({p[0][:64] for p in by_prefix.values()}) == len(by_prefix)
    spec = [r for r in reqs if r.spec and r.prefix < 0 and len(r.prompt) > 100]
    assert all(len(set(r.prompt)) <= 32 for r in spec)  # a repeated segment of at most 32 tokens
    uni = make_requests(SoakParams(**dict(vars(PARAMS), loguniform=False)))
    assert np.median([len(r.prompt) for r in uni]) > 1500


def _out(i, tokens, margins, finish="length"):
    return dict(id=i, tokens=tokens, lp=[[-0.1, None if m is None else -0.1 - m] for m in margins],
                finish=finish)


def test_compare_finds_mismatches_near_ties_and_bad_outputs():
    reqs = make_requests(SoakParams(**dict(vars(PARAMS), num_requests=6, output=LengthRange(4, 4),
                                            spec_fraction=0.0)))
    alone = {i: _out(i, [1, 2, 3, 4], [1.0, 0.01, 2.0, 2.0]) for i in range(6)}
    tested = {0: _out(0, [1, 2, 3, 4], [1.0, 0.01, 2.0, 2.0]),  # equal, log-probs too
              1: _out(1, [1, 5, 3, 4], [1.0] * 4),  # differs at 1, where alone's margin is 0.01
              2: _out(2, [1, 2, 3, 9], [1.0] * 4),  # differs at 3 (margin 2.0: not a tie)
              3: _out(3, [], []),  # empty
              4: dict(_out(4, [1, 2, 3, 4], [1.0] * 4), lp=[[None, None]] * 4)}  # NaN log-probs
    res = compare.compare(reqs, alone, {"pressure": tested}, tie_nats=0.05)["pressure"]
    assert res["compared"] == 3 and res["mismatched"] == 2 and res["mismatched_near_tie"] == 1
    assert [(m["id"], m["position"], m["near_tie"]) for m in res["mismatches"]] == [(1, 1, True), (2, 3, False)]
    assert res["mismatches"][0]["alone_margin"] == pytest.approx(0.01)
    assert {b["id"]: b["why"] for b in res["bad_outputs"]} == {3: "empty", 4: "NaN or missing log-prob"}
    assert res["missing"] == 1  # request 5 was not served under pressure
    # of the matching requests (only 0 here): log-probs identical
    assert res["logprobs_identical"] == 1 and res["max_logprob_diff"] == 0
    moved = dict(alone[0], lp=[list(row) for row in alone[0]["lp"]])
    moved["lp"][2][0] -= 0.1
    res = compare.compare(reqs, alone, {"pressure": {0: moved}}, tie_nats=0.05)["pressure"]
    assert res["logprobs_identical"] == 0 and res["max_logprob_diff"] == pytest.approx(0.1, abs=1e-6)
    short = {0: _out(0, [1, 2], [1.0, 1.0], finish="stop")}
    assert "2 of 4 tokens" in compare.compare(reqs, alone, {"pressure": short}, 0.05)["pressure"]["bad_outputs"][0]["why"]
    assert compare.first_difference([1, 2], [1, 2, 3]) == 2 and compare.first_difference([1], [1]) is None


def test_soak_engine_arguments_per_pass(tmp_path):
    a = soak_args(["--out", str(tmp_path)])
    assert a.max_model_len == 32768 + 64 + 3 + 16 and a.pressure_kv_tokens == 3 * a.max_model_len
    from benchmarks.serving.soak.cli import pass_spec
    from vllm_nvfp4.testing.weightless import build_weightless_model

    model = str(build_weightless_model(tmp_path / "m", "tiny"))
    assert worker.engine_groups(["pressure", "spec", "alone"]) == [["pressure", "alone"], ["spec"]]
    assert worker.engine_groups(["spec"]) == [["spec"]] and worker.engine_groups(["alone"]) == [["alone"]]
    plain = worker.engine_kwargs(pass_spec(a, model, "dummy", "fp8", ["pressure", "alone"], math.inf))
    spec_kw = worker.engine_kwargs(pass_spec(a, model, "dummy", "fp8", ["spec"], math.inf))
    assert plain["num_gpu_blocks_override"] == math.ceil(a.pressure_kv_tokens / 16)
    assert plain["enable_prefix_caching"] and plain["max_num_batched_tokens"] == 4096
    assert plain["attention_backend"] == "FLASH_ATTN" and "speculative_config" not in plain
    assert spec_kw["speculative_config"]["method"] == "ngram"
    with pytest.raises(ValueError, match="spec needs its own"):
        worker.engine_kwargs(pass_spec(a, model, "dummy", "fp8", ["pressure", "spec"], math.inf))
    spec = pass_spec(a, model, "dummy", "nvfp4-mixed", ["pressure"], math.inf)
    assert spec["policy"] == "0:fp8,*:nvfp4" and len(worker.requests_of(spec, "pressure")) + len(
        worker.requests_of(spec, "spec")) == len(worker.requests_of(spec, "alone")) == 1000
    with pytest.raises(SystemExit):
        soak_args(["--out", str(tmp_path), "--pressure-kv-tokens", "1000"])


# ---------------------------------------------------------------- engines (CPU)

@pytest.mark.vllm
def test_cpu_tiny_serving_run_end_to_end(tmp_path):
    """``vllm serve`` of nvfp4-mixed and one ``vllm bench serve`` rate probe (~1.5 min on 2 cores)."""
    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--out", str(out), "--cpu-tiny",
                           "--model-dir", str(tmp_path / "m"), "--configs", "nvfp4-mixed",
                           "--workloads", "rate", "--max-probes", "1", "--port", "8139"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    raw = json.loads((out / "raw" / "nvfp4-mixed" / "rate_4.json").read_text())
    assert raw["completed"] == raw["num_prompts"] == 8 and raw["request_rate"] == 4.0
    assert 8 * 3 <= raw["total_output_tokens"] <= 8 * 9 and raw["p99_tpot_ms"] > 0
    summary = json.loads((out / orchestrate.SUMMARY).read_text())
    kinds = [r["kind"] for r in summary["records"]]
    assert kinds == ["server", "bench", "rate_probe", "rate_search"], kinds
    assert summary["records"][0]["http_keep_alive_s"] == SERVER_KEEP_ALIVE_S
    assert summary["rate_search"]["nvfp4-mixed"]["max_rate"] == 4.0  # the 2 s objective holds
    assert summary["policies"]["nvfp4-mixed"] == "0:fp8,*:nvfp4"
    assert "| rate_4 | nvfp4-mixed |" in (out / orchestrate.TABLE).read_text()
    assert (out / "serving_rate.png").exists()


@pytest.mark.vllm
def test_cpu_tiny_soak_preempts_and_matches_alone(tmp_path):
    """The pressure and alone passes of nvfp4-mixed on CPU (1.5-4 min on 2 busy cores): the pressure
    pass preempts, every output is complete and equals the alone pass's except at near ties.
    The ngram pass is covered by the engine arguments above and tests/test_spec_decode_engine.py."""
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving.soak", "--out", str(out), "--cpu-tiny",
                           "--configs", "nvfp4-mixed", "--passes", "pressure,alone", "--requests", "14",
                           "--spec-fraction", "0",
                           "--model-dir", str(tmp_path / "m")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "soak_summary.json").read_text())
    s = summary["configs"]["nvfp4-mixed"]
    assert s["crashes"] == [] and s["killed"] == [] and s["preemptions"]["pressure"] > 0, s["preemptions"]
    p = s["pressure"]
    assert p["missing"] == 0 and p["bad_outputs"] == [] and s["alone_bad_outputs"] == []
    assert p["compared"] == summary["requests"]["total"] == 14
    # a mismatch is allowed only where the alone pass had a near tie (benchmarks/serving/soak/compare.py)
    assert all(m["near_tie"] for m in p["mismatches"]), p["mismatches"]
    assert "| nvfp4-mixed | pressure |" in (out / "soak_summary.md").read_text()

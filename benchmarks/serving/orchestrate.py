"""The run: per configuration one ``vllm serve``, its workloads through ``vllm bench serve``, then
the summary, the markdown table and the plots.

Each ``vllm bench serve`` result JSON is kept as ``OUT/raw/CONFIG/LABEL.json``; each measurement
is appended to ``serving_records.jsonl`` as it completes (a kill keeps what was measured).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import shlex
import subprocess
import sys
import time
import urllib.request
from argparse import Namespace
from pathlib import Path
from typing import Callable, Optional

from benchmarks.e2e.budget import deadline_share
from benchmarks.e2e.configs import CONFIGS, BenchConfig, policy_for, unavailable_reason
from benchmarks.e2e.orchestrate import (child_env, prepare_model, prior_versions, start_run, versions,
                                        wait_gpu_free)
from benchmarks.e2e.records import Recorder, prior_records, read_records
from benchmarks.e2e.serve import (bench_serve_base, client_errors, result_record, serve_command, server_env,
                                  stop_group, wait_healthy)
from benchmarks.e2e.worker import log
from benchmarks.serving import rate_search, report
from benchmarks.serving.workloads import BenchRun, chat_runs, prefix_runs, rate_run
from vllm_nvfp4.model_shape import ModelShape

RECORDS = "serving_records.jsonl"
SUMMARY = "serving_summary.json"
TABLE = "serving_summary.md"
#: the server's Prometheus counter of preempted requests
PREEMPTIONS = "vllm:num_preemptions_total"


def client_command(a: Namespace, cfg: BenchConfig, run: BenchRun) -> list[str]:
    """``vllm bench serve`` of one run against this configuration's server."""
    return (bench_serve_base(a.port, a.model, raw_dir(a, cfg), run.result_name, f"{cfg.name}:{run.label}")
            + run.client_args() + shlex.split(a.bench_serve_args or ""))


def raw_dir(a: Namespace, cfg: BenchConfig) -> Path:
    return Path(a.out) / "raw" / cfg.name


def scrape_counter(port: int, name: str) -> Optional[float]:
    """Sum of a Prometheus counter over its label sets on the server's ``/metrics`` (None: absent)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]
    return sum(vals) if vals else None


class Estimator:
    """Seconds a run takes: prompt tokens / prefill rate + output tokens / decode rate, or the
    arrival time of a rate probe plus one request's decode, times a correction each measured run
    updates (measured / estimated of the latest run)."""

    def __init__(self, prefill_tok_s: float, decode_tok_s: float) -> None:
        self.prefill, self.decode, self.correction = prefill_tok_s, decode_tok_s, 1.0

    def raw(self, run: BenchRun) -> float:
        work = run.num_prompts * (run.mean_input / self.prefill + run.mean_output / self.decode)
        if math.isfinite(run.request_rate):
            work = max(work, run.num_prompts / run.request_rate + run.mean_output * 0.05)
        return work + 20.0  # the client's own start (imports vLLM)

    def seconds(self, run: BenchRun) -> float:
        return self.raw(run) * self.correction

    def measured(self, run: BenchRun, wall_s: float) -> None:
        self.correction = max(0.2, wall_s / self.raw(run))


def pending_runs(a: Namespace, workload: str, done: set[str]) -> list[BenchRun]:
    """The runs of ``workload`` (``chat`` or ``prefix``) whose labels are not in ``done``."""
    runs = chat_runs(a) if workload == "chat" else prefix_runs(a)
    return [r for r in runs if r.label not in done]


class ConfigRun:
    """One configuration's server and its workloads, until ``deadline`` (Unix s); runs labelled
    in ``done`` (measured in ``--prior-records``, with ``--skip-measured``) are left out."""

    def __init__(self, a: Namespace, cfg: BenchConfig, deadline: float, est: Estimator,
                 done: frozenset[str] = frozenset()) -> None:
        self.a, self.cfg, self.deadline, self.est, self.done = a, cfg, deadline, est, set(done)
        self.rec = Recorder(Path(a.out) / RECORDS, config=cfg.name)
        self.log_path = Path(a.out) / f"serve_{cfg.name}.log"

    def left(self) -> float:
        return self.deadline - time.time()

    def bench(self, run: BenchRun) -> Optional[dict]:
        """One ``vllm bench serve`` run: its vLLM result JSON (None: skipped or failed; recorded)."""
        need = self.est.seconds(run)
        if need > self.left():
            self.rec.write("skip", workload=run.workload, label=run.label,
                           reason=f"budget: needs ~{need:.0f}s, {self.left():.0f}s left")
            log(f"{self.cfg.name} {run.label}: skipped (~{need:.0f}s > {self.left():.0f}s left)")
            return None
        cmd = client_command(self.a, self.cfg, run)
        path = raw_dir(self.a, self.cfg) / run.result_name
        path.unlink(missing_ok=True)
        before = scrape_counter(self.a.port, PREEMPTIONS)
        log(f"{self.cfg.name} {run.label}: {run.num_prompts} prompts (~{need:.0f}s)")
        t0 = time.time()
        with open(self.log_path, "a") as lf:
            lf.write(f"\n===== {shlex.join(cmd)}\n")
            lf.flush()
            start = lf.tell()
            timeout = None if math.isinf(self.deadline) else max(10.0, self.left())
            try:
                rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout,
                                    env=child_env()).returncode
            except subprocess.TimeoutExpired:
                rc = "killed at the configuration's deadline"
        wall = time.time() - t0
        if rc != 0 or not path.exists():
            self.rec.write("error", workload=run.workload, label=run.label,
                           what="vllm bench serve", error=f"exit {rc} (see {self.log_path.name})")
            log(f"{self.cfg.name} {run.label}: vllm bench serve failed: exit {rc}")
            return None
        self.est.measured(run, wall)
        result = json.loads(path.read_text())
        if result.get("failed"):  # the client's reasons, from its output in the log
            with open(self.log_path) as lf:
                lf.seek(start)
                result["failed_errors"] = client_errors(lf.read())
        after = scrape_counter(self.a.port, PREEMPTIONS)
        self.rec.write("bench", workload=run.workload, label=run.label, wall_s=round(wall, 1),
                       num_prompts=run.num_prompts, result_file=str(path.relative_to(self.a.out)),
                       preemptions=None if before is None or after is None else int(after - before),
                       command=shlex.join(cmd), **run.extra, **result_record(result))
        log(f"{self.cfg.name} {run.label}: {result.get('completed')} done in {wall:.0f}s, "
            f"{result.get('output_throughput', 0):.0f} output tok/s, TTFT p50 "
            f"{result.get('p50_ttft_ms', 0):.0f} ms, TPOT p99 {result.get('p99_tpot_ms', 0):.1f} ms")
        return result

    def rate_search(self) -> None:
        """Probes of :mod:`benchmarks.serving.rate_search` while probes and time last."""
        a = self.a
        obj = rate_search.Objective(a.tpot_p99_ms, a.ttft_p99_ms)
        passed = {r["rate"]: r["passed"] for r in prior_records(a.prior_records)  # resume a search
                  if r["kind"] == "rate_probe" and r.get("config") == self.cfg.name
                  and r.get("objective") == vars(obj)}
        if passed:
            log(f"{self.cfg.name}: rate search resumes from earlier probes {passed}")
        new = 0
        while new < a.max_probes:
            rate = rate_search.next_rate(passed, a.rate_start, a.rate_factor, a.rate_tol)
            if rate is None:
                break
            rate = round(rate, 4)
            run = rate_run(a, rate, len(passed))
            result = self.bench(run)
            if result is None:
                break
            ok, why = obj.check(result)
            passed[rate], new = ok, new + 1
            self.rec.write("rate_probe", label=run.label, rate=rate, passed=ok, why=why, objective=vars(obj))
            log(f"{self.cfg.name} rate {rate:g}/s: {'pass' if ok else 'fail'} ({why})")
        self.rec.write("rate_search", objective=vars(obj), rates={str(r): ok for r, ok in passed.items()},
                       **rate_search.summarize(passed))

    def run(self, policy: Optional[str]) -> None:
        a = self.a
        env = server_env(child_env(), policy)
        hybrid = ModelShape.from_model_dir(a.model).needs_packed_groups
        cmd = serve_command(a, self.cfg, hybrid, prefix_caching=True)
        raw_dir(a, self.cfg).mkdir(parents=True, exist_ok=True)
        log(f"{self.cfg.name}: {shlex.join(cmd)}")
        t0 = time.time()
        with open(self.log_path, "a") as lf:
            lf.write(f"\n===== serve {self.cfg.name}: {shlex.join(cmd)}\n")
            lf.flush()
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            if not wait_healthy(a.port, proc, min(self.deadline - 30, t0 + a.serve_start_s)):
                why = "server exited" if proc.poll() is not None else "no /health before the deadline"
                self.rec.write("error", what="vllm serve", error=f"{why} (see {self.log_path.name})")
                log(f"{self.cfg.name}: {why}")
                return
            self.rec.write("server", start_s=round(time.time() - t0, 1), command=shlex.join(cmd), policy=policy,
                           http_keep_alive_s=int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]))
            log(f"{self.cfg.name}: /health after {time.time() - t0:.0f}s")
            steps: dict[str, Callable[[], None]] = {
                "chat": lambda: [self.bench(r) for r in pending_runs(a, "chat", self.done)],
                "prefix": lambda: [self.bench(r) for r in pending_runs(a, "prefix", self.done)],
                "rate": self.rate_search}
            for w in a.workloads:
                steps[w]()
        finally:
            stop_group(proc)


def meta(a: Namespace) -> dict:
    shape = ModelShape.from_model_dir(a.model)
    return dict(started_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join([sys.executable, "-m", "benchmarks.serving"] + a.argv),
                args={k: v for k, v in vars(a).items() if k != "argv"}, versions=versions(),
                prior_versions=prior_versions(a.prior_records, SUMMARY),
                model=dict(shape.to_json(), path=a.model, preset=None if a.model_given else a.preset,
                           load_format="dummy"),
                policies={n: policy_for(CONFIGS[n], shape.layer_types, a.mixed_policy) for n in a.configs},
                method="benchmarks/serving/__init__.py")


def summarize(a: Namespace, head: dict) -> dict:
    records = report.merge(prior_records(a.prior_records), read_records(Path(a.out) / RECORDS))
    summary = dict(head, finished_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   **report.tables(records), records=records)
    out = Path(a.out)
    (out / (SUMMARY + ".tmp")).write_text(json.dumps(summary, indent=1, default=str))
    (out / (SUMMARY + ".tmp")).replace(out / SUMMARY)
    (out / TABLE).write_text(report.markdown(summary))
    return summary


def merge_only(a: Namespace) -> int:
    """The summary, table and plots of ``--prior-records`` alone, in ``--out`` (no server): the
    arguments, model and policies of the newest summary beside them, each file's machine in
    ``prior_versions``. Refuses an ``--out`` that holds a run's records (its summary would be
    replaced)."""
    if (Path(a.out) / RECORDS).exists():
        sys.exit(f"--merge-only: {Path(a.out) / RECORDS} exists; a run's summary there would be "
                 "replaced. Give --out a folder of its own and name that file in --prior-records")
    beside = [Path(p).parent / SUMMARY for p in a.prior_records]
    summaries = [json.loads(p.read_text()) for p in beside if p.exists()]
    last = summaries[-1] if summaries else {}
    policies = {k: v for s in summaries for k, v in (s.get("policies") or {}).items()}
    head = dict(started_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join([sys.executable, "-m", "benchmarks.serving"] + a.argv),
                args=last.get("args"), versions=None, prior_versions=prior_versions(a.prior_records, SUMMARY),
                model=last.get("model"), policies=policies, method="benchmarks/serving/__init__.py")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    summarize(a, head)
    print((Path(a.out) / TABLE).read_text(), flush=True)
    from benchmarks.serving.plots import plot_summary

    for p in plot_summary(Path(a.out) / SUMMARY, Path(a.out)):
        log(f"plot {p}")
    return 0


def dry_run(a: Namespace) -> int:
    prepare_model(a)
    hybrid = ModelShape.from_model_dir(a.model).needs_packed_groups
    runs = chat_runs(a) * ("chat" in a.workloads) + prefix_runs(a) * ("prefix" in a.workloads)
    if "rate" in a.workloads:
        runs.append(rate_run(a, a.rate_start, 0))
    est = Estimator(a.est_prefill_tok_s, a.est_decode_tok_s)
    plan = {n: dict(unavailable=unavailable_reason(CONFIGS[n]),
                    server=shlex.join(serve_command(a, CONFIGS[n], hybrid, prefix_caching=True)),
                    clients={r.label: dict(command=shlex.join(client_command(a, CONFIGS[n], r)),
                                           estimate_s=round(est.seconds(r)))
                             for r in runs})
            for n in a.configs}
    print(json.dumps(dict(max_model_len=a.max_model_len, model=a.model, configs=plan), indent=1))
    return 0


def run(a: Namespace) -> int:
    t_start = time.time()
    out = start_run(a, RECORDS)
    head = meta(a)
    end = t_start + a.budget_s if a.budget_s else math.inf
    log(f"serving: configs {a.configs}, workloads {a.workloads}, max_model_len {a.max_model_len}, "
        f"budget {a.budget_s or 'none'}")
    est = Estimator(a.est_prefill_tok_s, a.est_decode_tok_s)
    measured = report.measured_labels(prior_records(a.prior_records)) if a.skip_measured else {}
    for i, name in enumerate(a.configs):
        cfg = CONFIGS[name]
        rec = Recorder(out / RECORDS, config=name)
        done = frozenset(measured.get(name, ()))
        if done and "rate" not in a.workloads and not any(
                pending_runs(a, w, set(done)) for w in a.workloads):
            rec.write("skip", what="serve", reason="every run is in --prior-records (--skip-measured)")
            log(f"{name}: skipped (every run is in --prior-records)")
            continue
        why = unavailable_reason(cfg)
        left = end - time.time()
        if why or left < a.min_config_s:
            why = why or f"budget ({left:.0f}s left)"
            rec.write("skip", what="serve", reason=why)
            log(f"{name}: skipped ({why})")
            continue
        later = len(a.configs) - i  # equal shares: the workloads, not the cache, set the time
        deadline = min(end - a.min_config_s * (later - 1), deadline_share(time.time(), end, [1.0] * later)) \
            if math.isfinite(end) else math.inf
        try:
            ConfigRun(a, cfg, deadline, est, done).run(head["policies"][name])
        except Exception as exc:  # one configuration's failure must not lose the others
            rec.write("error", what="serve", error=repr(exc))
            log(f"{name}: FAILED: {exc!r}")
        if not a.cpu:
            wait_gpu_free()
        summarize(a, head)
    summary = summarize(a, head)
    print("\n" + (out / TABLE).read_text(), flush=True)
    try:
        from benchmarks.serving.plots import plot_summary

        for p in plot_summary(out / SUMMARY, out):
            log(f"plot {p}")
    except ImportError as e:
        log(f"no plots: {e} (pip install matplotlib, then python -m benchmarks.serving --plot {out / SUMMARY})")
    log(f"done in {time.time() - t_start:.0f}s; {len(summary['records'])} records in {out / SUMMARY}")
    return 0

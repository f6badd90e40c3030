"""Online serving numbers from vLLM's own tools: ``vllm bench serve`` against ``vllm serve``.

For each configuration: start ``vllm serve`` (same model, memory setting and KV dtype as the
offline runs; the nvfp4 policy through ``VLLM_NVFP4_POLICY``), wait for ``/health``, run
``vllm bench serve`` on its random dataset, keep its result JSON (``OUT/bench_serve_CONFIG.json``)
and record its throughput / TTFT / TPOT / ITL / end-to-end latency fields, stop the server.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from argparse import Namespace
from pathlib import Path
from typing import Mapping, Optional

from benchmarks.e2e.configs import BenchConfig, backend_for
from benchmarks.e2e.records import Recorder
from vllm_nvfp4.model_shape import ModelShape

SERVE_LOG = "serve.log"
#: idle HTTP keep-alive of the server, s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, vLLM's default 5): longer
#: than the 60 s ``vllm bench serve`` keeps a pooled connection, so the client never sends a request
#: on a connection the server is closing (that request fails with "Server disconnected", unseen
#: by the engine)
SERVER_KEEP_ALIVE_S = 75
#: fields of vLLM's result JSON copied into the ``bench_serve`` record
RESULT_FIELDS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                 "request_throughput", "output_throughput", "total_token_throughput",
                 "max_concurrency", "request_rate", "failed_errors")
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
LATENCY_FIELD = re.compile(r"^(mean|median|std|p[0-9.]+)_[a-z0-9]+_ms$")
#: where ``vllm bench serve`` starts printing the errors of its failed requests
FAILED_REQUESTS = "Failed requests during benchmark run detected"
#: the first line of one failed request's error: ``Error 3: <its error>``
FAILED_REQUEST_LINE = re.compile(r"^Error \d+: (.*)$")
#: the last line of a Python traceback: ``module.ExceptionName: message``
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Timeout\w*)\b.*$")
VLLM_CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def serve_command(a: Namespace, cfg: BenchConfig, hybrid: bool = False,
                  prefix_caching: bool = False) -> list[str]:
    """``vllm serve`` of one configuration on 127.0.0.1:``a.port`` (``hybrid``: the model has
    sliding-window layers, :func:`~benchmarks.e2e.configs.backend_for`; ``prefix_caching``:
    vLLM's prefix cache on, as ``vllm serve`` has it by default)."""
    cmd = VLLM_CLI + ["serve", a.model, "--port", str(a.port), "--host", "127.0.0.1",
                      "--load-format", "dummy", "--kv-cache-dtype", cfg.kv_cache_dtype,
                      "--max-model-len", str(a.max_model_len), "--gpu-memory-utilization",
                      str(a.gpu_mem), "--enable-prefix-caching" if prefix_caching
                      else "--no-enable-prefix-caching", "--seed", "0"]
    backend = backend_for(cfg, hybrid)
    if backend and not a.cpu:
        cmd += ["--attention-backend", backend]
    if cfg.skip_layers:
        cmd += ["--kv-cache-dtype-skip-layers",
                *cfg.skipped(ModelShape.from_model_dir(a.model).num_layers)]
    if a.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if a.max_num_seqs:
        cmd += ["--max-num-seqs", str(a.max_num_seqs)]
    if a.eager:
        cmd += ["--enforce-eager"]
    return cmd


def bench_serve_base(port: int, model: str, result_dir: Path, result_name: str, label: str) -> list[str]:
    """``vllm bench serve`` against 127.0.0.1:``port`` without its dataset flags: ``ignore_eos``,
    TTFT / TPOT / ITL / end-to-end percentiles 50 and 99, the result JSON saved as
    ``result_dir/result_name``."""
    return VLLM_CLI + [
        "bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
        "--model", model, "--ignore-eos", "--percentile-metrics", PERCENTILE_METRICS,
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(Path(result_dir).resolve()),
        "--result-filename", result_name, "--label", label, "--disable-tqdm"]


def bench_serve_command(a: Namespace, cfg: BenchConfig, result_name: str) -> list[str]:
    """``vllm bench serve`` with random prompts of ``serve_prompt_len`` tokens, ``ignore_eos``."""
    cmd = bench_serve_base(a.port, a.model, Path(a.out), result_name, cfg.name) + [
        "--dataset-name", "random",
        "--random-input-len", str(a.serve_prompt_len), "--random-output-len", str(a.serve_output_len),
        "--num-prompts", str(a.serve_requests), "--max-concurrency", str(a.clients),
        "--request-rate", str(a.request_rate), "--seed", "0"]
    return cmd + shlex.split(a.bench_serve_args or "")


def result_record(result: dict) -> dict:
    """The ``bench_serve`` record fields of one vLLM result JSON (plus every mean/median/p
    latency field it has, e.g. ``median_ttft_ms``, ``p99_tpot_ms``)."""
    out = {k: result[k] for k in RESULT_FIELDS if k in result}
    out.update({k: v for k, v in result.items() if LATENCY_FIELD.match(k)})
    return out


def client_errors(output: str, limit: int = 3) -> list[str]:
    """The distinct exception lines (at most ``limit``, first seen first) that ``vllm bench
    serve`` printed for its failed requests in ``output`` (its stdout), [] where none failed."""
    if FAILED_REQUESTS not in output:
        return []
    found = []
    for line in output[output.index(FAILED_REQUESTS):].splitlines()[1:]:
        line = line.strip()
        if line.startswith("="):  # the result banner: the errors are over
            break
        numbered = FAILED_REQUEST_LINE.match(line)  # "Error 3: <its error>"
        if numbered:
            line = numbered.group(1)
            if line.startswith("Traceback"):  # its last line names the exception
                continue
            found.append(line)
        elif EXCEPTION_LINE.match(line):
            found.append(line)
    return list(dict.fromkeys(found))[:limit]


def wait_healthy(port: int, proc: subprocess.Popen, deadline: float) -> bool:
    """Poll ``/health`` until it answers, the server exits or ``deadline`` (Unix s) passes."""
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return True
        except OSError:
            time.sleep(1)
    return False


def stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after ``grace`` s, then stragglers."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        break
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # e.g. the engine core of a stopped API server
    except (ProcessLookupError, PermissionError):
        pass


def server_env(base: Mapping[str, str], policy: Optional[str]) -> dict[str, str]:
    """``base`` with the nvfp4 policy (``VLLM_NVFP4_POLICY``, when given) and the server's HTTP
    keep-alive (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: :data:`SERVER_KEEP_ALIVE_S` unless ``base`` sets it)."""
    env = dict(base)
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEP_ALIVE_S))
    if policy:
        env["VLLM_NVFP4_POLICY"] = policy
    return env


def run_serve(a: Namespace, cfg: BenchConfig, policy: Optional[str], deadline: float,
              rec: Recorder, log) -> None:
    """One configuration: server up, ``vllm bench serve``, record, server down."""
    env = server_env(os.environ, policy)
    cmd = serve_command(a, cfg, ModelShape.from_model_dir(a.model).needs_packed_groups)
    log(f"serve {cfg.name}: {shlex.join(cmd)}")
    t0 = time.time()
    with open(Path(a.out) / SERVE_LOG, "a") as lf:
        lf.write(f"\n===== serve {cfg.name}: {shlex.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            if not wait_healthy(a.port, proc, min(deadline - 30, t0 + a.serve_start_s)):
                why = "server exited" if proc.poll() is not None else "no /health before the deadline"
                rec.write("error", what=f"serve {cfg.name}", error=why, start_s=round(time.time() - t0, 1))
                log(f"serve {cfg.name}: {why} (see {SERVE_LOG})")
                return
            start_s = time.time() - t0
            name = f"bench_serve_{cfg.name}.json"
            bench = bench_serve_command(a, cfg, name)
            log(f"serve {cfg.name}: /health after {start_s:.0f}s; {shlex.join(bench)}")
            lf.write(f"\n===== vllm bench serve {cfg.name}: {shlex.join(bench)}\n")
            lf.flush()
            timeout = None if deadline == float("inf") else max(10.0, deadline - time.time())
            try:
                rc = subprocess.run(bench, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            path = Path(a.out) / name
            if rc != 0 or not path.exists():
                rec.write("error", what=f"vllm bench serve {cfg.name}", error=f"exit {rc} (see {SERVE_LOG})")
                log(f"serve {cfg.name}: vllm bench serve failed: exit {rc}")
                return
            fields = result_record(json.loads(path.read_text()))
            rec.write("bench_serve", server_start_s=round(start_s, 1), result_file=name,
                      prompt_len=a.serve_prompt_len, output_len=a.serve_output_len,
                      command=shlex.join(bench), **fields)
            log(f"serve {cfg.name}: {fields.get('completed')} requests, {fields.get('output_throughput')} "
                f"output tok/s, TTFT median {fields.get('median_ttft_ms')} ms")
        finally:
            stop_group(proc)

"""The run: one worker process per configuration, then the serve runs, then the summary.

Each configuration gets its own process (GPU memory is returned between them; a crash or a kill
costs only that configuration). fp8 runs first where asked: its largest batch per context is
handed to the later configurations as their ``ref`` decode stage.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from argparse import Namespace
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from benchmarks.e2e import report
from benchmarks.e2e.budget import Budget
from benchmarks.e2e.capacity import (DEFAULT_IN_FLIGHT_TOKENS, bytes_per_token_by_config, estimate_batch,
                                     max_batch, pool_layout)
from benchmarks.e2e.configs import CONFIGS, REFERENCE, policy_for, unavailable_reason
from benchmarks.e2e.records import RECORDS, Recorder, latest, merge_records, prior_records, read_records
from benchmarks.e2e.serve import bench_serve_command, run_serve, serve_command
from benchmarks.e2e.worker import log
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.testing.weightless import PRESETS, build_weightless_model

REPO = Path(__file__).resolve().parents[2]
SUMMARY = "e2e_summary.json"
WORKER_LOG = "workers.log"
#: worker log lines kept in a ``backend_log`` record: which backend and KV size vLLM chose
BACKEND_LOG_KEYS = ("attention backend", "Using AttentionBackend", "vllm-nvfp4: KV policy",
                    "GPU KV cache size", "Maximum concurrency")


def worker_spec(a: Namespace, name: str, deadline: float, soft: float, ref: dict[str, int]) -> dict:
    """Everything a worker reads (JSON-serializable; ``inf`` deadlines without a budget)."""
    return dict(vars(a), config=name, deadline=deadline, soft_deadline=soft, ref_batches=ref)


def worker_command(spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.e2e.worker", str(spec_path)]


def child_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (vLLM's spawned processes too)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _pump(proc: subprocess.Popen, lf: Any, seen: list[str]) -> None:
    """Copy a worker's output to the log, echo progress and error lines, keep backend lines."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lf.write(line)
        if any(k in line for k in BACKEND_LOG_KEYS) and len(seen) < 12:
            seen.append(line.strip()[-300:])
        if line.startswith("[bench") or ("Error" in line[:200] and "Warning" not in line):
            sys.stdout.write(line)
            sys.stdout.flush()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of a worker's process group (engine core, GPU workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_config(a: Namespace, name: str, deadline: float, soft: float, ref: dict[str, int],
               grace_s: float) -> int:
    """One worker process, its whole group killed at ``deadline`` + ``grace_s``."""
    out = Path(a.out)
    spec_path = out / f"worker_{name}.json"
    spec_path.write_text(json.dumps(worker_spec(a, name, deadline, soft, ref), indent=1))
    cmd = worker_command(spec_path)
    log(f"{name}: worker {shlex.join(cmd)}" + ("" if deadline == float("inf") else
                                                f" ({deadline - time.time():.0f}s)"))
    timeout = None if deadline == float("inf") else max(1.0, deadline - time.time() + grace_s)
    with open(out / WORKER_LOG, "a") as lf:
        lf.write(f"\n===== {name}: {shlex.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, bufsize=1, cwd=REPO, env=child_env())
        seen: list[str] = []
        pump = threading.Thread(target=_pump, args=(proc, lf, seen), daemon=True)
        pump.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"{name}: past its deadline, killing the worker")
            Recorder(out / RECORDS, config=name).write("killed", reason="deadline")
            rc = -9
        kill_group(proc)
        pump.join(timeout=5)
    if seen:
        Recorder(out / RECORDS, config=name).write("backend_log", lines=seen[:6])
    if not a.cpu:
        wait_gpu_free()
    return rc


def gpu_memory_used_mib() -> Optional[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def wait_gpu_free(limit_mib: int = 2048, timeout: float = 30.0) -> None:
    """Wait (bounded) until the previous engine's GPU memory is back."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        used = gpu_memory_used_mib()
        if used is None or used < limit_mib:
            return
        time.sleep(1)
    log(f"warning: {gpu_memory_used_mib()} MiB still used on the GPU")


def _run_text(cmd: list[str]) -> Optional[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, Any]:
    """Python, packages, GPU and the repository commit, for the summary."""
    out: dict[str, Any] = dict(python=platform.python_version(), platform=platform.platform(),
                               cpu_count=os.cpu_count())
    for pkg in ("vllm", "torch", "triton", "transformers", "vllm-nvfp4"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    out["gpu"] = _run_text(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"])
    out["git_commit"] = _run_text(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    return out


def prior_versions(paths: list[str], summary_name: str = SUMMARY) -> dict[str, Any]:
    """``versions`` of the summary (``summary_name``) beside each ``--prior-records`` file, by
    records path (where there is one): the machines the merged records were measured on."""
    out: dict[str, Any] = {}
    for p in paths:
        summary = Path(p).parent / summary_name
        if summary.exists():
            out[p] = json.loads(summary.read_text()).get("versions")
    return out


def summarize(a: Namespace, meta: dict, t_start: float) -> dict:
    """Merge earlier runs' records with this run's, compute ratios and targets, write the summary."""
    now = read_records(Path(a.out) / RECORDS)
    records = merge_records(prior_records(a.prior_records), now, a.dtypes, a.serve,
                            a.contexts + a.ttft_contexts)
    ctxs = sorted({r["context"] for r in records if "context" in r} | set(a.contexts + a.ttft_contexts),
                  reverse=True)
    ratios = report.compute_ratios(records, ctxs)
    targets = report.check_targets(ratios, report.load_targets(a.targets),
                                  None if a.model_given else a.preset)
    summary = dict(meta, finished_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   wall_s=round(time.time() - t_start, 1), ratios=ratios, targets=targets, records=records)
    tmp = Path(a.out) / (SUMMARY + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    tmp.replace(Path(a.out) / SUMMARY)
    return summary


def prepare_model(a: Namespace) -> None:
    """Write the weight-less model of ``--preset`` unless ``--model`` names one (positions raised
    only where the preset has fewer than the run needs)."""
    a.model_given = a.model is not None
    if a.model is None:
        need = a.max_model_len + 1024
        a.model = str(build_weightless_model(a.model_dir, a.preset,
                                             need if need > PRESETS[a.preset]["max_pos"] else None))


#: the configured block size the plan assumes without ``--block-size`` where the installed vLLM
#: names no default (vLLM 0.32's on CUDA; 0.34's ``CacheConfig.DEFAULT_BLOCK_SIZE`` is 64); a
#: worker reads the engine's
PLAN_BLOCK_SIZE = 16


def plan_block_size(a: Namespace) -> int:
    """The configured block size of the plan: ``--block-size``, else the installed vLLM's
    default (:data:`PLAN_BLOCK_SIZE` without vLLM or where it has none)."""
    if a.block_size:
        return int(a.block_size)
    try:
        from vllm.config import CacheConfig
    except ImportError:
        return PLAN_BLOCK_SIZE
    return int(getattr(CacheConfig, "DEFAULT_BLOCK_SIZE", PLAN_BLOCK_SIZE))
#: KV bytes the plan's batches are estimated for (a worker measures the engine's)
PLAN_KV_BYTES = 64 * 2**30


def plan(a: Namespace) -> dict[str, Any]:
    """What a run would do, without starting anything (``--dry-run`` prints it): per configuration
    its policy, bytes per token, pool layout and, for ``PLAN_KV_BYTES`` of KV cache, its largest
    batch per context (vs fp8's: the same bytes in fp8's pool layout)."""
    shape = ModelShape.from_model_dir(a.model)
    bpt = bytes_per_token_by_config(shape, a.mixed_policy)
    in_flight = a.max_num_batched_tokens or DEFAULT_IN_FLIGHT_TOKENS
    names = list(dict.fromkeys(a.dtypes + a.serve))
    block_size = plan_block_size(a)
    layouts = {n: pool_layout(CONFIGS[n].kv_cache_dtype, shape,
                              policy_for(CONFIGS[n], shape.layer_types, a.mixed_policy), block_size,
                              a.max_model_len, in_flight, len(CONFIGS[n].skip_layers))
               for n in dict.fromkeys([REFERENCE] + names)}
    configs = {}
    for n in names:
        batch = {str(c): estimate_batch(PLAN_KV_BYTES, layouts[n], c + a.headroom, in_flight,
                                        a.max_batch) for c in a.contexts}
        configs[n] = dict(kv_cache_dtype=CONFIGS[n].kv_cache_dtype,
                          policy=policy_for(CONFIGS[n], shape.layer_types, a.mixed_policy),
                          kv_bytes_per_token=bpt[n], vs_fp8=round(bpt[REFERENCE] / bpt[n], 4),
                          pool=layouts[n].to_json(), max_batch_at_plan_kv_bytes=batch)
    return dict(model=dict(shape.to_json(), path=a.model, hybrid=shape.needs_packed_groups,
                           layer_types={t.label(): shape.layer_types.count(t) for t in dict.fromkeys(shape.layer_types)}),
                assumed=dict(block_size=block_size, max_in_flight_tokens=in_flight,
                             kv_gib=PLAN_KV_BYTES / 2**30, max_model_len=a.max_model_len),
                configs=configs, contexts=a.contexts, ttft_contexts=a.ttft_contexts,
                worker=shlex.join(worker_command(Path(a.out) / "worker_CONFIG.json")),
                serve={n: dict(server=shlex.join(serve_command(a, CONFIGS[n], shape.needs_packed_groups)),
                               client=shlex.join(bench_serve_command(a, CONFIGS[n], f"bench_serve_{n}.json")))
                       for n in a.serve})


def start_run(a: Namespace, records: str) -> Path:
    """Create ``a.out``, delete its ``records`` file with ``--fresh``, write the model
    (:func:`prepare_model`). Returns ``a.out``."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.fresh and (out / records).exists():
        (out / records).unlink()
    prepare_model(a)
    return out


def run(a: Namespace) -> int:
    t_start = time.time()
    out = start_run(a, RECORDS)
    budget = Budget.start(a.budget_s, a.serve_reserve_s if a.serve else 0.0, a.min_config_s)
    p = plan(a)
    meta = dict(started_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join([sys.executable, "-m", "benchmarks.e2e"] + a.argv), args=vars(a),
                versions=versions(), prior_versions=prior_versions(a.prior_records),
                model=dict(p["model"], load_format="dummy", preset=None if a.model_given else a.preset),
                configs=p["configs"],
                method="benchmarks/e2e/__init__.py")
    log(f"model {a.model}: {p['model']}; configs {a.dtypes}; contexts {a.contexts}; "
        f"budget {a.budget_s or 'none'}")
    ref: dict[str, int] = {}
    e = latest(prior_records(a.prior_records), kind="engine", config=REFERENCE)
    if e and REFERENCE not in a.dtypes:
        ref = dict(e["max_batch"])
        log(f"reference batches from {e['prior']}: {ref}")
    for i, name in enumerate(a.dtypes):
        why = unavailable_reason(CONFIGS[name])
        if why:
            Recorder(out / RECORDS, config=name).write("skip", what="engine", reason=why)
            log(f"{name}: skipped ({why})")
            continue
        if budget.limited and budget.left(reserve_serve=True) < a.min_config_s:
            Recorder(out / RECORDS, config=name).write("skip", what="engine", reason="budget")
            log(f"{name}: skipped (budget)")
            continue
        hard, soft = budget.config_deadlines([CONFIGS[n].weight for n in a.dtypes[i:]], reserve_serve=True)
        run_config(a, name, hard, soft, ref, a.grace_s)
        if name == REFERENCE:
            e = latest(read_records(out / RECORDS), kind="engine", config=REFERENCE)
            ref = dict(e["max_batch"]) if e else ref
        summarize(a, meta, t_start)
    for name in a.serve:
        rec = Recorder(out / RECORDS, config=name)
        if budget.limited and budget.left() < a.serve_min_s:
            rec.write("skip", what="serve", reason=f"budget ({budget.left():.0f}s left)")
            log(f"serve {name}: skipped, {budget.left():.0f}s left")
            continue
        try:
            run_serve(a, CONFIGS[name], p["configs"][name]["policy"], budget.end, rec, log)
        except Exception as exc:
            rec.write("error", what="serve", error=repr(exc))
        if not a.cpu:
            wait_gpu_free()
        summarize(a, meta, t_start)
    summary = summarize(a, meta, t_start)
    print("\n" + report.summary_table(summary["records"], summary["ratios"], summary["targets"]), flush=True)
    log(f"done in {time.time() - t_start:.0f}s; results in {out / SUMMARY}")
    return 0

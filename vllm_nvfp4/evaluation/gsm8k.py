"""GSM8K through the real lm-eval command line (``lm_eval --model vllm ...``), one run per config.

The task is ``gsm8k_nvfp4`` from ``vllm_nvfp4/evaluation/lm_eval_tasks/`` (lm-eval's ``gsm8k`` over the local
JSONL). :func:`lm_eval_command` builds the exact command a user can copy; :func:`parse_results`
reads lm-eval's ``results_*.json`` (strict and flexible exact match with their standard errors)
and :func:`paired_difference` the per-question samples, so a configuration can be compared with
FP8 question by question (a paired standard error, much tighter than two independent ones).
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

TASK = "gsm8k_nvfp4"
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"  # lm-eval --include_path
FILTERS = ("strict-match", "flexible-extract")


def lm_eval_executable() -> list[str]:
    """The ``lm_eval`` console script next to this interpreter, else ``python -m lm_eval``."""
    exe = Path(sys.executable).parent / "lm_eval"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("lm_eval")
    return [found] if found else [sys.executable, "-m", "lm_eval"]


def lm_eval_command(model: str, kv_cache_dtype: str, output_path: Path, limit: Optional[int],
                    data_path: Optional[Path] = None, max_model_len: int = 4096,
                    extra_model_args: Sequence[str] = ("enforce_eager=True", "enable_prefix_caching=True"),
                    seed: int = 0, tasks_dir: Path = TASKS_DIR, dtype: str = "bfloat16") -> list[str]:
    """Arguments of one lm-eval run (without the executable).

    Prefix caching is on (vLLM's default for decoder models, stated so the command says it): the
    task's fixed 5-shot examples are then prefilled once, not once per question.
    """
    model_args = ",".join([f"pretrained={model}", f"kv_cache_dtype={kv_cache_dtype}", f"dtype={dtype}",
                           f"max_model_len={max_model_len}", f"seed={seed}", *extra_model_args])
    cmd = ["--model", "vllm", "--model_args", model_args, "--tasks", TASK, "--include_path", str(tasks_dir),
           "--batch_size", "auto", "--output_path", str(output_path), "--log_samples", "--seed", str(seed)]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    if data_path is not None:
        cmd += ["--metadata", json.dumps({"data_path": str(data_path)})]
    return cmd


def printable(args: Sequence[str], env: Mapping[str, str]) -> str:
    """``VAR=value ... lm_eval ARGS`` as one copyable shell line."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + "lm_eval " + shlex.join(args)


def run(args: Sequence[str], env: Mapping[str, str], log_path: Path, timeout_s: Optional[float] = None) -> float:
    """Run lm-eval, its output streamed to the console and to ``log_path``; returns seconds.

    Raises ``RuntimeError`` with the log's tail if lm-eval fails.
    """
    t0 = time.time()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*lm_eval_executable(), *args], env=dict(env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if not line.startswith(("Processed prompts", "Adding requests")) or "100%" in line:
                print(f"    [lm_eval] {line.rstrip()}", file=sys.stderr, flush=True)
        rc = proc.wait(timeout_s)
    if rc != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-25:])
        raise RuntimeError(f"lm_eval exited with {rc} (log {log_path}):\n{tail}")
    return time.time() - t0


def _newest(directory: Path, pattern: str) -> Path:
    found = sorted(directory.rglob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no {pattern} under {directory}")
    return found[-1]


def parse_results(output_path: Path, task: str = TASK) -> dict[str, Any]:
    """Strict / flexible exact match, their standard errors and the sample count."""
    data = json.loads(_newest(output_path, "results_*.json").read_text())
    res = data["results"][task]
    out: dict[str, Any] = {"n": int(data.get("n-samples", {}).get(task, {}).get("effective", 0)) or None}
    for f in FILTERS:
        acc, se = res.get(f"exact_match,{f}"), res.get(f"exact_match_stderr,{f}")
        out[f] = {"acc": acc, "stderr": se if isinstance(se, (int, float)) else None}
    return out


def per_question(output_path: Path, task: str = TASK) -> dict[str, dict[int, float]]:
    """``{filter: {doc_id: exact_match}}`` from lm-eval's ``samples_<task>_*.jsonl``."""
    path = _newest(output_path, f"samples_{task}_*.jsonl")
    out: dict[str, dict[int, float]] = {f: {} for f in FILTERS}
    for line in path.read_text().splitlines():
        if line.strip():
            s = json.loads(line)
            if s.get("filter") in out:
                out[s["filter"]][int(s["doc_id"])] = float(s["exact_match"])
    return out


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> dict[str, Any]:
    """Mean of ``a - b`` over the shared questions with its standard error (paired)."""
    ids = sorted(set(a) & set(b))
    if not ids:
        return {"diff": None, "stderr": None, "n": 0}
    d = [a[i] - b[i] for i in ids]
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    return {"diff": mean, "stderr": se, "n": n, "questions_differing": sum(x != 0 for x in d)}

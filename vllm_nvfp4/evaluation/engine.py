"""Run one KV configuration in one vLLM engine, in a fresh spawned process.

Each configuration gets its own process so that ``$VLLM_NVFP4_POLICY`` and the rest of the
environment are in place before vLLM is imported, and so that nothing (policy caches, memory,
the distributed state) leaks from one engine into the next. The parent never imports vLLM.

The child runs, in this order: teacher-forced scoring of the NLL windows (``prompt_logprobs=1``;
optionally a second, reverse-ordered pass for the noise floor), teacher-forced scoring of the
passkey prompts (prompt + answer), and reads back the KV capacity the engine allocated.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

#: Environment for vLLM on a CPU: engine core and worker in the engine's process (starts in
#: seconds, not tens of seconds); values already set by the user win.
CPU_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass
class EngineJob:
    """Everything the child needs (picklable; no vLLM objects)."""

    model: str
    kv_cache_dtype: str
    env: dict[str, str]
    engine_kwargs: dict[str, Any]
    nll_windows: list[list[int]] = field(default_factory=list)
    repeat_nll: bool = False
    passkey_prompts: list[list[int]] = field(default_factory=list)  # prompt + answer token ids


def _policy_in_force(worker: Any) -> dict[str, Any]:
    """The policy the worker's layers serve (a start-up calibration's, or the resolved one)."""
    from vllm_nvfp4.integration.model import model_policy

    return model_policy(worker.model_runner.vllm_config).to_dict()


def _engine_report(llm: Any) -> dict[str, Any]:
    from vllm_nvfp4.integration.dtype import is_ours

    cc = llm.llm_engine.vllm_config.cache_config
    out = {"num_blocks": int(cc.num_gpu_blocks), "block_size": int(cc.block_size),
           "kv_cache_memory_bytes": int(cc.kv_cache_memory_bytes) if cc.kv_cache_memory_bytes else None,
           "cache_dtype": str(cc.cache_dtype)}
    if is_ours(cc.cache_dtype):
        out["policy"] = llm.collective_rpc(_policy_in_force)[0]
    return out


def _score(llm: Any, windows: list[list[int]]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    from vllm_nvfp4.evaluation.logprobs import scores_from_prompt_logprobs

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=True)
    return [scores_from_prompt_logprobs(w, o.prompt_logprobs).to_dict() for w, o in zip(windows, outs)]


def run_job(job: EngineJob) -> dict[str, Any]:
    """Start the engine and run the job in *this* process (the child); returns the results."""
    from vllm import LLM

    t0 = time.time()
    llm = LLM(model=job.model, kv_cache_dtype=job.kv_cache_dtype, **job.engine_kwargs)
    result: dict[str, Any] = {"engine_start_s": round(time.time() - t0, 2), **_engine_report(llm)}
    if job.nll_windows:
        t = time.time()
        result["nll"] = _score(llm, job.nll_windows)
        if job.repeat_nll:  # noise floor: same engine dtype, other batch order
            rev = _score(llm, job.nll_windows[::-1])
            result["nll_repeat"] = rev[::-1]
        result["nll_s"] = round(time.time() - t, 2)
    if job.passkey_prompts:
        t = time.time()
        result["passkey"] = _score(llm, job.passkey_prompts)
        result["passkey_s"] = round(time.time() - t, 2)
    return result


def _child(job: EngineJob, result_path: str) -> None:
    for k, v in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    os.environ.update(job.env)
    try:
        result = run_job(job)
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        Path(result_path).write_text(json.dumps({"error": f"{type(e).__name__}: {e}",
                                                 "traceback": traceback.format_exc()}))
        sys.exit(1)
    Path(result_path).write_text(json.dumps(result))


class EngineFailed(RuntimeError):
    """The engine process failed; the message carries its error and the tail of its traceback."""


def run_in_subprocess(job: EngineJob, result_path: Path, timeout_s: Optional[float] = None) -> dict[str, Any]:
    """Run ``job`` in a spawned process and return its result dict (raises :class:`EngineFailed`)."""
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    proc = multiprocessing.get_context("spawn").Process(target=_child, args=(job, str(result_path)))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(10)
        raise EngineFailed(f"{job.kv_cache_dtype} engine did not finish within {timeout_s} s")
    data = json.loads(result_path.read_text()) if result_path.is_file() else None
    if data is None:
        raise EngineFailed(f"{job.kv_cache_dtype} engine process exited with {proc.exitcode} and no result")
    if "error" in data:
        tail = "\n".join(data.get("traceback", "").splitlines()[-12:])
        raise EngineFailed(f"{job.kv_cache_dtype} engine failed: {data['error']}\n{tail}")
    return data


def job_summary(job: EngineJob) -> dict[str, Any]:
    """The job without its token lists (for the results JSON)."""
    d = asdict(job)
    d["nll_windows"] = len(job.nll_windows)
    d["passkey_prompts"] = len(job.passkey_prompts)
    return d

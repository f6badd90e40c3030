"""One soak pass in its own process: ``python -m benchmarks.serving.soak.worker SPEC.json``.

Passes (``mode``):

* ``pressure``: the non-speculative requests, all submitted at once, on an engine whose KV cache
  holds ``pressure_kv_tokens`` tokens (``num_gpu_blocks_override``), prefix caching on, chunked
  prefill of ``chunk_tokens``: vLLM must preempt and recompute;
* ``spec``: the speculative requests the same way, with ngram speculation;
* ``alone``: every request served alone (``max_num_seqs=1``), the engine's full cache, prefix
  caching off, the same chunked prefill: the reference.

Every request still to serve is added at once and the engine is stepped by hand (``LLMEngine``).

Each finished request is appended to ``outputs_CONFIG_MODE.jsonl`` (``id``, ``tokens``, per
token ``[logprob, runner-up logprob]``, ``finish``); requests already there are skipped, so a
pass cut off by a time limit resumes where it stopped. The pass ends with a ``pass`` record
(preemptions, the per-request preemption histogram, drafted / accepted tokens, wall time) or an ``error`` record.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from argparse import Namespace
from pathlib import Path
from typing import Any, Optional

from benchmarks.e2e.configs import CONFIGS, backend_for
from benchmarks.e2e.records import Recorder, read_records
from benchmarks.e2e.worker import log
from benchmarks.serving.soak.requests import SoakParams, SoakRequest, make_requests
from benchmarks.serving.workloads import LengthRange

MODES = ("pressure", "spec", "alone")
RECORDS = "soak_records.jsonl"
#: the Prometheus metrics of ``LLM.get_metrics()`` a pass reports
PREEMPTIONS = "vllm:num_preemptions"
REQUEST_PREEMPTIONS = "vllm:request_num_preemptions"
DRAFTED, ACCEPTED = "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"


def outputs_path(out: Path, config: str, mode: str) -> Path:
    return Path(out) / f"outputs_{config}_{mode}.jsonl"


def params(spec: dict) -> SoakParams:
    """The :class:`SoakParams` of a spec (ranges stored as [lo, hi])."""
    d = dict(spec["params"])
    for k in ("prompt", "output", "prefix_len"):
        d[k] = LengthRange(*d[k])
    return SoakParams(**d)


def requests_of(spec: dict) -> list[SoakRequest]:
    """The requests this pass serves: the non-speculative ones (pressure), the speculative ones
    (spec) or all (alone)."""
    reqs = make_requests(params(spec))
    if spec["mode"] == "pressure":
        return [r for r in reqs if not r.spec]
    if spec["mode"] == "spec":
        return [r for r in reqs if r.spec]
    return reqs


def engine_kwargs(spec: dict) -> dict[str, Any]:
    """``LLM(...)`` arguments of a pass (module doc)."""
    a = Namespace(**spec)
    cfg = CONFIGS[a.config]
    kw: dict[str, Any] = dict(
        model=a.model, load_format=a.load_format, kv_cache_dtype=cfg.kv_cache_dtype,
        max_model_len=a.max_model_len, gpu_memory_utilization=a.gpu_mem, seed=0,
        enable_chunked_prefill=True, max_num_batched_tokens=a.chunk_tokens, block_size=a.block_size,
        disable_log_stats=False, enforce_eager=a.eager)
    backend = backend_for(cfg, a.hybrid)
    if backend and not a.cpu:
        kw["attention_backend"] = backend
    if a.mode == "alone":
        kw.update(max_num_seqs=1, enable_prefix_caching=False)
    else:
        kw.update(max_num_seqs=a.max_num_seqs, enable_prefix_caching=True,
                  num_gpu_blocks_override=math.ceil(a.pressure_kv_tokens / a.block_size))
    if a.mode == "spec":
        kw["speculative_config"] = dict(method="ngram", num_speculative_tokens=a.spec_tokens,
                                        prompt_lookup_min=2, prompt_lookup_max=4)
    if a.distributed_executor_backend:
        kw["distributed_executor_backend"] = a.distributed_executor_backend
    return kw


def output_record(req_id: int, out: Any) -> dict:
    """A finished request: tokens, per token its logprob and the runner-up's (NaN kept as
    None: JSON has no NaN), the finish reason."""
    o = out.outputs[0]
    lps = []
    for tok, lp in zip(o.token_ids, o.logprobs or []):
        own = lp[tok].logprob
        other = max((v.logprob for t, v in lp.items() if t != tok), default=None)
        lps.append([_num(own), _num(other)])
    return dict(id=req_id, tokens=list(o.token_ids), lp=lps, finish=o.finish_reason)


def _num(x: Optional[float]) -> Optional[float]:
    return None if x is None or not math.isfinite(x) else round(float(x), 5)


def metric_values(llm: Any) -> dict[str, Any]:
    """Preemptions, drafted / accepted tokens, and the per-request preemption histogram (vLLM's
    cumulative buckets by upper bound; its first, ``1.0``, holds requests preempted once or never)
    of this engine so far."""
    out: dict[str, Any] = {"preemptions": 0.0, "drafted": 0.0, "accepted": 0.0,
                           "request_preemption_buckets": {}}
    names = {PREEMPTIONS: "preemptions", DRAFTED: "drafted", ACCEPTED: "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += m.value
        elif m.name == REQUEST_PREEMPTIONS:
            for le, n in m.buckets.items():
                out["request_preemption_buckets"][le] = out["request_preemption_buckets"].get(le, 0) + n
    return out


def run_pass(spec: dict, rec: Recorder) -> None:
    """Add every request still to serve, step the engine, append each output as it finishes;
    at the deadline the rest is aborted (and served by the next call)."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    path = outputs_path(spec["out"], spec["config"], spec["mode"])
    done = {r["id"] for r in read_records(path)}
    todo = [r for r in requests_of(spec) if r.id not in done]
    log(f"soak {spec['config']} {spec['mode']}: {len(todo)} requests to serve ({len(done)} done before)")
    if not todo:
        return
    kw = engine_kwargs(spec)
    t0 = time.time()
    llm = LLM(**kw)
    engine = llm.llm_engine
    start_s = time.time() - t0
    log(f"soak {spec['config']} {spec['mode']}: engine up in {start_s:.0f}s")
    for r in todo:  # FINAL_ONLY: one output per request, when it finishes
        sp = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, logprobs=2,
                            output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(str(r.id), {"prompt_token_ids": list(r.prompt)}, sp)
    served, t1, t_log = 0, time.time(), time.time()
    with open(path, "a", encoding="utf-8") as f:
        while engine.has_unfinished_requests():
            if time.time() > spec["deadline"]:
                left = [str(r.id) for r in todo if r.id not in done]
                engine.abort_request(left)
                rec.write("skip", mode=spec["mode"], what=f"{len(left)} requests", reason="budget")
                log(f"soak {spec['config']} {spec['mode']}: deadline, {len(left)} requests left")
                break
            for o in engine.step():
                if o.finished:
                    f.write(json.dumps(output_record(int(o.request_id), o)) + "\n")
                    done.add(int(o.request_id))
                    served += 1
            if time.time() - t_log > 30:
                f.flush()
                os.fsync(f.fileno())
                t_log = time.time()
                log(f"soak {spec['config']} {spec['mode']}: {served} of {len(todo)} served")
    m = metric_values(llm)  # a fresh engine: its counters are this pass's
    rec.write("pass", mode=spec["mode"], served=served, engine_start_s=round(start_s, 1),
              wall_s=round(time.time() - t1, 1), engine_kwargs={k: str(v) for k, v in kw.items()}, **m)
    log(f"soak {spec['config']} {spec['mode']}: {served} served, {m['preemptions']:.0f} preemptions, "
        f"{m['accepted']:.0f} of {m['drafted']:.0f} drafted tokens accepted")


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rec = Recorder(Path(spec["out"]) / RECORDS, config=spec["config"])
    rc = 0
    try:
        if spec.get("policy"):
            os.environ["VLLM_NVFP4_POLICY"] = spec["policy"]
        run_pass(spec, rec)
    except Exception as e:  # a crash is a finding: recorded, the orchestrator carries on
        rec.write("error", mode=spec["mode"], what="pass", error=repr(e),
                  traceback=traceback.format_exc()[-3000:])
        log(f"soak {spec['config']} {spec['mode']}: CRASHED: {e!r}")
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m benchmarks.serving.soak.worker SPEC.json (written by python -m "
                 "benchmarks.serving.soak)")
    main(sys.argv[1])

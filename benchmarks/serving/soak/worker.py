"""Soak passes in their own process: ``python -m benchmarks.serving.soak.worker SPEC.json``.

Passes (``mode``):

* ``pressure``: the non-speculative requests, all submitted at once, on an engine whose KV cache
  holds ``pressure_kv_tokens`` tokens (``num_gpu_blocks_override``), prefix caching on, chunked
  prefill of ``chunk_tokens``: vLLM must preempt and recompute;
* ``spec``: the speculative requests the same way, with ngram speculation;
* ``alone``: the reference: every request by itself, the prefix cache emptied before each
  (``reset_prefix_cache``), the same chunked prefill. Served one at a time, a request never shares
  a batch, a cached block or the cache's room with another, so it runs on the pressure engine
  (the cache holds one request of ``max_model_len``): the spec's ``modes`` ``["pressure",
  "alone"]`` are served by one engine, one start instead of two.

Each finished request is appended to ``outputs_CONFIG_MODE.jsonl`` (``id``, ``tokens``, per
token ``[logprob, runner-up logprob]``, ``finish``); requests already there are skipped, so a
pass cut off by a time limit resumes where it stopped. Each pass ends with a ``pass`` record
(its preemptions, per-request preemption histogram, drafted / accepted tokens, wall time) or an
``error`` record.
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


def requests_of(spec: dict, mode: str) -> list[SoakRequest]:
    """The requests pass ``mode`` serves: the non-speculative ones (pressure), the speculative
    ones (spec) or all (alone)."""
    reqs = make_requests(params(spec))
    if mode == "pressure":
        return [r for r in reqs if not r.spec]
    if mode == "spec":
        return [r for r in reqs if r.spec]
    return reqs


def engine_groups(modes: list[str]) -> list[list[str]]:
    """The passes of ``modes`` grouped by engine, in order: pressure and alone share one, spec
    (ngram speculation for every request) has its own."""
    plain = [m for m in modes if m != "spec"]
    return [g for g in (plain, ["spec"] if "spec" in modes else []) if g]


def engine_kwargs(spec: dict) -> dict[str, Any]:
    """``LLM(...)`` arguments of the engine serving ``spec["modes"]`` (module doc)."""
    if len(engine_groups(spec["modes"])) != 1:
        raise ValueError(f"one engine cannot serve passes {spec['modes']}: spec needs its own")
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
    kw.update(max_num_seqs=a.max_num_seqs, enable_prefix_caching=True,
              num_gpu_blocks_override=math.ceil(a.pressure_kv_tokens / a.block_size))
    if a.modes == ["spec"]:
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


def metric_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What :func:`metric_values` counted between ``before`` and ``after`` (one pass of an
    engine that serves several)."""
    out = {k: after[k] - before[k] for k in ("preemptions", "drafted", "accepted")}
    b = before["request_preemption_buckets"]
    out["request_preemption_buckets"] = {le: n - b.get(le, 0)
                                         for le, n in after["request_preemption_buckets"].items()}
    return out


def run_passes(spec: dict, rec: Recorder) -> None:
    """Start one engine and serve ``spec["modes"]`` on it in order (module doc)."""
    from vllm import LLM

    todo = {}
    for mode in spec["modes"]:
        done = {r["id"] for r in read_records(outputs_path(spec["out"], spec["config"], mode))}
        todo[mode] = [r for r in requests_of(spec, mode) if r.id not in done]
        log(f"soak {spec['config']} {mode}: {len(todo[mode])} requests to serve ({len(done)} done before)")
    if not any(todo.values()):
        return
    kw = engine_kwargs(spec)
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    log(f"soak {spec['config']}: engine up in {start_s:.0f}s")
    kw_text = {k: str(v) for k, v in kw.items()}
    for mode in spec["modes"]:
        before, t1 = metric_values(llm), time.time()
        serve = serve_one_by_one if mode == "alone" else serve_at_once
        served = serve(llm.llm_engine, todo[mode], spec, mode, rec)
        m = metric_delta(metric_values(llm), before)
        rec.write("pass", mode=mode, served=served, engine_start_s=round(start_s, 1),
                  wall_s=round(time.time() - t1, 1), engine_kwargs=kw_text, **m)
        log(f"soak {spec['config']} {mode}: {served} served, {m['preemptions']:.0f} preemptions, "
            f"{m['accepted']:.0f} of {m['drafted']:.0f} drafted tokens accepted")
        if time.time() > spec["deadline"]:
            break


def _sampling(r: SoakRequest) -> Any:
    """Greedy, ``r.max_tokens`` tokens, two log-probs per token, one output when finished."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, logprobs=2,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def serve_at_once(engine: Any, todo: list[SoakRequest], spec: dict, mode: str, rec: Recorder) -> int:
    """Add every request of ``todo``, step the engine, append each output as it finishes; at the
    deadline abort the rest (the next call serves them). Returns the number served."""
    for r in todo:
        engine.add_request(str(r.id), {"prompt_token_ids": list(r.prompt)}, _sampling(r))
    left, served, t_log = {r.id for r in todo}, 0, time.time()
    with open(outputs_path(spec["out"], spec["config"], mode), "a", encoding="utf-8") as f:
        while engine.has_unfinished_requests():
            if time.time() > spec["deadline"]:
                engine.abort_request([str(i) for i in left])
                _stopped(rec, spec, mode, len(left))
                break
            for o in engine.step():
                if o.finished:
                    f.write(json.dumps(output_record(int(o.request_id), o)) + "\n")
                    left.discard(int(o.request_id))
                    served += 1
            t_log = _progress(f, t_log, spec, mode, served, len(todo))
    return served


def serve_one_by_one(engine: Any, todo: list[SoakRequest], spec: dict, mode: str, rec: Recorder) -> int:
    """Serve each request of ``todo`` by itself, the prefix cache emptied first; stop at the
    deadline (the next call serves the rest). Returns the number served."""
    served, t_log = 0, time.time()
    with open(outputs_path(spec["out"], spec["config"], mode), "a", encoding="utf-8") as f:
        for r in todo:
            if time.time() > spec["deadline"]:
                _stopped(rec, spec, mode, len(todo) - served)
                break
            if not engine.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache() failed with no request running")
            engine.add_request(str(r.id), {"prompt_token_ids": list(r.prompt)}, _sampling(r))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        f.write(json.dumps(output_record(int(o.request_id), o)) + "\n")
                        served += 1
            t_log = _progress(f, t_log, spec, mode, served, len(todo))
    return served


def _flush(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def _progress(f: Any, t_log: float, spec: dict, mode: str, served: int, total: int) -> float:
    """Every 30 s: the outputs file flushed to disk and a progress line. Returns the time of
    the last line."""
    if time.time() - t_log <= 30:
        return t_log
    _flush(f)
    log(f"soak {spec['config']} {mode}: {served} of {total} served")
    return time.time()


def _stopped(rec: Recorder, spec: dict, mode: str, left: int) -> None:
    rec.write("skip", mode=mode, what=f"{left} requests", reason="budget")
    log(f"soak {spec['config']} {mode}: deadline, {left} requests left")


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rec = Recorder(Path(spec["out"]) / RECORDS, config=spec["config"])
    rc = 0
    try:
        if spec.get("policy"):
            os.environ["VLLM_NVFP4_POLICY"] = spec["policy"]
        run_passes(spec, rec)
    except Exception as e:  # a crash is a finding: recorded, the orchestrator carries on
        rec.write("error", mode="+".join(spec["modes"]), what="pass", error=repr(e),
                  traceback=traceback.format_exc()[-3000:])
        log(f"soak {spec['config']} {'+'.join(spec['modes'])}: CRASHED: {e!r}")
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m benchmarks.serving.soak.worker SPEC.json (written by python -m "
                 "benchmarks.serving.soak)")
    main(sys.argv[1])

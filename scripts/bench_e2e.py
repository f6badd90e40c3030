#!/usr/bin/env python3
"""End-to-end KV capacity and speed of vLLM with ``nvfp4_mixed`` against ``fp8`` and ``auto`` (issue 7).

One engine per configuration, each in its own process (GPU memory is returned between them, a
crash or a timeout costs only that configuration). Per configuration, in this order:

1. **capacity**: KV tokens vLLM allocated (``num_gpu_blocks x block_size``, the number its
   "GPU KV cache size" log line reports) at the same ``--gpu-mem``, and the largest batch that
   holds ``context + headroom`` tokens per sequence, for each context;
2. **TTFT**: one request of ``context`` random tokens, ``max_tokens=1``, on an idle engine (after a
   short warm-up request); median of ``--ttft-reps``;
3. **decode**, for each context, in growing stages over ONE prefill: batch 16, then the reference
   batch (the largest batch ``fp8`` holds at that context: measured earlier in this run, or
   computed from this engine's KV bytes), then this configuration's largest batch. Each stage adds
   requests (random prompts of ``context`` tokens, ``ignore_eos``) to those still decoding, steps
   the engine until every request has its first token, skips ``--warm-steps`` steps and times
   ``--steps`` pure-decode steps: time per output token = window / steps, throughput = output
   tokens / window. CUDA graphs stay on (capture sizes trimmed to a list holding every batch
   used, unless ``--default-capture-sizes``);
4. optionally (``--profile``) a torch-profiler trace of a few decode steps at the reference batch,
   GPU kernel time split into attention / KV write / GEMM / other;

then, optionally (``--serve``), ``vllm serve`` with ``--clients`` concurrent streaming clients
on 127.0.0.1 (bounded requests and time): throughput, TTFT and latency p50/p99.

Everything is sized by ``--budget-s``: each configuration gets a deadline (a share of what is
left), a stage whose estimated cost (from the measured TTFT) does not fit is skipped and said so,
and a process past its deadline is killed. Every measurement is appended to
``OUT/e2e_records.jsonl`` as it completes, so a timeout keeps what was measured; the summary
(``OUT/e2e_h200.json``: records, the issue's ratio targets, versions, machine, command, date) and
a short table come last.

    python3 scripts/bench_e2e.py --out $OUT --budget-s 480                      # H200, 8B shape
    python3 scripts/bench_e2e.py --out /tmp/e2e --cpu-tiny                      # CPU smoke run

Configurations (``--dtypes``): auto (bf16, FA3), fp8 (FA3), fp8-triton (TRITON_ATTN),
nvfp4-mixed (the first eighth of the layers FP8, i.e. 4 of 32; ``--mixed-policy`` overrides),
nvfp4-all (``*:nvfp4``). The nvfp4 policies reach the engine through ``VLLM_NVFP4_POLICY``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from make_random_model import PRESETS, make_random_model  # noqa: E402

RECORDS = "e2e_records.jsonl"
SUMMARY = "e2e_h200.json"
WORKER_LOG = "workers.log"
SERVE_LOG = "serve.log"
SMALL_BATCH = 16
#: CUDA-graph capture sizes when trimmed: every batch a stage can use is padded to one of these
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 128, 144, 160,
                 176, 192, 224, 256, 288, 320, 352, 384, 448, 512]
ELEM_BYTES = {"auto": 2.0, "fp8": 1.0}  # per K or V element; nvfp4_mixed comes from its policy
NVFP4_BYTES = 0.5625  # E2M1 nibble + one E4M3 scale per 16 elements
#: targets of issue 7
TARGET_CAPACITY = 1.65
TARGET_DECODE_32K = 1.3
TARGET_TTFT = 1.1


# --------------------------------------------------------------------------------------------
# configurations and capacity arithmetic (pure, unit-tested)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchConfig:
    """One engine configuration of the matrix."""

    name: str
    kv_cache_dtype: str
    attention_backend: Optional[str]  # None: vLLM picks (ours for nvfp4_mixed)
    policy: Optional[str]  # compact policy, "mixed" = first eighth FP8, None for auto/fp8
    weight: float  # relative share of the time budget (bigger caches take longer to fill)


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    BenchConfig("fp8", "fp8", "FLASH_ATTN", None, 1.0),
    BenchConfig("nvfp4-mixed", "nvfp4_mixed", None, "mixed", 1.6),
    BenchConfig("auto", "auto", "FLASH_ATTN", None, 0.8),
    BenchConfig("fp8-triton", "fp8", "TRITON_ATTN", None, 1.0),
    BenchConfig("nvfp4-all", "nvfp4_mixed", None, "*:nvfp4", 1.7),
)}
REFERENCE = "fp8"  # its largest batch per context is the common batch of the decode comparison


def mixed_policy(num_layers: int) -> str:
    """The first eighth of the layers (at least one) FP8, the rest NVFP4: 4 of 32 for Llama-8B."""
    k = max(1, round(num_layers / 8))
    return f"0-{k - 1}:fp8,*:nvfp4" if k > 1 else "0:fp8,*:nvfp4"


def policy_for(cfg: BenchConfig, num_layers: int, override: Optional[str] = None) -> Optional[str]:
    """The compact policy string this configuration runs with (None when it has none)."""
    if cfg.policy is None:
        return None
    if cfg.policy == "mixed":
        return override or mixed_policy(num_layers)
    return cfg.policy


def layer_formats(policy: str, num_layers: int) -> list[tuple[str, str]]:
    """(K format, V format) per layer, parsed by the project's policy module."""
    from vllm_nvfp4.policy import KVPolicy

    pol = KVPolicy.from_compact(policy, num_layers)
    return [(lp.k, lp.v) for lp in pol.layers]


def kv_bytes_per_token(kv_cache_dtype: str, num_layers: int, kv_heads: int, head_dim: int,
                       formats: Optional[list[tuple[str, str]]] = None) -> float:
    """Cache bytes per token over all layers (K + V, NVFP4 scales included)."""
    if kv_cache_dtype in ELEM_BYTES:
        return 2 * ELEM_BYTES[kv_cache_dtype] * head_dim * kv_heads * num_layers
    if formats is None or len(formats) != num_layers:
        raise ValueError("nvfp4_mixed needs one (k, v) format pair per layer")
    per = {"fp8": 1.0, "nvfp4": NVFP4_BYTES}
    return sum(per[k] + per[v] for k, v in formats) * head_dim * kv_heads


def max_batch(capacity_tokens: int, context: int, headroom: int, block_size: int,
              cap: int = CAPTURE_SIZES[-1]) -> int:
    """Largest number of sequences of ``context + headroom`` tokens the block pool holds."""
    per_seq = math.ceil((context + headroom) / block_size)
    return max(0, min(cap, (capacity_tokens // block_size) // per_seq))


def estimate_batch(kv_bytes: float, bytes_per_token: float, context: int, headroom: int,
                   block_size: int, cap: int = CAPTURE_SIZES[-1]) -> int:
    """:func:`max_batch` of another dtype given this engine's KV bytes (same memory setting)."""
    return max_batch(int(kv_bytes // bytes_per_token), context, headroom, block_size, cap)


def plan_stages(own_max: int, ref_batch: Optional[int], small: int = SMALL_BATCH
                ) -> list[tuple[str, int]]:
    """Decode stages at one context: (label, batch), growing, deduplicated, each <= own_max."""
    wanted: dict[int, list[str]] = {}
    for label, b in (("16", small), ("ref", ref_batch), ("max", own_max)):
        if b and 0 < b <= own_max:
            wanted.setdefault(int(b), []).append(label)
    return [("+".join(labels), b) for b, labels in sorted(wanted.items())]


def capture_sizes_for(max_b: int) -> list[int]:
    """Trimmed capture sizes up to the largest batch a stage can use."""
    return [s for s in CAPTURE_SIZES if s <= max(max_b, 1)] or [1]


def parse_contexts(text: str) -> list[int]:
    """'32k,8192' -> [32768, 8192] (order kept: the first context gets the budget first)."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        n = int(float(item[:-1]) * 1024) if item.endswith("k") else int(item)
        if n <= 0:
            raise ValueError(f"context must be positive, got {item!r}")
        out.append(n)
    if not out:
        raise ValueError("no contexts given")
    return out


def parse_dtypes(text: str) -> list[str]:
    """Comma-separated configuration names, validated ('all' = every one, reference first)."""
    if text.strip() in ("none", ""):
        return []
    names = list(CONFIGS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise ValueError(f"unknown configuration(s) {bad}; choose from {list(CONFIGS)}")
    return names


def deadline_share(now: float, end: float, weights: list[float]) -> float:
    """Deadline of the first of ``weights`` when what is left is shared in proportion to them."""
    left = max(0.0, end - now)
    return now + left * weights[0] / sum(weights)


def deadlines(now: float, end: float, weights: list[float], floor_s: float) -> tuple[float, float]:
    """(hard, soft) deadline of the first of the configurations still to run.

    hard: everything except ``floor_s`` for each later configuration (an engine start plus TTFT),
    so the first context's stages - the issue's targets - are not cut by a fixed share; soft: the
    proportional share, for optional work (contexts after the first). soft <= hard.
    """
    hard = max(now, end - floor_s * (len(weights) - 1))
    return hard, min(hard, deadline_share(now, end, weights))


def percentile(values: list[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


# --------------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------------

def log(msg: str) -> None:
    """Progress line (prefixed, flushed) that the driver shows."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Recorder:
    """Appends one JSON object per line to the records file (flushed and synced at once)."""

    def __init__(self, path: Path, **common: Any) -> None:
        self.path = Path(path)
        self.common = common

    def write(self, kind: str, **fields: Any) -> dict:
        rec = dict(kind=kind, t=round(time.time(), 3), **self.common, **fields)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return rec


def read_records(path: Path) -> list[dict]:
    """All complete records (a line cut by a kill is skipped)."""
    out = []
    if not Path(path).exists():
        return out
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


# --------------------------------------------------------------------------------------------
# worker: one engine, capacity + TTFT + decode stages (+ profile)
# --------------------------------------------------------------------------------------------

class Stepper:
    """Drives ``LLMEngine.step()`` by hand: add requests, step, count tokens, abort."""

    def __init__(self, engine: Any, vocab: int, seed: int) -> None:
        self.engine = engine
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.tokens: dict[str, int] = {}  # request id -> output tokens so far
        self.finished: set[str] = set()
        self.n = 0

    def add(self, count: int, context: int, max_tokens: int) -> list[str]:
        """Add ``count`` requests of ``context`` random prompt tokens (ignore_eos, DELTA outputs)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            detokenize=False, output_kind=RequestOutputKind.DELTA)
        ids = []
        for _ in range(count):
            rid = f"r{self.n}"
            self.n += 1
            prompt = self.rng.integers(3, self.vocab, size=context).tolist()
            self.engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            self.tokens[rid] = 0
            ids.append(rid)
        return ids

    def step(self) -> tuple[float, int, int]:
        """One engine step: (time after it, requests that got tokens, new tokens)."""
        outs = self.engine.step()
        t = time.perf_counter()
        n_req = n_tok = 0
        for o in outs:
            k = len(o.outputs[0].token_ids) if o.outputs else 0
            if o.request_id in self.tokens:
                self.tokens[o.request_id] += k
            n_req += k > 0
            n_tok += k
            if o.finished:
                self.finished.add(o.request_id)
        return t, n_req, n_tok

    def all_started(self, ids: list[str]) -> bool:
        return all(self.tokens.get(i, 0) > 0 for i in ids)

    def running(self) -> list[str]:
        return [i for i in self.tokens if i not in self.finished]

    def abort_all(self) -> None:
        live = self.running()
        if live:
            self.engine.abort_request(live)
        for i in live:
            self.finished.add(i)
        t_end = time.time() + 30
        while self.engine.has_unfinished_requests() and time.time() < t_end:
            self.engine.step()


def measure_ttft(st: Stepper, context: int) -> float:
    """Seconds from adding one request of ``context`` tokens to its first (and only) token."""
    t0 = time.perf_counter()
    (rid,) = st.add(1, context, max_tokens=1)
    while rid not in st.finished:
        st.step()
    return time.perf_counter() - t0


def prefill_stage(st: Stepper, new: int, context: int, max_tokens: int, deadline: float
                  ) -> tuple[list[str], float, int]:
    """Add ``new`` requests; step until each has a token. (ids, seconds, steps); raises on deadline."""
    t0 = time.perf_counter()
    ids = st.add(new, context, max_tokens)
    steps = 0
    while not st.all_started(ids):
        st.step()
        steps += 1
        if time.time() > deadline:
            raise TimeoutError(f"prefill of {new} x {context} passed the deadline")
    return ids, time.perf_counter() - t0, steps


def decode_window(st: Stepper, warm: int, steps: int) -> dict:
    """Time ``steps`` decode steps after ``warm`` ones: tokens, seconds, min/max requests per step."""
    for _ in range(warm):
        t_prev, _, _ = st.step()
    if warm == 0:
        t_prev = time.perf_counter()
    toks, reqs = 0, []
    for _ in range(steps):
        t, n_req, n_tok = st.step()
        toks += n_tok
        reqs.append(n_req)
    dt = t - t_prev
    return dict(steps=steps, tokens=toks, seconds=round(dt, 4),
                tok_per_s=round(toks / dt, 1) if dt > 0 else None,
                tpot_ms=round(1000 * dt / steps, 3), min_batch=min(reqs), max_batch=max(reqs))


class Worker:
    """Runs the measurements of one configuration against one engine."""

    def __init__(self, a: argparse.Namespace, cfg: BenchConfig, rec: Recorder, model_info: dict):
        self.a, self.cfg, self.rec, self.info = a, cfg, rec, model_info
        self.deadline = a.deadline  # hard: the orchestrator kills this process soon after
        self.soft = min(a.soft_deadline or a.deadline, a.deadline)  # for contexts after the first
        self.llm: Any = None
        self.profiled = False

    # -- engine ----------------------------------------------------------------------------
    def engine_kwargs(self) -> dict:
        a, cfg = self.a, self.cfg
        kw: dict[str, Any] = dict(
            model=a.model, load_format="dummy", kv_cache_dtype=cfg.kv_cache_dtype,
            gpu_memory_utilization=a.gpu_mem, max_model_len=a.max_model_len,
            enable_prefix_caching=False, seed=0)
        if a.max_num_seqs:
            kw["max_num_seqs"] = a.max_num_seqs
        if cfg.attention_backend and not a.cpu:
            kw["attention_backend"] = cfg.attention_backend
        if a.eager:
            kw["enforce_eager"] = True
        elif not a.default_capture_sizes:
            kw["compilation_config"] = {"cudagraph_capture_sizes": capture_sizes_for(a.max_batch)}
        if a.profile and not a.cpu:
            kw["profiler_config"] = dict(
                profiler="torch", torch_profiler_dir=str(Path(a.profile_dir).resolve()),
                torch_profiler_activities=["CUDA"], torch_profiler_with_stack=False,
                torch_profiler_use_gzip=False, ignore_frontend=True)
        return kw

    def start(self) -> dict:
        from vllm import LLM

        kw = self.engine_kwargs()
        log(f"{self.cfg.name}: starting engine {kw}")
        t0 = time.time()
        self.llm = LLM(**kw)
        start_s = time.time() - t0
        cc = self.llm.llm_engine.vllm_config.cache_config
        blocks, bs = int(cc.num_gpu_blocks), int(cc.block_size)
        bpt = self.info["kv_bytes_per_token"][self.cfg.name]
        cap = blocks * bs
        mb = {str(c): max_batch(cap, c, self.a.headroom, bs, self.a.max_batch)
              for c in dict.fromkeys(self.a.contexts + self.a.ttft_contexts)}
        rec = self.rec.write(
            "engine", engine_start_s=round(start_s, 1), num_gpu_blocks=blocks, block_size=bs,
            capacity_tokens=cap, kv_bytes_per_token=bpt, kv_gib=round(cap * bpt / 2**30, 2),
            # vLLM's "KV cache size" log line: max concurrency x max_model_len (equal to
            # capacity_tokens when max_model_len is a multiple of the block size); often unset here
            vllm_kv_cache_size_tokens=getattr(cc, "kv_cache_size_tokens", None),
            max_batch=mb, max_batch_x_context={c: b * int(c) for c, b in mb.items()},
            engine_kwargs={k: v for k, v in kw.items() if k != "profiler_config"},
            policy=self.info["policies"].get(self.cfg.name),
            attention_backend=kw.get("attention_backend", "vLLM default"))
        log(f"{self.cfg.name}: engine up in {start_s:.0f}s: {cap} KV tokens "
            f"({blocks} blocks x {bs}), max batch {mb}")
        return rec

    # -- measurements ------------------------------------------------------------------------
    def left(self, soft: bool = False) -> float:
        return (self.soft if soft else self.deadline) - time.time()

    def ttft(self, st: Stepper) -> dict[int, float]:
        """Median TTFT per context (after one warm-up request per context)."""
        out: dict[int, float] = {}
        for c in dict.fromkeys(self.a.contexts + self.a.ttft_contexts):
            if self.left() < 10:
                self.rec.write("skip", what=f"ttft {c}", reason="budget")
                continue
            samples = [measure_ttft(st, c) for _ in range(1 + self.a.ttft_reps)]
            med = statistics.median(samples[1:])
            out[c] = med
            self.rec.write("ttft", context=c, ttft_s=round(med, 4), warmup_s=round(samples[0], 4),
                           samples_s=[round(s, 4) for s in samples[1:]])
            log(f"{self.cfg.name}: TTFT {c}: {1000 * med:.1f} ms (samples "
                f"{[round(1000 * s, 1) for s in samples[1:]]}, warm-up {1000 * samples[0]:.0f})")
        return out

    def decode_context(self, st: Stepper, context: int, own_max: int, ttft_s: float,
                       soft: bool) -> None:
        """Growing decode stages at one context over one prefill (see the module doc).

        ``soft``: plan against the soft deadline (contexts after the first are optional work).
        """
        a = self.a
        ref, ref_src = self.ref_batch(context)
        stages = plan_stages(own_max, ref)
        step_s = 0.05
        have = 0
        max_tokens = a.headroom  # never reached: the stages abort everything at the end
        try:
            for label, batch in stages:
                new = batch - have
                est = new * ttft_s * a.prefill_factor + (a.warm_steps + a.steps) * step_s + 5
                if est > self.left(soft):
                    left = self.left(soft)
                    self.rec.write("skip", what=f"decode {context} x {batch} ({label})",
                                   reason=f"budget: needs ~{est:.0f}s, {left:.0f}s left")
                    log(f"{self.cfg.name}: skip decode {context} x {batch}: ~{est:.0f}s > {left:.0f}s left")
                    break
                _, pre_s, pre_steps = prefill_stage(st, new, context, max_tokens, self.deadline)
                have = batch
                w = decode_window(st, a.warm_steps, a.steps)
                step_s = w["tpot_ms"] / 1000
                gen = [st.tokens[i] for i in st.running()]
                self.rec.write(
                    "decode", context=context, batch=batch, label=label,
                    ref_batch_source=ref_src if "ref" in label else None,
                    prefill_new_requests=new, prefill_s=round(pre_s, 2), prefill_steps=pre_steps,
                    prefill_tok_per_s=round(new * context / pre_s),
                    mean_context_end=round(context + statistics.mean(gen), 1) if gen else None,
                    max_generated=max(gen, default=0), batch_shortfall=w["min_batch"] < batch, **w)
                log(f"{self.cfg.name}: decode ctx {context} batch {batch} ({label}): "
                    f"{w['tok_per_s']} tok/s, {w['tpot_ms']} ms/token (prefill of {new} in "
                    f"{pre_s:.1f}s; requests/step {w['min_batch']}-{w['max_batch']})")
                if "ref" in label and a.profile and not a.cpu and not self.profiled:
                    self.profile(st, context, batch, w["tpot_ms"])
        finally:
            st.abort_all()

    def ref_batch(self, context: int) -> tuple[Optional[int], str]:
        """The reference (fp8) batch at ``context``: measured in this run, or estimated."""
        if str(context) in self.a.ref_batches:
            return int(self.a.ref_batches[str(context)]), "measured (fp8 engine of this run)"
        if self.cfg.name == REFERENCE:  # its own largest batch is the reference
            eng = self.llm.llm_engine.vllm_config.cache_config
            b = max_batch(eng.num_gpu_blocks * eng.block_size, context, self.a.headroom,
                          eng.block_size, self.a.max_batch)
            return b, "this engine (fp8 is the reference)"
        cc = self.llm.llm_engine.vllm_config.cache_config
        bpt = self.info["kv_bytes_per_token"][self.cfg.name]
        kv_bytes = cc.num_gpu_blocks * cc.block_size * bpt
        ref_bpt = self.info["kv_bytes_per_token_of"]("fp8")
        b = estimate_batch(kv_bytes, ref_bpt, context, self.a.headroom, cc.block_size, self.a.max_batch)
        return b, "estimated from this engine's KV bytes / fp8 bytes per token"

    def profile(self, st: Stepper, context: int, batch: int, tpot_ms: float) -> None:
        """Profile ``--profile-steps`` engine iterations of pure decode at ``batch``.

        GPU kernel time is split by category (:func:`kernel_category`); the split is reported
        as fractions of the kernel time and as ms per step (fraction x the stage's measured
        time per output token), which stays right even if the trace holds a step more or less.
        """
        self.profiled = True
        if self.left() < 30:
            self.rec.write("skip", what="profile", reason="budget")
            return
        pdir = Path(self.a.profile_dir)
        before = set(pdir.rglob("*.json*")) if pdir.exists() else set()
        n = self.a.profile_steps
        try:
            self.llm.start_profile(max_iterations=n)
            for _ in range(n + 2):
                st.step()
            self.llm.stop_profile()
            trace = wait_for_trace(pdir, before, timeout=60)
            us = kernel_time_by_category(load_trace_events(trace))
            total = us["total"] or float("nan")
            frac = {k: round(v / total, 4) for k, v in us.items() if k != "total"}
            per_step = {k: round(f * tpot_ms, 3) for k, f in frac.items()}
            self.rec.write("profile", context=context, batch=batch, iterations=n,
                           kernel_us_total=us, fraction=frac, tpot_ms=tpot_ms,
                           ms_per_step=per_step,
                           kernel_ms_per_iteration=round(us["total"] / n / 1000, 3),
                           trace=str(trace))
            log(f"{self.cfg.name}: profile ctx {context} batch {batch}: fractions {frac}; "
                f"kernel ms/iteration {us['total'] / n / 1000:.2f} vs {tpot_ms:.2f} ms/token")
        except Exception as e:  # profiling is a bonus: never lose the run for it
            self.rec.write("error", what="profile", error=repr(e))
            log(f"{self.cfg.name}: profile failed: {e!r}")

    def run(self) -> None:
        eng = self.start()
        st = Stepper(self.llm.llm_engine, self.info["vocab"], seed=zlib.crc32(self.cfg.name.encode()))
        ttfts = self.ttft(st)
        for i, c in enumerate(self.a.contexts):
            if c not in ttfts:
                continue
            own = eng["max_batch"][str(c)]
            if own <= 0:
                self.rec.write("skip", what=f"decode {c}", reason="not even one sequence fits")
                continue
            self.decode_context(st, c, own, ttfts[c], soft=i > 0)



def wait_for_trace(pdir: Path, before: set, timeout: float) -> Path:
    """The trace file the profiler wrote after ``before`` was listed."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        new = [p for p in pdir.rglob("*.json*") if p not in before and p.stat().st_size > 0]
        if new:
            time.sleep(2)  # let the writer finish
            return max(new, key=lambda p: p.stat().st_mtime)
        time.sleep(0.5)
    raise TimeoutError(f"no profiler trace appeared in {pdir}")


def load_trace_events(path: Path) -> list[dict]:
    """traceEvents of a Chrome trace (.json or .json.gz)."""
    import gzip

    opener: Callable[..., Any] = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


ATTENTION_KEYS = ("flash", "fmha", "attn", "attention", "_decode_kernel", "_decode_keys_kernel",
                  "_reduce_kernel", "_prefill_kernel", "_dequant_kv_kernel", "combine")
KV_WRITE_KEYS = ("reshape_and_cache", "_write_kv_kernel", "cache_kernel")
GEMM_KEYS = ("gemm", "xmma", "cutlass", "nvjet", "matmul", "sm90_")


def kernel_category(name: str) -> str:
    """attention / kv_write / gemm / other, from a CUDA kernel's name."""
    n = name.lower()
    if any(k in n for k in KV_WRITE_KEYS):
        return "kv_write"
    if any(k in n for k in ATTENTION_KEYS):
        return "attention"
    if any(k in n for k in GEMM_KEYS):
        return "gemm"
    return "other"


def kernel_time_by_category(events: list[dict]) -> dict[str, float]:
    """Total GPU kernel microseconds per category (plus 'total')."""
    out = {"attention": 0.0, "kv_write": 0.0, "gemm": 0.0, "other": 0.0}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            out[kernel_category(str(ev.get("name", "")))] += float(ev.get("dur", 0.0))
    out["total"] = sum(out.values())
    return out


def run_worker(a: argparse.Namespace) -> int:
    """Entry of ``--worker NAME`` (a child process of the orchestrator)."""
    cfg = CONFIGS[a.worker]
    info = model_info(a)
    pol = info["policies"].get(cfg.name)
    if pol:
        os.environ["VLLM_NVFP4_POLICY"] = pol
    rec = Recorder(Path(a.out) / RECORDS, config=cfg.name)
    w = Worker(a, cfg, rec, info)
    rc = 0
    try:
        w.run()
    except Exception as e:
        rec.write("error", what="worker", error=repr(e), traceback=traceback.format_exc()[-3000:])
        log(f"{cfg.name}: FAILED: {e!r}")
        rc = 1
    rec.write("done", rc=rc)
    # No graceful engine shutdown (it waits ~5-10 s for the engine core): the orchestrator
    # kills this process group, which returns the GPU memory at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# --------------------------------------------------------------------------------------------
# serve: `vllm serve` + concurrent streaming clients
# --------------------------------------------------------------------------------------------

def http_json(url: str, body: Optional[dict] = None, timeout: float = 2.0) -> Any:
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    return json.loads(raw) if raw.strip().startswith(("{", "[")) else raw


def stream_completion(port: int, model: str, prompt: list[int], max_tokens: int,
                      timeout: float) -> dict:
    """One streamed /v1/completions request: ttft, latency, completion tokens."""
    import http.client

    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                ignore_eos=True, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, n_tok = None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        msg = json.loads(line[5:])
        if ttft is None and msg.get("choices"):
            ttft = time.perf_counter() - t0
        if msg.get("usage"):
            n_tok = msg["usage"].get("completion_tokens")
    conn.close()
    return dict(ttft_s=ttft, latency_s=time.perf_counter() - t0, tokens=n_tok or 0)


def client_load(port: int, model: str, vocab: int, clients: int, requests: int, prompt_len: int,
                max_tokens: int, time_cap: float) -> dict:
    """``clients`` threads send streamed requests until ``requests`` are done or time is up."""
    lock = threading.Lock()
    results: list[dict] = []
    errors: list[str] = []
    sent = [0]
    t_stop = time.time() + time_cap

    def client(k: int) -> None:
        rng = random.Random(1000 + k)
        while time.time() < t_stop:
            with lock:
                if sent[0] >= requests:
                    return
                sent[0] += 1
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            try:
                r = stream_completion(port, model, prompt, max_tokens, timeout=max(5.0, t_stop - time.time() + 5))
                with lock:
                    results.append(r)
            except Exception as e:
                with lock:
                    errors.append(repr(e)[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, t_stop - time.time() + 30))
    wall = time.perf_counter() - t0
    lat = [r["latency_s"] for r in results]
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in results
            if r["ttft_s"] is not None and r["tokens"] > 1]
    toks = sum(r["tokens"] for r in results)
    r3 = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return dict(clients=clients, requests_done=len(results), errors=len(errors),
                first_errors=errors[:3], wall_s=round(wall, 2), output_tokens=toks,
                output_tok_per_s=round(toks / wall, 1) if wall > 0 else None,
                requests_per_s=round(len(results) / wall, 3) if wall > 0 else None,
                latency_p50_s=r3(percentile(lat, 50)), latency_p99_s=r3(percentile(lat, 99)),
                ttft_p50_s=r3(percentile(ttft, 50)), ttft_p99_s=r3(percentile(ttft, 99)),
                tpot_p50_ms=r3(None if not tpot else 1000 * percentile(tpot, 50)),
                tpot_p99_ms=r3(None if not tpot else 1000 * percentile(tpot, 99)))


def serve_command(a: argparse.Namespace, cfg: BenchConfig, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", a.model,
           "--port", str(port), "--host", "127.0.0.1", "--load-format", "dummy",
           "--kv-cache-dtype", cfg.kv_cache_dtype, "--max-model-len", str(a.max_model_len),
           "--gpu-memory-utilization", str(a.gpu_mem), "--no-enable-prefix-caching", "--seed", "0"]
    if cfg.attention_backend and not a.cpu:
        cmd += ["--attention-backend", cfg.attention_backend]
    if a.eager:
        cmd += ["--enforce-eager"]
    return cmd


def run_serve(a: argparse.Namespace, cfg: BenchConfig, info: dict, deadline: float,
              rec: Recorder) -> None:
    """Start ``vllm serve``, wait for /health, run the client load, stop the server group."""
    port = a.port
    env = dict(os.environ)
    pol = info["policies"].get(cfg.name)
    if pol:
        env["VLLM_NVFP4_POLICY"] = pol
    cmd = serve_command(a, cfg, port)
    log(f"serve {cfg.name}: {shlex.join(cmd)}")
    t0 = time.time()
    with open(Path(a.out) / SERVE_LOG, "a") as lf:
        lf.write(f"\n===== serve {cfg.name}: {shlex.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        up = False
        while time.time() < deadline - a.serve_time_s and proc.poll() is None:
            try:
                http_json(f"http://127.0.0.1:{port}/health")
                up = True
                break
            except Exception:
                time.sleep(1)
        start_s = time.time() - t0
        if not up:
            why = "server exited" if proc.poll() is not None else "no /health before the deadline"
            rec.write("error", what=f"serve {cfg.name}", error=why, start_s=round(start_s, 1))
            log(f"serve {cfg.name}: {why} after {start_s:.0f}s")
            return
        log(f"serve {cfg.name}: /health after {start_s:.0f}s; {a.clients} clients")
        cap = min(a.serve_time_s, max(5.0, deadline - time.time() - 10))
        res = client_load(port, a.model, info["vocab"], a.clients, a.serve_requests,
                          a.serve_prompt_len, a.serve_output_len, cap)
        rec.write("serve", server_start_s=round(start_s, 1), prompt_len=a.serve_prompt_len,
                  output_len=a.serve_output_len, **res)
        log(f"serve {cfg.name}: {res['requests_done']} requests, {res['output_tok_per_s']} tok/s, "
            f"latency p50 {res['latency_p50_s']}s p99 {res['latency_p99_s']}s, "
            f"TTFT p50 {res['ttft_p50_s']}s, errors {res['errors']}")
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the process group the child leads, then SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (engine core)
        except (ProcessLookupError, PermissionError):
            pass
        return


# --------------------------------------------------------------------------------------------
# orchestrator
# --------------------------------------------------------------------------------------------

def model_info(a: argparse.Namespace) -> dict:
    """Geometry of the model dir, each configuration's policy and KV bytes per token."""
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    L, kvh = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    policies, bpt = {}, {}
    for name, c in CONFIGS.items():
        pol = policy_for(c, L, a.mixed_policy)
        if pol:
            policies[name] = pol
        fmts = layer_formats(pol, L) if pol else None
        bpt[name] = kv_bytes_per_token(c.kv_cache_dtype, L, kvh, hd, fmts)
    return dict(vocab=cfg["vocab_size"], layers=L, kv_heads=kvh, head_dim=hd,
                heads=cfg["num_attention_heads"], hidden=cfg["hidden_size"],
                policies=policies, kv_bytes_per_token=bpt,
                kv_bytes_per_token_of=lambda n: bpt[n])


def worker_command(a: argparse.Namespace, name: str, deadline: float, ref: dict,
                   soft: Optional[float] = None) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name,
           "--deadline", f"{deadline:.1f}", "--soft-deadline", f"{soft or deadline:.1f}",
           "--ref-batches", json.dumps(ref)]
    for flag in ("out", "model", "gpu_mem", "max_model_len", "headroom", "steps", "warm_steps",
                 "ttft_reps", "max_batch", "prefill_factor", "profile_steps", "profile_dir",
                 "max_num_seqs", "mixed_policy"):
        v = getattr(a, flag)
        if v is not None:
            cmd += ["--" + flag.replace("_", "-"), str(v)]
    cmd += ["--contexts", ",".join(map(str, a.contexts))]
    if a.ttft_contexts:
        cmd += ["--ttft-contexts", ",".join(map(str, a.ttft_contexts))]
    for flag in ("eager", "cpu", "profile", "default_capture_sizes"):
        if getattr(a, flag):
            cmd.append("--" + flag.replace("_", "-"))
    return cmd


def gpu_memory_used_mib() -> Optional[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return int(out.split()[0])
    except Exception:
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


def run_config(a: argparse.Namespace, name: str, deadline: float, soft: float, ref: dict) -> int:
    """One worker process, killed (whole group) at ``deadline`` + grace."""
    cmd = worker_command(a, name, deadline, ref, soft)
    log(f"{name}: worker with {deadline - time.time():.0f}s ({soft - time.time():.0f}s for "
        f"contexts after the first)")
    with open(Path(a.out) / WORKER_LOG, "a") as lf:
        lf.write(f"\n===== {name}: {shlex.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, bufsize=1)
        seen: list[str] = []
        pump = threading.Thread(target=_pump, args=(proc, lf, seen), daemon=True)
        pump.start()
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time() + a.grace_s))
        except subprocess.TimeoutExpired:
            log(f"{name}: past its deadline, killing the worker")
            Recorder(Path(a.out) / RECORDS, config=name).write("killed", reason="deadline")
            rc = -9
        kill_group(proc)
        pump.join(timeout=5)
    if seen:
        Recorder(Path(a.out) / RECORDS, config=name).write("backend_log", lines=seen[:6])
    if not a.cpu:
        wait_gpu_free()
    return rc


BACKEND_LOG_KEYS = ("attention backend", "Using AttentionBackend", "vllm-nvfp4: KV policy",
                    "GPU KV cache size", "Maximum concurrency")


def _pump(proc: subprocess.Popen, lf: Any, seen: list[str]) -> None:
    """Copy the worker's output to the log; echo our progress lines and errors; keep the
    log lines that say which attention backend and KV cache size vLLM chose."""
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


def versions() -> dict:
    out: dict[str, Any] = dict(python=platform.python_version(), platform=platform.platform())
    from importlib import metadata

    for pkg in ("vllm", "torch", "triton", "transformers", "vllm-nvfp4"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        out["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip() or None
    except Exception:
        out["gpu"] = None
    try:
        out["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                           capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        out["git_commit"] = None
    out["cpu_count"] = os.cpu_count()
    return out


def latest(records: list[dict], **match: Any) -> Optional[dict]:
    """The last record whose fields equal ``match`` (records are in measurement order, prior
    runs first, so this is the newest measurement)."""
    for r in reversed(records):
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
    return round(x / y, 3) if x is not None and y not in (None, 0) else None


def compute_targets(records: list[dict], contexts: list[int]) -> dict:
    """The ratios issue 7 asks for, with the targets and whether they are met."""
    eng = {r["config"]: r for r in records if r["kind"] == "engine"}
    dec = [r for r in records if r["kind"] == "decode"]
    ttft = {(r["config"], r["context"]): r["ttft_s"] for r in records if r["kind"] == "ttft"}
    out: dict[str, Any] = {"capacity_vs_fp8": {}, "decode_vs_best_fp8": {}, "ttft_vs_fp8": {}}
    fp8_cap = eng.get("fp8", {}).get("capacity_tokens")
    for name, e in eng.items():
        out["capacity_vs_fp8"][name] = ratio(e["capacity_tokens"], fp8_cap)
    r = out["capacity_vs_fp8"].get("nvfp4-mixed")
    out["target_capacity"] = dict(target=TARGET_CAPACITY, value=r, met=None if r is None else r >= TARGET_CAPACITY)
    for c in contexts:
        # the newest record of each (merged summaries hold older runs first)
        fp8_ref = list({d["config"]: d for d in dec if d["config"] in ("fp8", "fp8-triton")
                        and "ref" in d["label"] and d["context"] == c}.values())
        if not fp8_ref:
            continue
        b = fp8_ref[0]["batch"]
        best_fp8 = max(fp8_ref, key=lambda d: d["tok_per_s"] or 0)
        row: dict[str, Any] = dict(batch=b, best_fp8=best_fp8["config"], best_fp8_tok_per_s=best_fp8["tok_per_s"])
        for name in ("nvfp4-mixed", "nvfp4-all", "auto"):
            # its "ref" stage (the fp8 batch it was given or estimated), else the same batch
            same = [d for d in dec if d["config"] == name and d["context"] == c
                    and ("ref" in d["label"] or d["batch"] == b)]
            if same:
                row[name] = ratio(same[-1]["tok_per_s"], best_fp8["tok_per_s"])
                if same[-1]["batch"] != b:
                    row[f"{name}_batch"] = same[-1]["batch"]  # estimate differed from fp8's own
            own = [d for d in dec if d["config"] == name and d["context"] == c and "max" in d["label"]]
            if own:
                row[f"{name}_at_own_max_batch"] = dict(batch=own[-1]["batch"], tok_per_s=own[-1]["tok_per_s"],
                                                       vs_best_fp8=ratio(own[-1]["tok_per_s"], best_fp8["tok_per_s"]))
        out["decode_vs_best_fp8"][str(c)] = row
    r32 = out["decode_vs_best_fp8"].get("32768", {}).get("nvfp4-mixed")
    out["target_decode_32k"] = dict(target=TARGET_DECODE_32K, value=r32,
                                    met=None if r32 is None else r32 >= TARGET_DECODE_32K)
    for c in contexts:
        base = ttft.get(("fp8", c))
        out["ttft_vs_fp8"][str(c)] = {n: ratio(ttft.get((n, c)), base) for n in CONFIGS if (n, c) in ttft}
    worst = [v.get("nvfp4-mixed") for v in out["ttft_vs_fp8"].values() if v.get("nvfp4-mixed")]
    out["target_ttft"] = dict(target=TARGET_TTFT, value=max(worst) if worst else None,
                              met=None if not worst else max(worst) <= TARGET_TTFT)
    return out


def summary_table(records: list[dict], targets: dict) -> str:
    """The short table printed last."""
    lines = [f"{'config':12s} {'start':>6s} {'KV tokens':>10s} {'cap/fp8':>7s}  "
             f"{'ctx':>6s} {'TTFT ms':>8s}  decode batch:tok/s(ms/tok)"]
    eng = {r["config"]: r for r in records if r["kind"] == "engine"}
    names = list(dict.fromkeys(r["config"] for r in records if "config" in r))
    for name in names:
        e = eng.get(name)
        ctxs = sorted({r["context"] for r in records if r.get("config") == name and "context" in r}) or [None]
        for i, c in enumerate(ctxs):
            tt = latest(records, kind="ttft", config=name, context=c)
            decs = [r for r in records if r["kind"] == "decode" and r["config"] == name and r["context"] == c]
            d = " ".join(f"{r['batch']}:{r['tok_per_s']:.0f}({r['tpot_ms']:.1f})" for r in decs)
            head = (f"{name:12s} {e['engine_start_s']:6.0f} {e['capacity_tokens']:10d} "
                    f"{targets['capacity_vs_fp8'].get(name) or float('nan'):7.3f}" if e and i == 0
                    else f"{name if i == 0 else '':12s} {'':6s} {'':10s} {'':7s}")
            lines.append(f"{head}  {c if c else '-':>6} "
                         f"{(1000 * tt['ttft_s']) if tt else float('nan'):8.1f}  {d}")
    for r in records:
        if r["kind"] in ("error", "killed"):
            lines.append(f"{r.get('config', '?'):12s} {r['kind'].upper()}: {r.get('what', '')} {str(r.get('error', r.get('reason', '')))[:150]}")
        if r["kind"] == "serve":
            lines.append(f"serve {r['config']}: {r['output_tok_per_s']} tok/s, {r['requests_done']} req, "
                         f"lat p50/p99 {r['latency_p50_s']}/{r['latency_p99_s']}s, "
                         f"TTFT p50/p99 {r['ttft_p50_s']}/{r['ttft_p99_s']}s")
    for key in ("target_capacity", "target_decode_32k", "target_ttft"):
        t = targets[key]
        lines.append(f"{key}: value {t['value']} target {t['target']} met {t['met']}")
    return "\n".join(lines)


def prior_records(paths: list[str]) -> list[dict]:
    """Records of earlier runs (``--prior-records``), tagged with the file they came from.
    A configuration measured again in this run replaces its earlier records."""
    out = []
    for p in paths:
        for r in read_records(Path(p)):
            out.append(dict(r, prior=str(p)))
    return out


def merged_records(a: argparse.Namespace) -> list[dict]:
    """This run's records, plus earlier runs' records of configurations not measured now."""
    now = read_records(Path(a.out) / RECORDS)
    fresh = {r.get("config") for r in now if r["kind"] == "engine"} | set(a.dtypes)
    old = [r for r in prior_records(a.prior_records) if r.get("config") not in fresh
           or (r["kind"] == "serve" and r.get("config") not in a.serve)]
    return old + now


def write_summary(a: argparse.Namespace, t_start: float, meta: dict) -> dict:
    records = merged_records(a)
    ctxs = sorted({r["context"] for r in records if "context" in r} | set(a.contexts + a.ttft_contexts),
                  reverse=True)
    targets = compute_targets(records, ctxs)
    summary = dict(meta, finished_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   wall_s=round(time.time() - t_start, 1), targets=targets, records=records)
    tmp = Path(a.out) / (SUMMARY + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    tmp.replace(Path(a.out) / SUMMARY)
    return summary


def run_orchestrator(a: argparse.Namespace) -> int:
    t_start = time.time()
    end = t_start + a.budget_s
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.fresh and (out / RECORDS).exists():
        (out / RECORDS).unlink()
    if a.model is None:
        need = a.max_model_len + 1024
        a.model = str(make_random_model(a.model_dir, a.preset,
                                        need if need > PRESETS[a.preset]["max_pos"] else None))
    info = model_info(a)
    meta = dict(
        issue=7, started_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command=shlex.join([sys.executable] + sys.argv), argv=sys.argv[1:],
        args={k: v for k, v in vars(a).items() if k not in ("ref_batches",)},
        versions=versions(), model=dict({k: v for k, v in info.items() if k != "kv_bytes_per_token_of"},
                                        preset=a.preset, load_format="dummy"),
        env={k: os.environ.get(k) for k in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ENABLE_V1_MULTIPROCESSING",
                                            "VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES")},
        method="see the module docstring of scripts/bench_e2e.py and docs/PERFORMANCE.md")
    log(f"model {a.model}: {info['layers']} layers, {info['heads']}/{info['kv_heads']} heads, "
        f"head_dim {info['head_dim']}; KV bytes/token {info['kv_bytes_per_token']}; "
        f"budget {a.budget_s:.0f}s; configs {a.dtypes}; contexts {a.contexts}")
    serve_names = a.serve
    offline_end = end - (a.serve_reserve_s if serve_names else 0)
    ref: dict[str, int] = {}
    e = latest(prior_records(a.prior_records), kind="engine", config=REFERENCE)
    if e and REFERENCE not in a.dtypes:  # fp8's largest batches measured by an earlier run
        ref = dict(e["max_batch"])
        log(f"reference batches from {e['prior']}: {ref}")
    for i, name in enumerate(a.dtypes):
        if offline_end - time.time() < a.min_config_s:
            Recorder(out / RECORDS, config=name).write("skip", what="engine", reason="budget")
            log(f"{name}: skipped (budget)")
            continue
        weights = [CONFIGS[n].weight for n in a.dtypes[i:]]
        hard, soft = deadlines(time.time(), offline_end, weights, a.min_config_s)
        run_config(a, name, hard, soft, ref)
        if name == REFERENCE:
            e = latest(read_records(out / RECORDS), kind="engine", config=REFERENCE)
            if e:
                ref = {c: b for c, b in e["max_batch"].items()}
        write_summary(a, t_start, meta)
    for name in serve_names:
        left = end - time.time()
        if left < a.serve_min_s:
            Recorder(out / RECORDS, config=name).write("skip", what="serve", reason=f"budget ({left:.0f}s left)")
            log(f"serve {name}: skipped, {left:.0f}s left")
            continue
        rec = Recorder(out / RECORDS, config=name)
        try:
            run_serve(a, CONFIGS[name], info, end, rec)
        except Exception as e:
            rec.write("error", what="serve", error=repr(e))
        if not a.cpu:
            wait_gpu_free()
        write_summary(a, t_start, meta)
    summary = write_summary(a, t_start, meta)
    print("\n" + summary_table(summary["records"], summary["targets"]), flush=True)
    log(f"done in {time.time() - t_start:.0f}s; results in {out / SUMMARY}")
    return 0


def plot_summary(summary_path: Path, plot_dir: Path) -> list[Path]:
    """PNG plots from a summary: KV capacity per configuration; decode throughput against
    context (at fp8's largest batch, and at each configuration's own largest batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = json.loads(Path(summary_path).read_text())["records"]
    plot_dir.mkdir(parents=True, exist_ok=True)
    out = []
    eng = list({r["config"]: r for r in recs if r["kind"] == "engine"}.values())  # newest each
    if eng:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [r["config"] for r in eng]
        ax.bar(names, [r["capacity_tokens"] / 1e6 for r in eng], color="tab:blue")
        for i, r in enumerate(eng):
            ax.text(i, r["capacity_tokens"] / 1e6, f"{r['capacity_tokens'] / 1e6:.2f}M",
                    ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("KV cache capacity (M tokens)")
        ax.set_title("KV capacity at the same gpu_memory_utilization (H200, Llama-8B shape)", fontsize=9)
        fig.tight_layout()
        out.append(plot_dir / "e2e_capacity.png")
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    dec = [r for r in recs if r["kind"] == "decode"]
    if dec:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, key, title in ((axes[0], "ref", "at fp8's largest batch"),
                               (axes[1], "max", "at each config's largest batch")):
            for name in dict.fromkeys(r["config"] for r in dec):
                pts = sorted((r["context"], r["tok_per_s"], r["batch"]) for r in dec
                             if r["config"] == name and key in r["label"].split("+"))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
                    for c, t, b in pts:
                        ax.annotate(f"b{b}", (c, t), fontsize=7, textcoords="offset points", xytext=(3, 3))
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)  # a zoomed axis would magnify a 2% gap into a cliff
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("decode output tokens/s")
            ax.set_title(f"Decode throughput {title}", fontsize=9)
            ax.legend(fontsize=8)
        fig.tight_layout()
        out.append(plot_dir / "e2e_decode.png")
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    return out


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="result folder (records, summary, logs); required")
    ap.add_argument("--plot", default=None, metavar="SUMMARY_JSON",
                    help="only plot an earlier summary (e2e_h200.json) into --plot-dir, then exit")
    ap.add_argument("--plot-dir", default=str(REPO / "docs" / "img"))
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole run")
    ap.add_argument("--dtypes", type=parse_dtypes, default=parse_dtypes("fp8,nvfp4-mixed,auto"),
                    help=f"configurations in order, or 'all' ({', '.join(CONFIGS)})")
    ap.add_argument("--contexts", type=parse_contexts, default=parse_contexts("32768,8192"),
                    help="prompt lengths in tokens ('32k' ok); the first gets the time first")
    ap.add_argument("--prior-records", type=lambda s: [p for p in s.split(",") if p], default=[],
                    help="e2e_records.jsonl files of earlier runs: merged into the summary (targets, "
                         "table) and the source of fp8's reference batches when fp8 is not run now")
    ap.add_argument("--ttft-contexts", type=parse_contexts, default=[],
                    help="extra prompt lengths measured for TTFT only (no decode stages)")
    ap.add_argument("--model", default=None, help="model dir (default: written from --preset)")
    ap.add_argument("--model-dir", default="/tmp/vllm-nvfp4-models/llama8b-random")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    ap.add_argument("--gpu-mem", type=float, default=0.9, help="gpu_memory_utilization (same for all)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: largest context + headroom")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's (1024 on H200)")
    ap.add_argument("--max-batch", type=int, default=512, help="cap of the largest batch (graph sizes)")
    ap.add_argument("--headroom", type=int, default=1024,
                    help="tokens reserved per sequence beyond the prompt (output growth)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per stage")
    ap.add_argument("--warm-steps", type=int, default=8, help="decode steps before the timed ones")
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--prefill-factor", type=float, default=1.1,
                    help="prefill time per request = factor x TTFT, for the budget estimate")
    ap.add_argument("--mixed-policy", default=None, help="compact policy of nvfp4-mixed (default: first 1/8 FP8)")
    ap.add_argument("--profile", action="store_true", help="torch-profile decode steps at the reference batch")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--profile-dir", default="/tmp/vllm-nvfp4-profile")
    ap.add_argument("--serve", type=lambda s: [] if s in ("", "none") else parse_dtypes(s), default=[],
                    help="configurations to run through `vllm serve` after the offline runs ('none')")
    ap.add_argument("--serve-reserve-s", type=float, default=150.0, help="budget kept for the serve runs")
    ap.add_argument("--serve-min-s", type=float, default=120.0, help="skip a serve run with less left")
    ap.add_argument("--serve-time-s", type=float, default=40.0, help="client load time cap")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--serve-requests", type=int, default=128)
    ap.add_argument("--serve-prompt-len", type=int, default=2048)
    ap.add_argument("--serve-output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--min-config-s", type=float, default=100.0,
                    help="time kept for each later configuration (engine start + TTFT); "
                         "no engine is started with less left")
    ap.add_argument("--grace-s", type=float, default=20.0, help="after a worker's deadline, before the kill")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs; not for numbers)")
    ap.add_argument("--default-capture-sizes", action="store_true", help="vLLM's own CUDA-graph sizes")
    ap.add_argument("--cpu", action="store_true", help="CPU build of vLLM: no backend names, no nvidia-smi")
    ap.add_argument("--cpu-tiny", action="store_true",
                    help="CPU smoke run: tiny model, contexts 64, 4 steps, eager, auto + nvfp4-mixed")
    ap.add_argument("--fresh", action="store_true", help="delete earlier records in --out first")
    # worker-only
    ap.add_argument("--worker", choices=list(CONFIGS), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--soft-deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ref-batches", type=json.loads, default={}, help=argparse.SUPPRESS)
    return ap


def apply_cpu_tiny(a: argparse.Namespace, argv: list[str]) -> None:
    """Defaults of the CPU smoke run (explicit flags still win)."""
    given = {t.split("=")[0] for t in argv if t.startswith("--")}
    defaults = dict(preset="tiny", contexts=[64], steps=4, warm_steps=1, ttft_reps=1, headroom=64,
                    max_batch=8, budget_s=240.0, min_config_s=10.0, serve_reserve_s=60.0,
                    serve_min_s=20.0, serve_time_s=10.0, clients=2, serve_requests=4,
                    serve_prompt_len=32, serve_output_len=8, dtypes=["auto", "nvfp4-mixed"],
                    model_dir="/tmp/vllm-nvfp4-models/tiny-random")
    for k, v in defaults.items():
        if "--" + k.replace("_", "-") not in given:
            setattr(a, k, v)
    a.cpu = a.eager = True


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.plot:
        return a
    if not a.out:
        ap.error("--out is required")
    if a.cpu_tiny:
        apply_cpu_tiny(a, argv)
    if a.cpu:  # vLLM's CPU worker refuses to start without a KV-cache size (GiB)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if not any(t.startswith("--gpu-mem") for t in argv):
            a.gpu_mem = 0.3  # on CPU: the fraction of RAM vLLM checks is free (the KV size is above)
    longest = max(a.contexts + a.ttft_contexts)
    if a.max_model_len is None:
        a.max_model_len = longest + a.headroom
    if longest + a.headroom > a.max_model_len:
        raise SystemExit(f"--max-model-len {a.max_model_len} < largest context + headroom")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    if a.plot:
        for p in plot_summary(Path(a.plot), Path(a.plot_dir)):
            print(p)
        return 0
    if a.worker:
        return run_worker(a)
    return run_orchestrator(a)


if __name__ == "__main__":
    sys.exit(main())

"""One engine configuration in its own process: capacity, TTFT, decode stages, kernel split.

Run by the orchestrator as ``python -m benchmarks.e2e.worker SPEC.json`` (the run's settings plus
``config``, ``deadline``, ``soft_deadline`` and ``ref_batches``); every measurement is appended to
the run's records as it completes. The process exits without shutting the engine down: the
orchestrator kills its process group, which returns the GPU memory at once.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
import zlib
from argparse import Namespace
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.e2e import trace
from benchmarks.e2e.capacity import (PoolLayout, bytes_per_token_by_config, capacity_tokens, estimate_batch,
                                     max_batch, plan_stages, pool_layout)
from benchmarks.e2e.configs import CONFIGS, REFERENCE, backend_for, capture_sizes_for, policy_for
from benchmarks.e2e.records import RECORDS, Recorder
from benchmarks.e2e.stepping import Stepper, decode_window, measure_ttft, prefill_stage
from vllm_nvfp4.model_shape import ModelShape


def log(msg: str) -> None:
    """Progress line the orchestrator echoes (prefix ``[bench``)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def engine_kwargs(a: Namespace, kv_cache_dtype: str, attention_backend: Optional[str],
                  skip_layers: Sequence[str] = ()) -> dict:
    """``LLM(...)`` arguments of one configuration: dummy weights, no prefix caching."""
    kw: dict[str, Any] = dict(
        model=a.model, load_format="dummy", kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=a.gpu_mem, max_model_len=a.max_model_len,
        enable_prefix_caching=False, seed=0)
    if skip_layers:
        kw["kv_cache_dtype_skip_layers"] = list(skip_layers)
    if a.block_size:
        kw["block_size"] = a.block_size
    if a.extensible_kv_cache:
        kw["enable_extensible_kv_cache"] = a.extensible_kv_cache == "on"
    if a.max_num_seqs:
        kw["max_num_seqs"] = a.max_num_seqs
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if attention_backend and not a.cpu:
        kw["attention_backend"] = attention_backend
    if a.eager:
        kw["enforce_eager"] = True
    elif not a.default_capture_sizes:
        kw["compilation_config"] = {"cudagraph_capture_sizes": capture_sizes_for(a.max_batch)}
    if a.profile and not a.cpu:
        kw["profiler_config"] = dict(
            profiler="torch", torch_profiler_dir=str(Path(a.profile_dir).resolve()),
            torch_profiler_activities=["CPU", "CUDA"], torch_profiler_with_stack=False,
            torch_profiler_use_gzip=False, ignore_frontend=True)
    kw.update(getattr(a, "engine_args", None) or {})
    return kw


class Worker:
    """The measurements of one configuration against one engine (see the package docstring)."""

    def __init__(self, a: Namespace, rec: Recorder) -> None:
        self.a, self.cfg, self.rec = a, CONFIGS[a.config], rec
        self.shape = ModelShape.from_model_dir(a.model)
        self.bpt = bytes_per_token_by_config(self.shape, a.mixed_policy)
        self.policy = policy_for(self.cfg, self.shape.layer_types, a.mixed_policy)
        self.in_flight = 0  # the engine's max_in_flight_tokens, read at start
        self.deadline = a.deadline  # hard: the orchestrator kills this process soon after
        self.soft = min(a.soft_deadline, a.deadline)  # for contexts after the first
        self.llm: Any = None
        self.profiled = False

    def contexts(self) -> list[int]:
        return list(dict.fromkeys(self.a.contexts + self.a.ttft_contexts))

    def start(self) -> dict:
        from vllm import LLM

        kw = engine_kwargs(self.a, self.cfg.kv_cache_dtype, backend_for(self.cfg, self.shape.needs_packed_groups),
                           self.cfg.skipped(self.shape.num_layers))
        log(f"{self.cfg.name}: starting engine {kw}")
        t0 = time.time()
        self.llm = LLM(**kw)
        start_s = time.time() - t0
        vc = self.llm.llm_engine.vllm_config
        cc = vc.cache_config
        blocks, bs = int(cc.num_gpu_blocks), int(cc.block_size)
        planned_bs = self.planned_block_size()
        self.in_flight = int(vc.max_in_flight_tokens)
        own, bpt = self.layout(self.cfg.name), self.bpt[self.cfg.name]
        cap = capacity_tokens(blocks, own, self.a.max_model_len)
        mb = {str(c): max_batch(blocks, own, c + self.a.headroom, self.in_flight, self.a.max_batch)
              for c in self.contexts()}
        if self.cfg.skip_layers:  # vLLM pads the skipped layers' pages: take its own report
            if getattr(cc, "kv_cache_size_tokens", None) is None:
                raise RuntimeError(f"{self.cfg.name}: this vLLM reports no kv_cache_size_tokens "
                                   "(vLLM >= 0.34 does); capacity with skipped layers needs it")
            cap = int(cc.kv_cache_size_tokens)
            seqs = float(cc.kv_cache_max_concurrency) * self.a.max_model_len
            mb = {str(c): min(self.a.max_batch, int(seqs // (c + self.a.headroom)))
                  for c in self.contexts()}
        rec = self.rec.write(
            "engine", engine_start_s=round(start_s, 1), num_gpu_blocks=blocks, block_size=bs,
            planned_block_size=planned_bs,
            capacity_tokens=cap, kv_bytes_per_token=bpt,
            kv_gib=round(blocks * own.block_bytes / 2**30, 2), pool=own.to_json(),
            max_in_flight_tokens=self.in_flight,
            vllm_kv_cache_size_tokens=getattr(cc, "kv_cache_size_tokens", None),
            vllm_max_concurrency=getattr(cc, "kv_cache_max_concurrency", None),
            max_batch=mb, max_batch_x_context={c: b * int(c) for c, b in mb.items()},
            engine_kwargs={k: v for k, v in kw.items() if k != "profiler_config"},
            policy=self.policy, attention_backend=kw.get("attention_backend", "vLLM default"))
        log(f"{self.cfg.name}: engine up in {start_s:.0f}s: {cap} KV tokens ({blocks} blocks of "
            f"{own.block_bytes} B, groups {[(g.kind, g.block_size) for g in own.groups]}), "
            f"max batch {mb}")
        return rec

    def planned_block_size(self) -> int:
        """The block size this engine was configured with, which its KV-cache groups were
        planned from. vLLM's ``cache_config.block_size`` is its smallest group's once the engine
        is up (16 of nvfp4_mixed's 16 / 16 / 64 on a Gemma 3 with vLLM 0.34); the plugin keeps
        the configured one (:func:`~vllm_nvfp4.integration.model.planned_block_size`)."""
        from vllm_nvfp4.integration.model import planned_block_size

        return int(planned_block_size(self.llm.llm_engine.vllm_config))

    def layout(self, name: str) -> PoolLayout:
        """The pool layout configuration ``name`` has at this engine's configured block size and
        lengths."""
        cfg = CONFIGS[name]
        bs = self.planned_block_size()
        return pool_layout(cfg.kv_cache_dtype, self.shape, policy_for(cfg, self.shape.layer_types, self.a.mixed_policy),
                           bs, self.a.max_model_len, self.in_flight, len(cfg.skip_layers))

    def left(self, soft: bool = False) -> float:
        return (self.soft if soft else self.deadline) - time.time()

    def ttft(self, st: Stepper) -> dict[int, float]:
        """Median TTFT per context over ``ttft_reps`` requests, after one warm-up request."""
        out: dict[int, float] = {}
        for c in self.contexts():
            if self.left() < 10:
                self.rec.write("skip", what=f"ttft {c}", reason="budget")
                continue
            samples = [measure_ttft(st, c) for _ in range(1 + self.a.ttft_reps)]
            out[c] = med = statistics.median(samples[1:])
            self.rec.write("ttft", context=c, ttft_s=round(med, 4), warmup_s=round(samples[0], 4),
                           samples_s=[round(s, 4) for s in samples[1:]])
            log(f"{self.cfg.name}: TTFT {c}: {1000 * med:.1f} ms")
        return out

    def ref_batch(self, context: int) -> tuple[Optional[int], str]:
        """The reference (fp8) largest batch at ``context``: measured, this engine's, or estimated."""
        cc = self.llm.llm_engine.vllm_config.cache_config
        if str(context) in self.a.ref_batches:
            return int(self.a.ref_batches[str(context)]), "measured (fp8 engine)"
        tokens = context + self.a.headroom
        own = self.layout(self.cfg.name)
        if self.cfg.name == REFERENCE:
            return (max_batch(cc.num_gpu_blocks, own, tokens, self.in_flight, self.a.max_batch),
                    "this engine (fp8 is the reference)")
        b = estimate_batch(cc.num_gpu_blocks * own.block_bytes, self.layout(REFERENCE), tokens,
                           self.in_flight, self.a.max_batch)
        return b, "estimated from this engine's KV bytes and fp8's pool layout"

    def decode_context(self, st: Stepper, context: int, own_max: int, ttft_s: float, soft: bool) -> None:
        """Growing decode stages over one prefill at ``context`` (plan against the soft deadline
        for contexts after the first)."""
        a = self.a
        ref, ref_src = self.ref_batch(context)
        step_s, have = 0.05, 0
        try:
            for label, batch in plan_stages(own_max, ref):
                new = batch - have
                est = new * ttft_s * a.prefill_factor + (a.warm_steps + a.steps) * step_s + 5
                if est > self.left(soft):
                    self.rec.write("skip", what=f"decode {context} x {batch} ({label})",
                                   reason=f"budget: needs ~{est:.0f}s, {self.left(soft):.0f}s left")
                    log(f"{self.cfg.name}: skip decode {context} x {batch}: ~{est:.0f}s")
                    break
                # max_tokens = headroom is never reached: the stages abort everything at the end
                _, pre_s, pre_steps = prefill_stage(st, new, context, a.headroom, self.deadline)
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
                log(f"{self.cfg.name}: decode ctx {context} batch {batch} ({label}): {w['tok_per_s']} "
                    f"tok/s, {w['tpot_ms']} ms/token (requests/step {w['min_batch']}-{w['max_batch']})")
                if "ref" in label and a.profile and not a.cpu and not self.profiled:
                    self.profile(st, context, batch, w["tpot_ms"])
        finally:
            st.abort_all()

    def profile(self, st: Stepper, context: int, batch: int, tpot_ms: float) -> None:
        """Torch-profile ``profile_steps`` pure-decode iterations; record the kernel split."""
        self.profiled = True
        if self.left() < 30:
            self.rec.write("skip", what="profile", reason="budget")
            return
        pdir, n = Path(self.a.profile_dir), self.a.profile_steps
        before = set(pdir.rglob("*.json*")) if pdir.exists() else set()
        try:
            self.llm.start_profile(max_iterations=n)
            for _ in range(n + 2):
                st.step()
            self.llm.stop_profile()
            path = trace.wait_for_trace(pdir, before, timeout=60)
            events = trace.load_trace_events(path)
            us = trace.kernel_time_by_category(events)
            frac, per_step = trace.split_per_step(us, tpot_ms)
            self.rec.write("profile", context=context, batch=batch, iterations=n, kernel_us_total=us,
                           fraction=frac, tpot_ms=tpot_ms, ms_per_step=per_step,
                           kernel_ms_per_iteration=round(us["total"] / n / 1000, 3),
                           top_kernels=trace.top_kernels(events), idle=trace.idle_gaps(events, n),
                           trace=str(path))
            log(f"{self.cfg.name}: profile ctx {context} batch {batch}: fractions {frac}")
        except Exception as e:  # the split is a bonus: never lose the run for it
            self.rec.write("error", what="profile", error=repr(e))
            log(f"{self.cfg.name}: profile failed: {e!r}")

    def run(self) -> None:
        eng = self.start()
        st = Stepper(self.llm.llm_engine, self.llm.llm_engine.model_config.get_vocab_size(), seed=zlib.crc32(self.cfg.name.encode()))
        ttfts = self.ttft(st)
        for i, c in enumerate(self.a.contexts):
            if c not in ttfts:
                continue
            own = eng["max_batch"][str(c)]
            if own <= 0:
                self.rec.write("skip", what=f"decode {c}", reason="not even one sequence fits")
                continue
            self.decode_context(st, c, own, ttfts[c], soft=i > 0)


def main(spec_path: str) -> int:
    a = Namespace(**json.loads(Path(spec_path).read_text()))
    rec = Recorder(Path(a.out) / RECORDS, config=a.config)
    rc = 0
    try:
        w = Worker(a, rec)
        if w.policy:
            os.environ["VLLM_NVFP4_POLICY"] = w.policy
        w.run()
    except Exception as e:
        rec.write("error", what="worker", error=repr(e), traceback=traceback.format_exc()[-3000:])
        log(f"{a.config}: FAILED: {e!r}")
        rc = 1
    rec.write("done", rc=rc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m benchmarks.e2e.worker SPEC.json (written by python -m benchmarks.e2e)")
    main(sys.argv[1])

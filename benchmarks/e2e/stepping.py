"""Driving ``LLMEngine.step()`` by hand: TTFT of one request, prefill stages, timed decode windows.

Decode is timed at a fixed batch and context, which vLLM's own ``bench latency`` / ``throughput``
cannot do: requests of ``context`` random tokens are added, the engine is stepped until every one
has its first token, then pure-decode steps are timed (time per output token = window / steps).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


class Stepper:
    """Adds random-prompt requests to an engine, steps it, counts tokens per request, aborts."""

    def __init__(self, engine: Any, vocab: int, seed: int) -> None:
        self.engine = engine
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.tokens: dict[str, int] = {}  # request id -> output tokens so far
        self.finished: set[str] = set()
        self.n = 0

    def add(self, count: int, context: int, max_tokens: int) -> list[str]:
        """Add ``count`` requests of ``context`` random prompt tokens (greedy, ignore_eos)."""
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
        """One engine step: (perf_counter after it, requests that got tokens, new tokens)."""
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

    def abort_all(self, timeout_s: float = 30.0) -> None:
        """Abort every running request and step until the engine has none left (bounded)."""
        live = self.running()
        if live:
            self.engine.abort_request(live)
        self.finished.update(live)
        t_end = time.time() + timeout_s
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
    """Add ``new`` requests; step until each has a token: (ids, seconds, steps).

    Raises ``TimeoutError`` past ``deadline`` (Unix seconds; ``inf`` for none).
    """
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
    """Time ``steps`` decode steps after ``warm`` ones.

    Returns steps, output tokens, seconds, tok_per_s, tpot_ms (window / steps) and the smallest
    and largest number of requests that got a token in one step (a shortfall shows requests that
    finished or had not started).
    """
    t_prev = time.perf_counter()
    for _ in range(warm):
        t_prev, _, _ = st.step()
    toks, reqs = 0, []
    t = t_prev
    for _ in range(steps):
        t, n_req, n_tok = st.step()
        toks += n_tok
        reqs.append(n_req)
    dt = t - t_prev
    return dict(steps=steps, tokens=toks, seconds=round(dt, 4),
                tok_per_s=round(toks / dt, 1) if dt > 0 else None,
                tpot_ms=round(1000 * dt / steps, 3), min_batch=min(reqs), max_batch=max(reqs))

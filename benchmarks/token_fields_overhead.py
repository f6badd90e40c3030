"""Per-step cost of the token fields the cache write reads: the position-0 marks (policies with
``k_sink_uncentered``) and each token's position (policies with ``k_rot``).

The metadata builder builds them eagerly in every step, decode steps replayed from a CUDA graph
included: from the positions vLLM's model runner already holds
(:func:`vllm_nvfp4.integration.backend.fields_from_vllm_positions` on
``CommonAttentionMetadata.positions``, int64: one cast-copy, one compare), or, where a step has
none, derived from the query and sequence lengths
(:func:`~vllm_nvfp4.integration.backend.mark_first_keys`,
:func:`~vllm_nvfp4.integration.backend.token_positions`). This times the three and the
accumulating ``index_put_`` the marking replaced (which sorts the rows on CUDA),
for a decode batch (one token per request, a full graph's padded requests after it) and a mixed
batch, with the builder's buffers (``--tokens``: vLLM's ``max_num_batched_tokens``): host time
per call (launches queued, one sync at the end) and GPU time per call (CUDA events), the median of
``--reps`` repetitions.

    python benchmarks/token_fields_overhead.py [--calls 2000] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

import torch


def accumulating(query_start_loc, seq_lens, num_reqs, counts, marks):
    """The former marking: one accumulating ``index_put_`` of the requests' first rows."""
    starts = query_start_loc[:num_reqs]
    q_lens = query_start_loc[1:num_reqs + 1] - starts
    fresh = (seq_lens[:num_reqs] == q_lens) & (q_lens > 0)
    counts.zero_()
    counts.index_put_((starts.long(),), fresh.to(torch.int32), accumulate=True)
    return torch.gt(counts[:marks.shape[0]], 0, out=marks)


def batch(q_lens: list[int], ctx: list[int], device: str
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``query_start_loc``, ``seq_lens`` (int32) and vLLM's positions of the real tokens (int64)."""
    q = torch.tensor(q_lens)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q.cumsum(0)]).to(torch.int32)
    pos = torch.cat([c + torch.arange(n) for n, c in zip(q_lens, ctx)]).to(torch.int64)
    return qsl.to(device), (q + torch.tensor(ctx)).to(torch.int32).to(device), pos.to(device)


def time_calls(fn, args, calls: int, device: str) -> tuple[float, Optional[float]]:
    """(host us per call, GPU us per call; None off CUDA) over ``calls`` back-to-back calls."""
    cuda = device == "cuda"
    for _ in range(20):
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    host = (time.perf_counter() - t0) / calls * 1e6
    gpu = None
    if cuda:
        end.record()
        torch.cuda.synchronize()
        gpu = start.elapsed_time(end) / calls * 1e3
    return host, gpu


def main() -> int:
    from vllm_nvfp4.integration.backend import (fields_from_vllm_positions, mark_first_keys,
                                                token_positions)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=16384, help="the buffers' rows (max_num_batched_tokens)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    cases = {  # name -> (query lengths, contexts before the step)
        "decode 52 (+4 padded)": ([1] * 52 + [0] * 4, [32768] * 52 + [0] * 4),
        "mixed 8 x 64 + 56 decodes": ([1] * 56 + [64] * 8, [300] * 56 + [0] * 8),
    }
    out = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
           "torch": torch.__version__, "tokens": a.tokens, "cases": {}}
    for name, (q_lens, ctx) in cases.items():
        qsl, seq_lens, vllm_pos = batch(q_lens, ctx, a.device)
        n = vllm_pos.shape[0]
        counts = torch.zeros(a.tokens + 1, dtype=torch.int32, device=a.device)
        marks = torch.zeros(a.tokens, dtype=torch.bool, device=a.device)
        rows = torch.arange(a.tokens, dtype=torch.int32, device=a.device)
        pos_out = torch.zeros(a.tokens, dtype=torch.int32, device=a.device)
        args = (qsl, seq_lens, len(q_lens), counts, marks)
        pos_args = (qsl, seq_lens, len(q_lens), rows, pos_out)
        assert torch.equal(mark_first_keys(*args).clone(), accumulating(*args))
        first = mark_first_keys(*args)[:n].clone()
        assert torch.equal(token_positions(*pos_args)[:n].long(), vllm_pos)
        fields_from_vllm_positions(vllm_pos, pos_out, marks)
        assert torch.equal(pos_out[:n].long(), vllm_pos) and torch.equal(marks[:n], first)
        row = {}
        for label, fn, fn_args in (
                ("first keys: scatter (fallback)", mark_first_keys, args),
                ("first keys: accumulating index_put_", accumulating, args),
                ("positions: derived (fallback)", token_positions, pos_args),
                ("both from vLLM's positions (builder)", fields_from_vllm_positions,
                 (vllm_pos, pos_out, marks))):
            runs = [time_calls(fn, fn_args, a.calls, a.device) for _ in range(a.reps)]
            row[label] = {"host_us": round(statistics.median(r[0] for r in runs), 1),
                          "gpu_us": (round(statistics.median(r[1] for r in runs), 1)
                                     if runs[0][1] is not None else None)}
        out["cases"][name] = row
        print(f"{name:28s} " + "  ".join(f"{k}: host {v['host_us']} us, GPU {v['gpu_us']} us"
                                         for k, v in row.items()), flush=True)
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

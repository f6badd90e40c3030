"""Kernel split and GPU idle time of decode steps from a torch-profiler (Chrome) trace.

GPU kernel time is summed per category - attention, KV write, GEMM, other - from the kernels'
names; vLLM's ``bench`` tools report whole-step times only. :func:`idle_gaps` finds where the GPU
waits between kernels and which host calls ran meanwhile.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Any, Callable

CATEGORIES = ("attention", "kv_write", "gemm", "other")
#: name fragments, checked in this order: KV write first (its kernels also say "cache")
KV_WRITE_KEYS = ("reshape_and_cache", "_write_kv_kernel", "cache_kernel")
ATTENTION_KEYS = ("flash", "fmha", "attn", "attention", "_decode_kernel", "_decode_keys_kernel",
                  "_reduce_kernel", "_prefill_kernel", "_dequant_kv_kernel", "combine")
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


def load_trace_events(path: Path) -> list[dict]:
    """``traceEvents`` of a Chrome trace (``.json`` or ``.json.gz``)."""
    opener: Callable[..., Any] = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def kernel_time_by_category(events: list[dict]) -> dict[str, float]:
    """Total GPU kernel microseconds per category, plus ``total``."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            out[kernel_category(str(ev.get("name", "")))] += float(ev.get("dur", 0.0))
    out["total"] = sum(out.values())
    return out


def top_kernels(events: list[dict], n: int = 12) -> list[tuple[str, str, float, int]]:
    """The ``n`` kernels of most total GPU time: (category, name cut to 90 characters, total
    microseconds, launches)."""
    total: dict[str, list[float]] = {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            t = total.setdefault(str(ev.get("name", "")), [0.0, 0])
            t[0] += float(ev.get("dur", 0.0))
            t[1] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [(kernel_category(k), k[:90], round(us, 1), int(c)) for k, (us, c) in ranked]


def split_per_step(us: dict[str, float], tpot_ms: float) -> tuple[dict[str, float], dict[str, float]]:
    """(fraction of kernel time, ms per decode step) per category.

    ms per step = fraction x the measured time per output token, which stays right when the
    trace holds one step more or less than asked.
    """
    total = us["total"] or float("nan")
    frac = {k: round(us[k] / total, 4) for k in CATEGORIES}
    return frac, {k: round(f * tpot_ms, 3) for k, f in frac.items()}


def wait_for_trace(pdir: Path, before: set[Path], timeout: float) -> Path:
    """The newest trace file the profiler wrote into ``pdir`` after ``before`` was listed."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        new = [p for p in pdir.rglob("*.json*") if p not in before and p.stat().st_size > 0]
        if new:
            time.sleep(2)  # let the writer finish
            return max(new, key=lambda p: p.stat().st_mtime)
        time.sleep(0.5)
    raise TimeoutError(f"no profiler trace appeared in {pdir}")


#: trace categories of GPU work (busy time) and of host work shown next to an idle gap
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")


def idle_gaps(events: list[dict], iterations: int, min_gap_us: float = 20.0, top: int = 8
              ) -> dict[str, Any]:
    """GPU idle time between the first and the last GPU event of the trace.

    Returns ``idle_us`` (all gaps), ``idle_ms_per_iteration`` (divided by ``iterations``),
    ``busy_ms_per_iteration``, ``gaps`` (how many are >= ``min_gap_us``) and ``largest``: the
    ``top`` longest gaps, each with the kernels before and after it and the host events that
    overlap it most (name, microseconds of overlap), longest first.
    """
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")))
                 for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES)
    host = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")))
            for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES]
    gaps: list[tuple[float, float, str, str]] = []
    busy = idle = 0.0
    end, last = None, ""
    for start, stop, name in gpu:
        if end is not None and start > end:
            idle += start - end
            gaps.append((start - end, end, last, name))
        busy += max(0.0, stop - max(start, end if end is not None else start))
        if end is None or stop >= end:
            end, last = stop, name
    largest = []
    for length, at, before, after in sorted(gaps, reverse=True)[:top]:
        overlap: dict[str, float] = {}
        for hs, he, hname in host:
            o = min(he, at + length) - max(hs, at)
            if o > 0:
                overlap[hname] = overlap.get(hname, 0.0) + o
        ranked = sorted(overlap.items(), key=lambda kv: -kv[1])[:6]
        largest.append({"us": round(length, 1), "after": before[:70], "before": after[:70],
                        "host": [(n[:70], round(o, 1)) for n, o in ranked]})
    n = max(iterations, 1)
    return {"idle_us": round(idle, 1), "idle_ms_per_iteration": round(idle / n / 1000, 3),
            "busy_ms_per_iteration": round(busy / n / 1000, 3),
            "gaps": sum(g[0] >= min_gap_us for g in gaps), "largest": largest}

"""The highest request rate a server sustains within a latency objective: a geometric bisection.

A probe at rate r passes when every request completed and its p99 TPOT (and, if set, p99 TTFT)
is within the objective. The search keeps the highest passing rate ``lo`` and the lowest failing
one ``hi``: it widens the bracket by ``factor`` until both exist, then probes sqrt(lo * hi) until
hi / lo <= 1 + ``tol``. The answer is ``lo``; each probe's result is recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Objective:
    """p99 TPOT bound in ms and an optional p99 TTFT bound in ms."""

    p99_tpot_ms: float
    p99_ttft_ms: Optional[float] = None

    def check(self, result: dict) -> tuple[bool, str]:
        """(passed, why) of one ``vllm bench serve`` result JSON (``p99_*`` fields present)."""
        done, want = result.get("completed", 0), result.get("num_prompts")
        if result.get("failed") or (want is not None and done < want):
            errors = "; ".join(result.get("failed_errors") or [])
            return False, (f"{result.get('failed', 0)} failed, {done} of {want} completed"
                           + (f" ({errors})" if errors else ""))
        tpot = result.get("p99_tpot_ms")
        if tpot is None or not math.isfinite(tpot):
            return False, "no p99 TPOT in the result"
        if tpot > self.p99_tpot_ms:
            return False, f"p99 TPOT {tpot:.1f} ms > {self.p99_tpot_ms:g}"
        ttft = result.get("p99_ttft_ms")
        if self.p99_ttft_ms is not None and (ttft is None or ttft > self.p99_ttft_ms):
            return False, f"p99 TTFT {ttft} ms > {self.p99_ttft_ms:g}"
        return True, f"p99 TPOT {tpot:.1f} ms <= {self.p99_tpot_ms:g}"


def bracket(passed: dict[float, bool]) -> tuple[Optional[float], Optional[float]]:
    """(highest passing rate below every failing one, lowest failing rate) of the probes so far.
    A pass above a failure (noise) is ignored: the bracket stays below the lowest failure."""
    fails = [r for r, ok in passed.items() if not ok]
    hi = min(fails) if fails else None
    oks = [r for r, ok in passed.items() if ok and (hi is None or r < hi)]
    return (max(oks) if oks else None), hi


def next_rate(passed: dict[float, bool], start: float, factor: float = 2.0, tol: float = 0.15,
              floor: float = 1e-3) -> Optional[float]:
    """The next rate to probe (None: done) given the probes so far (rate -> passed)."""
    if not passed:
        return start
    lo, hi = bracket(passed)
    if lo is None:
        nxt = min(passed) / factor
        return nxt if nxt >= floor else None
    if hi is None:
        return max(passed) * factor
    if hi / lo <= 1 + tol:
        return None
    return math.sqrt(lo * hi)


def summarize(passed: dict[float, bool]) -> dict:
    """The search's answer: the highest sustained rate and the lowest failing one."""
    lo, hi = bracket(passed)
    return dict(max_rate=lo, lowest_failing_rate=hi, probes=len(passed))

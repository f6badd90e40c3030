"""Optional wall-clock budget (``--budget-s``): deadlines for machines that grant a fixed time.

Without a budget every deadline is infinite: nothing is skipped and no worker is killed. With
one, each configuration gets a hard deadline (everything except ``floor_s`` for each later
configuration: an engine start plus TTFT) and a soft one (its weighted share of what is left,
for optional work such as contexts after the first); a stage whose estimated cost does not fit
is skipped and recorded, and a worker past its hard deadline is killed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

UNLIMITED = math.inf


def deadline_share(now: float, end: float, weights: list[float]) -> float:
    """Deadline of the first of ``weights`` when what is left is shared in proportion to them."""
    left = max(0.0, end - now)
    return now + left * weights[0] / sum(weights)


def deadlines(now: float, end: float, weights: list[float], floor_s: float) -> tuple[float, float]:
    """(hard, soft) deadline of the first of the configurations still to run; soft <= hard."""
    hard = max(now, end - floor_s * (len(weights) - 1))
    return hard, min(hard, deadline_share(now, end, weights))


@dataclass
class Budget:
    """The end of a run (Unix seconds; ``inf`` without ``--budget-s``) and what is kept back."""

    end: float = UNLIMITED
    serve_reserve_s: float = 0.0  # kept for the `vllm serve` runs after the offline ones
    min_config_s: float = 0.0  # no engine is started with less left

    @classmethod
    def start(cls, budget_s: Optional[float], serve_reserve_s: float, min_config_s: float) -> "Budget":
        if budget_s is None:
            return cls()
        return cls(time.time() + budget_s, serve_reserve_s, min_config_s)

    @property
    def limited(self) -> bool:
        return self.end != UNLIMITED

    def left(self, reserve_serve: bool = False) -> float:
        return self.end - (self.serve_reserve_s if reserve_serve else 0.0) - time.time()

    def config_deadlines(self, weights: list[float], reserve_serve: bool) -> tuple[float, float]:
        """(hard, soft) deadlines of the next configuration (both ``inf`` without a budget)."""
        if not self.limited:
            return UNLIMITED, UNLIMITED
        end = self.end - (self.serve_reserve_s if reserve_serve else 0.0)
        return deadlines(time.time(), end, weights, self.min_config_s)

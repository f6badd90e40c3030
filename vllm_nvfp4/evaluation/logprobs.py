"""Teacher-forced scoring from vLLM ``prompt_logprobs``: per-position NLL and top-1 token.

With ``SamplingParams(max_tokens=1, prompt_logprobs=1)`` vLLM returns, for every prompt position
``t >= 1``, a dict holding the log-prob of the actual token ``x_t`` and the rank-1 token (the same
entry when the model's top-1 *is* ``x_t``). That is all we need:

* ``nll[t] = -log p(x_t | x_<t)``: the teacher-forced loss, compared between a KV configuration and
  the BF16 reference on identical windows (``delta NLL``, nats/token);
* ``top1[t]``: the argmax token; ``top-1 agreement`` is the fraction of positions where a
  configuration's argmax equals the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from vllm_nvfp4.evaluation.stats import Interval, bootstrap_ratio, mean_interval


@dataclass(frozen=True)
class WindowScores:
    """Scores of one window of ``T`` tokens: ``nll`` and ``top1`` for positions ``1..T-1``."""

    nll: tuple[float, ...]
    top1: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"nll": list(self.nll), "top1": list(self.top1)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WindowScores":
        return cls(nll=tuple(float(x) for x in d["nll"]), top1=tuple(int(x) for x in d["top1"]))


def scores_from_prompt_logprobs(token_ids: Sequence[int],
                                prompt_logprobs: Sequence[Optional[Mapping[int, Any]]]) -> WindowScores:
    """Build :class:`WindowScores` from one vLLM ``RequestOutput.prompt_logprobs``.

    ``prompt_logprobs[t]`` maps token id -> object with ``.logprob`` and ``.rank`` (vLLM's
    ``Logprob``); entry 0 is ``None``. Raises ``ValueError`` if vLLM did not return what was asked.
    """
    if len(prompt_logprobs) != len(token_ids):
        raise ValueError(f"got {len(prompt_logprobs)} prompt log-prob entries for {len(token_ids)} tokens")
    nll, top1 = [], []
    for t in range(1, len(token_ids)):
        entry = prompt_logprobs[t]
        if not entry or token_ids[t] not in entry:
            raise ValueError(f"position {t}: no log-prob for the prompt token (ask prompt_logprobs>=1)")
        nll.append(-float(entry[token_ids[t]].logprob))
        best = [tok for tok, lp in entry.items() if getattr(lp, "rank", None) == 1]
        if not best:
            raise ValueError(f"position {t}: no rank-1 token in the prompt log-probs")
        top1.append(int(best[0]))
    return WindowScores(nll=tuple(nll), top1=tuple(top1))


@dataclass(frozen=True)
class Comparison:
    """A configuration against the reference over the same windows."""

    nll: float  # mean NLL of the configuration, nats/token
    delta_nll: Interval  # per-window mean delta NLL, 95% t-interval over windows
    delta_nll_token_se: float  # s.e. treating tokens as independent (optimistic; for comparison)
    top1_agreement: float  # fraction of positions whose argmax equals the reference's
    window_delta_nll: tuple[float, ...]
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {"nll": round(self.nll, 8), "delta_nll": self.delta_nll.to_dict(),
                "delta_nll_token_se": round(self.delta_nll_token_se, 8),
                "top1_agreement": round(self.top1_agreement, 8),
                "window_delta_nll": [round(x, 8) for x in self.window_delta_nll], "tokens": self.tokens}


def compare(ref: Sequence[WindowScores], other: Sequence[WindowScores]) -> Comparison:
    """Paired comparison of ``other`` against ``ref`` (same windows, same order)."""
    if len(ref) != len(other) or not ref:
        raise ValueError(f"need the same non-zero number of windows, got {len(ref)} and {len(other)}")
    window_d, diffs, agree, total_nll = [], [], 0, 0.0
    for r, o in zip(ref, other):
        if len(r.nll) != len(o.nll):
            raise ValueError("windows of different lengths cannot be paired")
        d = [b - a for a, b in zip(r.nll, o.nll)]
        diffs.extend(d)
        window_d.append(sum(d) / len(d))
        agree += sum(a == b for a, b in zip(r.top1, o.top1))
        total_nll += sum(o.nll)
    n = len(diffs)
    mean = sum(diffs) / n
    token_se = (sum((x - mean) ** 2 for x in diffs) / (n - 1) / n) ** 0.5 if n > 1 else 0.0
    return Comparison(nll=total_nll / n, delta_nll=mean_interval(window_d), delta_nll_token_se=token_se,
                      top1_agreement=agree / n, window_delta_nll=tuple(window_d), tokens=n)


def ratio_to(num: Comparison, den: Comparison) -> dict[str, float]:
    """``delta NLL(num) / delta NLL(den)`` with a window-bootstrap 95% interval."""
    point, lo, hi = bootstrap_ratio(num.window_delta_nll, den.window_delta_nll)
    return {"ratio": round(point, 6), "lo": round(lo, 6), "hi": round(hi, 6)}

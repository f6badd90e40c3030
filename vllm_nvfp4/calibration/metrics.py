"""Damage of a quantized forward against the reference: next-token KL and delta NLL.

For each scored position ``t`` (predicting token ``t+1`` of a window):
``kl_t = sum_v p_ref(v) * (log p_ref(v) - log p_q(v))`` (nats) and
``dnll_t = -log p_q(x_{t+1}) + log p_ref(x_{t+1})`` (nats) and ``top1_t = [argmax p_q = argmax
p_ref]``. Reported values are means over all scored positions of all windows; ``dnll_se`` is the
standard error of the mean of the paired per-token differences (the statistical noise of ``dnll``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch

CHUNK = 512  # positions per log_softmax chunk: bounds the fp32 working set to CHUNK x vocab


@dataclass(frozen=True)
class Reference:
    """Reference log-probs of one window: ``logp [T-1, vocab]`` fp32 and ``nll [T-1]``."""

    logp: torch.Tensor
    nll: torch.Tensor
    targets: torch.Tensor  # [T-1] next tokens


@dataclass(frozen=True)
class Metrics:
    """Damage of one configuration (means over tokens, nats/token)."""

    kl: float
    dnll: float
    dnll_se: float
    nll: float
    tokens: int
    seconds: float = 0.0
    dnll_vs_base_se: Optional[float] = None  # s.e. of the paired NLL difference to a baseline policy
    top1: Optional[float] = None  # fraction of positions whose argmax is the reference's

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 8) if isinstance(v, float) else v) for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Metrics":
        return cls(**{k: d[k] for k in ("kl", "dnll", "dnll_se", "nll", "tokens")},
                   seconds=d.get("seconds", 0.0), dnll_vs_base_se=d.get("dnll_vs_base_se"),
                   top1=d.get("top1"))


def reference_from_logits(logits: torch.Tensor, ids: torch.Tensor) -> Reference:
    """``logits [T, vocab]`` (any float dtype) and ``ids [T]`` -> :class:`Reference`."""
    logp = torch.cat([c.float().log_softmax(-1) for c in logits[:-1].split(CHUNK)])
    targets = ids[1:]
    nll = -logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    return Reference(logp=logp, nll=nll, targets=targets)


def kl_divergence(logp_ref: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """``KL(p_ref || p_q)`` per row (nats) of log-probs ``[rows, vocab]`` fp32 -> ``[rows]``."""
    return (logp_ref.exp() * (logp_ref - logp_q)).sum(-1).clamp_min(0.0)  # rounding can give -1e-9


def per_token_damage(logits: torch.Tensor, ref: Reference) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kl [T-1], nll [T-1], top1 [T-1] bool)`` of ``logits [T, vocab]`` against ``ref``."""
    kls, nlls, agree = [], [], []
    for lq, lr, tg in zip(logits[:-1].split(CHUNK), ref.logp.split(CHUNK), ref.targets.split(CHUNK)):
        lq = lq.float().log_softmax(-1)
        kls.append(kl_divergence(lr, lq))
        nlls.append(-lq.gather(1, tg.unsqueeze(1)).squeeze(1))
        agree.append(lq.argmax(-1) == lr.argmax(-1))
    return torch.cat(kls), torch.cat(nlls), torch.cat(agree)


def _se(d: torch.Tensor) -> float:
    """Standard error of the mean of ``d`` (0 for a single value)."""
    return float(d.std(unbiased=True)) / math.sqrt(d.numel()) if d.numel() > 1 else 0.0


def summarize(kl: Sequence[torch.Tensor], nll: Sequence[torch.Tensor], top1: Sequence[torch.Tensor],
              refs: Sequence[Reference], seconds: float = 0.0,
              base_nll: Optional[Sequence[torch.Tensor]] = None) -> Metrics:
    """Aggregate per-window per-token KL / NLL / top-1 agreement into :class:`Metrics`.

    ``base_nll``: per-token NLL of a baseline policy on the same windows, for ``dnll_vs_base_se``.
    """
    kl_all = torch.cat(list(kl)).double()
    nll_all = torch.cat(list(nll)).double()
    d = nll_all - torch.cat([r.nll for r in refs]).double()
    vs_base = _se(nll_all - torch.cat(list(base_nll)).double()) if base_nll is not None else None
    return Metrics(kl=float(kl_all.mean()), dnll=float(d.mean()), dnll_se=_se(d),
                   nll=float(nll_all.mean()), tokens=d.numel(), seconds=seconds, dnll_vs_base_se=vs_base,
                   top1=float(torch.cat(list(top1)).double().mean()))

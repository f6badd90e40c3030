"""The sink key stored uncentered or centered, chosen by measurement where the user did not choose
(``tune`` without ``--[no-]k-sink-uncentered``, the start-up calibration).

The key at position 0 stored without the K centering offsets (``k_sink_uncentered``,
:mod:`vllm_nvfp4.policy.layer_policy`) helps one model and hurts another: through vLLM,
SmolLM2-135M's flag-only top-1 +0.019, Gemma 3 270M's all-NVFP4 -0.031 (docs/ACCURACY.md). So the
policy as calibrated (flagged where the first key fits the K range) and the same policy without
the flags are both scored by the caller's metric on its held-out windows, and the better one is
kept; a tie keeps the key centered (those layers run the decode kernel without the correction,
which is faster).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

from vllm_nvfp4.policy import KVPolicy

#: the two variants, as the record names them
UNCENTERED, CENTERED = "uncentered", "centered"


def has_sink_key(policy: KVPolicy) -> bool:
    """Whether some layer of ``policy`` stores its sink key uncentered (else nothing to choose)."""
    return any(lp.k_sink_uncentered is not None for lp in policy.layers)


def without_sink_key(policy: KVPolicy) -> KVPolicy:
    """``policy`` with every layer's sink key stored centered (the flags removed; all else kept)."""
    layers = tuple(lp if lp.k_sink_uncentered is None else replace(lp, k_sink_uncentered=None)
                   for lp in policy.layers)
    return replace(policy, layers=layers)


def choose(scores: Mapping[str, float], metric: str, **facts: Any) -> dict[str, Any]:
    """The record of the choice between ``scores[UNCENTERED]`` and ``scores[CENTERED]`` by
    ``metric`` (``"top1"``: agreement, higher is better; ``"kl"``, ``"dnll"``: damage, lower is
    better; a tie or a NaN keeps the key centered), with ``facts`` (e.g. tokens, windows)."""
    u, c = float(scores[UNCENTERED]), float(scores[CENTERED])
    better = u > c if metric == "top1" else u < c
    return {"metric": metric, UNCENTERED: round(u, 8), CENTERED: round(c, 8),
            "chosen": UNCENTERED if better else CENTERED, **facts}


def chosen_policy(policy: KVPolicy, record: Mapping[str, Any]) -> KVPolicy:
    """``policy`` (as calibrated, flags included) as the ``record`` of :func:`choose` keeps it."""
    return policy if record["chosen"] == UNCENTERED else without_sink_key(policy)


def sink_line(record: Optional[Mapping[str, Any]]) -> str:
    """The choice in words, for the log and ``tune``'s report ("" without a record)."""
    if not record:
        return ""
    return (f"sink key {record['chosen']} (measured {record['metric']}: uncentered "
            f"{record[UNCENTERED]:.4g}, centered {record[CENTERED]:.4g})")

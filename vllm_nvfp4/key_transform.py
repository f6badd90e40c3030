"""How the cache stores keys under a policy's K centering and K smoothing: one definition for
the serving integration and the calibration hook, so both round exactly alike."""

from __future__ import annotations

from typing import Optional

import torch


def stored_keys(key: torch.Tensor, center: Optional[torch.Tensor] = None,
                smooth: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(K - mu) / lam`` in FP32, cast back to ``key.dtype``.

    ``center`` (``mu``) and ``smooth`` (``lam``) are FP32 ``[kv_heads, head_dim]`` already shaped
    to broadcast against ``key`` (e.g. ``[kv_heads, 1, head_dim]`` for transformers'
    ``[batch, kv_heads, seq, head_dim]``); either may be None."""
    k = key.float()
    if center is not None:
        k = k - center
    if smooth is not None:
        k = k / smooth
    return k.to(key.dtype)

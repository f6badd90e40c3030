"""How the cache stores keys under a policy's K channel permutation, K centering and K smoothing:
one definition for the serving integration and the calibration hook, so both round exactly alike."""

from __future__ import annotations

from typing import Optional

import torch


def permute_channels(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` with channel ``perm[..., j]`` at position ``j``: ``perm`` holds int64 channel
    indices already shaped to broadcast against ``x`` (e.g. ``[kv_heads, D]`` for vLLM's
    ``[tokens, kv_heads, D]``, ``[kv_heads, 1, D]`` for transformers' ``[batch, kv_heads, seq,
    D]``). Exact (a gather)."""
    return x.gather(-1, perm.to(x.device).expand(x.shape))


def stored_keys(key: torch.Tensor, center: Optional[torch.Tensor] = None,
                smooth: Optional[torch.Tensor] = None,
                perm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(K[perm] - mu) / lam`` in FP32, cast back to ``key.dtype``.

    ``center`` (``mu``) and ``smooth`` (``lam``) are FP32 ``[kv_heads, head_dim]`` in the permuted
    channel order and ``perm`` int64 channel indices (:func:`permute_channels`), all already shaped
    to broadcast against ``key`` (e.g. ``[kv_heads, 1, head_dim]`` for transformers' ``[batch,
    kv_heads, seq, head_dim]``); any may be None."""
    k = key.float()
    if perm is not None:
        k = permute_channels(k, perm)
    if center is not None:
        k = k - center
    if smooth is not None:
        k = k / smooth
    return k.to(key.dtype)


def sink_shift(center: torch.Tensor, smooth: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What the readers subtract from the decoded key at position 0 where it is stored
    uncentered (``K[perm] / lam``, policy ``k_sink_uncentered``): ``mu / lam`` (``mu`` without
    smoothing) in FP32, ``[kv_heads, head_dim]`` like ``center``; ``q . (k0 / lam - mu / lam)``
    with the query times ``lam`` is then the centered logit ``q . (k0 - mu)``."""
    mu = center.float()
    return mu if smooth is None else mu / smooth.float()

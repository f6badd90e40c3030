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
                perm: Optional[torch.Tensor] = None,
                offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(K[perm] - mu - R(p) b_k) / lam`` in FP32, cast back to ``key.dtype``.

    ``center`` (``mu``) and ``smooth`` (``lam``) are FP32 ``[kv_heads, head_dim]`` in the permuted
    channel order and ``perm`` int64 channel indices (:func:`permute_channels`), all already shaped
    to broadcast against ``key`` (e.g. ``[kv_heads, 1, head_dim]`` for transformers' ``[batch,
    kv_heads, seq, head_dim]``); ``offset`` the rotating center of each key
    (:func:`rotating_offset`, policy ``k_rot``, never with ``perm`` or ``smooth``), FP32 shaped
    alike (e.g. ``[kv_heads, seq, head_dim]``); any may be None."""
    k = key.float()
    if perm is not None:
        k = permute_channels(k, perm)
    if center is not None:
        k = k - center
    if offset is not None:
        k = k - offset
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


def rotating_offset(idx: torch.Tensor, b: torch.Tensor, theta: torch.Tensor,
                    positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``R(p) b_k`` of policy ``k_rot`` (``RotCenter`` of :mod:`vllm_nvfp4.kernels.launch`):
    FP32 ``[kv_heads, len(positions), head_dim]`` on the device of ``positions``, zero but on
    each head's rotated pairs.

    ``idx`` (int) ``[kv_heads, k]``: pair ``i`` = channels ``(i, i + head_dim / 2)``; ``b`` FP32
    ``[kv_heads, 2, k]``: the pairs' first and second channels of ``b`` (attention scaling
    included); ``theta`` FP32 ``[kv_heads, k]`` (radians per position); ``positions`` int
    ``[seq]``: the keys' indices in their sequence. Channel ``i`` gets ``b_i cos - b_{i+D/2}
    sin`` and channel ``i + D/2`` ``b_i sin + b_{i+D/2} cos`` of the angle ``theta_i p``,
    computed in float64 from the FP32 ``theta`` (the angle reduced exactly, as the kernels'
    ``_cos_sin`` does; an FP32 angle is off by up to half its ulp, ~5e-4 rad at 1e4 rad)."""
    dev = positions.device
    ang = positions.to(torch.float64)[None, :, None] * theta.to(dev, torch.float64)[:, None, :]
    cos, sin = ang.cos().float(), ang.sin().float()  # [kv_heads, seq, k]
    b0, b1 = (b[:, j, None, :].to(dev, torch.float32) for j in (0, 1))  # [kv_heads, 1, k]
    half = head_dim // 2
    idx = idx.to(dev, torch.int64)[:, None, :].expand(-1, positions.numel(), -1)
    out = torch.zeros(b.shape[0], positions.numel(), head_dim, dtype=torch.float32, device=dev)
    out.scatter_(-1, idx, b0 * cos - b1 * sin)
    out.scatter_(-1, idx + half, b0 * sin + b1 * cos)
    return out

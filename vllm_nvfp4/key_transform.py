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
    kv_heads, seq, head_dim]``); any may be None. A rotating center (policy ``k_rot``,
    :func:`rot_offset`) is subtracted from this result in FP32 by the writer."""
    k = key.float()
    if perm is not None:
        k = permute_channels(k, perm)
    if center is not None:
        k = k - center
    if smooth is not None:
        k = k / smooth
    return k.to(key.dtype)


def key_centers(center: Optional[torch.Tensor], center0: Optional[torch.Tensor] = None,
                first: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The center of each written key: ``center`` (FP32 ``[kv_heads, head_dim]``, or None), or
    with ``center0`` (the same shape: the uncentered sink key's, policy ``k_sink_uncentered``)
    and ``first`` (bool ``[T]``, the tokens at position 0) ``[T, kv_heads, head_dim]``, taking
    ``center0`` where ``first``."""
    if center is None or center0 is None:
        return center
    return torch.where(first[:, None, None], center0, center)


def sink_shift(center: torch.Tensor, smooth: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What the readers subtract from the decoded key at position 0 where it is stored
    uncentered (``K[perm] / lam``, policy ``k_sink_uncentered``): ``mu / lam`` (``mu`` without
    smoothing) in FP32, ``[kv_heads, head_dim]`` like ``center``; ``q . (k0 / lam - mu / lam)``
    with the query times ``lam`` is then the centered logit ``q . (k0 - mu)``."""
    mu = center.float()
    return mu if smooth is None else mu / smooth.float()


def rot_offset(idx: torch.Tensor, b: torch.Tensor, theta: torch.Tensor,
               positions: torch.Tensor, head_dim: int,
               key0_plain: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rotating center ``R(p) b_k`` (policy ``k_rot``) of keys at ``positions`` (ints
    ``[T]``): FP32 ``[T, kv_heads, head_dim]``, 0 off the rotated pairs. ``idx`` ints ``[kv_heads,
    k]`` (pair ``i`` = channels ``(i, i + head_dim / 2)``), ``b`` ``[kv_heads, 2, k]`` (both
    halves), ``theta`` FP32 ``[kv_heads, k]`` (radians per position). Angles ``theta * p`` and the
    rotation are float64 (exact for the FP32 ``theta``), rounded once to FP32. ``key0_plain``
    (bool ``[kv_heads]``): those heads take no offset at position 0 (their sink key is stored
    uncentered). On the device of ``positions``."""
    dev = positions.device
    ang = positions.to(torch.float64)[:, None, None] * theta.to(dev, torch.float64)[None]  # [T, H, k]
    c, s = ang.cos(), ang.sin()
    b64 = b.to(dev, torch.float64)
    b1, b2 = b64[:, 0], b64[:, 1]  # [H, k]
    out = torch.zeros(ang.shape[0], ang.shape[1], head_dim, dtype=torch.float64,
                      device=ang.device)
    i = idx.to(device=ang.device, dtype=torch.long)[None].expand(ang.shape)
    out.scatter_(2, i, b1 * c - b2 * s)
    out.scatter_(2, i + head_dim // 2, b2 * c + b1 * s)
    if key0_plain is not None:
        skip = (positions.to(ang.device)[:, None] == 0) & key0_plain.to(ang.device)[None, :]
        out.masked_fill_(skip[..., None], 0.0)
    return out.float()

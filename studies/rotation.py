"""Orthogonal rotations along head_dim applied before the KV cache quantizes K and V.

A rotation ``R`` (orthogonal, ``[D, D]``) leaves attention exact: the cache stores ``k' = R k``
and the query is rotated alike, ``q' = R q``, so ``q' . k' = q . k``; the cache stores
``v' = R v`` and the attention output is rotated back, ``out = R^T (sum_j p_j v'_j)``. What
changes is what the quantizer sees: a Hadamard rotation spreads one large channel over all
channels of a block, so a single outlier no longer sets a coarse NVFP4 block scale for its 16
neighbours.

Kinds (all normalized so ``R R^T = I``):

* ``hadamard``: the Sylvester Walsh-Hadamard matrix of size ``D`` (``D`` a power of two).
* ``hadamard16``: block-diagonal, one 16 x 16 Walsh-Hadamard per NVFP4 block (mixes only
  within a block; ``D % 16 == 0``).
* ``random_hadamard``: ``H diag(s)`` with fixed pseudo-random signs ``s`` (seed 0), which breaks
  the structure a plain Hadamard shares with RoPE's channel pairing.

Tensors are row vectors along the last dim: ``x' = x R^T`` and back ``x = x' R``, in FP32, cast
back to the input dtype.
"""

from __future__ import annotations

import functools

import torch

from vllm_nvfp4.formats import NVFP4_BLOCK_SIZE

ROTATIONS = ("hadamard", "hadamard16", "random_hadamard")
_SIGN_SEED = 0


def _sylvester(n: int) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard matrix ``[n, n]`` of +-1 (``n`` a power of two)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=None)
def _matrix(kind: str, head_dim: int) -> torch.Tensor:
    if kind not in ROTATIONS:
        raise ValueError(f"unknown rotation {kind!r}; choose one of {', '.join(ROTATIONS)}")
    if head_dim <= 0 or head_dim % NVFP4_BLOCK_SIZE:
        raise ValueError(f"rotation {kind!r} needs head_dim a positive multiple of "
                         f"{NVFP4_BLOCK_SIZE}, got {head_dim}")
    if kind == "hadamard16":
        h = torch.block_diag(*[_sylvester(NVFP4_BLOCK_SIZE)] * (head_dim // NVFP4_BLOCK_SIZE))
        return (h / NVFP4_BLOCK_SIZE ** 0.5).float()
    if head_dim & (head_dim - 1):
        raise ValueError(f"rotation {kind!r} needs head_dim a power of two, got {head_dim}; "
                         "use hadamard16")
    h = _sylvester(head_dim) / head_dim ** 0.5
    if kind == "random_hadamard":
        gen = torch.Generator().manual_seed(_SIGN_SEED)
        signs = torch.randint(0, 2, (head_dim,), generator=gen).double() * 2 - 1
        h = h * signs  # H diag(s): column j times s_j
    return h.float()


def rotation_matrix(kind: str, head_dim: int) -> torch.Tensor:
    """The orthogonal FP32 matrix ``R [head_dim, head_dim]`` of ``kind`` (see module doc)."""
    return _matrix(kind, head_dim).clone()


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` -> ``x R^T`` (each row vector rotated), FP32 math, ``x.dtype`` out."""
    return (x.float() @ matrix.to(x.device).T).to(x.dtype)


def unrotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``x [..., D]`` -> ``x R``, FP32 math, ``x.dtype`` out."""
    return (x.float() @ matrix.to(x.device)).to(x.dtype)

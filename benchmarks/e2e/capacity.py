"""KV-cache capacity arithmetic: bytes per token of each configuration, largest batch, stages.

Bytes per token of ``nvfp4_mixed`` come from the library (:meth:`KVPolicy.kv_bytes_per_token`),
``fp8`` is the all-FP8 policy of the same library, ``auto`` stores the model's dtype.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from benchmarks.e2e.configs import CAPTURE_SIZES, CONFIGS, SMALL_BATCH, policy_for
from vllm_nvfp4.policy import KVPolicy


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry of a Hugging Face ``config.json``."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    dtype: str  # the model's torch dtype name, e.g. "bfloat16" (what kv_cache_dtype=auto stores)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelShape":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        return cls(num_layers=cfg["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   hidden=cfg["hidden_size"], vocab=cfg["vocab_size"],
                   dtype=cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")


def kv_bytes_per_token(kv_cache_dtype: str, shape: ModelShape, policy: Optional[str] = None) -> int:
    """Cache bytes one token occupies over all layers (K + V, NVFP4 block scales included)."""
    if kv_cache_dtype == "auto":
        itemsize = getattr(torch, shape.dtype).itemsize
        return 2 * itemsize * shape.head_dim * shape.num_kv_heads * shape.num_layers
    if kv_cache_dtype == "fp8":
        policy = "*:fp8"
    elif kv_cache_dtype != "nvfp4_mixed":
        raise ValueError(f"no bytes-per-token rule for kv_cache_dtype {kv_cache_dtype!r}")
    if policy is None:
        raise ValueError("nvfp4_mixed needs a policy to count its bytes per token")
    pol = KVPolicy.from_compact(policy, shape.num_layers)
    return pol.kv_bytes_per_token(num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)


def bytes_per_token_by_config(shape: ModelShape, mixed_override: Optional[str] = None
                              ) -> dict[str, int]:
    """:func:`kv_bytes_per_token` of every configuration of the matrix."""
    return {name: kv_bytes_per_token(c.kv_cache_dtype, shape,
                                     policy_for(c, shape.num_layers, mixed_override))
            for name, c in CONFIGS.items()}


def max_batch(capacity_tokens: int, context: int, headroom: int, block_size: int,
              cap: int = CAPTURE_SIZES[-1]) -> int:
    """Largest number of sequences of ``context + headroom`` tokens the block pool holds."""
    per_seq = math.ceil((context + headroom) / block_size)
    return max(0, min(cap, (capacity_tokens // block_size) // per_seq))


def estimate_batch(kv_bytes: float, bytes_per_token: float, context: int, headroom: int,
                   block_size: int, cap: int = CAPTURE_SIZES[-1]) -> int:
    """:func:`max_batch` of another dtype given this engine's KV bytes (same memory setting)."""
    return max_batch(int(kv_bytes // bytes_per_token), context, headroom, block_size, cap)


def plan_stages(own_max: int, ref_batch: Optional[int], small: int = SMALL_BATCH
                ) -> list[tuple[str, int]]:
    """Decode stages at one context: (label, batch), growing, deduplicated, each <= own_max.

    Labels: ``16`` (a small batch), ``ref`` (the reference's largest batch), ``max`` (this
    configuration's largest batch), joined with ``+`` where batches coincide.
    """
    wanted: dict[int, list[str]] = {}
    for label, b in (("16", small), ("ref", ref_batch), ("max", own_max)):
        if b and 0 < b <= own_max:
            wanted.setdefault(int(b), []).append(label)
    return [("+".join(labels), b) for b, labels in sorted(wanted.items())]

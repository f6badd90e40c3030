"""A policy with the rotating K center (``k_rot``) on synthetic values, for engines with random
weights: tests of the serving path and decode-time benchmarks (the kernels' work does not depend
on the values, only on the formats and the number of pairs).

Per layer and KV head: ``b`` random, its ``pairs`` largest-``|b_pair|`` RoPE pairs rotated with
the model's angles (``rope_theta ** (-2i / head_dim)``, no RoPE scaling), ``k_center`` random
with zeros on the rotated pairs' channels (docs/design/rotating_centering.md, section 1).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Optional, Sequence

import torch

from vllm_nvfp4.policy import KRot, KVPolicy, LayerPolicy

Rot = Optional[Literal["random", "zero"]]


def rope_geometry(config: Mapping[str, Any]) -> tuple[int, int, int, float]:
    """(layers, KV heads, head_dim, RoPE base) of a Hugging Face ``config.json`` dict."""
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    return config["num_hidden_layers"], config["num_key_value_heads"], int(d), float(base)


def synthetic_rot_policy(config: Mapping[str, Any], formats: Sequence[tuple[str, str]],
                         pairs: int = 8, rot: Rot = "random", seed: int = 0,
                         sink_uncentered_layers: Sequence[int] = (),
                         meta: Optional[dict[str, Any]] = None) -> KVPolicy:
    """Centered K on every layer, with a :class:`KRot` of ``pairs`` pairs per head (``rot``:
    ``"random"`` its ``b``, ``"zero"`` ``b = 0``, None: no ``k_rot``, the same ``k_center``).

    ``formats``: (K, V) format names per layer (``"fp8"`` / ``"nvfp4"``), one per layer of
    ``config``. ``sink_uncentered_layers``: layers whose first KV head stores its sink key
    uncentered. Default scales.
    """
    from vllm_nvfp4.kernels.launch import RotCenter

    layers, heads, d, base = rope_geometry(config)
    RotCenter.check_pairs(pairs, d)  # what the attention kernels take
    if len(formats) != layers:
        raise ValueError(f"formats has {len(formats)} entries; the model has {layers} layers")
    theta = (base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)).float()  # inv_freq
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, (kf, vf) in enumerate(formats):
        b = torch.randn(heads, d, generator=gen) * 0.5 + 0.05
        center = RotCenter.top_pairs(b, theta, pairs)
        mu = torch.randn(heads, d, generator=gen) * 0.3 + 0.05
        for h in range(heads):
            idx = center.idx[h].long()
            mu[h, idx] = 0.0
            mu[h, idx + d // 2] = 0.0
        k_rot = None
        if rot is not None:
            rb = center.b if rot == "random" else torch.zeros_like(center.b)
            k_rot = KRot(tuple(map(tuple, center.idx.tolist())),
                         tuple(tuple(map(tuple, r)) for r in rb.tolist()),
                         tuple(map(tuple, center.theta.tolist())))
        sink = [True] + [False] * (heads - 1) if i in sink_uncentered_layers else None
        rows.append(LayerPolicy(kf, vf, k_center=mu.tolist(), k_rot=k_rot, k_sink_uncentered=sink))
    return KVPolicy(tuple(rows), dict(meta or {"synthetic": "k_rot"}))

"""A layer's policy row on one tensor-parallel rank: the values of the rank's KV heads.

Per-KV-head lists (scales, K smoothing factors, K centering offsets, K channel permutations) are
split across the ranks when there are at least as many KV heads as ranks, else each rank gets the
one KV head it replicates. The results are the lists the impl copies into its persistent tensors (channel
indices of :data:`INDEX_FIELDS` as int64, the rest FP32). A layer whose sink key is stored
uncentered (``k_sink_uncentered``) also gets what position 0 is written and read with.
"""

from __future__ import annotations

from typing import Optional, Sequence, TypeVar

import torch

from vllm_nvfp4.formats import KVFormat
from vllm_nvfp4.key_transform import rot_offset, sink_shift
from vllm_nvfp4.policy import CHANNEL_FIELDS, LayerPolicy, Scale

T = TypeVar("T")
#: the impl's per-layer tensors of channel indices (int64)
INDEX_FIELDS = ("k_perm", "q_perm")
#: the impl's per-layer int32 tensors (the rotating center's pairs and per-head flags); every
#: tensor in neither tuple is FP32
INT32_FIELDS = ("rot_idx", "key0_plain")


def rank_heads(per_head: Sequence[T], total_heads: int, num_heads: int, tp_rank: int,
               tp_size: int) -> list[T]:
    """This rank's entries of a per-KV-head list (heads split across ranks, or replicated)."""
    if total_heads >= tp_size:
        return list(per_head[tp_rank * num_heads:(tp_rank + 1) * num_heads])
    return [per_head[tp_rank * total_heads // tp_size]] * num_heads


def rank_scales(scale: Optional[Scale], fmt: KVFormat, total_heads: int, num_heads: int,
                tp_rank: int, tp_size: int) -> list[float]:
    """This rank's per-KV-head scales from a policy entry (None: the documented default)."""
    if scale is None:
        return [KVFormat.parse(fmt).default_scale] * num_heads
    if not isinstance(scale, tuple):
        return [float(scale)] * num_heads
    return rank_heads(scale, total_heads, num_heads, tp_rank, tp_size)


def rank_row_values(row: LayerPolicy, layer_name: str, total_heads: int, num_kv_heads: int,
                    num_heads: int, head_size: int, tp_rank: int,
                    tp_size: int) -> dict[str, list]:
    """The impl's per-layer tensors of ``row`` on this rank, by attribute name, as lists:
    ``k_scale``/``v_scale`` ``[num_kv_heads]``; where the row has them, ``k_smooth``/``k_center``/
    ``k_perm`` ``[num_kv_heads][head_size]`` and ``q_smooth``/``q_perm`` ``[num_heads][head_size]``
    (each query head takes the rows of its KV head); with ``k_sink_uncentered``, ``k0_center``
    (the center position 0 is stored with: 0 for the flagged heads, ``k_center`` for the others)
    and ``key0_shift`` (what readers subtract from position 0's decoded key:
    :func:`~vllm_nvfp4.key_transform.sink_shift` for the flagged heads, 0 for the others),
    ``[num_kv_heads][head_size]`` FP32 values. With ``k_rot``: ``rot_idx`` / ``rot_b`` /
    ``rot_theta`` (:class:`~vllm_nvfp4.kernels.launch.RotCenter`: ``[num_kv_heads][k]``,
    ``[num_kv_heads][2][k]``, ``[num_kv_heads][k]``); with both, ``key0_shift`` of a flagged head
    adds ``R(0) b_k = b_k`` (its key at position 0 is written without it, readers add it to every
    key) and ``key0_plain`` ``[num_kv_heads]`` (1: the flagged heads) tells the writer."""
    values: dict[str, list] = {
        f"{kv}_scale": rank_scales(row.quant_scale(kv), row.format_of(kv), total_heads,
                                   num_kv_heads, tp_rank, tp_size) for kv in ("k", "v")}
    for name in CHANNEL_FIELDS:
        rows = getattr(row, name)
        if rows is None:
            continue
        rows = rank_heads(rows, total_heads, num_kv_heads, tp_rank, tp_size)
        if len(rows[0]) != head_size:
            raise RuntimeError(f"{layer_name}: the policy's {name} has {len(rows[0])} values "
                               f"per head, the layer's head size is {head_size}")
        values[name] = rows
    rot = row.k_rot
    if rot is not None:
        for name, rows in (("rot_idx", rot.pairs), ("rot_b", rot.b), ("rot_theta", rot.theta)):
            values[name] = [list(map(list, r)) if name == "rot_b" else list(r)
                            for r in rank_heads(rows, total_heads, num_kv_heads, tp_rank, tp_size)]
    sink = row.sink_heads(total_heads)
    if sink is not None:
        flagged = torch.tensor(rank_heads(sink, total_heads, num_kv_heads, tp_rank, tp_size))
        mu = torch.tensor(values["k_center"], dtype=torch.float32)
        lam = torch.tensor(values["k_smooth"], dtype=torch.float32) if "k_smooth" in values else None
        shift = sink_shift(mu, lam)
        if rot is not None:  # + R(0) b_k: b_k scattered onto its pairs' channels
            shift = shift + rot_offset(torch.tensor(values["rot_idx"]), torch.tensor(values["rot_b"]),
                                       torch.tensor(values["rot_theta"]), torch.zeros(1),
                                       head_size)[0]
            values["key0_plain"] = flagged.int().tolist()
        values["k0_center"] = torch.where(flagged[:, None], 0.0, mu).tolist()
        values["key0_shift"] = torch.where(flagged[:, None], shift, 0.0).tolist()
    group = num_heads // num_kv_heads
    for k_name, q_name in (("k_smooth", "q_smooth"), ("k_perm", "q_perm")):
        if k_name in values:
            values[q_name] = [r for r in values[k_name] for _ in range(group)]
    return values

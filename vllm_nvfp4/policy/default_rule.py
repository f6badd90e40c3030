"""The policy a model gets when none is given.

Sliding-window layers FP8 (their cache is bounded by the window, so NVFP4 would save little there,
and every token passes through them); of the full-attention layers the first and the last FP8,
the others NVFP4. A model whose KV layers are all sliding-window (Mistral with a window) applies
the first/last rule to those instead. Layers keep the default scales of
:mod:`~vllm_nvfp4.policy.layer_policy`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from vllm_nvfp4.policy.errors import PolicyError
from vllm_nvfp4.policy.kv_policy import KVPolicy
from vllm_nvfp4.policy.layer_types import FULL_ATTENTION, LayerType


def growing_layers(layer_types: Sequence[LayerType]) -> list[int]:
    """The layers whose cache grows with the context, where the rule chooses formats: the
    full-attention KV layers, or every KV layer when none is full (the others stay FP8)."""
    kv = [i for i, t in enumerate(layer_types) if t.holds_kv]
    return [i for i in kv if layer_types[i].kind == "full"] or kv


def default_rule_text(layer_types: Sequence[LayerType]) -> tuple[str, str]:
    """``(compact policy, its source)`` of the default rule (module doc) for ``layer_types``:
    sliding layers FP8; of the growing layers (the full-attention ones, or all KV layers if none
    is full) the first and last FP8, the others NVFP4; everything FP8 when there are at most
    two growing layers."""
    types = tuple(layer_types)
    kv = [i for i, t in enumerate(types) if t.holds_kv]
    if not kv:
        raise PolicyError("the model has no layer with a KV cache; nvfp4_mixed has nothing to store")
    growing = growing_layers(types)
    if len(growing) <= 2:
        return "*:fp8", "default rule"
    if len(growing) == len(kv):
        return f"{growing[0]}:fp8,{growing[-1]}:fp8,*:nvfp4", "default rule (first/last FP8)"
    return (f"{growing[0]}:fp8,{growing[-1]}:fp8,swa:fp8,full:nvfp4",
            "default rule (sliding FP8, first/last full-attention FP8)")


def default_policy(num_layers: int, layer_types: Optional[Sequence[LayerType]] = None) -> KVPolicy:
    """The policy of :func:`default_rule_text` (all layers full attention without
    ``layer_types``)."""
    types = tuple(layer_types) if layer_types is not None else (FULL_ATTENTION,) * num_layers
    text, source = default_rule_text(types)
    return KVPolicy.from_compact(text, num_layers, source=source, layer_types=types)

"""The RoPE of a model loaded in vLLM as the start-up calibration's rotating K center needs it
(policy ``k_rot``, docs/design/rotating_centering.md): the counterpart of
:func:`~vllm_nvfp4.calibration.rope.model_rope` for vLLM's model classes.

vLLM's attention modules (``LlamaAttention`` and the like) hold the rotary embedding that rotates
their q and k before the attention layer (``rotary_emb``, from ``get_rope``; one object shared by
every layer of the same RoPE). Its angles are ``p * inv_freq`` with ``inv_freq`` from the
object's own ``_compute_inv_freq`` (each scaling type overrides it: Llama 3, YaRN, ...), called
with the attribute its parameter names (``base`` or ``scaling_factor``), and its cos and sin
carry ``mscale`` (YaRN's attention scaling; 1 for most). The result is checked against the
module's ``cos_sin_cache`` (what the model rotates with), which rejects the types whose angles are
not ``p * inv_freq`` (linear position scaling, dynamic NTK, LongRoPE). Refused, in words: M-RoPE,
a layout other than neox (rotate-half pairs ``(i, i + D/2)``), a rotary dimension below the head
dimension, and RoPEs that differ between layers (Gemma 3's local and global layers), as the
offline calibration refuses them.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence, Union

import torch

from vllm_nvfp4.calibration.rope import Rope, _cos_sin

#: positions of the cos/sin table compared with ``cos/sin(p * inv_freq) * mscale``
CHECK_POSITIONS = 64
#: the comparison's tolerance in units of the table dtype's epsilon (times ``mscale``)
CHECK_EPS = 8.0
#: the attributes passed to ``_compute_inv_freq`` by the name of its parameter
_INV_FREQ_ARGS = ("base", "scaling_factor")


def rotary_of(model: torch.nn.Module, layer_name: str) -> Optional[torch.nn.Module]:
    """The rotary embedding of the attention layer ``layer_name`` (its name in the forward
    context, e.g. ``model.layers.0.self_attn.attn``): ``rotary_emb`` of the module that holds
    the layer; None where there is none."""
    parent = layer_name.rpartition(".")[0]
    try:
        holder = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    emb = getattr(holder, "rotary_emb", None)
    return emb if isinstance(emb, torch.nn.Module) else None


def module_rope(emb: torch.nn.Module, head_dim: int) -> Union[Rope, str]:
    """One vLLM rotary embedding's :class:`~vllm_nvfp4.calibration.rope.Rope` where the rotating
    K center fits it, else the reason it does not, in words (module doc)."""
    from vllm.model_executor.layers.rotary_embedding import MRotaryEmbedding

    kind = type(emb).__name__
    if isinstance(emb, MRotaryEmbedding):
        return f"its RoPE is M-RoPE ({kind}: several position ids per token)"
    if not getattr(emb, "is_neox_style", False):
        return (f"its RoPE ({kind}) does not pair channels (i, i + head_dim/2) (is_neox_style "
                "is not set)")
    rotary_dim = getattr(emb, "rotary_dim", None)
    if rotary_dim != head_dim:
        return f"its RoPE rotates {rotary_dim} of the {head_dim} channels of a head (partial rotary)"
    compute = getattr(emb, "_compute_inv_freq", None)
    params = list(inspect.signature(compute).parameters) if callable(compute) else []
    if len(params) != 1 or params[0] not in _INV_FREQ_ARGS or not hasattr(emb, params[0]):
        return f"its RoPE ({kind}) has no _compute_inv_freq(base) or _compute_inv_freq(scaling_factor)"
    inv_freq = compute(getattr(emb, params[0])).detach().float().cpu()
    scaling = float(getattr(emb, "mscale", 1.0))
    if inv_freq.dim() != 1 or 2 * inv_freq.numel() != head_dim:
        return f"its RoPE ({kind}) has {inv_freq.numel()} frequencies for a head of {head_dim} channels"
    if not bool(torch.isfinite(inv_freq).all()) or not bool((inv_freq > 0).all()):
        return "its RoPE frequencies are not all finite and > 0"
    problem = _table_mismatch(emb, inv_freq, scaling)
    if problem is not None:
        return f"its RoPE ({kind}) {problem}"
    return Rope(inv_freq, scaling)


def _table_mismatch(emb: torch.nn.Module, inv_freq: torch.Tensor, scaling: float) -> Optional[str]:
    """Why the module's ``cos_sin_cache`` (``[positions, rotary_dim]``: cos, then sin of every
    pair) is not ``cos/sin(p * inv_freq) * scaling`` at the first :data:`CHECK_POSITIONS`
    positions; None where it is."""
    table = getattr(emb, "cos_sin_cache", None)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] != 2 * inv_freq.numel():
        return "has no cos/sin table of one row per position"
    rows = min(CHECK_POSITIONS, table.shape[0])
    cos, sin = _cos_sin(torch.arange(rows), inv_freq, scaling)
    half = inv_freq.numel()
    want = torch.cat([cos[:, :half], sin[:, :half]], dim=-1)
    got = table[:rows].detach().float().cpu()
    tol = CHECK_EPS * torch.finfo(table.dtype).eps * max(1.0, abs(scaling))
    err = float((got - want).abs().max())
    if err > tol:
        return (f"rotates by other angles than p * inv_freq from its _compute_inv_freq (cos/sin "
                f"table off by {err:.3g}; position scaling such as linear or dynamic NTK)")
    return None


def vllm_rope(model: torch.nn.Module, layer_names: Sequence[str], head_dim: int,
              uses_mrope: bool = False) -> Union[Rope, str]:
    """The RoPE of the attention layers ``layer_names`` of ``model`` (vLLM's, e.g. the runner's
    ``get_model()``) where the rotating K center fits it: every layer's rotary embedding fits
    (:func:`module_rope`) and all have the same frequencies and scaling. Else the reason it
    does not fit, in words. ``uses_mrope``: vLLM's ``ModelConfig.uses_mrope``."""
    if uses_mrope:
        return "its RoPE is M-RoPE (several position ids per token)"
    if not layer_names:
        return "it has no attention layers"
    found: dict[int, Any] = {}
    for name in layer_names:
        emb = rotary_of(model, name)
        if emb is None:
            return f"no rotary embedding (rotary_emb) beside its attention layer {name}"
        found.setdefault(id(emb), (name, emb))
    ropes = []
    for name, emb in found.values():
        rope = module_rope(emb, head_dim)
        if isinstance(rope, str):
            return rope
        ropes.append((name, rope))
    first_name, first = ropes[0]
    for name, rope in ropes[1:]:
        if rope.scaling != first.scaling or not torch.equal(rope.inv_freq, first.inv_freq):
            return (f"its layers have different RoPEs ({first_name} and {name}; a RoPE per "
                    "layer type, as Gemma 3's, is not supported)")
    return first

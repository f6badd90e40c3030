"""A Hugging Face model's RoPE as the rotating K center needs it (docs/design/rotating_centering.md):
its frequencies, the rotation and its inverse on ``[..., seq, head_dim]`` tensors, and the
positions of the keys an attention call gets.

The rotating center (policy ``k_rot``) rotates pair ``i`` = channels ``(i, i + head_dim / 2)``
by ``theta_i p`` (transformers' ``rotate_half`` layout, "neox" in vLLM) with ``p`` the key's index
in its sequence. Models whose RoPE is laid out otherwise, covers only part of ``head_dim`` or
takes several position ids per token (M-RoPE) get no ``k_rot`` (:func:`model_rope` says why).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Union

import torch

from vllm_nvfp4.calibration.hf_model import attention_modules, text_config


@dataclass(frozen=True)
class Rope:
    """A model's RoPE: ``inv_freq`` FP32 ``[head_dim / 2]`` (radians per position of each pair)
    and ``scaling``, the factor its cos and sin carry (YaRN's ``attention_scaling``; 1.0 for
    most)."""

    inv_freq: torch.Tensor
    scaling: float = 1.0


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
             scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [len(positions), head_dim]`` (FP32, times ``scaling``) as transformers builds
    them: the angles ``p * inv_freq`` repeated for both halves (rotate_half pairs ``(i, i + D/2)``)."""
    ang = positions.float()[:, None] * inv_freq.float().to(positions.device)[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos() * scaling, ang.sin() * scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                scaling: float = 1.0) -> torch.Tensor:
    """``R(p) x`` for ``x [..., seq, head_dim]`` at ``positions [seq]`` (FP32): the model's RoPE."""
    cos, sin = _cos_sin(positions.to(x.device), inv_freq, scaling)
    x = x.float()
    return x * cos + _rotate_half(x) * sin


def rope_unrotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  scaling: float = 1.0) -> torch.Tensor:
    """``R(p)^-1 x`` (FP32): the pre-RoPE key of a post-RoPE key ``x [..., seq, head_dim]`` at
    ``positions [seq]`` (the model's FP32 angles, so it inverts the model's own rotation)."""
    cos, sin = _cos_sin(positions.to(x.device), inv_freq, scaling)
    x = x.float()
    return (x * cos - _rotate_half(x) * sin) / (scaling * scaling)


def _rotary_module(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The decoder's shared rotary embedding (a module named ``rotary_emb`` with ``inv_freq``)."""
    for name, mod in model.named_modules():
        if name.split(".")[-1] == "rotary_emb" and isinstance(getattr(mod, "inv_freq", None), torch.Tensor):
            return mod
    return None


def _is_rotate_half(attention: torch.nn.Module) -> bool:
    """Whether the attention module's modeling file pairs channels ``(i, i + D/2)``: its
    ``rotate_half`` maps ``[x1, x2]`` to ``[-x2, x1]``."""
    fn = getattr(sys.modules.get(type(attention).__module__), "rotate_half", None)
    if fn is None:
        return False
    x = torch.arange(1.0, 9.0)
    try:
        return bool(torch.equal(fn(x), _rotate_half(x)))
    except Exception:  # noqa: BLE001 - another signature: not the layout we know
        return False


def model_rope(model: torch.nn.Module, head_dim: int) -> Union[Rope, str]:
    """The model's :class:`Rope` where the rotating K center fits it (rotate-half pairs over all
    of ``head_dim``, one position id per token), else the reason it does not, in words."""
    cfg = text_config(model)
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, attr, None)
        if isinstance(params, dict) and ("mrope_section" in params or params.get("mrope_interleaved")):
            return "its RoPE is M-RoPE (several position ids per token)"
    emb = _rotary_module(model)
    if emb is None:
        return ("no rotary embedding with one inv_freq for every layer found (rotary_emb; a "
                "RoPE per layer type, as Gemma 3's, is not supported)")
    inv_freq = emb.inv_freq.detach().float().cpu()
    if inv_freq.dim() != 1 or 2 * inv_freq.numel() != head_dim:
        return (f"its RoPE rotates {2 * inv_freq.numel()} of the {head_dim} channels of a head "
                "(partial rotary)")
    mods = attention_modules(model)
    if not mods or not _is_rotate_half(mods[0]):
        return "its RoPE does not pair channels (i, i + head_dim/2) (not rotate-half / neox)"
    if not bool(torch.isfinite(inv_freq).all()) or not bool((inv_freq > 0).all()):
        return "its RoPE frequencies are not all finite and > 0"
    return Rope(inv_freq, float(getattr(emb, "attention_scaling", 1.0)))


def key_positions(position_ids: Optional[torch.Tensor], seq: int,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """Positions (int64 ``[seq]``) of the ``seq`` keys an attention call gets, from the forward's
    ``position_ids [batch, queries]`` (every row alike: the calibration runs one sequence per
    forward): the last ``queries`` keys are the queries' own, earlier keys (a cache's) the
    consecutive positions before them. ``ValueError`` without position ids or with rows that
    differ."""
    if position_ids is None:
        raise ValueError("the attention call got no position_ids; the rotating K center needs "
                         "each key's position (models that do not pass them are not supported)")
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[0] > 1 and not bool((pos == pos[:1]).all()):
        raise ValueError("position_ids differ between the sequences of a batch; run one per forward")
    row = pos[0].to(device=device, dtype=torch.int64)
    if row.numel() >= seq:
        return row[-seq:]
    return torch.cat([torch.arange(seq - row.numel(), device=row.device) + row[0] - (seq - row.numel()), row])

"""The decoder structure of a Hugging Face causal LM that calibration hooks into: its text config,
its attention modules in layer order and its layer types (which layers hold a KV cache)."""

from __future__ import annotations

from typing import Any

import torch

from vllm_nvfp4.policy import LayerType, layer_types_from_config


def text_config(model: torch.nn.Module) -> Any:
    """The decoder's config (``get_text_config()`` for multimodal wrappers)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Attention modules of the KV-holding layers in layer order (modules with ``layer_idx`` and
    ``k_proj``/``v_proj``; linear-attention / Mamba layers have neither)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    return sorted(mods, key=lambda m: m.layer_idx)


def model_layer_types(model: torch.nn.Module) -> tuple[LayerType, ...]:
    """Per decoder layer, its :class:`~vllm_nvfp4.policy.LayerType` (from the config), checked
    against the attention modules found: the KV layers must be exactly those with K/V
    projections (``RuntimeError`` otherwise)."""
    types = layer_types_from_config(text_config(model))
    found = [m.layer_idx for m in attention_modules(model)]
    expected = [i for i, t in enumerate(types) if t.holds_kv]
    if found != expected:
        raise RuntimeError(
            f"{type(model).__name__}: attention modules with K/V projections sit at layers "
            f"{found}, but the config's layer types put the KV cache at layers {expected}")
    return types

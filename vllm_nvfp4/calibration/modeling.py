"""Load a Hugging Face causal LM for calibration and describe the shape of its KV cache."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from vllm_nvfp4.calibration.kv_hooks import attention_modules, model_layer_types, text_config
from vllm_nvfp4.policy import LayerType

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ModelError(ValueError):
    """The model directory is missing, unreadable or of an unsupported kind."""


@dataclass(frozen=True)
class ModelInfo:
    """What a policy depends on: decoder layers and their types, KV heads, head size, and the
    config it came from."""

    path: str
    num_layers: int  # decoder layers = policy rows (KV-holding or not)
    num_kv_heads: int
    head_dim: int
    dtype: str
    config_sha256: str
    max_positions: int
    layer_types: tuple[LayerType, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layer_types"] = [t.to_json() for t in self.layer_types]
        return out

    @property
    def kv_layers(self) -> list[int]:
        """Decoder layers that hold a KV cache (all of them in a dense model)."""
        return [i for i, t in enumerate(self.layer_types) if t.holds_kv]


def read_config(model_dir: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model directory (:class:`ModelError` if unreadable)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{model_dir}: cannot read config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{model_dir}/config.json is not a JSON object")
    return cfg


def config_sha256(model_dir: Path) -> str:
    """SHA-256 of ``config.json`` parsed and re-serialised with sorted keys (formatting-proof)."""
    return hashlib.sha256(json.dumps(read_config(model_dir), sort_keys=True).encode()).hexdigest()


def config_shape(model_dir: Path) -> tuple[Optional[int], Optional[int]]:
    """``(num_hidden_layers, max_position_embeddings)`` from ``config.json`` (text config if
    nested), for checking arguments before loading weights; ``None`` where absent."""
    cfg = read_config(model_dir)
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    layers, pos = cfg.get("num_hidden_layers"), cfg.get("max_position_embeddings")
    return (layers if isinstance(layers, int) else None, pos if isinstance(pos, int) else None)


def load_model(model_dir: str | Path, dtype: str = "bfloat16") -> tuple[torch.nn.Module, Any, ModelInfo]:
    """Load ``(model, tokenizer, info)`` from a local HF directory, eval mode, SDPA attention
    (eager where the architecture has no SDPA path, e.g. gpt-oss with its sinks)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a Hugging Face model directory (no config.json); "
                         "for SmolLM2 run: python scripts/prepare_assets.py smollm2")
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype],
                                                         attn_implementation="sdpa")
        except ValueError as e:  # gpt-oss: eager only (its sinks)
            if "scaled_dot_product_attention" not in str(e):
                raise
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype],
                                                         attn_implementation="eager")
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load {path} with transformers: {e}") from None
    model.eval()
    mods = attention_modules(model)
    if not mods:
        raise ModelError(f"{path}: no Llama/Qwen2/Mistral-style attention layers found")
    cfg = text_config(model)
    try:
        types = model_layer_types(model)
    except (RuntimeError, ValueError) as e:
        raise ModelError(f"{path}: {e}") from None
    info = ModelInfo(
        path=str(path.resolve()),
        num_layers=len(types),
        num_kv_heads=int(cfg.num_key_value_heads),
        head_dim=int(mods[0].head_dim),
        dtype=dtype,
        config_sha256=config_sha256(path),
        max_positions=int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 30,
        layer_types=types,
    )
    if info.head_dim % 16:
        raise ModelError(f"{path}: head_dim {info.head_dim} is not a multiple of 16; NVFP4 needs 16-blocks")
    return model, tokenizer, info

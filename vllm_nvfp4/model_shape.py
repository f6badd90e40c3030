"""The attention geometry of a model: what its KV-cache bytes, its policy and its page layout depend on.

One type for every reader: the vLLM integration builds it from the engine config
(:meth:`ModelShape.from_vllm_config`, per tensor-parallel rank), offline tools (accuracy
evaluation, benchmarks) from a Hugging Face ``config.json`` (:meth:`ModelShape.from_hf_config`,
one rank). Imports no vLLM.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Optional

from vllm_nvfp4.policy import LayerType, layer_types_from_config

#: bytes per element of the model dtypes an unquantized (``kv_cache_dtype=auto``) cache stores
MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: ``max_position_embeddings`` of a config that does not set it (transformers' Llama default)
DEFAULT_MAX_POSITIONS = 2048


class ModelShapeError(ValueError):
    """A model config that does not describe its attention geometry; the message says what is missing."""


@dataclass(frozen=True)
class ModelShape:
    """Layer count, KV heads (whole model and this rank), head size, dtype and context of a model."""

    num_layers: int  # decoder layers of the whole model = rows of the policy
    total_num_kv_heads: int  # of the whole model (a policy's per-head scales)
    num_kv_heads: int  # on this tensor-parallel rank (what one page holds)
    head_dim: int
    dtype: str  # the model's torch dtype name, a key of MODEL_DTYPE_BYTES
    max_positions: int  # max_position_embeddings
    block_size: Optional[int] = None  # tokens per KV-cache block (engine configs only)
    model_dir: Optional[str] = None  # the local model directory, if the model is one
    #: per decoder layer, from the config (:func:`~vllm_nvfp4.policy.layer_types_from_config`)
    layer_types: tuple[LayerType, ...] = ()

    @property
    def needs_packed_groups(self) -> bool:
        """Whether vLLM keeps the layers in more than one kind of KV-cache group (full and
        sliding-window layers, or attention next to Mamba / linear-attention state)."""
        return len({(t.kind, t.window) for t in self.layer_types}) > 1

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (layer types as their policy-JSON form)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["layer_types"] = [t.to_json() for t in self.layer_types]
        return out

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the model dtype (what ``kv_cache_dtype=auto`` stores)."""
        return MODEL_DTYPE_BYTES[self.dtype]

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "ModelShape":
        """The shape vLLM serves: its model, parallel and cache configs (this rank's KV heads)."""
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        return cls(
            num_layers=mc.get_total_num_hidden_layers(),
            total_num_kv_heads=mc.get_total_num_kv_heads(),
            num_kv_heads=mc.get_num_kv_heads(pc),
            head_dim=mc.get_head_size(),
            dtype=_dtype_name(mc.dtype, "vLLM model_config.dtype"),
            max_positions=int(getattr(mc.hf_text_config, "max_position_embeddings", None)
                              or DEFAULT_MAX_POSITIONS),
            block_size=vllm_config.cache_config.block_size,
            model_dir=mc.model if os.path.isdir(str(mc.model)) else None,
            layer_types=layer_types_from_config(mc.hf_text_config),
        )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], model_dir: Optional[str] = None) -> "ModelShape":
        """The shape of a parsed ``config.json`` (its ``text_config`` when nested), on one rank."""
        cfg = config.get("text_config") or config
        dtype = _dtype_name(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16", "config.json dtype")
        try:
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            return cls(
                num_layers=int(cfg["num_hidden_layers"]),
                total_num_kv_heads=kv_heads,
                num_kv_heads=kv_heads,
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                dtype=dtype,
                max_positions=int(cfg.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS),
                model_dir=model_dir,
                layer_types=layer_types_from_config(SimpleNamespace(**cfg)),
            )
        except KeyError as e:
            raise ModelShapeError(f"model config has no {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelShapeError(f"model config has a non-integer size ({e})") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelShape":
        """:meth:`from_hf_config` of ``model_dir/config.json``."""
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelShapeError(f"{model_dir}: cannot read config.json ({e})") from None
        if not isinstance(config, dict):
            raise ModelShapeError(f"{path} is not a JSON object")
        try:
            return cls.from_hf_config(config, str(model_dir))
        except ModelShapeError as e:
            raise ModelShapeError(f"{path}: {e}") from None


def _dtype_name(dtype: Any, what: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in MODEL_DTYPE_BYTES:
        raise ModelShapeError(f"{what} {dtype!r} is not one of {', '.join(MODEL_DTYPE_BYTES)}")
    return name

"""vllm_nvfp4.model_shape: the one model-geometry type, from a Hugging Face config and from vLLM's
engine config (they must agree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_nvfp4.model_shape import DEFAULT_MAX_POSITIONS, ModelShape, ModelShapeError
from vllm_nvfp4.policy import FULL_ATTENTION, LayerType

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}


def test_llama_config_derives_head_dim_and_keeps_one_rank():
    s = ModelShape.from_hf_config(LLAMA_8B)
    assert s == ModelShape(num_layers=32, total_num_kv_heads=8, num_kv_heads=8, head_dim=128,
                           dtype="bfloat16", max_positions=131072,
                           layer_types=(FULL_ATTENTION,) * 32)
    assert s.dtype_bytes == 2 and s.block_size is None and s.model_dir is None


def test_explicit_head_dim_nested_text_config_and_defaults():
    gemma_like = {"model_type": "gemma3", "text_config": {
        "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
        "hidden_size": 640, "head_dim": 256, "dtype": "float32"}}
    s = ModelShape.from_hf_config(gemma_like, model_dir="/m")
    assert (s.num_layers, s.total_num_kv_heads, s.head_dim, s.dtype, s.dtype_bytes) == (6, 4, 256, "float32", 4)
    assert s.max_positions == DEFAULT_MAX_POSITIONS and s.model_dir == "/m"
    mha = ModelShape.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 6, "hidden_size": 384})
    assert (mha.num_kv_heads, mha.head_dim, mha.dtype) == (6, 64, "bfloat16")  # MHA, bf16 default


def test_bad_configs_say_what_is_wrong(tmp_path: Path):
    with pytest.raises(ModelShapeError, match="no 'num_hidden_layers'"):
        ModelShape.from_hf_config({k: v for k, v in LLAMA_8B.items() if k != "num_hidden_layers"})
    with pytest.raises(ModelShapeError, match="non-integer"):
        ModelShape.from_hf_config({**LLAMA_8B, "num_key_value_heads": "eight"})
    with pytest.raises(ModelShapeError, match="dtype 'int8' is not one of bfloat16, float16, float32"):
        ModelShape.from_hf_config({**LLAMA_8B, "torch_dtype": "int8"})
    with pytest.raises(ModelShapeError, match="cannot read config.json"):
        ModelShape.from_model_dir(tmp_path / "missing")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelShapeError, match="not a JSON object"):
        ModelShape.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    with pytest.raises(ModelShapeError, match=r"config\.json: model config has no 'num_attention_heads'"):
        ModelShape.from_model_dir(tmp_path)


def test_vllm_engine_config_and_config_json_agree(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(tiny_model_dir), max_model_len=256, block_size=32).create_engine_config()
    served = ModelShape.from_vllm_config(config)
    offline = ModelShape.from_model_dir(tiny_model_dir)
    assert served.block_size == 32 and served.model_dir == str(tiny_model_dir)
    assert served == ModelShape(**{**offline.__dict__, "block_size": 32})
    assert (served.num_layers, served.num_kv_heads, served.head_dim, served.dtype) == (4, 2, 32, "bfloat16")


def test_to_json_is_json_with_typed_layers():
    """What evaluation writes into its results: plain JSON, each layer type in its policy form."""
    shape = ModelShape(num_layers=2, total_num_kv_heads=2, num_kv_heads=2, head_dim=64,
                       dtype="bfloat16", max_positions=4096,
                       layer_types=(LayerType("sliding", 128, True), LayerType()))
    data = json.loads(json.dumps(shape.to_json()))
    assert data["layer_types"] == [{"type": "sliding", "window": 128, "sinks": True},
                                   {"type": "full"}]
    assert data["num_layers"] == 2 and data["head_dim"] == 64 and data["model_dir"] is None

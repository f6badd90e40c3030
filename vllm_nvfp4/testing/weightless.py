"""Weight-less model directories of real geometries, for speed benchmarks.

:func:`build_weightless_model` writes only ``config.json``, ``generation_config.json`` and a
byte-level tokenizer of a preset geometry (:data:`PRESETS`); vLLM runs it with
``load_format="dummy"`` (random weights initialised on the device). Architectures (a preset's
``arch``):

* ``llama``: ``LlamaForCausalLM`` (Llama-3.1-8B and smaller);
* ``gpt_oss``: ``GptOssForCausalLM`` as gpt-oss-20b: sliding window 128 on even layers, full
  attention on odd ones, attention sinks, MoE (bf16 experts: the dummy loader fills them; MoE
  runs on vLLM's fused-MoE kernels on the GPU);
* ``gemma3``: ``Gemma3ForCausalLM`` (text only) as Gemma-3-27B: five sliding-window (1024)
  layers to one global, per-type RoPE (global: linear scaling 8).

The hybrid configs are written by transformers' config classes (``GptOssConfig``,
``Gemma3TextConfig``), so they carry every field vLLM reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

from vllm_nvfp4.testing.models import llama_config
from vllm_nvfp4.testing.tokenizers import write_byte_tokenizer

WEIGHTLESS_MARKER = "random_model.json"
ARCHS = ("llama", "gpt_oss", "gemma3")

#: weight-less presets (:func:`build_weightless_model`): architecture, geometry, positions;
#: llama: llama3 RoPE scaling or not; gpt_oss: experts; gemma3 / gpt_oss: sliding ``window``
#: (layer pattern: module doc). ``*-tiny``: the same architecture and pattern, CPU-sized, with
#: enough full-attention layers (4, 3) that the default policy puts some in NVFP4.
PRESETS: dict[str, dict[str, Any]] = {
    "llama8b": dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                    intermediate=14336, vocab=128256, max_pos=131072, llama3_rope=True),
    "small": dict(arch="llama", layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128,
                  intermediate=2816, vocab=32000, max_pos=131072, llama3_rope=False),
    "tiny": dict(arch="llama", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32,
                 intermediate=256, vocab=512, max_pos=4096, llama3_rope=False),
    "gpt-oss-20b": dict(arch="gpt_oss", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64,
                        intermediate=2880, vocab=201088, max_pos=131072, window=128,
                        experts=32, experts_per_token=4),
    "gpt-oss-tiny": dict(arch="gpt_oss", layers=8, hidden=128, heads=4, kv_heads=2, head_dim=64,
                         intermediate=128, vocab=512, max_pos=4096, window=32, experts=4,
                         experts_per_token=2),
    "gemma3-27b": dict(arch="gemma3", layers=62, hidden=5376, heads=32, kv_heads=16, head_dim=128,
                       intermediate=21504, vocab=262208, max_pos=131072, window=1024,
                       query_pre_attn_scalar=168),
    "gemma3-tiny": dict(arch="gemma3", layers=18, hidden=128, heads=4, kv_heads=2, head_dim=32,
                        intermediate=256, vocab=512, max_pos=4096, window=32,
                        query_pre_attn_scalar=32),
}
#: transformers' names of the two attention types
_SLIDING, _FULL = "sliding_attention", "full_attention"


def build_weightless_model(out_dir: Union[str, os.PathLike], preset: str = "llama8b",
                           max_pos: Optional[int] = None) -> Path:
    """Write (or reuse, when the marker matches) a weight-less directory of ``preset``.

    ``config.json`` (bf16; :func:`model_config`), ``generation_config.json`` and a byte-level
    tokenizer; no weights (``load_format="dummy"``). ``max_pos`` overrides the preset's
    ``max_position_embeddings``.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = dict(PRESETS[preset])
    if max_pos:
        p["max_pos"] = int(max_pos)
    out = Path(out_dir)
    marker = out / WEIGHTLESS_MARKER
    args = dict(p, preset=preset, version=1)
    if marker.exists() and json.loads(marker.read_text()) == args:
        return out
    cfg = model_config(p)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2))
    write_byte_tokenizer(out, p["vocab"], p["max_pos"])
    marker.write_text(json.dumps(args, indent=2, sort_keys=True))
    return out


def layer_types(p: dict[str, Any]) -> list[str]:
    """transformers' ``layer_types`` of a hybrid preset: gpt-oss sliding on even layers (vLLM's
    gpt-oss fixes that pattern), Gemma 3 full on every sixth."""
    n = p["layers"]
    if p["arch"] == "gpt_oss":
        return [_SLIDING if i % 2 == 0 else _FULL for i in range(n)]
    if p["arch"] == "gemma3":
        return [_FULL if (i + 1) % 6 == 0 else _SLIDING for i in range(n)]
    raise ValueError(f"architecture {p['arch']!r} has no sliding layers")


def model_config(p: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of the preset ``p`` (a value of :data:`PRESETS`, ``max_pos`` applied)."""
    if p["arch"] not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {p['arch']!r}")
    if p["arch"] == "llama":
        return _llama(p)
    common = dict(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                  num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                  num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"],
                  max_position_embeddings=p["max_pos"], sliding_window=p["window"],
                  layer_types=layer_types(p), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if p["arch"] == "gpt_oss":
        from transformers import GptOssConfig

        cfg = GptOssConfig(**common, num_local_experts=p["experts"],
                           num_experts_per_tok=p["experts_per_token"],
                           architectures=["GptOssForCausalLM"]).to_dict()
    else:
        from transformers import Gemma3TextConfig

        rope = {_SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                _FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
        cfg = Gemma3TextConfig(**common, query_pre_attn_scalar=p["query_pre_attn_scalar"],
                               rope_parameters=rope, architectures=["Gemma3ForCausalLM"]).to_dict()
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    return cfg


def _llama(p: dict[str, Any]) -> dict[str, Any]:
    """Llama ``config.json``: RoPE theta 500000, llama3 scaling where the preset says so."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 500000.0}
    if p["llama3_rope"]:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    cfg = llama_config(p, "bfloat16", p["max_pos"], rope)
    cfg["transformers_version"] = "5.0.0"  # else transformers 5 warns about a Mistral regex
    if p["llama3_rope"]:  # transformers 4.x name of the same thing
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return cfg


def weight_bytes(preset: str) -> int:
    """bf16 bytes of a preset's weights (embedding, layers, norm, lm_head; gpt-oss: every
    expert, router and attention biases; Gemma 3: tied embeddings)."""
    p = PRESETS[preset]
    h, i, v, hd = p["hidden"], p["intermediate"], p["vocab"], p["head_dim"]
    attn = h * hd * (p["heads"] * 2 + p["kv_heads"] * 2)
    if p["arch"] == "gpt_oss":  # experts' gate_up (+ bias) and down (+ bias), router, sinks
        mlp = p["experts"] * (3 * h * i + 2 * i + h) + p["experts"] * (h + 1)
        attn += hd * (p["heads"] + 2 * p["kv_heads"]) + h + p["heads"]
    else:
        mlp = 3 * h * i
    norms = (4 if p["arch"] == "gemma3" else 2) * h
    embeddings = (1 if p["arch"] == "gemma3" else 2) * v * h
    return 2 * (embeddings + p["layers"] * (attn + mlp + norms) + h)

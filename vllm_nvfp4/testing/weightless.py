"""Weight-less Llama model directories of real geometries, for speed benchmarks.

:func:`build_weightless_model` writes only ``config.json``, ``generation_config.json`` and a
byte-level tokenizer of a preset geometry (:data:`PRESETS`, e.g. Llama-3.1-8B); vLLM runs it with
``load_format="dummy"`` (random weights initialised on the device).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

from vllm_nvfp4.testing.models import llama_config
from vllm_nvfp4.testing.tokenizers import write_byte_tokenizer

WEIGHTLESS_MARKER = "random_model.json"

#: weight-less presets (:func:`build_weightless_model`): geometry, positions, llama3 RoPE scaling
PRESETS: dict[str, dict[str, Any]] = {
    "llama8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                    intermediate=14336, vocab=128256, max_pos=131072, llama3_rope=True),
    "small": dict(layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128,
                  intermediate=2816, vocab=32000, max_pos=131072, llama3_rope=False),
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32,
                 intermediate=256, vocab=512, max_pos=4096, llama3_rope=False),
}


def build_weightless_model(out_dir: Union[str, os.PathLike], preset: str = "llama8b",
                           max_pos: Optional[int] = None) -> Path:
    """Write (or reuse, when the marker matches) a weight-less Llama directory of ``preset``.

    ``config.json`` (bf16, RoPE theta 500000; llama3 scaling where the preset says so),
    ``generation_config.json`` and a byte-level tokenizer; no weights (``load_format="dummy"``).
    ``max_pos`` overrides the preset's ``max_position_embeddings``.
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
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 500000.0}
    if p["llama3_rope"]:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    cfg = llama_config(p, "bfloat16", p["max_pos"], rope)
    cfg["transformers_version"] = "5.0.0"  # else transformers 5 warns about a Mistral regex
    if p["llama3_rope"]:  # transformers 4.x name of the same thing
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2))
    write_byte_tokenizer(out, p["vocab"], p["max_pos"])
    marker.write_text(json.dumps(args, indent=2, sort_keys=True))
    return out


def weight_bytes(preset: str) -> int:
    """bf16 bytes of a preset's weights (embedding + layers + norm + lm_head)."""
    p = PRESETS[preset]
    h, i, v, hd = p["hidden"], p["intermediate"], p["vocab"], p["head_dim"]
    attn = h * hd * (p["heads"] * 2 + p["kv_heads"] * 2)
    per_layer = attn + 3 * h * i + 2 * h
    return 2 * (2 * v * h + p["layers"] * per_layer + h)

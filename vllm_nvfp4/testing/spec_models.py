"""Models for speculative-decoding checks: a repetitive tiny Llama and an EAGLE head that echoes.

The repetitive model's greedy text has runs that ngram and draft proposals can hit and miss; the
EAGLE head mostly proposes the target's last token again. Both are random-weight, built from
:func:`vllm_nvfp4.testing.models.build_tiny_llama`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vllm_nvfp4.testing.models import build_tiny_llama

BRANCH_GAIN = 2.0  # residual-branch gain of the repetitive model


def repetitive_llama(dst: Path, head_dim: int = 32) -> Path:
    """The tiny float32 Llama (the CUDA kernels need ``head_dim >= 64``) with the LM head tied to
    the embeddings and o_proj / down_proj doubled: greedy text of runs of repeated tokens broken
    by the attention (drafts hit and miss). Written to ``dst``, from a base model beside it."""
    from safetensors.torch import load_file, save_file

    src = build_tiny_llama(dst.parent / f"base-h{head_dim}", head_dim=head_dim, dtype="float32")
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * BRANCH_GAIN
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def echo_eagle(target: Path, out: Path) -> Path:
    """A one-layer EAGLE head for ``target`` that mostly proposes the target's last token again.

    ``fc`` passes the target's hidden state through (``[0 | I]``), the layer is the target's
    layer 0 with ``o_proj`` scaled by 0.1 and the MLP off, so the shared LM head maps the hidden
    state back to the token the target just produced, nudged by the head's attention over its own
    (FP8, draft-rule) cache. On the repetitive model its drafts hit the runs of repeated tokens.
    """
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    src = load_file(str(target / "model.safetensors"))
    head = {k[len("model."):]: v.clone() for k, v in src.items()
            if k.startswith("model.layers.0.") and "input_layernorm" not in k}
    head["layers.0.self_attn.o_proj.weight"] *= 0.1
    head["layers.0.mlp.down_proj.weight"].zero_()
    hidden = cfg["hidden_size"]
    eye = torch.eye(hidden, dtype=src["model.embed_tokens.weight"].dtype)
    head["fc.weight"] = torch.cat([torch.zeros_like(eye), eye], dim=1)  # [H, 2H]: embed | hidden
    head["embed_tokens.weight"] = src["model.embed_tokens.weight"]
    save_file(head, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

"""Tiny random-weight hybrid / sliding-window models (Gemma 3, gpt-oss, Mistral with a window,
Qwen3-Next) built from the transformers config classes, for tests and demos.

:func:`build_tiny_hybrid` writes a model directory that vLLM and transformers load like a
downloaded one, with the tokenizer of :mod:`vllm_nvfp4.tiny_model`. Weights: the architecture's
own initializer with ``initializer_range = 1/sqrt(hidden)`` (unit-variance activations), the
query/key projections scaled by ``qk_gain`` (peaked attention, so the cached K/V matter), the
output head by 4, special-token rows of the head zero (greedy decoding does not stop early).
Results are cached like :func:`vllm_nvfp4.tiny_model.build_tiny_llama`'s.

Layer patterns (decoder-layer index: type), chosen so that the default policy puts some
full-attention layers in NVFP4 and a prompt of a few hundred tokens is longer than the window:

* ``gemma3``:  12 layers, two sliding (window 32) then one full, four times (vLLM's Gemma 3
  reads ``layer_types``), head_dim 32, 4 / 2 heads;
* ``gpt_oss``: 12 layers, sliding (window 32) on even layers, full on odd (vLLM's gpt-oss fixes
  this pattern), attention sinks, 4 experts top-2, head_dim 64, 4 / 2 heads;
* ``mistral``: 6 layers, all sliding (window 48), head_dim 32, 4 / 2 heads;
* ``qwen3_next``: 8 layers, Gated DeltaNet on 3 of 4, full attention on layers 3 and 7,
  head_dim 64, 4 / 2 heads, 4 experts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

from vllm_nvfp4.tiny_model import BUILD_VERSION, MARKER, _atomic_dir, cache_root, save_tokenizer, train_tokenizer

HYBRID_ARCHS = ("gemma3", "gpt_oss", "mistral", "qwen3_next")
HYBRID_BUILD = 1  # bump when the output of a given argument set changes
_ALTERNATING = ["sliding_attention", "full_attention"] * 6
_GEMMA_PATTERN = ["sliding_attention", "sliding_attention", "full_attention"] * 4


def _config(arch: str, vocab: int, max_pos: int) -> Any:
    """The transformers config of the tiny ``arch`` model (float32)."""
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=max_pos, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
                                  initializer_range=1.0 / math.sqrt(128))
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        cfg = Gemma3TextConfig(**common, num_hidden_layers=12, head_dim=32, sliding_window=32,
                               layer_types=list(_GEMMA_PATTERN), query_pre_attn_scalar=32,
                               architectures=["Gemma3ForCausalLM"])
    elif arch == "gpt_oss":
        from transformers import GptOssConfig

        common["intermediate_size"] = 128
        cfg = GptOssConfig(**common, num_hidden_layers=12, head_dim=64, sliding_window=32,
                           layer_types=list(_ALTERNATING), num_local_experts=4,
                           num_experts_per_tok=2, architectures=["GptOssForCausalLM"])
    elif arch == "mistral":
        from transformers import MistralConfig

        cfg = MistralConfig(**common, num_hidden_layers=6, head_dim=32, sliding_window=48,
                            architectures=["MistralForCausalLM"])
    elif arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig(**common, num_hidden_layers=8, head_dim=64,
                              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                              linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=32, linear_value_head_dim=32,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                              shared_expert_intermediate_size=64, decoder_sparse_step=1,
                              architectures=["Qwen3NextForCausalLM"])
    else:
        raise ValueError(f"arch must be one of {HYBRID_ARCHS}, got {arch!r}")
    cfg.dtype = "float32"
    return cfg


def _scale_weights(model: Any, qk_gain: float, seed: int) -> None:
    """In place: q/k projections x ``qk_gain``, head x 4 with zero special-token rows, sinks
    and norm weights drawn around their defaults."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        head = model.get_output_embeddings().weight
        head.mul_(4.0)
        head[:4] = 0.0


def build_tiny_hybrid(arch: str, out_dir: Optional[Union[str, os.PathLike]] = None,
                      vocab: int = 4096, seed: int = 0, max_pos: int = 4096,
                      qk_gain: float = 2.0) -> Path:
    """Write (or reuse) the tiny random-weight ``arch`` model (module doc) and return its path."""
    import torch

    if arch not in HYBRID_ARCHS:
        raise ValueError(f"arch must be one of {HYBRID_ARCHS}, got {arch!r}")
    args = dict(arch=arch, vocab=vocab, seed=seed, max_pos=max_pos, qk_gain=qk_gain,
                build_version=BUILD_VERSION, hybrid_build=HYBRID_BUILD)
    if out_dir is None:
        digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:10]
        out = cache_root() / "models" / f"tiny-{arch}-{digest}"
    else:
        out = Path(out_dir)
    marker = out / MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == args:
                return out
        except (OSError, ValueError):
            pass
    if out.exists() and any(out.iterdir()) and not marker.exists():
        raise FileExistsError(f"{out} exists, is not empty and was not made by build_tiny_hybrid")
    tok_path = train_tokenizer(vocab)

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_config(arch, vocab, max_pos), dtype=torch.float32)
        _scale_weights(model, qk_gain, seed)
        model.save_pretrained(str(tmp))
        save_tokenizer(tmp, tok_path, max_pos)
        (tmp / MARKER).write_text(json.dumps(args, indent=2, sort_keys=True))

    if out.exists():
        shutil.rmtree(out)
    return _atomic_dir(out, build)

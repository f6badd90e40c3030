"""Tiny random-weight hybrid and sliding-window models, from the transformers config classes.

:func:`build_tiny_hybrid` writes one (Gemma 3, gpt-oss, Mistral with a window, Qwen3-Next):
the architecture's own initializer with ``initializer_range = 1/sqrt(hidden)``, the q/k
projections times ``qk_gain``, the head times 4 with zero special-token rows. Layer
patterns, chosen so that the default policy puts some full-attention layers in NVFP4 and a
prompt of a few hundred tokens is longer than the window:

* ``gemma3``:  12 layers, two sliding (window 32) then one full, four times (vLLM's Gemma 3
  reads ``layer_types``), head_dim 32 (256 on CUDA), 4 / 2 heads;
* ``gpt_oss``: 12 layers, sliding (window 32) on even layers, full on odd (vLLM's gpt-oss fixes
  this pattern), attention sinks, 4 experts top-2, head_dim 64 (also on CUDA), 4 / 2 heads;
* ``mistral``: 6 layers, all sliding (window 48), head_dim 32 (128 on CUDA), 4 / 2 heads;
* ``qwen3_next``: 8 layers, Gated DeltaNet on 3 of 4 (head dims 128: the CPU kernel's),
  full attention on layers 3 and 7, head_dim 64 (256 on CUDA), 4 / 2 heads, 4 experts (vLLM's CPU build
  runs it in bfloat16 only).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from vllm_nvfp4.testing.model_cache import BUILD_VERSION, cached_build
from vllm_nvfp4.testing.tokenizers import save_tokenizer, train_tokenizer


HYBRID_ARCHS = ("gemma3", "gpt_oss", "mistral", "qwen3_next")
HYBRID_BUILD = 2  # bump when the output of a given argument set changes
_ALTERNATING = ["sliding_attention", "full_attention"] * 6
_GEMMA_PATTERN = ["sliding_attention", "sliding_attention", "full_attention"] * 4
_QWEN3_NEXT_PATTERN = (["linear_attention"] * 3 + ["full_attention"]) * 2


_CPU_HEAD_DIMS = {"gemma3": 32, "gpt_oss": 64, "mistral": 32, "qwen3_next": 64}
#: head_dim of each tiny hybrid model on CUDA (the GPU kernels need >= 64): the real models'
GPU_HEAD_DIMS = {"gemma3": 256, "gpt_oss": 64, "mistral": 128, "qwen3_next": 256}


def _hybrid_config(arch: str, vocab: int, max_pos: int, head_dim: Optional[int] = None,
                   layer_types: Optional[Sequence[str]] = None) -> Any:
    """The transformers config of the tiny ``arch`` model (float32); ``head_dim`` None: the
    small default of each architecture (module doc); ``layer_types`` (``qwen3_next`` only): its
    decoder layers' types, None for the module doc's."""
    if layer_types is not None and arch != "qwen3_next":
        raise ValueError(f"layer_types is for qwen3_next only, not {arch!r}")
    if arch not in _CPU_HEAD_DIMS:
        raise ValueError(f"arch must be one of {HYBRID_ARCHS}, got {arch!r}")
    head_dim = head_dim or _CPU_HEAD_DIMS[arch]
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=max_pos, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
                                  initializer_range=1.0 / math.sqrt(128))
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        cfg = Gemma3TextConfig(**common, num_hidden_layers=12, head_dim=head_dim, sliding_window=32,
                               layer_types=list(_GEMMA_PATTERN), query_pre_attn_scalar=head_dim,
                               architectures=["Gemma3ForCausalLM"])
    elif arch == "gpt_oss":
        from transformers import GptOssConfig

        common["intermediate_size"] = 128
        cfg = GptOssConfig(**common, num_hidden_layers=12, head_dim=head_dim, sliding_window=32,
                           layer_types=list(_ALTERNATING), num_local_experts=4,
                           num_experts_per_tok=2, architectures=["GptOssForCausalLM"])
    elif arch == "mistral":
        from transformers import MistralConfig

        cfg = MistralConfig(**common, num_hidden_layers=6, head_dim=head_dim, sliding_window=48,
                            architectures=["MistralForCausalLM"])
    else:
        from transformers import Qwen3NextConfig

        types = list(layer_types or _QWEN3_NEXT_PATTERN)
        cfg = Qwen3NextConfig(**common, num_hidden_layers=len(types), head_dim=head_dim,
                              layer_types=types,
                              linear_num_key_heads=1, linear_num_value_heads=2,
                              linear_key_head_dim=128, linear_value_head_dim=128,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                              shared_expert_intermediate_size=64, decoder_sparse_step=1,
                              architectures=["Qwen3NextForCausalLM"])
    cfg.dtype = "float32"
    return cfg


def _scale_hybrid_weights(model: Any, qk_gain: float, seed: int) -> None:
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
                      qk_gain: float = 2.0, head_dim: Optional[int] = None,
                      layer_types: Optional[Sequence[str]] = None) -> Path:
    """Write (or reuse) the tiny random-weight hybrid ``arch`` model (:data:`HYBRID_ARCHS`, see
    the module doc) and return its path; ``out_dir=None``: in the model cache (:mod:`.model_cache`).
    ``head_dim``: None for the module doc's; :data:`GPU_HEAD_DIMS` for the CUDA kernels.
    ``layer_types`` (``qwen3_next`` only): the config's per-layer types (``linear_attention`` /
    ``full_attention``), None for the module doc's 8."""
    import torch

    if arch not in HYBRID_ARCHS:
        raise ValueError(f"arch must be one of {HYBRID_ARCHS}, got {arch!r}")
    args = dict(arch=arch, vocab=vocab, seed=seed, max_pos=max_pos, qk_gain=qk_gain,
                build_version=BUILD_VERSION, hybrid_build=HYBRID_BUILD)
    if head_dim is not None:
        args["head_dim"] = head_dim
    if layer_types is not None:
        args["layer_types"] = list(layer_types)

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            _hybrid_config(arch, vocab, max_pos, head_dim, layer_types), dtype=torch.float32)
        _scale_hybrid_weights(model, qk_gain, seed)
        model.save_pretrained(str(tmp))
        save_tokenizer(tmp, train_tokenizer(vocab), max_pos)

    return cached_build(out_dir, args, f"tiny-{arch}", build)


def by_type_policy_text(types: Any) -> str:
    """The compact policy the hybrid checks serve, by layer type with one index beating its
    type: ``swa:fp8,full:nvfp4,<last full>:fp8``; no sliding layer (Qwen3-Next):
    ``full:nvfp4,<last full>:fp8``; all sliding (Mistral): ``*:nvfp4,0:fp8``. ``types``: the
    model's :class:`~vllm_nvfp4.policy.LayerType` per decoder layer."""
    full = [i for i, t in enumerate(types) if t.kind == "full"]
    if not full:
        return "*:nvfp4,0:fp8"
    if any(t.kind == "sliding" for t in types):
        return f"swa:fp8,full:nvfp4,{full[-1]}:fp8"
    return f"full:nvfp4,{full[-1]}:fp8"


def mixed_sliding_policy_text(types: Any) -> str:
    """A compact policy whose sliding layers mix two K/V format pairs in unequal numbers, as
    ``select`` writes them: every layer NVFP4, K in FP8 in every third sliding layer from the
    second (the tiny Gemma 3: layers 1, 6 and 10 of 8 sliding; the first sliding layer keeps the
    smaller page, as Gemma 3 270M's ``tune`` policy). ``types``: as :func:`by_type_policy_text`."""
    sliding = [i for i, t in enumerate(types) if t.kind == "sliding"]
    if len(sliding) < 3 or not any(t.kind == "full" for t in types):
        raise ValueError("a mixed sliding policy needs full-attention and >= 3 sliding layers")
    return ",".join(["*:nvfp4"] + [f"{i}:k=fp8,v=nvfp4" for i in sliding[1::3]])


def write_by_type_policy(model_dir: Union[str, os.PathLike],
                         policy_text: Callable[[Any], str] = by_type_policy_text) -> Any:
    """Write ``policy_text`` of the model's layer types (default :func:`by_type_policy_text`;
    :func:`mixed_sliding_policy_text`) for the model in ``model_dir`` as its
    ``nvfp4_policy.json`` (the file the plugin finds next to the model); returns the
    :class:`~vllm_nvfp4.policy.KVPolicy`."""
    import json

    from transformers import AutoConfig

    from vllm_nvfp4.policy import POLICY_FILENAME, KVPolicy, layer_types_from_config

    types = layer_types_from_config(AutoConfig.from_pretrained(model_dir).get_text_config())
    policy = KVPolicy.from_compact(policy_text(types), len(types), layer_types=types)
    (Path(model_dir) / POLICY_FILENAME).write_text(json.dumps(policy.to_dict()))
    return policy

"""Tiny random-weight Llama / Qwen2 checkpoints for tests and demos, and the builders' CLI.

:func:`build_tiny_llama` writes a tiny random-weight Llama / Qwen2 directory (``config.json``,
``model.safetensors``, ``generation_config.json``, a trained BPE tokenizer with a chat template)
that vLLM loads like any downloaded model. The other families: :mod:`.hybrid_models` (hybrid and
sliding-window architectures), :mod:`.weightless` (real geometries without weights).

The architectures' ``config.json`` writers are :data:`CONFIGS` (``llama``, ``qwen2``); a new
architecture adds its writer there (and its parameter names to :func:`_random_weights`). Nothing
is fetched: tokenizers come from :mod:`vllm_nvfp4.testing.tokenizers`.

The random weights are scaled so the model is not degenerate: every linear layer is drawn from
N(0, gain^2 / fan_in) (unit-variance activations), embeddings from N(0, 1), and query/key
projections get an extra gain so attention is peaked and depends on the cached K/V (which makes
KV-cache quantization visible in the outputs). The ``lm_head`` rows of the special tokens are zero,
so greedy decoding practically never stops early on ``</s>``.

Results are cached (:mod:`.model_cache`): the same arguments return the same directory at once.

CLI::

    python -m vllm_nvfp4.testing.models OUT_DIR [--layers 4 --hidden 128 --heads 4 --kv-heads 2
                                                 --head-dim 32 --vocab 4096 --arch llama|qwen2
                                                 --dtype bfloat16|float32|float16 --seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

from vllm_nvfp4.testing.model_cache import BUILD_VERSION, cached_build
from vllm_nvfp4.testing.tokenizers import SPECIAL_TOKENS, save_tokenizer, train_tokenizer

DTYPES = ("bfloat16", "float16", "float32")

#: A model geometry: layers, hidden, heads, kv_heads, head_dim, vocab, intermediate (ints).
Shape = dict[str, Any]


def _common_config(shape: Shape, dtype: str, max_pos: int, rope: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` fields every decoder architecture here shares."""
    return dict(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max_pos, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype=dtype, dtype=dtype,
        rope_theta=rope["rope_theta"], rope_parameters=rope, initializer_range=0.02, use_cache=True,
    )


def llama_config(shape: Shape, dtype: str, max_pos: int,
                 rope: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` (default RoPE, theta 10000, unless ``rope``)."""
    rope = rope or {"rope_type": "default", "rope_theta": 10000.0}
    return dict(_common_config(shape, dtype, max_pos, rope), architectures=["LlamaForCausalLM"],
                model_type="llama", head_dim=shape["head_dim"], attention_bias=False,
                mlp_bias=False)


def qwen2_config(shape: Shape, dtype: str, max_pos: int,
                 rope: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``config.json`` of a ``Qwen2ForCausalLM`` (q/k/v biases, every layer full attention)."""
    rope = rope or {"rope_type": "default", "rope_theta": 10000.0}
    return dict(_common_config(shape, dtype, max_pos, rope), architectures=["Qwen2ForCausalLM"],
                model_type="qwen2", use_sliding_window=False, sliding_window=None,
                max_window_layers=shape["layers"], layer_types=["full_attention"] * shape["layers"])


#: architecture name -> its ``config.json`` writer
CONFIGS: dict[str, Callable[..., dict[str, Any]]] = {"llama": llama_config, "qwen2": qwen2_config}
ARCHS = tuple(CONFIGS)


def _random_weights(cfg: dict, arch: str, seed: int, qk_gain: float, dtype: str) -> dict:
    """State dict of a Llama/Qwen2 causal LM (HF parameter names), scaled as the module doc says."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, V, I = cfg["hidden"], cfg["vocab"], cfg["intermediate"]
    nq, nkv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    tdtype = getattr(torch, dtype)

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (gain / math.sqrt(in_f))

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": torch.randn(V, H, generator=g)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(H)
        sd[p + "post_attention_layernorm.weight"] = norm(H)
        sd[p + "self_attn.q_proj.weight"] = lin(nq * hd, H, qk_gain)
        sd[p + "self_attn.k_proj.weight"] = lin(nkv * hd, H, qk_gain)
        sd[p + "self_attn.v_proj.weight"] = lin(nkv * hd, H)
        sd[p + "self_attn.o_proj.weight"] = lin(H, nq * hd)
        if arch == "qwen2":
            sd[p + "self_attn.q_proj.bias"] = 0.1 * torch.randn(nq * hd, generator=g)
            sd[p + "self_attn.k_proj.bias"] = 0.1 * torch.randn(nkv * hd, generator=g)
            sd[p + "self_attn.v_proj.bias"] = 0.1 * torch.randn(nkv * hd, generator=g)
        sd[p + "mlp.gate_proj.weight"] = lin(I, H)
        sd[p + "mlp.up_proj.weight"] = lin(I, H)
        sd[p + "mlp.down_proj.weight"] = lin(H, I)
    sd["model.norm.weight"] = norm(H)
    head = lin(V, H, 4.0)  # logits with std ~4: a clear argmax that still depends on the input
    head[: len(SPECIAL_TOKENS)] = 0.0
    sd["lm_head.weight"] = head
    return {k: v.to(tdtype).contiguous() for k, v in sd.items()}


def build_tiny_llama(
    out_dir: Optional[Union[str, os.PathLike]] = None,
    num_layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 4096,
    seed: int = 0,
    arch: str = "llama",
    dtype: str = "bfloat16",
    intermediate: Optional[int] = None,
    max_pos: int = 4096,
    qk_gain: float = 2.0,
) -> Path:
    """Write (or reuse) a tiny random-weight causal LM directory and return its path.

    Args:
        out_dir: target directory; ``None`` = a per-arguments folder in the model cache (:mod:`.model_cache`).
        num_layers, hidden, heads, kv_heads: transformer shape; ``heads % kv_heads == 0``.
        head_dim: per-head size, a multiple of 16 (vLLM's CPU backend wants one of 32, 64, 80, ...).
        vocab: model vocabulary size; the tokenizer is trained to this size.
        seed: weight seed; same arguments give identical weights.
        arch: ``"llama"`` or ``"qwen2"`` (Qwen2 adds q/k/v biases).
        dtype: stored weight dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        intermediate: MLP width (default ``2 * hidden``).
        max_pos: ``max_position_embeddings``.
        qk_gain: extra gain of the q/k projections (peakier attention for larger values).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    for name, v in dict(num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                        head_dim=head_dim, vocab=vocab, max_pos=max_pos).items():
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (NVFP4 blocks), got {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    cfg = dict(layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
               vocab=vocab, intermediate=intermediate or 2 * hidden)
    args = dict(cfg, arch=arch, dtype=dtype, seed=seed, max_pos=max_pos, qk_gain=qk_gain,
                build_version=BUILD_VERSION)

    def build(tmp: Path) -> None:
        from safetensors.torch import save_file

        (tmp / "config.json").write_text(json.dumps(CONFIGS[arch](cfg, dtype, max_pos), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2))
        save_file(_random_weights(cfg, arch, seed, qk_gain, dtype), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        save_tokenizer(tmp, train_tokenizer(vocab), max_pos)

    return cached_build(out_dir, args, f"tiny-{arch}-{num_layers}l-{hidden}h", build)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_nvfp4.testing.models",
                                 description="Build a tiny random-weight model with a BPE tokenizer.")
    ap.add_argument("out", nargs="?", default=None, help="output directory (default: the cache)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--max-pos", type=int, default=4096)
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.time()
    try:
        path = build_tiny_llama(a.out, num_layers=a.layers, hidden=a.hidden, heads=a.heads,
                                kv_heads=a.kv_heads, head_dim=a.head_dim, vocab=a.vocab,
                                seed=a.seed, arch=a.arch, dtype=a.dtype,
                                intermediate=a.intermediate, max_pos=a.max_pos)
    except (ValueError, FileExistsError) as e:
        ap.error(str(e))
    print(f"tiny {a.arch} model ({time.time() - t0:.1f}s): {path}", flush=True)
    print(path)


if __name__ == "__main__":
    main()

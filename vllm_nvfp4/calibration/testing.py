"""Tiny random causal LMs for tests and demos (no download): Llama- and Qwen2-shaped."""

from __future__ import annotations

from typing import Optional

import torch


def tiny_model(
    arch: str = "llama",
    num_layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    outlier_k_layer: Optional[int] = None,
    outlier_scale: float = 40.0,
) -> torch.nn.Module:
    """A randomly initialised ``arch`` ("llama" or "qwen2") model in eval mode, head_dim 32+.

    ``outlier_k_layer``: multiply a few output rows (channels) of that layer's ``k_proj`` by
    ``outlier_scale`` so its keys carry large outlier channels (the classic cause of KV-quantization
    damage; one channel per 16-element block in every KV head).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; use 'llama' or 'qwen2'")
    if outlier_k_layer is not None:
        k_proj = model.model.layers[outlier_k_layer].self_attn.k_proj
        head_dim = hidden // heads
        with torch.no_grad():
            # one channel in the first 16-block of each KV head (channel 1: a RoPE pair's partner
            # rotates with it, so the outlier spreads over channels 1 and 1 + head_dim/2)
            for h in range(kv_heads):
                k_proj.weight[h * head_dim + 1] *= outlier_scale
    return model.to(dtype).eval()

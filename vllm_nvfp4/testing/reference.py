"""Reference log-probs from transformers with the KV cache fake-quantized as vLLM stores it."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Optional

import torch


def reference_logprobs(model_dir: Path, prompts: list[list[int]], policy: Optional[Any],
                       dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """Prompt log-probs (token 1 onwards of every prompt, concatenated, FP32 on the CPU) of the
    transformers model in ``model_dir``, K/V fake-quantized per ``policy`` (None: plain)."""
    from transformers import AutoModelForCausalLM

    from vllm_nvfp4.calibration.kv_hooks import kv_cache_quantization

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    values = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        ctx = kv_cache_quantization(model, policy) if policy is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            logp = model(ids).logits[0].float().log_softmax(-1)
        values.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0].cpu())
    del model
    return torch.cat(values)

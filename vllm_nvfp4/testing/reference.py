"""Reference log-probs from transformers with the KV cache fake-quantized as vLLM stores it, and
how far rounding-level weight changes move them (the comparison's conditioning)."""

from __future__ import annotations

import contextlib
import shutil
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


def rounding_spread(model_dir: Path, prompts: list[list[int]], policy: Optional[Any],
                    work_dir: Path, rel: float = 1e-6, tol: float = 1e-3,
                    seed: int = 0) -> tuple[float, float]:
    """How far a rounding-level change of the weights moves :func:`reference_logprobs`: every
    projection weight scaled by ``1 + rel * N(0, 1)`` (a copy written to ``work_dir``). Returns
    the share of prompt tokens whose log-prob stays within ``tol`` nats and the mean move (nats).
    A well-conditioned model keeps nearly all; a random model with peaked attention and a
    quantized cache lets such a change flip stored codes, which later layers and positions carry
    on, so it bounds how closely any other summation order can agree."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, work_dir)
    model = AutoModelForCausalLM.from_pretrained(work_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("proj.weight"):
                w.mul_(1 + rel * torch.randn(w.shape, generator=gen))
    model.save_pretrained(work_dir)
    del model
    moved = (reference_logprobs(model_dir, prompts, policy)
             - reference_logprobs(work_dir, prompts, policy)).abs()
    return float((moved < tol).float().mean()), float(moved.mean())

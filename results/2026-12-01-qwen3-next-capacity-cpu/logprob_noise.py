"""Prompt log-probs of the tiny Qwen3-Next-style hybrid: bfloat16 rounding against the KV formats.

vLLM (bfloat16, the only dtype of its CPU GDN kernel) with ``auto`` and ``nvfp4_mixed`` (policy
``full:nvfp4,7:fp8``), transformers plain in float32 and bfloat16, and transformers float32 with
the KV cache fake-quantized as the policy stores it; prints one JSON line of mean absolute
differences per token (nats) over two prompts of 100 and 120 tokens.

    python logprob_noise.py
"""

import gc
import inspect
import json
import os
import textwrap
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if __name__ == "__main__":
    import torch
    from vllm import LLM, SamplingParams

    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid, write_by_type_policy
    from vllm_nvfp4.testing.reference import reference_logprobs

    model_dir = build_tiny_hybrid("qwen3_next", Path("/tmp/qwen3-next-capacity") / "qwen3_next")
    policy = write_by_type_policy(model_dir)
    got = {}
    for kv in ("auto", "nvfp4_mixed"):
        llm = LLM(model=str(model_dir), kv_cache_dtype=kv, dtype="bfloat16", max_model_len=512,
                  enforce_eager=True, distributed_executor_backend="uni", seed=0)
        ids = llm.get_tokenizer()(inspect.getsource(textwrap))["input_ids"]
        prompts = [ids[500 + 150 * i:500 + 150 * i + 100 + 20 * i] for i in range(2)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
        got[kv] = torch.tensor([o.prompt_logprobs[i][t].logprob for o, p in zip(outs, prompts)
                                for i, t in enumerate(p) if i > 0])
        del llm
        gc.collect()
    plain32 = reference_logprobs(model_dir, prompts, None, torch.float32)
    plain16 = reference_logprobs(model_dir, prompts, None, torch.bfloat16)
    quant32 = reference_logprobs(model_dir, prompts, policy, torch.float32)

    def diff(a, b):
        return round(float((a - b).abs().mean()), 4)

    print("RESULT " + json.dumps({
        "mean_logprob_auto": round(float(got["auto"].mean()), 2),
        "transformers_bf16_vs_fp32": diff(plain16, plain32),
        "quantized_vs_plain_reference_fp32": diff(quant32, plain32),
        "vllm_nvfp4_mixed_vs_auto": diff(got["nvfp4_mixed"], got["auto"]),
        "vllm_nvfp4_mixed_vs_quantized_reference": diff(got["nvfp4_mixed"], quant32),
        "vllm_nvfp4_mixed_vs_plain_reference": diff(got["nvfp4_mixed"], plain32),
        "vllm_auto_vs_plain_reference": diff(got["auto"], plain32)}))

#!/usr/bin/env python3
"""Generate a few completions with vLLM's ``LLM`` class and a chosen KV-cache dtype.

usage: python scripts/demo.py [--model DIR] [--kv-cache-dtype nvfp4_mixed] [--max-tokens 32]
                              [--prompt TEXT ...] [--temperature 0] [--eager | --no-eager]

Without ``--model`` it builds (once, cached under ~/.cache/vllm-nvfp4) a tiny random-weight Llama
with a real BPE tokenizer: the text is meaningless, but the whole serving path is real.
If vLLM does not accept the requested KV-cache dtype (the plugin is not installed, or
``VLLM_PLUGINS`` leaves it out), the demo stops with exit status 2 and says what to check.
Prints the completions and a last line ``DEMO OK {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_PROMPTS = [
    "def quicksort(items):\n    ",
    "import json\nimport os\n\n\ndef load_config(path):\n",
    "class LRUCache:\n    \"\"\"A least-recently-used cache.\"\"\"\n\n    def __init__(self, capacity",
]
DEFAULT_MODEL = dict(num_layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def dtype_accepted(name: str) -> tuple[bool, str]:
    """Whether vLLM (with its general plugins loaded, ours included) accepts ``name`` as
    ``kv_cache_dtype``; on refusal also the reason."""
    from vllm.config.cache import CacheConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    try:
        CacheConfig(cache_dtype=name)
    except Exception as e:  # pydantic ValidationError (0.32: closed Literal) or a plugin error
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        return False, f"{type(e).__name__}: {' '.join(lines)}"
    return True, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local HF model dir (default: the tiny model)")
    ap.add_argument("--kv-cache-dtype", default="nvfp4_mixed")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompt", action="append", default=None, help="repeatable; default: 3 code prompts")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                    help="enforce_eager (default: on for CPU, where torch.compile costs ~30 s)")
    a = ap.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    model = a.model
    if model is None:
        from vllm_nvfp4.testing.models import build_tiny_llama

        model = str(build_tiny_llama(**DEFAULT_MODEL))
        print(f"[demo] tiny random-weight model: {model}", flush=True)
    elif not os.path.isdir(model):
        ap.error(f"--model {model!r} is not a directory")

    t0 = time.time()
    from vllm import LLM, SamplingParams

    from vllm_nvfp4.doctor import vllm_plugins_hint

    kv = a.kv_cache_dtype
    hint = vllm_plugins_hint() if kv == "nvfp4_mixed" else None
    ok, why = dtype_accepted(kv)
    if not ok:
        problem = (f"{hint}." if hint else f"vLLM does not accept kv_cache_dtype={kv!r}. For "
                   "nvfp4_mixed, is vllm-nvfp4 installed (pip install -e .)? `vllm-nvfp4 doctor` "
                   "says what is missing.")
        print(f"[demo] ERROR: {problem} (vLLM: {why})", file=sys.stderr, flush=True)
        return 2
    cuda = _cuda()
    eager = (not cuda) if a.eager is None else a.eager
    t1 = time.time()
    llm = LLM(model=model, kv_cache_dtype=kv, max_model_len=a.max_model_len, enforce_eager=eager,
              max_num_seqs=16, seed=0, **({"gpu_memory_utilization": 0.5} if cuda else {}))
    t_start = time.time() - t1
    prompts = a.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, ignore_eos=True)
    t2 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    t_gen = time.time() - t2
    n_tok = 0
    for o in outs:
        n_tok += len(o.outputs[0].token_ids)
        print(f"--- prompt: {o.prompt!r}\n+++ output: {o.outputs[0].text!r}", flush=True)
    ok = all(len(o.outputs[0].token_ids) == a.max_tokens for o in outs)
    summary = dict(model=model, kv_cache_dtype=kv,
                   device="cuda" if cuda else "cpu", enforce_eager=eager,
                   import_s=round(t1 - t0, 1), engine_start_s=round(t_start, 1),
                   generate_s=round(t_gen, 2), output_tokens=n_tok)
    print(f"DEMO {'OK' if ok else 'FAILED'} {json.dumps(summary)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

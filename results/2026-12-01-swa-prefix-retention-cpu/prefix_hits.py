"""Prefix-cache hits of the tiny all-sliding Mistral (window 48) through vLLM on CPU.

Three requests, one at a time: a 96-token shared prefix plus ``--suffix`` tokens of their own.
Prints one JSON line: the KV dtype, the block size vLLM used, the retention interval, the hits
(``num_cached_tokens``) and, for the third request, which of its block hashes the pool held
when vLLM looked them up (``SlidingWindowManager.find_longest_cache_hit``, wrapped here).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}.items():
    os.environ.setdefault(key, value)

PREFIX = 96


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", required=True, help="kv_cache_dtype: nvfp4_mixed or fp8")
    ap.add_argument("--block", type=int, default=16, help="configured block_size")
    ap.add_argument("--suffix", type=int, default=20, help="own tokens after the shared prefix")
    ap.add_argument("--retention", default="0",
                    help="prefix_cache_retention_interval: an int, or 'None' (dense)")
    ap.add_argument("--model-dir", default="/tmp/tiny-mistral-swa")
    args = ap.parse_args()
    retention = None if args.retention == "None" else int(args.retention)

    from transformers import AutoConfig
    from vllm.v1.core import single_type_kv_cache_manager as managers

    from vllm_nvfp4.policy import KVPolicy, layer_types_from_config
    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid

    model_dir = build_tiny_hybrid("mistral", Path(args.model_dir))
    types = layer_types_from_config(AutoConfig.from_pretrained(model_dir).get_text_config())
    policy = KVPolicy.from_compact("*:nvfp4", len(types), layer_types=types)
    (model_dir / "nvfp4_policy.json").write_text(json.dumps(policy.to_dict()))

    lookups: list[dict] = []
    original = managers.SlidingWindowManager.find_longest_cache_hit.__func__

    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                               kv_cache_spec, *rest, **kw):
        found = original(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                         kv_cache_spec, *rest, **kw)
        lookups.append({"block_size": kv_cache_spec.block_size,
                        "held": [int(block_pool.get_cached_block(h, kv_cache_group_ids)
                                     is not None) for h in block_hashes]})
        return found

    managers.SlidingWindowManager.find_longest_cache_hit = classmethod(find_longest_cache_hit)

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), kv_cache_dtype=args.dtype, dtype="float32",
              block_size=args.block, max_model_len=512, max_num_batched_tokens=1024,
              max_num_seqs=4, enforce_eager=True, distributed_executor_backend="uni", seed=0,
              enable_prefix_caching=True, prefix_cache_retention_interval=retention)
    ids = list(range(10, 4000, 7))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    hits = []
    for i in range(3):
        prompt = ids[:PREFIX] + ids[200 + 60 * i:200 + 60 * i + args.suffix]
        out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
        hits.append(out.num_cached_tokens)
    print(json.dumps({"kv_cache_dtype": args.dtype, "configured_block": args.block,
                      "block_used": lookups[-1]["block_size"], "prompt_tokens": PREFIX + args.suffix,
                      "retention_interval": retention, "hits": hits,
                      "third_lookup_blocks_held": lookups[-1]["held"]}), flush=True)


if __name__ == "__main__":
    main()

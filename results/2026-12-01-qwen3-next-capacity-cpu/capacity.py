"""KV capacity vLLM reports for the tiny Qwen3-Next-style hybrid, by KV dtype and Mamba cache mode.

One engine per call (bfloat16, 1 GiB KV cache, configured block 16, eager); prints one JSON line:
the KV-cache groups (kind, block size, page bytes, layers), the shared block bytes, the number of
blocks and vLLM's ``kv_cache_size_tokens`` at ``--max-model-len``. ``nvfp4_mixed`` serves the
policy ``full:nvfp4,7:fp8`` written next to the model.

    python capacity.py --dtype nvfp4_mixed --prefix-caching 1 --max-model-len 4096
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc with a function

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--prefix-caching", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qwen3-next-capacity"))
    a = ap.parse_args()
    from vllm import LLM

    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid, write_by_type_policy
    from vllm_nvfp4.testing.kv_report import kv_cache_report

    model_dir = build_tiny_hybrid("qwen3_next", a.work / "qwen3_next")
    write_by_type_policy(model_dir)
    llm = LLM(model=str(model_dir), kv_cache_dtype=a.dtype, dtype="bfloat16", block_size=16,
              max_model_len=a.max_model_len, max_num_batched_tokens=1024, max_num_seqs=4,
              enforce_eager=True, distributed_executor_backend="uni", seed=0,
              enable_prefix_caching=bool(a.prefix_caching))
    r = llm.collective_rpc(kv_cache_report)[0]
    cc = llm.llm_engine.vllm_config.cache_config
    print("RESULT " + json.dumps({
        "dtype": a.dtype, "prefix_caching": bool(a.prefix_caching),
        "mamba_cache_mode": cc.mamba_cache_mode, "max_model_len": a.max_model_len,
        "layout": r["layout"],
        "groups": [(g["kind"], g["block_size"], g["page_bytes"], len(g["layer_pages"]))
                   for g in r["groups"]],
        "block_bytes": r["block_bytes"], "num_blocks": r["num_blocks"],
        "kv_cache_size_tokens": r["kv_cache_size_tokens"]}))

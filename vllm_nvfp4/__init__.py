"""vllm-nvfp4: a per-layer mixed FP8/NVFP4 KV cache for vLLM (kv-cache dtype ``nvfp4_mixed``)."""

__version__ = "0.1.0"

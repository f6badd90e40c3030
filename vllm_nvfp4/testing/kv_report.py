"""What a vLLM worker allocated for the KV cache, as plain data (tests and GPU checks).

:func:`kv_cache_report` runs inside the worker (``llm.collective_rpc(kv_cache_report)``).
"""

from __future__ import annotations

from typing import Any


def kv_cache_report(worker: Any) -> dict[str, Any]:
    """KV-cache groups (kind of their layers, block size, per-layer page bytes), the shared block
    bytes, ``num_blocks``, the layout, and per request at ``max_model_len`` the bytes vLLM
    allocates (whole blocks of every group) against what the layers' own pages need; plus each
    attention impl's class, block size, window and whether it has sinks."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    runner = worker.model_runner
    config, vc = runner.kv_cache_config, runner.vllm_config
    block_bytes = max(g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups)
    groups, allocated, needed = [], 0, 0
    for g in config.kv_cache_groups:
        spec = g.kv_cache_spec
        layers = (spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs)
                  else {n: spec for n in g.layer_names})
        groups.append({"kind": type(next(iter(layers.values()))).__name__,
                       "block_size": spec.block_size, "page_bytes": spec.page_size_bytes,
                       "layer_pages": {n: s.page_size_bytes for n, s in layers.items()}})
        allocated += -(-spec.max_memory_usage_bytes(vc) // spec.page_size_bytes) * block_bytes
        needed += sum(s.max_memory_usage_bytes(vc) for s in layers.values())
    impls = {}
    for name, layer in runner.compilation_config.static_forward_context.items():
        impl = getattr(layer, "impl", None)
        if getattr(impl, "layout", None) is not None:
            impls[name] = {"impl": type(impl).__name__, "block_size": impl.layout.block_size,
                           "formats": (str(impl.layout.k_format), str(impl.layout.v_format)),
                           "window": impl.sliding_window, "sinks": impl.sink_logits is not None}
    return {"groups": groups, "num_blocks": config.num_blocks, "block_bytes": block_bytes,
            "allocated_per_request": allocated, "needed_per_request": needed, "impls": impls,
            "layout": vc.cache_config.kv_cache_layout,
            "max_model_len": vc.model_config.max_model_len,
            "configured_block_size": vc.cache_config.block_size,
            "max_in_flight_tokens": vc.max_in_flight_tokens,
            "kv_cache_size_tokens": vc.cache_config.kv_cache_size_tokens}

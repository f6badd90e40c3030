"""Which KV connectors (offloading, disaggregated prefill) may move ``nvfp4_mixed`` pages.

A page of ours is opaque bytes: K/V data and scale planes are head-major inside the block (see
:mod:`vllm_nvfp4.layout`), so the bytes vLLM's ``[blocks, 1, block_size, C]`` view shows as the
row of token ``n`` are not token ``n``'s data. A connector is correct for us only if it moves
whole blocks byte for byte (all rows of a block, to the same rows of the destination block).
Connectors that pick single tokens, split heads or re-encode K and V would corrupt the cache,
so they are refused at start-up.

The backend declares block-contiguous layouts (``supported_kv_cache_layouts``: one layer's page
is one contiguous run of bytes per block), so connectors that copy pages see whole pages.
"""

from __future__ import annotations

from typing import Any

from vllm_nvfp4.integration.dtype import CACHE_DTYPE

#: connectors shipped with vLLM that copy whole blocks as raw bytes, and why
WHOLE_BLOCK_CONNECTORS: dict[str, str] = {
    "ExampleConnector": "stores and loads whole blocks only (prompts cut to full blocks)",
    "OffloadingConnector": "native CPU offloading (--kv-offloading-backend native): copies "
                           "whole pages; our layer views match no K/V layout it re-maps",
    "SimpleCPUOffloadConnector": "native offloading with VLLM_USE_SIMPLE_KV_OFFLOAD=1: copies "
                                 "raw block bytes",
}
MULTI_CONNECTOR = "MultiConnector"


def connector_names(kv_transfer_config: Any) -> list[str]:
    """The connector class names a ``KVTransferConfig`` uses (MultiConnector: each member)."""
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return []
    name = kv_transfer_config.kv_connector
    if name != MULTI_CONNECTOR:
        return [name]
    members = (kv_transfer_config.kv_connector_extra_config or {}).get("connectors", [])
    return [m.get("kv_connector") for m in members] or [name]


def check_kv_connectors(vllm_config: Any) -> None:
    """Raise ``ValueError`` naming the connector unless every one moves whole blocks."""
    refused = [n for n in connector_names(vllm_config.kv_transfer_config)
               if n not in WHOLE_BLOCK_CONNECTORS]
    if refused:
        raise ValueError(
            f"KV connector {', '.join(map(str, refused))} cannot move kv_cache_dtype={CACHE_DTYPE} "
            "pages: their bytes are not token-major (scale planes inside each block), so only "
            "connectors that copy whole blocks are safe. Supported: "
            f"{', '.join(WHOLE_BLOCK_CONNECTORS)}; or use --kv-cache-dtype fp8 with this connector"
        )

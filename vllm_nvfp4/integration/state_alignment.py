"""The attention page vLLM sizes a Mamba / Gated-DeltaNet hybrid's blocks by.

vLLM's ``Platform._align_hybrid_block_size`` asks the attention backend for one token's page of
an attention layer (``customize_spec`` of a one-token ``FullAttentionSpec``), raises the block
until that page holds a state page and pads the state pages to it. :func:`aligning_backend` hands
it our backend with that page set to
:func:`~vllm_nvfp4.integration.block_sizes.state_share_bytes_per_token`, so the full-attention
group's blocks hold whole state pages (see that module's doc).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_nvfp4.integration.block_sizes import state_share_bytes_per_token
from vllm_nvfp4.integration.model import model_policy
from vllm_nvfp4.model_shape import ModelShape


def aligning_backend(vllm_config: Any, backend_cls: type) -> type:
    """``backend_cls`` for vLLM's hybrid block alignment: for a model of full-attention and
    state layers a subclass whose ``customize_spec`` gives the one-token page
    :func:`state_share_bytes_per_token` (the class is used there only); else ``backend_cls``."""
    shape = ModelShape.from_vllm_config(vllm_config)
    per_token = state_share_bytes_per_token(model_policy(vllm_config), shape.num_kv_heads,
                                            shape.head_dim)
    if per_token is None:
        return backend_cls

    def customize_spec(cls: type, spec: Any) -> Any:
        return dataclasses.replace(spec, num_head_slots=1, state_content_bytes=per_token)

    return type(f"{backend_cls.__name__}StateAligned", (backend_cls,),
                {"customize_spec": classmethod(customize_spec), "__module__": __name__})

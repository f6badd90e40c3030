"""The state layers of a start-up calibration forward (:mod:`.calibration_forward`): Gated
DeltaNet layers (Qwen3-Next and its kind) run as in a pure-prefill step of vLLM.

Outside the scheduler a GDN layer has neither its attention metadata nor (before vLLM allocates
the KV cache) its state. For a forward over ``S`` sequences of ``L`` tokens, :class:`StateLayers`
gives every GDN layer a ``GDNAttentionMetadata`` built by the layer's own backend builder from
a pure-prefill batch (no initial state, sequence ``i`` in state slot ``i + 1``; slot 0 is vLLM's
null block), and binds zeroed conv/SSM state tensors of ``S + 1`` slots for the duration
(:meth:`StateLayers.bound`), restoring what was bound before. Each forward starts every sequence
from a zero state and only writes the final states, so the GDN layers of one state shape share
one set of temporary tensors.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import torch

_UNBOUND = object()  # a layer without a kv_cache attribute


def _is_gdn(layer: Any) -> bool:
    from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return isinstance(layer, GatedDeltaNetAttention) \
        and layer.mamba_type == MambaAttentionBackendEnum.GDN_ATTN


def state_layers(vllm_config: Any) -> dict[str, Any]:
    """Every state (Mamba-like) layer of the engine's forward context by name."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    ctx = vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in ctx.items() if isinstance(layer, MambaBase)}


def unsupported_state_layers(vllm_config: Any) -> list[str]:
    """The names of the state layers a calibration forward cannot run (all but Gated DeltaNet)."""
    return [name for name, layer in state_layers(vllm_config).items() if not _is_gdn(layer)]


class StateLayers:
    """The GDN layers of a model (``layers``: name -> layer, all of them GDN) in calibration
    forwards on ``device``."""

    def __init__(self, vllm_config: Any, layers: dict[str, Any], device: torch.device) -> None:
        self.vllm_config, self.layers, self.device = vllm_config, layers, device
        self._builder: Any = None
        self._metadata: dict[tuple[int, int], dict[str, Any]] = {}

    def metadata(self, num_seqs: int, seq_len: int) -> dict[str, Any]:
        """Per GDN layer name, the metadata of a pure prefill of ``num_seqs`` sequences of
        ``seq_len`` tokens laid end to end (one object for all layers, as vLLM's group has)."""
        key = (num_seqs, seq_len)
        if key not in self._metadata:
            meta = self._build(num_seqs, seq_len)
            self._metadata[key] = {name: meta for name in self.layers}
        return self._metadata[key]

    def _build(self, num_seqs: int, seq_len: int) -> Any:
        if self._builder is None:
            layer = next(iter(self.layers.values()))
            spec = layer.get_kv_cache_spec(self.vllm_config)
            self._builder = layer.get_attn_backend().get_builder_cls()(
                spec, list(self.layers), self.vllm_config, self.device)
        meta = self._builder.build(0, prefill_batch(self._builder.kv_cache_spec, num_seqs,
                                                    seq_len, self.device))
        # no mid-prefill checkpoints: nothing reads the calibration's states afterwards
        return meta if getattr(meta, "checkpoint", None) is None else replace(meta, checkpoint=None)

    @contextmanager
    def bound(self, max_seqs: int) -> Iterator[None]:
        """Bind zeroed states of ``max_seqs + 1`` slots (each state ``[slots, *shape]`` in its
        dtype, :meth:`get_state_shape` / :meth:`get_state_dtype`) to every GDN layer; restore
        the layers' own ``kv_cache`` on exit."""
        shared: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}
        saved = {name: getattr(layer, "kv_cache", _UNBOUND) for name, layer in self.layers.items()}
        try:
            for layer in self.layers.values():
                shapes = tuple(tuple(s) for s in layer.get_state_shape())
                dtypes = tuple(layer.get_state_dtype())
                if (shapes, dtypes) not in shared:
                    shared[(shapes, dtypes)] = tuple(
                        torch.zeros((max_seqs + 1, *shape), dtype=dtype, device=self.device)
                        for shape, dtype in zip(shapes, dtypes))
                layer.kv_cache = shared[(shapes, dtypes)]
            yield
        finally:
            for name, layer in self.layers.items():
                if saved[name] is _UNBOUND:
                    if hasattr(layer, "kv_cache"):
                        del layer.kv_cache
                else:
                    layer.kv_cache = saved[name]


def prefill_batch(spec: Any, num_seqs: int, seq_len: int, device: torch.device) -> Any:
    """vLLM's ``CommonAttentionMetadata`` of a first-chunk prefill of ``num_seqs`` sequences of
    ``seq_len`` tokens; every block-table column of sequence ``i`` is state slot ``i + 1``
    (``[num_seqs, cdiv(seq_len, block) + speculative blocks]``, read as vLLM's ``align`` and
    ``none`` Mamba cache modes read it)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    starts = torch.arange(num_seqs + 1, dtype=torch.int32) * seq_len
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    cols = -(-seq_len // spec.block_size) + spec.num_speculative_blocks
    blocks = torch.arange(1, num_seqs + 1, dtype=torch.int32)[:, None].expand(num_seqs, cols)
    tokens = num_seqs * seq_len
    return CommonAttentionMetadata(
        query_start_loc=starts.to(device), query_start_loc_cpu=starts,
        seq_lens=lens.to(device), num_reqs=num_seqs, num_actual_tokens=tokens,
        max_query_len=seq_len, max_seq_len=seq_len,
        block_table_tensor=blocks.contiguous().to(device),
        slot_mapping=torch.full((tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device),
        is_prefilling=torch.ones(num_seqs, dtype=torch.bool), seq_lens_cpu_upper_bound=lens)

"""KV-cache capacity of a Gemma-3-27B-shaped model under vLLM 0.34's planning, on CPU.

CI has vLLM 0.32 only. The planning functions these tests call (``get_kv_cache_groups`` with
``_get_packed_kv_cache_groups`` / ``_get_kv_cache_groups_uniform_page_size``,
``get_kv_cache_config_from_groups``, ``get_max_concurrency_for_kv_cache_config`` and
``SlidingWindowSpec.max_admission_blocks_per_request``) are the same code in 0.34's
``v1/core/kv_cache_planning.py`` / ``kv_cache_utils.py`` (0.34 adds EAGLE group annotation and
HiSparse, unused here). What 0.34 changes is its inputs, which the tests set as 0.34 does on an
H100: the configured block size 64 (``CacheConfig.DEFAULT_BLOCK_SIZE``) and 32768 tokens in
flight (async scheduling: 2 x ``max_num_batched_tokens`` 16384). The expected numbers are the
ones vLLM 0.34.0 logged for this model at ``max_model_len`` 33792 (fp8: 6360 blocks, "GPU KV
cache size: 58,054 tokens"; nvfp4_mixed ``5:fp8,59:fp8,swa:fp8,full:nvfp4``: 9563 blocks,
"kv cache group sizes (16, 16, 64)", "67,974 tokens").

Those token counts are vLLM's admission bound: each sliding layer counted at
``min(window - 1 + in-flight tokens, max_model_len)`` = 33791 tokens, so this policy's 52 FP8
sliding layers weigh as much as full ones and the bound is 1.07x the bytes of fp8's (1.2x with
fp8's 8 padding layers). A decoding sequence holds a window per sliding layer; there the plan is
the format arithmetic (:mod:`benchmarks.e2e.capacity`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.e2e import capacity
from vllm_nvfp4.integration.block_sizes import hybrid_plan
from vllm_nvfp4.layout import KVPageLayout
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.policy import KVPolicy, LayerType

LENGTH, WINDOW, HEADS, DIM, LAYERS = 33792, 1024, 16, 128, 62
BLOCK_034 = 64  # vLLM 0.34's CacheConfig.DEFAULT_BLOCK_SIZE
IN_FLIGHT_034 = 2 * 16384  # async scheduling x max_num_batched_tokens (H100, vLLM 0.34)
POLICY = "5:fp8,59:fp8,swa:fp8,full:nvfp4"
TYPES = tuple(LayerType("full") if i % 6 == 5 else LayerType("sliding", WINDOW)
              for i in range(LAYERS))
GEMMA3_27B = ModelShape(num_layers=LAYERS, total_num_kv_heads=HEADS, num_kv_heads=HEADS,
                        head_dim=DIM, dtype="bfloat16", max_positions=131072, layer_types=TYPES)
NAMES = [f"language_model.model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class _EngineConfig(SimpleNamespace):
    """A stand-in for vLLM's config object (weak-referenceable, as the plugin keys by it)."""


def _engine_config(block_size: int) -> _EngineConfig:
    return _EngineConfig(cache_config=SimpleNamespace(block_size=block_size),
                         model_config=SimpleNamespace(max_model_len=LENGTH),
                         max_in_flight_tokens=IN_FLIGHT_034)


def _planning():
    try:  # vLLM >= 0.33
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:  # vLLM 0.32
        from vllm.v1.core import kv_cache_utils as planning
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    return planning, get_max_concurrency_for_kv_cache_config


def _config(layout_name: str) -> SimpleNamespace:
    planning, _ = _planning()
    layout = next(x for x in planning.KVCacheLayout if x.name == layout_name)
    return SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout,
                                     num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        model_config=SimpleNamespace(max_model_len=LENGTH, supports_kv_cache_grouping=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=None, max_in_flight_tokens=IN_FLIGHT_034,
        num_prefill_lookahead_tokens=0)


def _spec(sliding: bool, **fields):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if sliding:
        return SlidingWindowSpec(**fields, sliding_window=WINDOW)
    return FullAttentionSpec(**fields)


def _fp8_specs() -> dict:
    """vLLM's fp8 pages (one byte per element, every layer the same page)."""
    import torch

    return {n: _spec(t.kind == "sliding", block_size=BLOCK_034, num_kv_heads=HEADS,
                     head_size=DIM, dtype=torch.uint8) for n, t in zip(NAMES, TYPES)}


def _mixed_specs():
    """The specs :func:`vllm_nvfp4.integration.kv_cache_spec.kv_cache_spec` gives each layer,
    and the plan they follow."""
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    policy = KVPolicy.from_compact(POLICY, LAYERS, layer_types=TYPES)
    plan = hybrid_plan(policy, HEADS, DIM, BLOCK_034, LENGTH, IN_FLIGHT_034)
    specs = {}
    for name, t, row in zip(NAMES, TYPES, policy.layers):
        block = plan.sliding_block if t.kind == "sliding" else plan.full_block
        page = KVPageLayout(HEADS, DIM, block, row.k, row.v)
        specs[name] = _spec(t.kind == "sliding", block_size=block, num_kv_heads=HEADS,
                            head_size=DIM, head_size_v=DIM, dtype=torch.uint8,
                            kv_quant_mode=KVQuantMode.NONE, num_head_slots=1,
                            state_content_bytes=page.bytes_per_token)
        assert specs[name].page_size_bytes == page.page_bytes
    return specs, plan


def _vllm_capacity(specs: dict, layout_name: str, num_blocks: int):
    """vLLM's groups, bytes per block and logged token capacity at ``num_blocks``."""
    planning, concurrency = _planning()
    config = _config(layout_name)
    groups = planning.get_kv_cache_groups(config, dict(specs))
    block_bytes = planning._get_kv_cache_bytes_per_block(groups, config.cache_config
                                                         .get_resolved_kv_cache_layout())
    kv_config = planning.get_kv_cache_config_from_groups(config, groups, num_blocks * block_bytes)
    return groups, block_bytes, int(concurrency(config, kv_config) * LENGTH)


def _kind(group) -> str:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec, UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    return "sliding" if isinstance(spec, SlidingWindowSpec) else "full"


def test_vllm034_logged_capacity_is_reproduced():
    """vLLM 0.34's numbers on the H100: fp8 in 7 groups of 64-token blocks (10 layers' pages a
    block, 8 padding layers) holds 58,054 tokens in 6360 blocks; nvfp4_mixed in groups of 16,
    16 and 64 tokens (26 + 26 sliding FP8 pages and the 10 full pages fill one block of
    1,703,936 bytes each: nothing padded) 67,974 in 9563 blocks."""
    groups, block_bytes, tokens = _vllm_capacity(_fp8_specs(), "LBNHC", 6360)
    assert [g.kv_cache_spec.block_size for g in groups] == [64] * 7
    assert (block_bytes, tokens) == (10 * 64 * HEADS * DIM * 2, 58054)

    specs, plan = _mixed_specs()
    assert (plan.full_block, plan.sliding_block, plan.sliding_groups) == (64, 16, 2)
    groups, block_bytes, tokens = _vllm_capacity(specs, "BLNHC", 9563)
    assert [(_kind(g), g.kv_cache_spec.block_size, len(g.layer_names)) for g in groups] == [
        ("sliding", 16, 26), ("sliding", 16, 26), ("full", 64, 10)]
    assert (block_bytes, tokens) == (plan.block_bytes, 67974) == (1703936, 67974)
    # the bound per request is the plan's (format arithmetic of vLLM's admission rule)
    assert plan.request_blocks == 2 * (-(-(WINDOW - 1 + IN_FLIGHT_034) // 16) + 1) + LENGTH // 64


def test_benchmark_pool_is_vllm034s_at_the_configured_block_size():
    """vLLM then sets ``cache_config.block_size`` to its smallest group's (16): planned from 16
    the benchmark saw other groups (full 32, four sliding, half the block bytes) and a largest
    batch of 1 at 32k; planned from the configured 64 its pool is vLLM's groups, and a decoding
    sequence (a window per sliding layer) fits 8 times where fp8's fits 5 (the benchmark's fp8
    engine on vLLM 0.34: 5; vLLM's own nvfp4: 10)."""
    specs, _ = _mixed_specs()
    groups, block_bytes, _ = _vllm_capacity(specs, "BLNHC", 9563)
    smallest = min(g.kv_cache_spec.block_size for g in groups)
    engine_groups = sorted((_kind(g), g.kv_cache_spec.block_size) for g in groups)

    def pool(block_size):
        return capacity.pool_layout("nvfp4_mixed", GEMMA3_27B, POLICY, block_size, LENGTH,
                                    IN_FLIGHT_034)

    wrong, right = pool(smallest), pool(BLOCK_034)
    assert (wrong.block_bytes, len(wrong.groups)) == (block_bytes // 2, 5)
    assert capacity.max_batch(9563, wrong, 32768 + 1024, IN_FLIGHT_034) == 1
    assert right.block_bytes == block_bytes
    assert sorted((g.kind, g.block_size) for g in right.groups) == engine_groups

    fp8 = capacity.pool_layout("fp8", GEMMA3_27B, None, BLOCK_034, LENGTH, IN_FLIGHT_034)
    assert capacity.max_batch(9563, right, 32768 + 1024, IN_FLIGHT_034) == 8
    assert capacity.max_batch(6360, fp8, 32768 + 1024, IN_FLIGHT_034) == 5
    mixed_tokens = capacity.capacity_tokens(9563, right, LENGTH) / (9563 * right.block_bytes)
    fp8_tokens = capacity.capacity_tokens(6360, fp8, LENGTH) / (6360 * fp8.block_bytes)
    assert mixed_tokens / fp8_tokens == pytest.approx(1.473, abs=0.002)  # per byte of KV cache


def test_planned_block_size_outlives_vllms_block_size_sync():
    """:func:`planned_block_size` keeps the block size the plan started from after vLLM's engine
    core replaced ``cache_config.block_size`` with the smallest group's; an unseen config gives
    its own."""
    from vllm_nvfp4.integration.model import group_block_sizes, planned_block_size

    policy = KVPolicy.from_compact(POLICY, LAYERS, layer_types=TYPES)
    config = _engine_config(BLOCK_034)
    shape = GEMMA3_27B.__class__(**{**GEMMA3_27B.__dict__, "block_size": BLOCK_034})
    assert group_block_sizes(policy, shape, config) == (64, 16)
    config.cache_config.block_size = 16  # what vLLM 0.34 sets once the KV cache is sized
    assert planned_block_size(config) == 64
    assert planned_block_size(_engine_config(32)) == 32


def test_worker_plans_from_the_configured_block_size():
    """The benchmark worker's pool layout uses the configured block size, not vLLM's synced
    ``cache_config.block_size``."""
    from benchmarks.e2e.worker import Worker
    from vllm_nvfp4.integration.model import group_block_sizes

    policy = KVPolicy.from_compact(POLICY, LAYERS, layer_types=TYPES)
    config = _engine_config(BLOCK_034)
    shape = GEMMA3_27B.__class__(**{**GEMMA3_27B.__dict__, "block_size": BLOCK_034})
    group_block_sizes(policy, shape, config)
    config.cache_config.block_size = 16
    worker = Worker.__new__(Worker)
    worker.a = SimpleNamespace(mixed_policy=POLICY, max_model_len=LENGTH)
    worker.shape, worker.in_flight = GEMMA3_27B, IN_FLIGHT_034
    worker.llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))
    assert worker.planned_block_size() == 64
    layout = worker.layout("nvfp4-mixed")
    assert layout.block_bytes == 1703936
    assert [(g.kind, g.block_size) for g in layout.groups] == [("full", 64)] + [("sliding", 16)] * 2

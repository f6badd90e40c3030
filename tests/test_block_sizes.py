"""Block sizes of hybrid models' KV-cache groups (:mod:`vllm_nvfp4.integration.block_sizes`):
vLLM's packing by hand-computed vectors, and the chosen sizes on real model geometries.

The engine tests (``test_integration_hybrid.py``, ``scripts/gpu_hybrid_check.py``) check that
vLLM forms exactly the planned groups."""

import pytest

from vllm_nvfp4.integration.block_sizes import (
    GroupPlan,
    arithmetic_request_bytes,
    choose_block_sizes,
    hybrid_plan,
    plan_groups,
)
from vllm_nvfp4.policy import KVPolicy, LayerType

NV, F8 = 2 * 2 * (16 + 2), 2 * 2 * 32  # bytes per token of one layer, 2 KV heads, head_dim 32


def test_packing_by_hand():
    """The tiny Gemma 3 (3 NVFP4 + 1 FP8 full layers, 8 FP8 sliding, window 32) at the
    configured block 16: a 5504-byte block (16 x 344) holds two 2048-byte sliding pages, so 4
    sliding groups; a request at 512 tokens with 1024 in flight holds 512 / 16 full blocks and
    per sliding group 512 / 16 + 1."""
    full = (NV, NV, NV, F8)
    assert plan_groups(full, F8, 8, 32, 16, 16, 512, 1024) == GroupPlan(16, 16, 4, 5504, 32 + 4 * 33)
    # 48-token full blocks: 16512 bytes hold all eight 16-token sliding pages (16384) in one group
    assert plan_groups(full, F8, 8, 32, 48, 16, 512, 1024) == GroupPlan(48, 16, 1, 16512, 11 + 33)
    # a sliding page larger than the full pages sets the block; one layer per group
    assert plan_groups(full, F8, 8, 32, 16, 64, 512, 64) == GroupPlan(16, 64, 8, 8192, 32 + 8 * 3)
    # as many FP8 as NVFP4 full layers (2:2): vLLM splits the sliding layers by that repeat
    # pattern (2 per group), although all 4 pages of 1152 bytes would fit one 6400-byte block
    assert plan_groups((NV, NV, F8, F8), NV, 4, 32, 16, 16, 512, 64).sliding_groups == 2


def test_plan_is_what_vllm_packs():
    """:func:`plan_groups` against vLLM's own grouping of the same specs (block bytes, sliding
    groups, one full-attention group) on random geometries."""
    import random
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, SlidingWindowSpec

    try:  # vLLM 0.33
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:  # vLLM 0.32
        from vllm.v1.core import kv_cache_utils as planning
    layout = next(x for x in planning.KVCacheLayout if x.name == "BLNHC")
    config = SimpleNamespace(speculative_config=None, cache_config=SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout))

    def spec(cls, block, per_token, **kw):
        return cls(block_size=block, num_kv_heads=1, head_size=16, head_size_v=16,
                   dtype=torch.uint8, kv_quant_mode=KVQuantMode.NONE, num_head_slots=1,
                   state_content_bytes=per_token, **kw)

    rng = random.Random(0)
    checked = 0
    while checked < 100:
        full = tuple(rng.choice([NV, F8, 144, 256]) for _ in range(rng.randint(1, 8)))
        num_sliding, per_token = rng.randint(1, 20), rng.choice([NV, F8, 144, 256])
        fb, sb = rng.randrange(16, 129, 16), rng.randrange(16, 257, 16)
        specs = {f"full.{i}": spec(FullAttentionSpec, fb, b) for i, b in enumerate(full)}
        specs |= {f"swa.{i}": spec(SlidingWindowSpec, sb, per_token, sliding_window=32)
                  for i in range(num_sliding)}
        if len({x.page_size_bytes for x in specs.values()}) == 1:
            continue  # vLLM does not pack a uniform page size
        groups = planning._get_packed_kv_cache_groups(config, specs)
        kinds = [type(next(iter(g.kv_cache_spec.kv_cache_specs.values()))) for g in groups]
        plan = plan_groups(full, per_token, num_sliding, 32, fb, sb, 512, 64)
        assert (kinds.count(FullAttentionSpec), kinds.count(SlidingWindowSpec),
                planning._get_kv_cache_bytes_per_block(groups, layout)) == (
            1, plan.sliding_groups, plan.block_bytes), (full, per_token, num_sliding, fb, sb)
        checked += 1


def test_choice_minimises_the_reserved_bytes():
    """The chosen plan reserves no more than any other searched one (within the tolerance),
    and prefers the configured block when it is as good."""
    full = (NV, NV, NV, F8)
    best = choose_block_sizes(full, F8, 8, 32, 16, 512, 1024)
    assert (best.full_block, best.sliding_block, best.sliding_groups) == (48, 16, 1)
    others = [plan_groups(full, F8, 8, 32, f, s, 512, 1024).request_bytes
              for f in range(16, 257, 16) for s in range(16, 257, 16)]
    assert best.request_bytes <= 1.01 * min(others)
    # all-FP8 pages of equal size pack exactly at the configured block
    assert choose_block_sizes((F8,) * 4, F8, 8, 32, 16, 512, 1024).full_block == 16
    with pytest.raises(ValueError, match="multiple of 16"):
        choose_block_sizes(full, F8, 8, 32, 24, 512, 1024)


def _policy(types, compact):
    return KVPolicy.from_compact(compact, len(types), layer_types=types)


@pytest.mark.parametrize("name,types,heads,dim", [
    ("gemma-3-27b", ([LayerType("sliding", 1024)] * 5 + [LayerType("full")]) * 10
     + [LayerType("sliding", 1024)] * 2, 16, 128),
    ("gpt-oss-20b", [LayerType("sliding", 128, True), LayerType("full", None, True)] * 12, 8, 64),
    ("gpt-oss-120b", [LayerType("sliding", 128, True), LayerType("full", None, True)] * 18, 8, 64),
])
@pytest.mark.parametrize("length,in_flight", [(32768, 8192), (131072, 2048)])
def test_real_geometries_reserve_the_format_arithmetic(name, types, heads, dim, length, in_flight):
    """Default-rule policies (sliding FP8, first and last full FP8): a request reserves at most
    2% more than the format arithmetic at block 16, where the configured block alone lost 3-9%."""
    full = [i for i, t in enumerate(types) if t.kind == "full"]
    policy = _policy(types, f"swa:fp8,full:nvfp4,{full[0]}:fp8,{full[-1]}:fp8")
    plan = hybrid_plan(policy, heads, dim, 16, length, in_flight)
    arithmetic = arithmetic_request_bytes(policy, heads, dim, length, in_flight, 16)
    assert arithmetic / plan.request_bytes >= 0.98, (name, plan)


def test_arithmetic_and_plan_inputs():
    """:func:`arithmetic_request_bytes` by hand; :func:`hybrid_plan` only for full + sliding
    layers of one sliding format."""
    swa, full = LayerType("sliding", 32), LayerType("full")
    policy = _policy([swa, full, swa], "swa:fp8,full:nvfp4")
    # full: 512 tokens x NV; sliding: min(31 + 64, 512) = 95 -> (6 + 1) blocks of 16, x F8 each
    assert arithmetic_request_bytes(policy, 2, 32, 512, 64, 16) == 512 * NV + 2 * 112 * F8
    assert hybrid_plan(policy, 2, 32, 16, 512, 64) == choose_block_sizes((NV,), F8, 2, 32, 16, 512, 64)
    assert hybrid_plan(_policy([full, full], "*:nvfp4"), 2, 32, 16, 512, 64) is None
    assert hybrid_plan(_policy([swa, full, swa], "swa:fp8,full:nvfp4,2:nvfp4"), 2, 32, 16, 512, 64) is None


@pytest.mark.parametrize("types,dim,compact", [
    ([LayerType("sliding", 32), LayerType("sliding", 32), LayerType("full")] * 4, 32,
     "swa:fp8,full:nvfp4"),  # the tiny Gemma 3
    ([LayerType("sliding", 32, True), LayerType("full", None, True)] * 6, 64,
     "swa:fp8,full:nvfp4"),  # the tiny gpt-oss
])
def test_tiny_hybrids_hold_more_than_fp8(types, dim, compact):
    """The tiny test models at 4096 tokens per request with 32 in flight (the engine test's
    chunked engine), no full-attention layer in FP8: >= 1.6x what vLLM reserves for fp8 (one
    page size: vLLM's groups of equal layer counts, no padding, so the arithmetic at block 16)."""
    policy = _policy(types, compact)
    fp8 = _policy(types, "*:fp8")
    plan = hybrid_plan(policy, 2, dim, 16, 4096, 32)
    assert arithmetic_request_bytes(fp8, 2, dim, 4096, 32, 16) / plan.request_bytes >= 1.6

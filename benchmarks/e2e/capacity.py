"""KV-cache capacity arithmetic: bytes per token of each configuration, pool layout, largest
batch, stages.

Bytes per token of ``nvfp4_mixed`` come from the library (:meth:`KVPolicy.kv_bytes_per_token`),
``fp8`` is the all-FP8 policy of the same library, ``auto`` stores the model's dtype.

The largest batch comes from the engine's pool of ``num_gpu_blocks`` blocks and its
:class:`PoolLayout`: the KV-cache groups drawing blocks from it. A dense model has one group.
A hybrid model (full + sliding-window layers) has a full-attention group and sliding-window
groups: with vLLM's own dtypes as vLLM forms them for equal pages
(``_get_kv_cache_groups_uniform_page_size``: groups of the smaller layer count, the larger one
if within 1.5x), with ``nvfp4_mixed`` as the plugin plans them
(:func:`vllm_nvfp4.integration.block_sizes.hybrid_plan`). A decoding sequence of ``T`` tokens
holds ``cdiv(T, block)`` blocks of the full group and ``cdiv(min(window, T), block) + 1`` of each
sliding group (vLLM frees the blocks behind the window); the blocks of one prefill chunk
(``max_in_flight_tokens``) of each sliding group are kept back, since vLLM frees them only once
the chunk is processed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from benchmarks.e2e.configs import CAPTURE_SIZES, CONFIGS, SMALL_BATCH, policy_for
from vllm_nvfp4.integration.block_sizes import hybrid_plan
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.policy import KVPolicy, policy_from_setting

#: ``max_num_batched_tokens`` of ``LLM()`` on an H100 / H200 in vLLM 0.32 (the in-flight tokens the
#: plan assumes when ``--max-num-batched-tokens`` is not given; a worker reads the engine's)
DEFAULT_IN_FLIGHT_TOKENS = 16384


def kv_bytes_per_token(kv_cache_dtype: str, shape: ModelShape, policy: Optional[str] = None,
                       num_skipped: int = 0) -> int:
    """Cache bytes one token occupies over all layers (K + V, NVFP4 block scales included).

    ``nvfp4`` is vLLM's own NVFP4 cache (the same bytes per element as ours); its
    ``num_skipped`` layers (``kv_cache_dtype_skip_layers``) store the model dtype.
    """
    model_dtype_layer = 2 * shape.dtype_bytes * shape.head_dim * shape.num_kv_heads
    if kv_cache_dtype == "auto":
        return model_dtype_layer * shape.num_layers
    if kv_cache_dtype == "nvfp4":
        nvfp4_layer = kv_bytes_per_token("nvfp4_mixed", shape, "*:nvfp4") // shape.num_layers
        return nvfp4_layer * (shape.num_layers - num_skipped) + model_dtype_layer * num_skipped
    if kv_cache_dtype == "fp8":
        policy = "*:fp8"
    elif kv_cache_dtype != "nvfp4_mixed":
        raise ValueError(f"no bytes-per-token rule for kv_cache_dtype {kv_cache_dtype!r}")
    if policy is None:
        raise ValueError("nvfp4_mixed needs a policy to count its bytes per token")
    return _policy(policy, shape).kv_bytes_per_token(num_kv_heads=shape.num_kv_heads,
                                                      head_dim=shape.head_dim)


def _policy(setting: str, shape: ModelShape) -> KVPolicy:
    """A compact policy string or a policy JSON file, as ``$VLLM_NVFP4_POLICY`` takes them."""
    return policy_from_setting(setting, shape.num_layers, shape.layer_types)


def bytes_per_token_by_config(shape: ModelShape, mixed_override: Optional[str] = None
                              ) -> dict[str, int]:
    """:func:`kv_bytes_per_token` of every configuration of the matrix (all KV layers)."""
    return {name: kv_bytes_per_token(c.kv_cache_dtype, shape,
                                     policy_for(c, shape.layer_types, mixed_override),
                                     len(c.skip_layers))
            for name, c in CONFIGS.items()}


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group of a pool: its kind (``full`` / ``sliding``), tokens per block, window."""

    kind: str
    block_size: int
    window: Optional[int] = None

    def blocks(self, tokens: int) -> int:
        """Blocks a decoding sequence of ``tokens`` holds in this group (module doc)."""
        if self.kind == "sliding":
            return -(-min(self.window, tokens) // self.block_size) + 1
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class PoolLayout:
    """An engine's KV pool: bytes of one pool block, the groups drawing from it."""

    block_bytes: int
    groups: tuple[KVGroup, ...]

    def blocks_per_sequence(self, tokens: int) -> int:
        return sum(g.blocks(tokens) for g in self.groups)

    def kept_back(self, in_flight_tokens: int) -> int:
        """Blocks of one prefill chunk in the sliding groups (module doc)."""
        return sum(-(-in_flight_tokens // g.block_size) for g in self.groups if g.kind == "sliding")

    def to_json(self) -> dict:
        """Block bytes and the groups, equal ones counted."""
        counted = {g: self.groups.count(g) for g in dict.fromkeys(self.groups)}
        return dict(block_bytes=self.block_bytes, groups=[dict(vars(g), count=n) for g, n in counted.items()])


def pool_layout(kv_cache_dtype: str, shape: ModelShape, policy: Optional[str], block_size: int,
                max_model_len: int, in_flight_tokens: int, num_skipped: int = 0) -> PoolLayout:
    """The :class:`PoolLayout` of one configuration (module doc); ``block_size``: the configured
    one, ``max_model_len`` and ``in_flight_tokens``: the engine's (the plugin plans with them).
    With ``num_skipped`` layers of vLLM's ``nvfp4`` in the model dtype the layout is the unpadded
    arithmetic (vLLM pads their pages to the NVFP4 page: the worker takes its report instead)."""
    kinds = {(t.kind, t.window) for t in shape.layer_types}
    if any(kind == "none" for kind, _ in kinds):
        raise ValueError("no capacity arithmetic for models with linear-attention / Mamba layers "
                         "(vLLM sizes their state pages); use a full / sliding-window model")
    if kv_cache_dtype == "nvfp4_mixed" and shape.needs_packed_groups:
        pol = _policy(policy, shape)
        plan = hybrid_plan(pol, shape.num_kv_heads, shape.head_dim, block_size, max_model_len,
                           in_flight_tokens)
        if plan is None:
            raise ValueError(f"no capacity arithmetic for policy {policy!r}: the sliding-window "
                             "layers must share one window")
        (window,) = {t.window for t in shape.layer_types if t.kind == "sliding"}
        groups = ((KVGroup("full", plan.full_block),) * plan.full_groups
                  + (KVGroup("sliding", plan.sliding_block, window),) * plan.sliding_groups)
        return PoolLayout(plan.block_bytes, groups)
    per_token = kv_bytes_per_token(kv_cache_dtype, shape, policy, num_skipped)
    if not shape.needs_packed_groups:
        return PoolLayout(per_token * block_size, (KVGroup("full", block_size),))
    # vLLM's own dtypes: every layer's page is the same; groups of group_size layers
    page = block_size * per_token // shape.num_layers
    counts = {k: sum((t.kind, t.window) == k for t in shape.layer_types) for k in kinds}
    group_size = min(counts.values())
    if max(counts.values()) < 1.5 * group_size:
        group_size = max(counts.values())
    groups = tuple(KVGroup(kind, block_size, window) for (kind, window), n in sorted(counts.items())
                   for _ in range(-(-n // group_size)))
    return PoolLayout(group_size * page, groups)


def max_batch(pool_blocks: int, layout: PoolLayout, tokens: int, in_flight_tokens: int,
              cap: int = CAPTURE_SIZES[-1]) -> int:
    """Largest number of decoding sequences of ``tokens`` tokens the pool holds (module doc)."""
    free = pool_blocks - layout.kept_back(in_flight_tokens)
    return max(0, min(cap, free // layout.blocks_per_sequence(tokens)))


def capacity_tokens(pool_blocks: int, layout: PoolLayout, max_model_len: int) -> int:
    """KV tokens the pool holds in sequences of ``max_model_len`` (fractional sequences count;
    a dense model at a ``max_model_len`` that is a multiple of the block: blocks x block size)."""
    return pool_blocks * max_model_len // layout.blocks_per_sequence(max_model_len)


def estimate_batch(kv_bytes: int, layout: PoolLayout, tokens: int, in_flight_tokens: int,
                   cap: int = CAPTURE_SIZES[-1]) -> int:
    """:func:`max_batch` of another configuration given this engine's KV bytes (same memory
    setting: its pool has ``kv_bytes // layout.block_bytes`` blocks)."""
    return max_batch(kv_bytes // layout.block_bytes, layout, tokens, in_flight_tokens, cap)


def plan_stages(own_max: int, ref_batch: Optional[int], small: int = SMALL_BATCH
                ) -> list[tuple[str, int]]:
    """Decode stages at one context: (label, batch), growing, deduplicated, each <= own_max.

    Labels: ``16`` (a small batch), ``ref`` (the reference's largest batch), ``max`` (this
    configuration's largest batch), joined with ``+`` where batches coincide.
    """
    wanted: dict[int, list[str]] = {}
    for label, b in (("16", small), ("ref", ref_batch), ("max", own_max)):
        if b and 0 < b <= own_max:
            wanted.setdefault(int(b), []).append(label)
    return [("+".join(labels), b) for b, labels in sorted(wanted.items())]

"""Tokens per block of a hybrid model's full-attention and sliding-window layers.

vLLM (0.32 and 0.33, ``_get_packed_kv_cache_groups`` under a block-outermost layout) packs the
KV-cache groups of a hybrid model into one pool of equal blocks. A block holds the pages of the
full-attention group (all full layers side by side) or those of one sliding-window group; the
sliding layers go as many to a group as fit the full group's pages (at least one), so the block
is ``max(full pages, widest sliding group)`` bytes. Whatever a group leaves empty in its blocks
is lost. With the page sizes of mixed FP8 / NVFP4 layers that loss is large at the block size
the user configured: e.g. 3 NVFP4 + 1 FP8 full layers of 2 x 32 heads have 344 B per token
(8 x 43), and no power-of-two sliding page fills more than 32/43 of their block.

:func:`choose_block_sizes` therefore picks both block sizes (multiples of 16 tokens) from what a
request at ``max_model_len`` takes from the pool, as vLLM counts it when it sizes the cache:
``cdiv(L, full block)`` full blocks and, per sliding group, ``cdiv(T, sliding block) + 1`` with
``T = min(window - 1 + in-flight tokens, L)`` (``SlidingWindowSpec``'s admission bound). Among
the plans within :data:`TOLERANCE` of the least bytes it takes the one with the finest
scheduler granularity (the lcm of the block sizes: prefix-cache hits land on its multiples), then
the configured full block size, then the smallest blocks.

Sliding layers of several K/V format pairs (several page sizes) in unequal numbers, as ``select``
writes them (Gemma 3 270M: K FP8 in 4 of 15 sliding layers), must stay in one sliding group:
vLLM splits such a bucket by a one-layer-per-page-size pattern that covers only the rarest
pair's layers and loses the rest (:func:`plan_groups`). Only plans that keep them whole are
searched; next to full layers of one page size that takes a full page at least as large as all
the sliding pages at the first sliding layer's size, so the full block may exceed
:data:`MAX_BLOCK` (:func:`_full_block_limit`).

Models with Mamba / Gated-DeltaNet layers (their state pages are vLLM's) get their block size
from vLLM (``Platform._align_hybrid_block_size``): it raises the attention block until one
attention layer's page holds a state page, pads the state page to exactly that page, and vLLM
then gives each state group blocks of the full-attention group's bytes. It asks the backend for
that one-token page; :func:`state_share_bytes_per_token` is ours: the full layers' bytes per token
over the states one of their blocks is to hold, so those blocks hold exactly that many states.
With an FP8 layer's page instead (vLLM's default for our uint8 pages), the tiny Qwen3-Next-style
model (one NVFP4 and one FP8 full layer: 400 B per token; six GDN layers) gets 528-token blocks
of 211,200 B, and each GDN group fills 135,168 B of every block it holds (one state).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from vllm_nvfp4.policy import KVPolicy

#: block sizes (tokens) searched for either kind: multiples of 16 (page planes stay 16-byte
#: aligned, :class:`vllm_nvfp4.layout.KVPageLayout`) up to this
MAX_BLOCK = 256
BLOCK_STEP = 16
#: plans whose request bytes are within this fraction of the least count as equal
TOLERANCE = 0.01


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupPlan:
    """How vLLM packs one hybrid model's groups for the given block sizes (tokens).

    ``block_bytes``: one block of the shared pool; ``full_groups`` / ``sliding_groups``: the
    full-attention and sliding-window groups it forms; ``request_blocks``: the pool blocks one
    request at ``max_model_len`` reserves."""

    full_block: int
    sliding_block: int
    sliding_groups: int
    block_bytes: int
    request_blocks: int
    full_groups: int = 1

    @property
    def request_bytes(self) -> int:
        """Bytes of the pool one request at ``max_model_len`` reserves."""
        return self.block_bytes * self.request_blocks

    @property
    def scheduler_block(self) -> int:
        """vLLM's scheduler block size for these groups (the lcm of their block sizes)."""
        return math.lcm(self.full_block, self.sliding_block)


def held_tokens(window: int, max_model_len: int, in_flight_tokens: int) -> int:
    """Tokens vLLM reserves per request for a sliding-window layer (its admission bound)."""
    return min(window - 1 + in_flight_tokens, max_model_len)


def _approximate_gcd(values: tuple[int, ...], lower: int) -> int:
    """vLLM's ``_approximate_gcd``: the group size ``d`` in ``[lower, max(values)]`` that pads
    the values least when each is rounded up to a multiple of ``d`` (ties: larger); ``lower``
    when it is above every value."""
    if lower > max(values):
        return lower
    return min(range(lower, max(values) + 1),
               key=lambda d: (sum((d - x % d) % d for x in values), -d))


def _repeats_per_group(full_layers_per_page: tuple[int, ...], num_split: int) -> int | None:
    """vLLM's split of the ``num_split`` sliding or state layers (one page size): when the full
    layers have several page sizes, as many layers of each (a 1:1 pattern), that count is the
    floor of the layers per group, and the group size minimises padding (ties: larger). None
    otherwise: the sliding / state layers are a state bucket (split only by what fits a block)."""
    counts = set(full_layers_per_page)
    if len(full_layers_per_page) < 2 or len(counts) != 1:
        return None
    (floor,) = counts
    return _approximate_gcd((floor, num_split), floor)


def _balanced(pages: Counter) -> bool:
    """Whether a bucket (layers per page size) has as many layers of each page size: vLLM's
    repeat pattern of one layer per page size."""
    return len(set(pages.values())) == 1


def _widest_group(pages: Counter, groups: int) -> int:
    """Page bytes of the largest of the ``groups`` groups vLLM splits a bucket into (each
    takes every ``groups``-th repeat of the pattern)."""
    return sum(_cdiv(n, groups) * page for page, n in pages.items())


def plan_groups(full_bytes_per_token: tuple[int, ...], sliding_bytes_per_token: tuple[int, ...],
                window: int, full_block: int, sliding_block: int, max_model_len: int,
                in_flight_tokens: int) -> Optional[GroupPlan]:
    """The :class:`GroupPlan` of one full-attention bucket and one sliding-window bucket (each
    layer's bytes per token, K + V, in model order: vLLM's order of the layers), or None where
    vLLM's ``_get_packed_kv_cache_groups`` cannot group them.

    vLLM (0.32 and 0.33 alike) takes a bucket with as many layers of each page size as a repeat
    pattern; the largest such bucket of several page sizes sets the floor of the repeats per
    group, and every balanced bucket is split into groups of that many repeats
    (:func:`_approximate_gcd`). Without such a bucket the sliding layers are a state bucket: one
    group holds as many as the block (the full group or one sliding page of each size) holds
    of the *first* sliding layer's page. A bucket of unequal page-size counts is split by the
    pattern too, which covers only the smallest count of layers: vLLM then drops layers (0.32:
    ``StopIteration``; 0.33: "KV cache groups miss layers"). So such a sliding bucket has a plan
    only when it stays one group."""
    full = Counter(full_block * b for b in full_bytes_per_token)
    sliding = Counter(sliding_block * b for b in sliding_bytes_per_token)
    buckets = (full, sliding)
    floor = max((max(c.values()) for c in buckets if _balanced(c) and len(c) > 1), default=0)
    repeats = (_approximate_gcd(tuple(max(c.values()) for c in buckets if _balanced(c)), floor)
               if floor else None)

    def split(pages: Counter) -> int:
        return _cdiv(max(pages.values()), repeats) if repeats and _balanced(pages) else 1

    full_groups, sliding_groups = split(full), split(sliding)
    if repeats is None:  # a state bucket: as many to a group as the block holds of the first page
        anchor = max(_widest_group(full, full_groups),
                     _widest_group(sliding, len(sliding_bytes_per_token)))
        per_group = max(anchor // (sliding_block * sliding_bytes_per_token[0]), 1)
        sliding_groups = _cdiv(len(sliding_bytes_per_token), per_group)
    if sliding_groups > 1 and not _balanced(sliding):
        return None
    block_bytes = max(_widest_group(full, full_groups), _widest_group(sliding, sliding_groups))
    held = held_tokens(window, max_model_len, in_flight_tokens)
    blocks = (full_groups * _cdiv(max_model_len, full_block)
              + sliding_groups * (_cdiv(held, sliding_block) + 1))
    return GroupPlan(full_block, sliding_block, sliding_groups, block_bytes, blocks, full_groups)


def _full_block_limit(full_bytes_per_token: tuple[int, ...],
                      sliding_bytes_per_token: tuple[int, ...], configured_block: int) -> int:
    """The largest full-attention block searched: :data:`MAX_BLOCK` (or the configured size if
    larger), raised where needed so that a full page of that many tokens holds every sliding
    page of :data:`BLOCK_STEP` tokens at the first sliding layer's size (then vLLM keeps sliding
    layers of unequal format counts in one group: :func:`plan_groups`)."""
    holds_all = BLOCK_STEP * _cdiv(len(sliding_bytes_per_token) * sliding_bytes_per_token[0],
                                   sum(full_bytes_per_token))
    return max(MAX_BLOCK, configured_block, holds_all)


@functools.lru_cache(maxsize=64)
def choose_block_sizes(full_bytes_per_token: tuple[int, ...],
                       sliding_bytes_per_token: tuple[int, ...], window: int,
                       configured_block: int, max_model_len: int,
                       in_flight_tokens: int) -> GroupPlan:
    """The plan (module doc) for full layers of ``full_bytes_per_token`` and sliding layers of
    ``sliding_bytes_per_token`` (model order) and ``window``: full blocks from
    ``configured_block`` up, sliding blocks from 16 up, both multiples of 16 and at most
    :data:`MAX_BLOCK` (full blocks: :func:`_full_block_limit`), among those vLLM can group."""
    if configured_block % BLOCK_STEP:
        raise ValueError(f"block size must be a multiple of {BLOCK_STEP}, got {configured_block}")
    limit = _full_block_limit(full_bytes_per_token, sliding_bytes_per_token, configured_block)
    plans = [p for fb in range(configured_block, limit + 1, BLOCK_STEP)
             for sb in range(BLOCK_STEP, MAX_BLOCK + 1, BLOCK_STEP)
             if (p := plan_groups(full_bytes_per_token, sliding_bytes_per_token, window, fb, sb,
                                  max_model_len, in_flight_tokens)) is not None]
    least = min(p.request_bytes for p in plans)
    near = [p for p in plans if p.request_bytes <= least * (1 + TOLERANCE)]
    return min(near, key=lambda p: (p.scheduler_block, p.full_block != configured_block,
                                    p.full_block, p.sliding_block))


def _layer_bytes(policy: KVPolicy, num_kv_heads: int, head_dim: int) -> list[tuple[str, int, int]]:
    """``(kind, window, bytes per token)`` of each KV layer of ``policy``, K + V, scales
    included."""
    return [(lp.layer_type.kind, lp.layer_type.window or 0,
             num_kv_heads * (lp.k.bytes_per_head(head_dim) + lp.v.bytes_per_head(head_dim)))
            for _, lp in policy.kv_layers()]


def hybrid_plan(policy: KVPolicy, num_kv_heads: int, head_dim: int, configured_block: int,
                max_model_len: int, in_flight_tokens: int) -> Optional[GroupPlan]:
    """:func:`choose_block_sizes` for a policy of full-attention and sliding-window layers of
    one window, in any mix of K/V formats; None for any other policy (one kind of layer, or
    several windows: vLLM groups those at the configured block size)."""
    layers = _layer_bytes(policy, num_kv_heads, head_dim)
    full = tuple(b for kind, _, b in layers if kind == "full")
    sliding = tuple(b for kind, _, b in layers if kind == "sliding")
    windows = {w for kind, w, _ in layers if kind == "sliding"}
    if not full or len(windows) != 1:
        return None
    (window,) = windows
    return choose_block_sizes(full, sliding, window, configured_block, max_model_len,
                              in_flight_tokens)


def unpackable_sliding_formats(policy: KVPolicy) -> Optional[str]:
    """Why vLLM cannot group this policy's sliding-window layers, or None.

    Next to full-attention layers vLLM splits a sliding bucket of several page sizes (K/V
    format pairs) in unequal numbers by a repeat pattern that drops layers
    (:func:`plan_groups`). :func:`hybrid_plan` chooses block sizes that keep such a bucket in
    one group, for full + sliding layers of one window and no others; an unequal mix beside
    layers without KV cache (their state buckets take part in vLLM's split) or sliding layers
    of another window is refused. Returns the format pairs and their layer counts for the
    error."""
    types = policy.layer_types
    windows = {t.window for t in types if t.kind == "sliding"}
    if not any(t.kind == "full" for t in types) or (
            all(t.holds_kv for t in types) and len(windows) <= 1):
        return None
    pairs: dict[int, dict[str, list[int]]] = {}  # window -> format pair -> layers
    for i, lp in policy.kv_layers():
        if lp.layer_type.kind == "sliding":
            pairs.setdefault(lp.layer_type.window, {}).setdefault(
                f"k={lp.k},v={lp.v}", []).append(i)
    unequal = [(w, by_pair) for w, by_pair in pairs.items()
               if len({len(layers) for layers in by_pair.values()}) > 1]
    if not unequal:
        return None
    return "; ".join(f"{len(layers)} with {pair} (window {w}: layers {', '.join(map(str, layers))})"
                     for w, by_pair in unequal for pair, layers in by_pair.items())


def state_share_bytes_per_token(policy: KVPolicy, num_kv_heads: int,
                                head_dim: int) -> Optional[int]:
    """The one-token attention page vLLM is to size a state-layer hybrid's blocks by (module
    doc), for a policy of full-attention layers and layers without KV cache; None for any other.

    One block of the full-attention group is to hold ``k`` state pages: vLLM's layer repeat when
    the full layers have several page sizes in equal counts (vLLM splits the state layers by it;
    at most the number of states), else the state layers spread evenly over as many groups as
    fp8 gets (groups of at most as many states as there are full layers). The page is the full
    layers' bytes per token over ``k``, rounded down (what a block leaves is under ``k`` bytes per
    token)."""
    layers = _layer_bytes(policy, num_kv_heads, head_dim)
    full = [b for kind, _, b in layers if kind == "full"]
    states = sum(1 for t in policy.layer_types if not t.holds_kv)
    if not states or not full or len(full) != len(layers):
        return None
    repeats = _repeats_per_group(tuple(Counter(full).values()), states)
    k = min(repeats, states) if repeats is not None else _cdiv(states, _cdiv(states, len(full)))
    return sum(full) // k


def arithmetic_request_bytes(policy: KVPolicy, num_kv_heads: int, head_dim: int,
                             max_model_len: int, in_flight_tokens: int, block_size: int) -> int:
    """The format arithmetic of one request at ``max_model_len``: what vLLM would reserve for it
    if every page were packed without loss at ``block_size``: each full-attention layer
    ``cdiv(L, block) * block`` tokens, each sliding layer ``(cdiv(T, block) + 1) * block``
    (:func:`held_tokens`), times the layer's bytes per token."""
    total = 0
    for kind, window, per_token in _layer_bytes(policy, num_kv_heads, head_dim):
        if kind == "sliding":
            blocks = _cdiv(held_tokens(window, max_model_len, in_flight_tokens), block_size) + 1
        else:
            blocks = _cdiv(max_model_len, block_size)
        total += blocks * block_size * per_token
    return total

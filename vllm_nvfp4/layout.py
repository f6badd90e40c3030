"""Byte layout of one cache page: one block of one layer, K and V together, scales included.

A layer's cache is a ``torch.uint8`` tensor ``cache [num_blocks, page_bytes]`` with
``cache.stride(1) == 1`` and any ``cache.stride(0) >= page_bytes`` (vLLM may interleave the pages
of several layers inside one block). Inside a page, with ``H`` KV heads, block size ``B`` and head
dim ``D``, the planes follow each other with no padding::

    page ──► ┌──────────────────────────────┐ k_data_offset (= 0)
             │ K data   [H, B, Wk] uint8    │ fp8: Wk = D (E4M3), nvfp4: Wk = D/2 (E2M1 codes in
             │                              │      chunk-planar order, see below)
             ├──────────────────────────────┤ k_scale_offset
             │ K scales [H, B, D/16] e4m3   │ nvfp4 only (0 bytes for fp8); token-major: the
             │                              │ D/16 block scales of one token are contiguous
             ├──────────────────────────────┤ v_data_offset
             │ V data   [H, B, Wv] uint8    │
             ├──────────────────────────────┤ v_scale_offset
             │ V scales [H, B, D/16] e4m3   │ nvfp4 only
             └──────────────────────────────┘ page_bytes

Why this arrangement (for the decode kernel, which walks one KV head through a block table):

* Head-major planes: one (block, head) tile of K or V data is ``B * W`` contiguous bytes
  (1 KiB of NVFP4 for B=16, D=128) - a single fully coalesced, 16-byte-aligned load.
* The data plane holds only data, so every row starts 16-byte aligned (``D/2`` is a multiple of
  8 and ``B`` of 16), unlike vLLM's inline ``[D/2 | D/16]`` rows of 72 bytes that are only 8-byte
  aligned and so need narrower loads.
* Token-major scales: the attention kernels hold a token's partial scores (one per 16-element
  chunk) in the registers of one thread, which then needs all ``D/16`` scales of that token: one
  8-byte shared-memory load for D=128 instead of one byte load per chunk, as a chunk-major
  scale plane would need. A (block, head) scale tile is still ``B * D/16`` contiguous bytes, one
  asynchronous copy.

Chunk-planar nibble order of an NVFP4 data row (``D/2`` bytes of one token and head): the head
vector is cut into groups of 64 elements (4 chunks of 16; a last group of ``D % 64`` elements has
fewer chunks), and inside a group of ``nc`` chunks nibble position ``nc * i + j`` holds element
``16 * j + i``. Positions pack two per byte, the even one ``a`` and the odd one ``b`` (E2M1 codes:
sign bit 3, magnitude bits 0-2) as :func:`pack_e2m1_pair`: ``a``'s magnitude at bits 1-3 and sign
at bit 7, ``b``'s magnitude at bits 4-6 and sign at bit 0. For a full group this reads: the
little-endian 16-bit word ``i`` holds element ``16 j + i`` of chunk ``j`` with magnitude and sign
at bits (1-3, 7), (4-6, 0), (9-11, 15), (12-14, 8) for ``j`` = 0..3, so ONE 16-element block is one
plane of 16 consecutive words. Chunk 2 sits where an fp16 keeps sign and exponent, so
``word & 0x8E00`` is its element times 2^-14 as fp16 (subnormal code 1 included); chunk 0 is the
same 8 bits lower, and one 3-input logic op gathers chunk 3's magnitudes (shifted by 3) and signs
(shifted by 7) into one word in which chunk 3 is in place and chunk 1 is 8 bits lower. The decode
kernel so turns a 32-bit register into four fp16x2 MMA operands in 9 integer ops (adjacent
nibbles would take 11), and applies the block scale to the partial dot product of each chunk
instead of multiplying every element (:func:`nvfp4_element_order` gives the permutation;
:func:`nvfp4_rows_from_packed` converts from :mod:`vllm_nvfp4.formats`' packing).

``page_bytes == B * H * (bytes_per_head(k_format, D) + bytes_per_head(v_format, D))`` exactly;
with ``B % 16 == 0`` every plane offset is a multiple of 16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from vllm_nvfp4.formats import NVFP4_BLOCK_SIZE, KVFormat, bytes_per_head, check_kv_format

KV = Literal["k", "v"]
PAGE_ALIGN = 16
NIBBLE_GROUP = 64  # elements per group of the chunk-planar nibble order


@functools.lru_cache(maxsize=None)
def _element_order(head_dim: int) -> tuple[int, ...]:
    order: list[int] = []
    for start in range(0, head_dim, NIBBLE_GROUP):
        chunks = min(NIBBLE_GROUP, head_dim - start) // NVFP4_BLOCK_SIZE
        order += [start + NVFP4_BLOCK_SIZE * j + i
                  for i in range(NVFP4_BLOCK_SIZE) for j in range(chunks)]
    return tuple(order)


def nvfp4_element_order(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 ``[head_dim]``: the element of the head vector at each nibble position of an NVFP4
    data row (chunk-planar order, module doc). Position ``p`` is the low nibble of byte ``p // 2``
    when ``p`` is even. ``head_dim`` must be a multiple of 16."""
    if head_dim <= 0 or head_dim % NVFP4_BLOCK_SIZE:
        raise ValueError(f"head_dim must be a positive multiple of 16, got {head_dim}")
    return torch.tensor(_element_order(head_dim), dtype=torch.int64, device=device)


def pack_e2m1_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The data-plane byte of E2M1 codes ``a`` (even nibble position) and ``b`` (odd), uint8:
    ``a``'s magnitude at bits 1-3 and sign at bit 7, ``b``'s magnitude at bits 4-6 and sign at
    bit 0 (module doc). Two zero codes give byte 0."""
    return ((a & 7) << 1) | ((a & 8) << 4) | ((b & 7) << 4) | (b >> 3)


def unpack_e2m1_pair(byte: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_e2m1_pair`: data-plane bytes (uint8) -> their codes ``(a, b)``."""
    return ((byte >> 1) & 7) | ((byte >> 4) & 8), ((byte >> 4) & 7) | ((byte & 1) << 3)


def _row_nibbles(rows: torch.Tensor) -> torch.Tensor:
    """Data-plane rows uint8 ``[..., W]`` -> the codes at their nibble positions ``[..., 2W]``."""
    return torch.stack(unpack_e2m1_pair(rows), dim=-1).flatten(-2)


def _row_bytes(nib: torch.Tensor) -> torch.Tensor:
    """Codes at nibble positions ``[..., 2W]`` -> data-plane rows ``[..., W]``."""
    pairs = nib.unflatten(-1, (-1, 2))
    return pack_e2m1_pair(pairs[..., 0], pairs[..., 1])


def _packed_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """:mod:`vllm_nvfp4.formats`' packing ``[..., W]`` (element ``2i`` in the low nibble of byte
    ``i``) -> codes in element order ``[..., 2W]``."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def nvfp4_rows_from_packed(packed: torch.Tensor) -> torch.Tensor:
    """:func:`vllm_nvfp4.formats.nvfp4_quantize`'s ``packed [..., D/2]`` (element order) -> the
    data-plane rows ``[..., D/2]`` (chunk-planar order, :func:`pack_e2m1_pair` bytes)."""
    order = nvfp4_element_order(packed.shape[-1] * 2, packed.device)
    return _row_bytes(_packed_nibbles(packed).index_select(-1, order))


def nvfp4_packed_from_rows(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nvfp4_rows_from_packed`: data-plane rows -> element-order ``packed``."""
    order = nvfp4_element_order(rows.shape[-1] * 2, rows.device)
    nib = torch.empty_like(_row_nibbles(rows))
    nib[..., order] = _row_nibbles(rows)
    pairs = nib.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


@dataclass(frozen=True)
class KVPageLayout:
    """Byte offsets of the K/V data and scale planes inside one cache page (see module doc).

    Immutable; the offsets and sizes are computed on first use and kept (they are read on every
    cache operation).
    """

    num_kv_heads: int
    head_dim: int
    block_size: int
    k_format: KVFormat
    v_format: KVFormat

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_format", check_kv_format(self.k_format))
        object.__setattr__(self, "v_format", check_kv_format(self.v_format))
        if self.num_kv_heads <= 0:
            raise ValueError(f"num_kv_heads must be > 0, got {self.num_kv_heads}")
        if self.head_dim <= 0 or self.head_dim % NVFP4_BLOCK_SIZE != 0:
            raise ValueError(f"head_dim must be a positive multiple of 16, got {self.head_dim}")
        if self.block_size <= 0 or self.block_size % PAGE_ALIGN != 0:
            raise ValueError(
                f"block_size must be a positive multiple of {PAGE_ALIGN} (keeps every plane "
                f"16-byte aligned), got {self.block_size}"
            )

    # ---- per-format widths -------------------------------------------------------------------
    def format_of(self, which: KV) -> str:
        """``k_format`` or ``v_format``."""
        if which == "k":
            return self.k_format
        if which == "v":
            return self.v_format
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")

    def data_width(self, which: KV) -> int:
        """Bytes of one head vector in the data plane: D (fp8) or D/2 (nvfp4)."""
        return self.format_of(which).data_width(self.head_dim)

    @property
    def scales_per_head(self) -> int:
        """NVFP4 block scales per head vector: D/16."""
        return self.head_dim // NVFP4_BLOCK_SIZE

    def has_scales(self, which: KV) -> bool:
        """True when the plane is NVFP4 (it then has a block-scale plane)."""
        return self.format_of(which).has_block_scales

    # ---- plane sizes and offsets (bytes) -----------------------------------------------------
    def data_bytes(self, which: KV) -> int:
        """Size of the K or V data plane in one page."""
        return self.num_kv_heads * self.block_size * self.data_width(which)

    def scale_bytes(self, which: KV) -> int:
        """Size of the K or V block-scale plane in one page (0 for fp8)."""
        if not self.has_scales(which):
            return 0
        return self.num_kv_heads * self.block_size * self.scales_per_head

    @property
    def k_data_offset(self) -> int:
        return 0

    @functools.cached_property
    def k_scale_offset(self) -> int:
        return self.k_data_offset + self.data_bytes("k")

    @functools.cached_property
    def v_data_offset(self) -> int:
        return self.k_scale_offset + self.scale_bytes("k")

    @functools.cached_property
    def v_scale_offset(self) -> int:
        return self.v_data_offset + self.data_bytes("v")

    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes of one cache block of one layer, K and V together, scales included."""
        return self.v_scale_offset + self.scale_bytes("v")

    def data_offset(self, which: KV) -> int:
        return self.k_data_offset if which == "k" else self.v_data_offset

    def scale_offset(self, which: KV) -> int:
        return self.k_scale_offset if which == "k" else self.v_scale_offset

    @functools.cached_property
    def bytes_per_token(self) -> int:
        """Cache bytes per token (all heads, K and V): ``page_bytes / block_size``."""
        return self.num_kv_heads * (
            bytes_per_head(self.k_format, self.head_dim) + bytes_per_head(self.v_format, self.head_dim)
        )

    # ---- views of a cache --------------------------------------------------------------------
    def check_cache(self, cache: torch.Tensor) -> None:
        """Raise ``ValueError``/``TypeError`` unless ``cache`` is a valid ``[N, >=page_bytes]`` view."""
        if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8:
            raise TypeError(f"cache must be a torch.uint8 tensor, got {getattr(cache, 'dtype', cache)}")
        if cache.dim() != 2:
            raise ValueError(f"cache must be 2-D [num_blocks, page_bytes], got shape {tuple(cache.shape)}")
        if cache.shape[1] != self.page_bytes:
            raise ValueError(
                f"cache rows hold {cache.shape[1]} bytes but this layout's page is "
                f"{self.page_bytes} bytes ({self})"
            )
        if cache.stride(1) != 1 or (cache.shape[0] > 1 and cache.stride(0) < self.page_bytes):
            raise ValueError(
                f"cache needs stride(1) == 1 and stride(0) >= {self.page_bytes}, "
                f"got strides {tuple(cache.stride())}"
            )

    def data_plane(self, cache: torch.Tensor, which: KV) -> torch.Tensor:
        """View ``uint8 [num_blocks, H, B, W]`` of the K or V data plane of ``cache`` (no copy)."""
        self.check_cache(cache)
        h, b, w = self.num_kv_heads, self.block_size, self.data_width(which)
        return torch.as_strided(
            cache,
            (cache.shape[0], h, b, w),
            (cache.stride(0), b * w, w, 1),
            cache.storage_offset() + self.data_offset(which),
        )

    def scale_plane(self, cache: torch.Tensor, which: KV) -> torch.Tensor:
        """View ``uint8 [num_blocks, H, B, D/16]`` of the K or V block scales (NVFP4 only)."""
        if not self.has_scales(which):
            raise ValueError(f"the {which.upper()} plane is {self.format_of(which)}: it has no scales")
        self.check_cache(cache)
        h, b, c = self.num_kv_heads, self.block_size, self.scales_per_head
        return torch.as_strided(
            cache,
            (cache.shape[0], h, b, c),
            (cache.stride(0), b * c, c, 1),
            cache.storage_offset() + self.scale_offset(which),
        )


def allocate_cache(
    layout: KVPageLayout,
    num_blocks: int,
    device: torch.device | str = "cpu",
    row_stride: int | None = None,
) -> torch.Tensor:
    """Zeroed ``uint8 [num_blocks, page_bytes]`` cache; ``row_stride`` (>= page_bytes) spaces rows apart
    to mimic vLLM's interleaving of layers inside one block."""
    stride = layout.page_bytes if row_stride is None else row_stride
    if stride < layout.page_bytes:
        raise ValueError(f"row_stride {stride} < page_bytes {layout.page_bytes}")
    backing = torch.zeros(num_blocks * stride, dtype=torch.uint8, device=device)
    return backing.view(num_blocks, stride)[:, : layout.page_bytes]

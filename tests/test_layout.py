"""KVPageLayout: page size formula, aligned non-overlapping planes, views of strided caches."""

import itertools

import pytest
import torch

from vllm_nvfp4.formats import bytes_per_head, e2m1_value
from vllm_nvfp4.layout import (
    KVPageLayout,
    allocate_cache,
    nvfp4_element_order,
    nvfp4_packed_from_rows,
    nvfp4_rows_from_packed,
    pack_e2m1_pair,
    unpack_e2m1_pair,
)

FORMATS = ("fp8", "nvfp4")


@pytest.mark.parametrize("kf,vf", list(itertools.product(FORMATS, FORMATS)))
@pytest.mark.parametrize("h,d,b", [(1, 64, 16), (8, 128, 16), (3, 256, 32), (5, 16, 48)])
def test_page_bytes_and_planes(kf, vf, h, d, b):
    lay = KVPageLayout(h, d, b, kf, vf)
    assert lay.page_bytes == b * h * (bytes_per_head(kf, d) + bytes_per_head(vf, d))
    assert lay.bytes_per_token * b == lay.page_bytes
    planes = [
        (lay.k_data_offset, lay.data_bytes("k")),
        (lay.k_scale_offset, lay.scale_bytes("k")),
        (lay.v_data_offset, lay.data_bytes("v")),
        (lay.v_scale_offset, lay.scale_bytes("v")),
    ]
    end = 0
    for off, size in planes:  # contiguous, in order, no gaps, each 16-byte aligned
        assert off == end and off % 16 == 0
        end = off + size
    assert end == lay.page_bytes
    assert (lay.scale_bytes("k") > 0) == (kf == "nvfp4")


@pytest.mark.parametrize(
    "args,err",
    [
        ((0, 128, 16, "fp8", "fp8"), "num_kv_heads"),
        ((2, 100, 16, "fp8", "fp8"), "head_dim"),
        ((2, 128, 8, "fp8", "fp8"), "block_size"),
        ((2, 128, 16, "int4", "fp8"), "unknown KV format"),
    ],
)
def test_invalid_layouts_raise(args, err):
    with pytest.raises(ValueError, match=err):
        KVPageLayout(*args)


def test_views_address_the_documented_bytes():
    lay = KVPageLayout(3, 32, 16, "nvfp4", "fp8")
    cache = allocate_cache(lay, 5, row_stride=lay.page_bytes + 80)
    assert cache.stride() == (lay.page_bytes + 80, 1)
    blk, head, tok, chunk = 3, 2, 7, 1
    lay.data_plane(cache, "k")[blk, head, tok, 5] = 11
    lay.scale_plane(cache, "k")[blk, head, tok, chunk] = 22
    lay.data_plane(cache, "v")[blk, head, tok, 31] = 33
    raw = cache.as_strided((5 * (lay.page_bytes + 80),), (1,), 0)
    base = blk * (lay.page_bytes + 80)
    w_k = lay.data_width("k")
    assert raw[base + lay.k_data_offset + (head * 16 + tok) * w_k + 5] == 11
    assert raw[base + lay.k_scale_offset + (head * 16 + tok) * 2 + chunk] == 22
    assert raw[base + lay.v_data_offset + (head * 16 + tok) * 32 + 31] == 33
    assert int((raw != 0).sum()) == 3  # nothing else touched, the row gaps included
    with pytest.raises(ValueError, match="no scales"):
        lay.scale_plane(cache, "v")


def test_check_cache_rejects_bad_caches():
    lay = KVPageLayout(2, 64, 16, "fp8", "nvfp4")
    with pytest.raises(TypeError):
        lay.check_cache(torch.zeros(4, lay.page_bytes, dtype=torch.int8))
    with pytest.raises(ValueError, match="page is"):
        lay.check_cache(torch.zeros(4, lay.page_bytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="stride"):
        lay.check_cache(torch.zeros(lay.page_bytes, 4, dtype=torch.uint8).t())


def test_nvfp4_chunk_planar_order():
    """Hand-checked positions: in a full 64-group 16-bit word i holds element 16 j + i of each
    chunk j; a 32-element tail group interleaves its 2 chunks; the row helpers invert."""
    order = nvfp4_element_order(96)
    assert order[:8].tolist() == [0, 16, 32, 48, 1, 17, 33, 49]
    assert order[60:64].tolist() == [15, 31, 47, 63]
    assert order[64:70].tolist() == [64, 80, 65, 81, 66, 82]
    assert sorted(order.tolist()) == list(range(96))
    packed = torch.randint(0, 256, (5, 3, 48), dtype=torch.uint8)
    rows = nvfp4_rows_from_packed(packed)
    assert torch.equal(nvfp4_packed_from_rows(rows), packed)
    # byte 0 of the row holds element 0 (magnitude bits 1-3, sign bit 7) and element 16
    # (chunk 1: magnitude bits 4-6, sign bit 0)
    elem0, elem16 = packed[..., 0] & 0xF, packed[..., 8] & 0xF
    byte0 = ((elem0 & 7) << 1) | ((elem0 >> 3) << 7) | ((elem16 & 7) << 4) | (elem16 >> 3)
    assert torch.equal(rows[..., 0], byte0)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_element_order(40)


def test_e2m1_pair_bytes_hand_values():
    """The data-plane byte of two codes: -1.5 (0b1011) and 4 (0b0110) -> 0xE6; 0.5 (0b0001) and
    -6 (0b1111) -> 0x73; every pair a different byte, unpacked back; zeros -> 0."""
    a = torch.tensor([0b1011, 0b0001, 0], dtype=torch.uint8)
    b = torch.tensor([0b0110, 0b1111, 0], dtype=torch.uint8)
    assert pack_e2m1_pair(a, b).tolist() == [0xE6, 0x73, 0]
    codes = torch.arange(16, dtype=torch.uint8)
    a, b = codes.repeat_interleave(16), codes.repeat(16)
    byte = pack_e2m1_pair(a, b)
    assert sorted(byte.tolist()) == list(range(256))
    ua, ub = unpack_e2m1_pair(byte)
    assert torch.equal(ua, a) and torch.equal(ub, b)


def test_word_decode_places_each_chunk_as_fp16():
    """The decode kernel's 9 integer ops on a 32-bit word of two 16-bit words (the asm in
    kernels/attention.py, here in int64): chunk j's element comes out as fp16 ``e2m1 * 2^-14``,
    for every code of every chunk in both halves."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (4096, 2, 4), dtype=torch.uint8, generator=gen)  # word, half, chunk
    lo = pack_e2m1_pair(codes[..., 0], codes[..., 1]).long()  # byte 2i: chunks 0, 1
    hi = pack_e2m1_pair(codes[..., 2], codes[..., 3]).long()  # byte 2i + 1: chunks 2, 3
    half = lo | (hi << 8)
    w = half[:, 0] | (half[:, 1] << 16)
    u32 = 0xFFFFFFFF
    m = 0x8E008E00
    t = ((w >> 3) & 0x0E0E0E0E) | ((w << 7) & u32 & ~0x0E0E0E0E)
    planes = [(w << 8) & m, (t << 8) & m, w & m, t & m]
    for j, plane in enumerate(planes):
        for h in range(2):
            bits = ((plane >> (16 * h)) & 0xFFFF).to(torch.int16)
            got = bits.view(torch.float16).float() * 2.0 ** 14
            assert torch.equal(got, e2m1_value(codes[:, h, j])), (j, h)


def test_kept_offsets_leave_equality_hash_and_pickling_alone():
    import pickle

    used = KVPageLayout(3, 64, 32, "nvfp4", "fp8")
    offsets = (used.k_scale_offset, used.v_data_offset, used.v_scale_offset, used.page_bytes)
    assert offsets == (3 * 32 * 32, 3 * 32 * 36, 3 * 32 * 100, 3 * 32 * 100)
    fresh = KVPageLayout(3, 64, 32, "nvfp4", "fp8")
    assert used == fresh and hash(used) == hash(fresh) and repr(used) == repr(fresh)
    again = pickle.loads(pickle.dumps(used))
    assert again == used and again.page_bytes == used.page_bytes == used.bytes_per_token * 32
    assert used != KVPageLayout(3, 64, 32, "fp8", "nvfp4")

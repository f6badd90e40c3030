"""Serving the rotating K center (policy ``k_rot``): each token's position from the step's
metadata, the write storing ``K - mu' - R(p) b_k`` (torch and Triton), the readers adding ``R(p)
b_k`` back (paged attention through ``LayerOps``, the dense prefill's dequantization), and the
per-rank policy values under tensor parallelism. Random, never-zero inputs, odd shapes; Triton
under ``TRITON_INTERPRET=1`` without a GPU."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paged_cases import random_kv, roundtrip, scales_for  # noqa: E402
from vllm_nvfp4 import ops  # noqa: E402
from vllm_nvfp4.kernels.launch import RotCenter  # noqa: E402
from vllm_nvfp4.key_transform import rot_offset  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout, allocate_cache  # noqa: E402
from vllm_nvfp4.paged_torch import attend_one_sequence, quantize_heads  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
BACKENDS = ["torch", "triton"] if CUDA or os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]
FAR = 100_003  # positions near 1e5: a plain FP32 angle is off by ~4e-3 rad there


def rope_theta(d: int, base: float = 10000.0) -> torch.Tensor:
    return (base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)).float()


def make_rot(h: int, d: int, k: int, seed: int) -> RotCenter:
    """Each head's ``k`` pairs of largest ``|b_pair|`` of a random ``b`` of the keys' size."""
    gen = torch.Generator().manual_seed(seed)
    b = torch.randn(h, d, generator=gen) * 3.0 + 0.1
    rot = RotCenter.top_pairs(b, rope_theta(d), k)
    return RotCenter(rot.idx.to(DEV), rot.b.to(DEV), rot.theta.to(DEV))


def rotate64(rot: RotCenter, pos: torch.Tensor, d: int) -> torch.Tensor:
    """``R(p) b_k`` in float64, written out independently of ``rot_offset``: ``[L, H, D]``."""
    out = torch.zeros(pos.shape[0], rot.idx.shape[0], d, dtype=torch.float64)
    for h in range(rot.idx.shape[0]):
        for n, i in enumerate(rot.idx[h].tolist()):
            ang = pos.double() * float(rot.theta[h, n])
            b1, b2 = float(rot.b[h, 0, n]), float(rot.b[h, 1, n])
            out[:, h, i] = b1 * ang.cos() - b2 * ang.sin()
            out[:, h, i + d // 2] = b2 * ang.cos() + b1 * ang.sin()
    return out


def test_rot_offset_is_the_rotated_center():
    rot = make_rot(3, 64, 5, 0)
    pos = torch.tensor([0, 1, 7, 4093, FAR, 2**23 + 11])
    want = rotate64(rot, pos, 64)
    got = rot_offset(rot.idx, rot.b, rot.theta, pos, 64)
    assert got.dtype == torch.float32 and torch.equal(got.double(), want.float().double())
    plain = torch.tensor([True, False, True])
    skipped = rot_offset(rot.idx, rot.b, rot.theta, pos, 64, plain)
    assert (skipped[0, 0] == 0).all() and (skipped[0, 2] == 0).all()
    assert torch.equal(skipped[0, 1], got[0, 1]) and torch.equal(skipped[1:], got[1:])


# ---------------------------------------------------------------------------- positions
def _definition(q_lens, seq_lens, n):
    want = torch.full((n,), -1, dtype=torch.int32)
    t = 0
    for q, l in zip(q_lens, seq_lens):
        want[t:t + q] = torch.arange(l - q, l)
        t += q
    return want


def _positions(q_lens, seq_lens, n, num_reqs=None):
    from vllm_nvfp4.integration.backend import token_positions

    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = torch.full((n,), 77, dtype=torch.int32)
    rows = torch.arange(n, dtype=torch.int32)
    got = token_positions(qsl, torch.tensor(seq_lens, dtype=torch.int32),
                          len(q_lens) if num_reqs is None else num_reqs, rows, out)
    assert got is out
    return got


def test_token_positions_of_a_hand_built_batch():
    """Decode (ctx 9), a fresh prefill of 4, an empty padded request, a 1-token prompt, a later
    chunk of a chunked prefill (20 done + 5), a prefix-cache hit (12 cached + 3 new), a
    speculative verify (1 + 2 tokens at ctx 20), a fresh prefill of 2; 4 spare rows."""
    q_lens = [1, 4, 0, 1, 5, 3, 3, 2]
    seq_lens = [10, 4, 0, 1, 25, 15, 23, 2]
    got = _positions(q_lens, seq_lens, 23)
    want = [9, 0, 1, 2, 3, 0, 20, 21, 22, 23, 24, 12, 13, 14, 20, 21, 22, 0, 1, -1, -1, -1, -1]
    assert got.tolist() == want
    assert torch.equal(got, _definition(q_lens, seq_lens, 23))


def _random_batch(gen: torch.Generator, fresh: float) -> tuple[list[int], list[int], list[int]]:
    """1-8 requests of 0-5 query tokens, each with no context (probability ``fresh``) or up to
    3000 tokens of it, then 0-3 empty padded requests: ``q_lens``, ``seq_lens`` (padded
    included) and the live requests' contexts."""
    live = int(torch.randint(1, 9, (1,), generator=gen))
    q = torch.randint(0, 6, (live,), generator=gen)
    ctx = torch.randint(0, 3000, (live,), generator=gen) * (torch.rand(live, generator=gen) >= fresh)
    pad = int(torch.randint(0, 4, (1,), generator=gen))
    return q.tolist() + [0] * pad, (q + ctx).tolist() + [0] * pad, ctx.tolist()


def test_token_positions_of_random_batches_with_padded_requests():
    gen = torch.Generator().manual_seed(3)
    for trial in range(60):
        q_lens, seq_lens, _ = _random_batch(gen, fresh=0.4)
        n = sum(q_lens) + (0 if trial % 2 else 5)
        if n == 0:
            continue
        got = _positions(q_lens, seq_lens, n)
        assert torch.equal(got, _definition(q_lens, seq_lens, n)), (trial, q_lens, seq_lens)


def test_fields_from_vllm_positions_equal_the_derived_ones():
    """The builder's fast path: vLLM's positions (the model runner's ``num_computed + i``, a full
    graph's padded tokens 0) give every real token the position and the position-0 mark that
    :func:`token_positions` and :func:`mark_first_keys` derive from the query and sequence
    lengths; :func:`vllm_token_positions` takes only one integer position per token."""
    from types import SimpleNamespace

    from vllm_nvfp4.integration.backend import (fields_from_vllm_positions, mark_first_keys,
                                                vllm_token_positions)

    gen = torch.Generator().manual_seed(5)
    for trial in range(40):
        q_lens, seq_lens, ctx = _random_batch(gen, fresh=0.5)
        real = sum(q_lens)
        padded = real + int(torch.randint(0, 5, (1,), generator=gen))
        vllm_pos = torch.zeros(padded, dtype=torch.int64)
        vllm_pos[:real] = torch.cat([c + torch.arange(n) for n, c in zip(q_lens, ctx)])
        size = padded + 3
        out = torch.full((size,), 99, dtype=torch.int32)
        marks = torch.zeros(size, dtype=torch.bool)
        assert fields_from_vllm_positions(vllm_pos, out, marks) == padded
        assert torch.equal(out[:real], _definition(q_lens, seq_lens, real)), trial
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        derived = mark_first_keys(qsl, torch.tensor(seq_lens, dtype=torch.int32), len(q_lens),
                                  torch.zeros(size + 1, dtype=torch.int32),
                                  torch.ones(size, dtype=torch.bool))
        assert torch.equal(marks[:real], derived[:real]), trial
        assert fields_from_vllm_positions(vllm_pos, out[:2], None) == min(padded, 2)
    pos = torch.arange(5)
    assert vllm_token_positions(SimpleNamespace(positions=pos, num_actual_tokens=5)) is pos
    for bad in (None, torch.zeros(3, 5, dtype=torch.int64), pos.float(), pos[:4]):
        assert vllm_token_positions(SimpleNamespace(positions=bad, num_actual_tokens=5)) is None


# ---------------------------------------------------------------------------- the write
def _write_case(kf: str, seed: int):
    lay = KVPageLayout(3, 64, 16, kf, "nvfp4")
    gen = torch.Generator().manual_seed(seed)
    t = 37
    key = random_kv(t, 3, 64, gen) * 2.0
    value = random_kv(t, 3, 64, gen)
    pos = torch.randint(FAR - 500, FAR + 500, (t,), generator=gen, dtype=torch.int32)
    pos[[0, 5, 17]] = 0  # first keys of three sequences
    pos[9] = 1
    blocks = 8
    slots = torch.randperm(blocks * 16, generator=gen)[:t]
    slots[11] = -1  # a padded token
    rot = make_rot(3, 64, 8, seed)
    plain = torch.tensor([1, 0, 1], dtype=torch.int32)
    k_scale = scales_for(key - rot_offset(rot.idx.cpu(), rot.b.cpu(), rot.theta.cpu(), pos, 64),
                         kf, gen)
    v_scale = scales_for(value, "nvfp4", gen)
    return lay, key, value, pos, slots, rot, plain, k_scale, v_scale


def _stored_k(lay, cache, slots):
    """K data (and scale) bytes of the given slots: ``[T, H, W]``."""
    keep = slots >= 0
    s = slots[keep].long()
    data = lay.data_plane(cache, "k")[s // 16, :, s % 16]
    sc = lay.scale_plane(cache, "k")[s // 16, :, s % 16] if lay.has_scales("k") else None
    return data.cpu(), None if sc is None else sc.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kf", ["nvfp4", "fp8"])
def test_write_stores_the_key_minus_the_rotating_center(backend, kf):
    """Bytes of ``quantize(K - R(p) b_k)``, the flagged heads' position-0 keys as given; on a GPU
    the Triton write's FP32 offset may move a value across a rounding boundary now and then (the
    interpreter's is bit-equal here)."""
    lay, key, value, pos, slots, rot, plain, k_scale, v_scale = _write_case(kf, 1)
    cache = allocate_cache(lay, 8, DEV)
    cache.fill_(0)
    ops.write_kv_cache(key.to(DEV), value.to(DEV), cache, slots.to(DEV), lay, k_scale.to(DEV),
                       v_scale.to(DEV), backend=backend, rot_center=rot, positions=pos.to(DEV),
                       key0_plain=plain.to(DEV))
    got, got_sc = _stored_k(lay, cache, slots)
    keep = slots >= 0

    def expected(shifted):
        data, sc = quantize_heads(shifted[keep], kf, k_scale)
        return data, sc

    want, want_sc = expected(key - rotate64(rot, pos, 64).float().masked_fill(
        ((pos[:, None] == 0) & plain.bool()[None, :])[..., None], 0.0))
    plain_data, _ = expected(key)
    assert (got != plain_data).float().mean() > 0.15  # the offset (8 of 32 pairs) is there
    if backend == "torch" or not CUDA:
        assert torch.equal(got, want) and (want_sc is None or torch.equal(got_sc, want_sc))
    else:
        assert (got == want).float().mean() > 0.99
        assert want_sc is None or (got_sc == want_sc).float().mean() > 0.99
    first = (pos[keep] == 0)
    flagged = first[:, None] & plain.bool()[None, :]
    unflagged = first[:, None] & ~plain.bool()[None, :]
    assert torch.equal(got[flagged], plain_data[flagged])  # the sink key stored as computed
    assert not torch.equal(got[unflagged], plain_data[unflagged])  # R(0) b_k = b_k subtracted


def test_write_needs_positions_and_checks_the_center():
    lay, key, value, pos, slots, rot, plain, k_scale, v_scale = _write_case("nvfp4", 2)
    cache = allocate_cache(lay, 8, "cpu")
    layer = ops.LayerOps(cache, lay, k_scale, v_scale, backend="torch",
                         rot_center=RotCenter(rot.idx.cpu(), rot.b.cpu(), rot.theta.cpu()))
    with pytest.raises(ValueError, match="positions"):
        layer.write(key, value, slots)
    with pytest.raises(ValueError, match="positions must be"):
        layer.write(key, value, slots, pos[:5])
    three = RotCenter.top_pairs(torch.randn(3, 64), rope_theta(64), 3)
    ops.LayerOps(cache, lay, k_scale, v_scale, backend="torch", rot_center=three)  # any k
    with pytest.raises(ValueError, match="power of 2"):
        ops.LayerOps(cache, lay, k_scale, v_scale, backend="triton", rot_center=three)
    with pytest.raises(ValueError, match="key0_plain"):
        ops.LayerOps(cache, lay, k_scale, v_scale, backend="torch", key0_plain=plain)


# ---------------------------------------------------------------------------- write, then attend
WINDOW = 48


def _far_batch(lay: KVPageLayout, q_lens: list[int], seed: int, backend: str):
    """Sequences of ``FAR + s`` tokens whose last ``WINDOW + q`` keys are written through
    ``LayerOps`` (the earlier blocks all point at one block of random bytes, which the window
    never reads), ``q_lens[s]`` queries at the end of each."""
    gen = torch.Generator().manual_seed(seed)
    h, d, bs = lay.num_kv_heads, lay.head_dim, lay.block_size
    lens = [FAR + 7 * s for s in range(len(q_lens))]
    width = -(-max(lens) // bs)
    tail = [-(-(WINDOW + q + bs) // bs) + 1 for q in q_lens]
    total = 1 + sum(tail)
    cache = allocate_cache(lay, total, DEV)
    junk = torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8)
    junk[(junk & 0x7F) == 0x7F] = 0x7E  # finite E4M3 (a tile may load keys left of the window)
    cache.copy_(junk)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    nxt = 1
    for s, (l, n) in enumerate(zip(lens, tail)):
        first = -(-l // bs) - n
        table[s, first:first + n] = torch.arange(nxt, nxt + n)
        nxt += n
    rot = make_rot(h, d, 8, seed)
    keys, values, pos_all, slots = [], [], [], []
    for s, (l, q) in enumerate(zip(lens, q_lens)):
        p = torch.arange(l - WINDOW - q, l)
        keys.append(random_kv(p.shape[0], h, d, gen) * 2.0)
        values.append(random_kv(p.shape[0], h, d, gen))
        pos_all.append(p)
        slots.append(table[s, p // bs].long() * bs + p % bs)
    key, value, pos = torch.cat(keys), torch.cat(values), torch.cat(pos_all).int()
    off = rot_offset(rot.idx.cpu(), rot.b.cpu(), rot.theta.cpu(), pos, d)
    k_scale, v_scale = scales_for(key - off, lay.k_format, gen), scales_for(value, lay.v_format, gen)
    layer = ops.LayerOps(cache, lay, k_scale.to(DEV), v_scale.to(DEV), WINDOW, backend=backend,
                         rot_center=rot)
    layer.write(key.to(DEV), value.to(DEV), torch.cat(slots).to(DEV), pos.to(DEV))
    query = torch.randn(sum(q_lens), 4 * h, d, generator=gen)  # GQA groups of 4
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = (table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV), qsl.to(DEV),
            max(q_lens), max(lens))
    return layer, query, meta, (keys, values, pos_all, off, k_scale, v_scale, rot, lens)


def _reference(lay, query, q_lens, ref, add_back=True):
    """Float64 windowed attention over ``dequant(quantize(K - R(p) b)) + R(p) b``."""
    keys, values, pos_all, off, k_scale, v_scale, rot, lens = ref
    outs, row, t = [], 0, 0
    for k, v, p, q in zip(keys, values, pos_all, q_lens):
        n = p.shape[0]
        kd = roundtrip(k - off[t:t + n], lay.k_format, k_scale)
        if add_back:
            kd = kd + rotate64(rot, p, lay.head_dim)
        vd = roundtrip(v, lay.v_format, v_scale)
        outs.append(attend_one_sequence(query[row:row + q].double(), kd, vd, 0.1, WINDOW))
        row, t = row + q, t + n
    return torch.cat(outs)


def _rel(got, want):
    got = got.double().cpu()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kf,vf,q_lens", [("nvfp4", "nvfp4", [1, 1]), ("fp8", "nvfp4", [5, 3]),
                                          ("nvfp4", "fp8", [1, 6])])
def test_write_then_attend_at_far_positions_matches_float64(backend, kf, vf, q_lens):
    lay = KVPageLayout(2, 64, 16, kf, vf)
    layer, query, meta, ref = _far_batch(lay, q_lens, 5, backend)
    out = torch.empty(query.shape, device=DEV)
    layer.attend(query.to(DEV), *meta[:3], meta[3], meta[4], 0.1, out)
    want = _reference(lay, query, q_lens, ref)
    err = _rel(out, want)
    tol = 2e-3 if CUDA else 1e-5  # test_kernels.py's tolerances against float64
    assert err < tol, err
    assert _rel(out, _reference(lay, query, q_lens, ref, add_back=False)) > 30 * tol
    if backend == "torch":  # the one-call API passes the center on as well (any backend)
        one_shot = torch.empty_like(out)
        ops.paged_attention(query.to(DEV), layer.cache, lay, layer.k_scale, layer.v_scale,
                            *meta[:3], meta[3], meta[4], 0.1, one_shot, WINDOW, backend=backend,
                            rot_center=layer.rot_center)
        assert torch.equal(one_shot, out)


@pytest.mark.parametrize("kf", ["nvfp4", "fp8"])
def test_dequantize_adds_the_rotating_center_triton_and_torch(kf):
    """``ops.dequantize_kv`` (the dense prefill's context): the Triton kernel against the torch
    path at far positions, with the key0 shift and a window's first key."""
    if "triton" not in BACKENDS:
        pytest.skip("no Triton")
    lay = KVPageLayout(2, 64, 16, kf, "fp8")
    layer, query, meta, ref = _far_batch(lay, [3, 2], 7, "torch")
    table, lens, _, _, max_len = meta
    starts = torch.tensor([FAR - WINDOW - 3, FAR + 7 - WINDOW - 2], dtype=torch.int32)
    n = (lens.cpu() - starts).tolist()
    cu = torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32)
    outs = {}
    for backend in ("torch", "triton"):
        k = torch.full((sum(n), 2, 64), float("nan"), device=DEV)
        v = torch.full_like(k, float("nan"))
        ops.dequantize_kv(layer.cache, lay, layer.k_scale, layer.v_scale, table, lens, cu.to(DEV),
                          max(n), k, v, seq_starts=starts.to(DEV), backend=backend,
                          rot_center=layer.rot_center)
        outs[backend] = k.cpu().double(), v.cpu()
    assert torch.equal(outs["torch"][1], outs["triton"][1])
    keys, _, pos_all, off, k_scale, _, rot, _ = ref
    want = torch.cat([roundtrip(k - o, kf, k_scale)[-m:] + rotate64(rot, p[-m:], 64)
                      for k, o, p, m in zip(keys, off.split([x.shape[0] for x in keys]), pos_all, n)])
    for backend in ("torch", "triton"):
        assert _rel(outs[backend][0], want) < 1e-6, backend


def test_dense_prefill_equals_the_paged_kernels():
    """The dense prefill (dequantize with ``R(p) b_k``, then a varlen attention) against the paged
    attention of the same cache, far positions, a window."""
    from test_dense_prefill import torch_varlen
    from vllm_nvfp4.integration.dense_prefill import dense_prefill, plan_prefill_groups

    lay = KVPageLayout(2, 64, 16, "nvfp4", "nvfp4")
    q_lens = [4, 7]
    layer, query, meta, ref = _far_batch(lay, q_lens, 9, "torch")
    table, lens, qsl, max_q, max_len = meta
    paged = torch.empty(query.shape, device=DEV)
    layer.attend(query.to(DEV), table, lens, qsl, max_q, max_len, 0.1, paged)
    (group,) = plan_prefill_groups(qsl.cpu(), lens.cpu(), 0, 10**6, torch.device(DEV), WINDOW)
    dense = torch.zeros(query.shape, device=DEV)
    dense_prefill(query.to(DEV), dense, layer.cache, lay, layer.k_scale, layer.v_scale, table,
                  lens, group, 0.1, None, torch_varlen, sliding_window=WINDOW,
                  rot_center=layer.rot_center)
    assert _rel(dense, paged.double().cpu()) < 1e-5
    assert _rel(dense, _reference(lay, query, q_lens, ref)) < 1e-5


# ---------------------------------------------------------------------------- tensor parallelism
def test_rank_row_values_with_k_rot_under_tp2():
    from vllm_nvfp4.integration.rank_params import rank_row_values
    from vllm_nvfp4.policy import KRot, LayerPolicy

    h, d, k = 4, 32, 8
    gen = torch.Generator().manual_seed(4)
    b = torch.randn(h, d, generator=gen) + 0.2
    rot = RotCenter.top_pairs(b, rope_theta(d), k)
    mu = torch.randn(h, d, generator=gen) + 0.1
    for hh in range(h):
        mu[hh, rot.idx[hh].long()] = 0.0
        mu[hh, rot.idx[hh].long() + d // 2] = 0.0
    krot = KRot(tuple(map(tuple, rot.idx.tolist())),
                tuple(tuple(map(tuple, r)) for r in rot.b.tolist()),
                tuple(map(tuple, rot.theta.tolist())))
    row = LayerPolicy("nvfp4", "fp8", k_center=mu.tolist(), k_rot=krot,
                      k_sink_uncentered=[True, False, False, True])
    for r in range(2):
        vals = rank_row_values(row, "layers.0", h, 2, 6, d, r, 2)
        mine = slice(2 * r, 2 * r + 2)
        assert vals["rot_idx"] == rot.idx[mine].tolist()
        assert vals["rot_b"] == rot.b[mine].tolist() and vals["rot_theta"] == rot.theta[mine].tolist()
        flags = [[True, False], [False, True]][r]
        assert vals["key0_plain"] == [int(f) for f in flags]
        scatter = rotate64(RotCenter(rot.idx[mine], rot.b[mine], rot.theta[mine]),
                           torch.zeros(1), d)[0].float()
        want = torch.where(torch.tensor(flags)[:, None], mu[mine] + scatter, 0.0)
        assert torch.equal(torch.tensor(vals["key0_shift"]), want)
        assert torch.equal(torch.tensor(vals["k0_center"]),
                           torch.where(torch.tensor(flags)[:, None], 0.0, mu[mine]))
    # fewer KV heads than ranks: each rank replicates its head
    one = LayerPolicy("nvfp4", "fp8", k_center=mu[:1].tolist(),
                      k_rot=KRot(krot.pairs[:1], krot.b[:1], krot.theta[:1]))
    for r in range(2):
        vals = rank_row_values(one, "layers.0", 1, 1, 3, d, r, 2)
        assert vals["rot_idx"] == rot.idx[:1].tolist() and "key0_plain" not in vals


# ---------------------------------------------------------------------------- bind
def _krot(rot: RotCenter, b_scale: float = 1.0):
    from vllm_nvfp4.policy import KRot

    return KRot(tuple(map(tuple, rot.idx.tolist())),
                tuple(tuple(map(tuple, r)) for r in (rot.b * b_scale).tolist()),
                tuple(map(tuple, rot.theta.tolist())))


@pytest.mark.vllm
def test_bind_builds_the_rotating_center_and_names_the_layer_and_k():
    from types import SimpleNamespace

    from vllm_nvfp4.integration.backend import Nvfp4MixedImpl
    from vllm_nvfp4.policy import LayerPolicy

    h, d = 2, 64
    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1),
                             model_config=SimpleNamespace(get_total_num_kv_heads=lambda: h))
    lay = KVPageLayout(h, d, 16, "nvfp4", "fp8")

    def row(k):
        rot = RotCenter.top_pairs(torch.randn(h, d) + 0.1, rope_theta(d), k)
        mu = torch.full((h, d), 0.25)
        for i in range(h):
            mu[i, rot.idx[i].long()] = 0.0
            mu[i, rot.idx[i].long() + d // 2] = 0.0
        return rot, LayerPolicy("nvfp4", "fp8", k_global_scale=1.0, v_scale=1.0,
                                k_center=mu.tolist(), k_rot=_krot(rot),
                                k_sink_uncentered=[False, True])

    impl = Nvfp4MixedImpl(8, d, 0.125, h)
    with pytest.raises(RuntimeError, match=r"model\.layers\.3\..*k_rot.*k = 12"):
        impl.bind("model.layers.3.self_attn.attn", 3, row(12)[1], lay, config, torch.device("cpu"))
    rot, good = row(8)
    impl = Nvfp4MixedImpl(8, d, 0.125, h)
    impl.bind("model.layers.3.self_attn.attn", 3, good, lay, config, torch.device("cpu"))
    got = impl.rot_center
    assert got.idx.dtype == torch.int32 and torch.equal(got.idx, rot.idx)
    assert torch.equal(got.b, rot.b) and torch.equal(got.theta, rot.theta)
    assert impl.key0_plain.tolist() == [0, 1]
    ops_ = impl._layer_ops(allocate_cache(lay, 3, "cpu").view(3, 1, 16, lay.bytes_per_token))
    assert ops_.rot_center is got and ops_.key0_plain is impl.key0_plain
    tensors = (got.idx, got.b, got.theta)
    impl.bind("model.layers.3.self_attn.attn", 3, good, lay, config, torch.device("cpu"))
    assert all(a is b for a, b in zip(tensors, (impl.rot_idx, impl.rot_b, impl.rot_theta)))
    for base, scaling in ((10000.0, None), (500000.0, {"rope_type": "yarn", "factor": 4.0})):
        config.model_config.hf_text_config = SimpleNamespace(rope_theta=base, rope_scaling=scaling)
        impl.bind("model.layers.3.self_attn.attn", 3, good, lay, config, torch.device("cpu"))
    config.model_config.hf_text_config = SimpleNamespace(
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    with pytest.raises(RuntimeError, match=r"layers\.3\..*angles differ.*base 500000"):
        impl.bind("model.layers.3.self_attn.attn", 3, good, lay, config, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="cannot drop k_rot"):
        impl.bind("model.layers.3.self_attn.attn", 3,
                  LayerPolicy("nvfp4", "fp8", k_global_scale=1.0, v_scale=1.0,
                              k_center=good.k_center, k_sink_uncentered=[False, True]),
                  lay, config, torch.device("cpu"))

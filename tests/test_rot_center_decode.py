"""The attention kernels' rotating-center correction (``rot_center=(b, theta)`` on every RoPE
pair, or a ``RotCenter`` on ``k`` pairs per KV head): K stored as ``k - R(p) b``, each key's logit
given back ``q . R(p) b`` in the kernel. Against float64 attention
over the keys ``dequant(stored) + R(p) b`` (positions: the index in the sequence), with the
tolerances of ``test_kernels.py``; and the GPU arithmetic of the correction (FP16 MMA operands,
FP32 tile-to-tile rotation) emulated at long positions against float64.

Without a GPU the kernels run small under ``TRITON_INTERPRET=1`` (fp32 math).
"""

import dataclasses
import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from paged_cases import make_batch, roundtrip  # noqa: E402
from vllm_nvfp4.kernels import attention as attn_kernels  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout  # noqa: E402
from vllm_nvfp4.paged_torch import attend_one_sequence  # noqa: E402

if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

DEV = "cuda" if CUDA else "cpu"
SCALE = 37 if CUDA else 1
WRITE = "triton" if CUDA else "torch"
#: test_kernels.py's relative L2 tolerance against float64
TOL = 2e-3 if CUDA else 1e-5


def rope_theta(d: int, base: float = 10000.0, factor: float = 1.0) -> torch.Tensor:
    """FP32 ``[d / 2]`` rotate-half RoPE angles per position, the low frequencies divided by
    ``factor`` (a stand-in for any rope scaling: the kernel takes the angles as given)."""
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.where(inv < 0.05, inv / factor, inv).float()


def rotate(b: torch.Tensor, theta: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``R(p) b`` in float64 for ``b [H, D]`` at positions ``pos [L]`` -> ``[L, H, D]``: pair
    ``(i, i + D/2)`` rotated by ``theta_i p`` (the study's ``rope_rotate``)."""
    ang = pos.double()[:, None] * theta.double()[None, :]  # exact angles of the FP32 theta
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    b1, b2 = b.double().chunk(2, dim=-1)
    return torch.cat([b1 * c - b2 * s, b2 * c + b1 * s], dim=-1)


def rot_reference(batch, softmax_scale, b, theta, window=None, cap=None, key0_shift=None):
    """Float64 attention over ``dequant(stored) + R(p) b`` (what the kernel attends), position 0
    minus ``key0_shift`` if given."""
    q = batch.query.cpu().double()
    outs, row = [], 0
    for (l, q_len), k, v in zip(batch.seqs, batch.keys, batch.values):
        kd = roundtrip(k, batch.layout.k_format, batch.k_scale)
        kd = kd + rotate(b.cpu(), theta.cpu(), torch.arange(l))
        if key0_shift is not None:
            kd[0] -= key0_shift.cpu().double()
        vd = roundtrip(v, batch.layout.v_format, batch.v_scale)
        outs.append(attend_one_sequence(q[row : row + q_len], kd, vd, softmax_scale, window, cap))
        row += q_len
    return torch.cat(outs)


def plain_reference(batch, softmax_scale, window=None, cap=None):
    return rot_reference(batch, softmax_scale, torch.zeros(batch.layout.num_kv_heads,
                                                           batch.layout.head_dim),
                         rope_theta(batch.layout.head_dim), window, cap)


def assert_close_rel(got, want, tol):
    got = got.double().cpu()
    assert torch.isfinite(got).all(), "non-finite output"
    rel = (got - want).norm() / want.norm()
    assert rel < tol, f"relative error {rel:.2e} >= {tol:.0e}"


def random_center(lay: KVPageLayout, seed: int) -> torch.Tensor:
    """A non-zero ``b [H, D]`` of the keys' size: ``q . R(p) b`` swings the logits by several
    units over the positions at softmax scale 0.1."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(lay.num_kv_heads, lay.head_dim, generator=gen) * 3.0).to(DEV)


def run(batch, b, theta, launch=None, window=None, cap=None, softmax_scale=0.1, key0_shift=None,
        rot=None):
    """The kernels with ``rot_center = (b, theta)``, or ``rot`` (a ``RotCenter``) if given."""
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, batch.layout, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, batch.max_query_len, batch.max_seq_len,
        softmax_scale, out, window, cap, launch=launch, key0_shift=key0_shift,
        rot_center=rot if rot is not None else None if b is None else (b, theta.to(DEV)))
    return out


def _launch(lay, decode, **fixed):
    return dataclasses.replace(attn_kernels.launch_defaults(lay, decode), **fixed)


@pytest.mark.parametrize("kf,vf,group,tile_n,splits", [
    ("nvfp4", "nvfp4", 4, 16, 3), ("fp8", "nvfp4", 4, 32, 2), ("fp8", "fp8", 2, 16, 5)])
def test_decode_matches_float64(kf, vf, group, tile_n, splits):
    """Decode, GQA, odd lengths (partial tiles, a one-key sequence, splits starting mid-sequence,
    one split past a short sequence's end) against float64 over ``stored + R(p) b``; far from
    the result without the correction."""
    lay = KVPageLayout(2, 128, 16, kf, vf)
    batch = make_batch(lay, [(37 * SCALE + 5, 1), (1, 1), (20 * SCALE + 3, 1),
                             (64 * SCALE + 1, 1)], 2 * group, device=DEV, seed=tile_n + splits,
                       write_backend=WRITE)
    b, theta = random_center(lay, splits), rope_theta(128, factor=8.0)
    got = run(batch, b, theta, _launch(lay, True, tile_n=tile_n, num_splits=splits))
    want = rot_reference(batch, 0.1, b, theta)
    assert_close_rel(got, want, TOL)
    assert (plain_reference(batch, 0.1) - want).norm() / want.norm() > 100 * TOL


@pytest.mark.parametrize("kf,vf,rows", [("nvfp4", "nvfp4", None), ("nvfp4", "nvfp4", 32),
                                        ("fp8", "fp8", None), ("fp8", "fp8", 16)])
def test_default_decode_launch_and_the_option_off(kf, vf, rows):
    """The production decode launch (64-key tiles, folded scales, pipelined stages, splits from
    the heuristic) with the correction against float64, its default table rows (16 rows x 4 row
    blocks with one warp, the whole tile with two) and others; with ``rot_center=None`` the
    kernel gives the uncorrected attention."""
    lay = KVPageLayout(1, 64, 16, kf, vf)
    batch = make_batch(lay, [(300 * SCALE + 7, 1), (3, 1)], 4, device=DEV, seed=23,
                       write_backend=WRITE)
    b, theta = random_center(lay, 1), rope_theta(64, base=500000.0)
    got = run(batch, b, theta, _launch(lay, True, rot_rows=rows))
    assert_close_rel(got, rot_reference(batch, 0.1, b, theta), TOL)
    if rows is None:
        assert_close_rel(run(batch, None, theta), plain_reference(batch, 0.1), TOL)


@pytest.mark.parametrize("after_loop", [False, True])
def test_with_the_sink_key_stored_uncentered(after_loop):
    """With ``key0_shift = b`` on one head (its key at position 0 stored uncentered, as the
    study's ``sink`` heads) position 0 gets ``stored + R(0) b - b`` = its stored key there; also
    with the correction after the tile loop (``key0_after_loop``: position 0's logit there
    includes its rotating term)."""
    lay = KVPageLayout(2, 64, 16, "nvfp4", "nvfp4")
    batch = make_batch(lay, [(70 * SCALE + 3, 1), (2, 1)], 4, device=DEV, seed=12,
                       write_backend=WRITE)
    b, theta = random_center(lay, 4), rope_theta(64)
    shift = b.clone()
    shift[1] = 0.0
    got = run(batch, b, theta, _launch(lay, True, tile_n=16, num_splits=2,
                                       key0_after_loop=after_loop), key0_shift=shift)
    assert_close_rel(got, rot_reference(batch, 0.1, b, theta, key0_shift=shift), TOL)


def test_window_soft_cap_and_parts():
    """A sliding window (tiles from the window start) with a soft-cap (the correction inside the
    cap), and the head dim in two parts (the correction added after the parts' sum)."""
    lay = KVPageLayout(1, 128, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(90 * SCALE + 7, 1), (5, 1)], 2, device=DEV, seed=4,
                       write_backend=WRITE)
    b, theta = random_center(lay, 2), rope_theta(128)
    got = run(batch, b, theta, attn_kernels.LaunchShape(16, 2, num_splits=2, dim_parts=2),
              window=40 * SCALE, cap=3.0)
    assert_close_rel(got, rot_reference(batch, 0.1, b, theta, window=40 * SCALE, cap=3.0), TOL)


def test_prefill_matches_float64():
    """Prefill (chunks from position 0 and later, causal, partial tiles) with the correction."""
    lay = KVPageLayout(2, 64, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(23 * SCALE, 23 * SCALE), (41 * SCALE, 9)], 4, device=DEV, seed=9,
                       write_backend=WRITE)
    b, theta = random_center(lay, 3), rope_theta(64)
    got = run(batch, b, theta, _launch(lay, False, tile_n=16))
    assert_close_rel(got, rot_reference(batch, 0.1, b, theta), TOL)


# ---------------------------------------------------------------- k selected pairs per KV head
def random_pairs(lay: KVPageLayout, k: int, seed: int) -> torch.Tensor:
    """Per KV head ``k`` distinct pairs of ``head_dim / 2`` in random order (neither contiguous
    nor sorted): ``[kv_heads, k]``."""
    gen = torch.Generator().manual_seed(seed)
    half = lay.head_dim // 2
    idx = torch.stack([torch.randperm(half, generator=gen)[:k] for _ in range(lay.num_kv_heads)])
    if k < half:
        assert not (idx.diff(dim=1) == 1).all(dim=1).any() and not (idx.diff(dim=1) > 0).all()
    return idx


def selected_center(rot: "attn_kernels.RotCenter", head_dim: int) -> torch.Tensor:
    """``b_k [kv_heads, head_dim]``: ``b`` on the selected pairs, 0 on every other."""
    half = head_dim // 2
    idx = rot.idx.long().cpu()
    out = torch.zeros(idx.shape[0], head_dim)
    out.scatter_(1, idx, rot.b[:, 0].cpu())
    out.scatter_(1, idx + half, rot.b[:, 1].cpu())
    return out


@pytest.mark.parametrize("kf,vf,d,k,group,tile_n,splits", [
    ("nvfp4", "nvfp4", 64, 8, 4, 16, 3), ("fp8", "fp8", 64, 16, 2, 32, 2),
    ("nvfp4", "fp8", 128, 16, 4, 16, 5), ("fp8", "nvfp4", 128, 8, 8, 32, 4)])
def test_k_pairs_decode_matches_float64(kf, vf, d, k, group, tile_n, splits):
    """Decode with ``k`` of the ``head_dim / 2`` pairs per KV head (random index sets per head),
    GQA, odd lengths and splits, against float64 over ``stored + R(p) b_k`` (``b_k``: ``b`` with
    the other pairs zero); far from both the uncorrected result and the all-pairs one."""
    lay = KVPageLayout(2, d, 16, kf, vf)
    batch = make_batch(lay, [(37 * SCALE + 5, 1), (1, 1), (20 * SCALE + 3, 1),
                             (64 * SCALE + 1, 1)], 2 * group, device=DEV, seed=k + splits,
                       write_backend=WRITE)
    b, theta = random_center(lay, splits), rope_theta(d, factor=8.0)
    rot = attn_kernels.RotCenter.select(b, theta, random_pairs(lay, k, seed=d + k).to(DEV))
    b_k = selected_center(rot, d)
    got = run(batch, None, None, _launch(lay, True, tile_n=tile_n, num_splits=splits), rot=rot)
    want = rot_reference(batch, 0.1, b_k, theta)
    assert_close_rel(got, want, TOL)
    # 8-16 pairs move the output by 10-17% on the GPU's random data (its generator differs)
    assert (plain_reference(batch, 0.1) - want).norm() / want.norm() > 20 * TOL
    assert (rot_reference(batch, 0.1, b, theta) - want).norm() / want.norm() > 20 * TOL


@pytest.mark.parametrize("kf,vf,k,rows", [("nvfp4", "nvfp4", 8, None), ("nvfp4", "nvfp4", 8, 16),
                                          ("fp8", "fp8", 8, None), ("nvfp4", "fp8", 16, 32)])
def test_k_pairs_default_decode_launch(kf, vf, k, rows):
    """The production decode launch (64-key tiles; tables of the whole tile with at most 16
    pairs, or 16 / 32 rows: 4 / 2 row blocks) with the ``k`` pairs of largest ``|b_pair|``
    (``top_pairs``)."""
    lay = KVPageLayout(1, 64, 16, kf, vf)
    batch = make_batch(lay, [(300 * SCALE + 7, 1), (3, 1)], 4, device=DEV, seed=29,
                       write_backend=WRITE)
    b, theta = random_center(lay, 5), rope_theta(64, base=500000.0)
    rot = attn_kernels.RotCenter.top_pairs(b, theta, k)
    norm = b.cpu().view(1, 2, 32).norm(dim=1)
    assert set(rot.idx[0].tolist()) == set(norm[0].argsort(descending=True)[:k].tolist())
    got = run(batch, None, None, _launch(lay, True, rot_rows=rows), rot=rot)
    assert_close_rel(got, rot_reference(batch, 0.1, selected_center(rot, 64), theta), TOL)


def test_k_pairs_prefill_window_soft_cap():
    """Prefill with 8 pairs per head, and decode with a window, a soft-cap and two head-dim
    parts."""
    lay = KVPageLayout(2, 64, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(23 * SCALE, 23 * SCALE), (41 * SCALE, 9)], 4, device=DEV, seed=9,
                       write_backend=WRITE)
    b, theta = random_center(lay, 3), rope_theta(64)
    rot = attn_kernels.RotCenter.select(b, theta, random_pairs(lay, 8, seed=3).to(DEV))
    got = run(batch, None, None, _launch(lay, False, tile_n=16), rot=rot)
    assert_close_rel(got, rot_reference(batch, 0.1, selected_center(rot, 64), theta), TOL)

    lay = KVPageLayout(1, 128, 16, "fp8", "nvfp4")
    batch = make_batch(lay, [(90 * SCALE + 7, 1), (5, 1)], 2, device=DEV, seed=4,
                       write_backend=WRITE)
    b, theta = random_center(lay, 2), rope_theta(128)
    rot = attn_kernels.RotCenter.select(b, theta, random_pairs(lay, 16, seed=4).to(DEV))
    got = run(batch, None, None, attn_kernels.LaunchShape(16, 2, num_splits=2, dim_parts=2),
              window=40 * SCALE, cap=3.0, rot=rot)
    want = rot_reference(batch, 0.1, selected_center(rot, 128), theta, window=40 * SCALE, cap=3.0)
    assert_close_rel(got, want, TOL)


@pytest.mark.parametrize("kf,vf,d", [("nvfp4", "nvfp4", 64), ("fp8", "fp8", 128)])
def test_all_pairs_in_any_order_equal_the_full_center(kf, vf, d):
    """``k = head_dim / 2`` pairs, listed in a random order per head, give the result of
    ``rot_center = (b, theta)`` (every pair, in order) and of float64 over ``stored + R(p) b``."""
    lay = KVPageLayout(2, d, 16, kf, vf)
    batch = make_batch(lay, [(50 * SCALE + 3, 1), (17 * SCALE, 1)], 4, device=DEV, seed=d,
                       write_backend=WRITE)
    b, theta = random_center(lay, 7), rope_theta(d, base=500000.0)
    rot = attn_kernels.RotCenter.select(b, theta, random_pairs(lay, d // 2, seed=1).to(DEV))
    assert torch.equal(selected_center(rot, d), b.cpu())
    launch = _launch(lay, True, tile_n=32, num_splits=2)
    got = run(batch, None, None, launch, rot=rot)
    full = run(batch, b, theta, launch)
    assert_close_rel(got, full.double().cpu(), TOL / 4)
    assert_close_rel(got, rot_reference(batch, 0.1, b, theta), TOL)


def test_rot_center_checks():
    """Pairs must be a power of 2 in ``[8, head_dim / 2]``, the tensors of their shapes."""
    lay = KVPageLayout(2, 64, 16, "nvfp4", "nvfp4")
    b, theta = random_center(lay, 0), rope_theta(64)
    for k in (4, 12, 64):
        idx = torch.arange(k).remainder(32).expand(2, k).to(DEV)
        with pytest.raises(ValueError, match="power of 2"):
            attn_kernels.RotCenter.select(b, theta, idx).check(2, 64)
    rot = attn_kernels.RotCenter.top_pairs(b, theta, 8)
    rot.check(2, 64)
    with pytest.raises(ValueError, match="rot_center.b"):
        dataclasses.replace(rot, b=rot.b.double()).check(2, 64)


# ---------------------------------------------------------------- the correction's precision
def _fp32_angle(theta: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The kernel's ``_cos_sin`` angle (FP32 FMAs emulated in float64: one rounding each)."""
    f32 = lambda x: x.float().double()  # noqa: E731
    th, pf = theta.double(), p.double()
    x = f32(th * pf)
    err = f32(th * pf - x)
    n = torch.floor(f32(x * f32(torch.tensor(1 / (2 * math.pi)))) + 0.5)
    hi, lo = 6.2831854820251465, -1.7484555314695172e-07
    return f32(f32(f32(x - n * hi) - n * lo) + err)


def emulated_correction(q, b, theta, t_begin, n_tiles, tile_n, rows, scale):
    """``q . R(p) b * scale`` as the GPU kernel computes it for keys ``t_begin ..`` (``n_tiles``
    tiles of ``rows``-row blocks): FP32 setup and tile-to-tile turns, FP16 MMA operands turned in
    FP16 from block to block (an HMUL2 and an HFMA2 each), FP32 accumulation. ``q [M, D]``,
    ``b [D]`` -> ``[n_tiles * tile_n, M]``."""
    h = q.shape[1] // 2
    q1, q2, b1, b2 = q[:, :h].T, q[:, h:].T, b[:h, None], b[h:, None]
    a = ((q1 * b1 + q2 * b2) * scale).float()
    bb = ((q2 * b1 - q1 * b2) * scale).float()
    ang = _fp32_angle(theta, torch.tensor(float(t_begin)))
    c, s = ang.cos().float()[:, None], ang.sin().float()[:, None]
    a, bb = a * c + bb * s, bb * c - a * s
    tab = _fp32_angle(theta[None, :], torch.arange(rows, dtype=torch.float64)[:, None])
    ct, st = tab.cos().half().float(), tab.sin().half().float()
    half = lambda x: x.half().float()  # noqa: E731
    step, block = (_fp32_angle(theta, torch.tensor(float(n)))[:, None] for n in (tile_n, rows))
    cn, sn = step.cos().float(), step.sin().float()
    cq, sq = half(block.cos()), half(block.sin())
    out = []
    for _ in range(n_tiles):
        wa, wb = half(a), half(bb)
        for r in range(tile_n // rows):
            if r:
                wa, wb = half(half(wa * cq) + wb * sq), half(half(wb * cq) - wa * sq)
            out.append(ct @ wa + st @ wb)
        a, bb = a * cn + bb * sn, bb * cn - a * sn
    return torch.cat(out)


def test_emulated_gpu_correction_far_below_the_k_error():
    """At positions up to 131k (4096-key splits of 64-key tiles in 16-row blocks, Llama-3-like
    angles) the GPU arithmetic's correction error stays far below the logit error of NVFP4 and
    FP8 K whose stored (centered) keys are as large as ``b``: measured RMS 4.3e-4 of the
    correction's RMS (max 2.2e-3; the FP16 operands and their FP16 turns between row blocks),
    against 8.3e-2 for NVFP4 (190x) and 2.6e-2 for FP8 (60x)."""
    from vllm_nvfp4 import formats
    gen = torch.Generator().manual_seed(0)
    d, tile_n, scale = 128, 64, 1 / math.sqrt(128)
    q = torch.randn(4, d, generator=gen, dtype=torch.float64)
    b = torch.randn(d, generator=gen, dtype=torch.float64)
    theta = rope_theta(d, base=500000.0, factor=8.0)
    err, corr = [], []
    for t_begin in (0, 28672, 126976):
        got = emulated_correction(q, b, theta, t_begin, 64, tile_n, 16, scale).double()
        corr.append(rotate(b[None], theta, torch.arange(t_begin, t_begin + 64 * tile_n))[:, 0]
                    @ q.T * scale)
        err.append(got - corr[-1])
    rms = lambda x: float(x.pow(2).mean().sqrt())  # noqa: E731
    err, corr = torch.cat(err), torch.cat(corr)
    keys = torch.randn(4096, 1, d, generator=gen)  # stored keys of b's size
    kerr = {}
    for fmt in ("nvfp4", "fp8"):
        ks = (formats.nvfp4_global_scale(keys.abs().amax()) if fmt == "nvfp4"
              else formats.fp8_scale_from_amax(keys.abs().amax())).view(1).float()
        dk = roundtrip(keys, fmt, ks)[:, 0] - keys[:, 0].double()
        kerr[fmt] = rms(dk @ q.T * scale)
    print(f"correction RMS {rms(corr):.3f}: error RMS {rms(err):.2e}, max "
          f"{float(err.abs().max()):.2e}; K logit error RMS {kerr}")
    assert rms(err) < kerr["fp8"] / 40 and rms(err) < kerr["nvfp4"] / 150
    assert float(err.abs().max()) < 3e-3 * rms(corr)


@triton.jit
def _angles_kernel(theta_ptr, p_ptr, c_ptr, s_ptr, N: tl.constexpr, F32: tl.constexpr):
    i = tl.arange(0, N)
    c, s = attn_kernels._cos_sin(tl.load(theta_ptr + i), tl.load(p_ptr + i), F32)
    tl.store(c_ptr + i, c)
    tl.store(s_ptr + i, s)


def test_angle_reduction_at_long_positions():
    """The kernel's ``cos, sin(theta p)`` stay within 1e-6 of float64 up to p = 2^20 (a plain
    FP32 product ``theta * p`` is off by up to 6e-2 rad there)."""
    gen = torch.Generator().manual_seed(1)
    theta = rope_theta(128, base=500000.0, factor=8.0).repeat(4)
    p = torch.randint(0, 2**20, (256,), generator=gen, dtype=torch.int32)
    c, s = torch.empty(256, device=DEV), torch.empty(256, device=DEV)
    _angles_kernel[(1,)](theta.to(DEV), p.to(DEV), c, s, N=256, F32=not CUDA)
    ang = theta.double() * p.double()
    assert float((c.cpu().double() - ang.cos()).abs().max()) < 1e-6
    assert float((s.cpu().double() - ang.sin()).abs().max()) < 1e-6

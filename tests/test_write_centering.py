"""K centering inside the cache write (``LayerOps`` with ``k_center`` / ``k0_center``): the
bytes equal those of writing :func:`~vllm_nvfp4.key_transform.stored_keys` computed beforehand,
bit for bit, on the torch path and the Triton kernel, with and without a rotating center. Random,
never-zero inputs, odd token counts; Triton under ``TRITON_INTERPRET=1`` without a GPU."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paged_cases import random_kv, scales_for  # noqa: E402
from test_rot_center_serving import make_rot  # noqa: E402
from vllm_nvfp4 import ops  # noqa: E402
from vllm_nvfp4.key_transform import stored_keys  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout, allocate_cache  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
BACKENDS = ["torch", "triton"] if CUDA or os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]
H, T, BLOCKS, BLOCK = 3, 19, 4, 16


def _case(d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    key = (random_kv(T, H, d, gen) * 2.0 + 1.5).to(dtype)  # keys off zero: the center matters
    value = random_kv(T, H, d, gen).to(dtype)
    center = torch.randn(H, d, generator=gen) * 1.5 + 1.0
    center0 = center.clone()
    center0[1] = 0.0  # head 1 stores its sink key uncentered
    first = torch.zeros(T, dtype=torch.bool)
    first[[0, 7, 13]] = True
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[:T]
    slots[5] = -1  # a padded token
    pos = torch.randint(1, 5000, (T,), generator=gen, dtype=torch.int32)
    pos[first] = 0
    return key, value, center, center0, first, slots, pos, gen


def _write(lay, key, value, slots, k_scale, v_scale, backend, **kw) -> torch.Tensor:
    cache = allocate_cache(lay, BLOCKS, DEV)
    cache.fill_(0)
    ops.write_kv_cache(key.to(DEV), value.to(DEV), cache, slots.to(DEV), lay, k_scale.to(DEV),
                       v_scale.to(DEV), backend=backend,
                       **{k: v.to(DEV) if isinstance(v, torch.Tensor) else v
                          for k, v in kw.items()})
    return cache.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kf,d,dtype,with_rot", [
    ("nvfp4", 64, torch.bfloat16, False), ("nvfp4", 64, torch.bfloat16, True),
    ("fp8", 64, torch.float32, True), ("nvfp4", 128, torch.float16, False)])
def test_centering_in_the_write_equals_stored_keys(backend, kf, d, dtype, with_rot):
    lay = KVPageLayout(H, d, BLOCK, kf, "nvfp4")
    key, value, center, center0, first, slots, pos, gen = _case(d, dtype, 3)
    stored = stored_keys(key, torch.where(first[:, None, None], center0, center))
    k_scale = scales_for(stored.float(), kf, gen)
    v_scale = scales_for(value.float(), "nvfp4", gen)
    rot = dict(rot_center=make_rot(H, d, 8, 5), positions=pos) if with_rot else {}
    want = _write(lay, stored, value, slots, k_scale, v_scale, backend, **rot)
    got = _write(lay, key, value, slots, k_scale, v_scale, backend, k_center=center,
                 k0_center=center0, first=first, **rot)
    assert torch.equal(got, want)
    if backend != "torch":
        return  # the data's checks below need one backend
    only_mu = _write(lay, key, value, slots, k_scale, v_scale, backend, k_center=center, **rot)
    assert not torch.equal(only_mu, got)  # the first keys took center0
    uncentered = _write(lay, key, value, slots, k_scale, v_scale, backend, **rot)
    assert (uncentered != got).float().mean() > 0.1


def test_centering_arguments_are_checked():
    lay = KVPageLayout(H, 64, BLOCK, "nvfp4", "nvfp4")
    key, value, center, center0, first, slots, _, gen = _case(64, torch.float32, 4)
    cache = allocate_cache(lay, BLOCKS, "cpu")
    scale = torch.ones(H)
    with pytest.raises(ValueError, match="needs k_center"):
        ops.LayerOps(cache, lay, scale, scale, backend="torch", k0_center=center0)
    with pytest.raises(ValueError, match="k_center must be contiguous, of shape"):
        ops.LayerOps(cache, lay, scale, scale, backend="torch", k_center=center[:, :32])
    with pytest.raises(TypeError, match="k0_center must be a float32"):
        ops.LayerOps(cache, lay, scale, scale, backend="torch", k_center=center,
                     k0_center=center0.double())
    layer = ops.LayerOps(cache, lay, scale, scale, backend="torch", k_center=center,
                         k0_center=center0)
    with pytest.raises(ValueError, match="position 0 to write"):
        layer.write(key, value, slots)
    with pytest.raises(ValueError, match="first must be a contiguous bool"):
        layer.write(key, value, slots, first=first.int())

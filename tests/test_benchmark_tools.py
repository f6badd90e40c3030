"""Benchmark tooling: bench_variants' variant names and time_zeroconfig's compile logger."""

import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are imported, as in test_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.bench_variants import VARIANTS, variant_config  # noqa: E402

from studies import time_zeroconfig  # noqa: E402


@pytest.mark.parametrize("name,kind,want", [
    ("s6", "decode", {"num_splits": 6}),
    ("r184", "decode", {"maxnreg": 184}),
    ("s12_r255", "decode", {"num_splits": 12, "maxnreg": 255}),
    ("st5", "decode", {"num_stages": 5}),
    ("s12_st5", "decode", {"num_splits": 12, "num_stages": 5}),
    ("sst5", "decode", None),      # an unknown prefix
    ("fold_v", "decode", VARIANTS["decode"]["fold_v"]),
    ("w2", "prefill", VARIANTS["prefill"]["w2"]),
    ("s6", "prefill", None),       # splits are a decode launch field
    ("s6_x2", "decode", None),     # an unknown token
    ("sx", "decode", None),
    ("w2", "decode", None),        # a prefill-only name
])
def test_variant_names(name, kind, want):
    assert variant_config(name, kind) == want


def test_compile_logger_writes_one_line_per_compile(capsys):
    """The sitecustomize source installs a Triton compilation listener that names the kernel,
    the cache hit, the milliseconds, the cache folder and the integer constexprs by name."""
    knobs = types.SimpleNamespace(compilation=types.SimpleNamespace(listener=None))
    triton_mod = types.ModuleType("triton")
    triton_mod.knobs = knobs
    saved = sys.modules.get("triton")
    sys.modules["triton"] = triton_mod
    try:
        namespace: dict = {}
        exec(compile(time_zeroconfig.COMPILE_LOGGER, "sitecustomize", "exec"), namespace)
    finally:
        if saved is not None:
            sys.modules["triton"] = saved
        else:
            del sys.modules["triton"]
    listener = knobs.compilation.listener
    assert listener is not None
    src = types.SimpleNamespace(fn=types.SimpleNamespace(arg_names=["x_ptr", "N", "BLOCK"]),
                                constants={(2,): 64, (1,): 7})
    listener(src=src, metadata={"name": "_k", "num_warps": 4},
             metadata_group={"_k.json": "/c/ab12/_k.json"},
             times=types.SimpleNamespace(total=6_250_000), cache_hit=False)
    line = capsys.readouterr().err.strip()
    assert line.startswith("triton-compile ")
    assert "_k hit=0 ms=6250 warps=4 dir=/c" in line
    assert "'BLOCK': 64" in line and "'N': 7" in line

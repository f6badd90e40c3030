"""Start-up calibration through real vLLM on CPU: ``LLM(kv_cache_dtype="nvfp4_mixed")`` with no
policy calibrates its scales on the built-in text before serving.

Checked: the scales and K centering offsets the worker binds equal ``vllm-nvfp4 calibrate
--k-center`` (transformers) on the same text; the cache file is written, then reused by the next
start (no second calibration run); the start-up selection keeps in FP8 a slot made sensitive on
purpose (the slot ``vllm-nvfp4 analyze`` also ranks first), ``=scales`` keeps the default rule's
formats and ``=0`` the default scales; a given policy file is never overridden; and on a
Qwen2-shaped model with a large K bias, prompt log-probs move much closer to the unquantized
cache's than with the default scales. The models are float32 so vLLM and transformers differ
only by summation order. The tiny Qwen3-Next (Gated DeltaNet; bfloat16, vLLM's CPU GDN kernel's
only dtype) calibrates at start-up too: its calibration forward's K/V against transformers, its
resumed sensitivity forwards, its GDN states afterwards, and the fallback when that path fails.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import re
import shutil
import textwrap
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import LogLines

pytestmark = pytest.mark.vllm

STARTUP_ENV = "VLLM_NVFP4_STARTUP_CALIBRATION"
#: a GDN model's calibration forward (bfloat16) may differ from transformers' float32 forward by
#: this times transformers' own bfloat16 difference (relative RMS of one sequence's K or V of an
#: attention layer; measured: 0.78-1.01x; with the 2 sequences as one in the GDN layers, the
#: second's 1.6-2.2x)
GDN_NOISE_MARGIN = 1.4


def _engine(model_dir: Path, **overrides: Any) -> Any:
    from vllm import LLM

    from conftest import FAST_LLM_KWARGS

    kwargs = dict(FAST_LLM_KWARGS, model=str(model_dir), kv_cache_dtype="nvfp4_mixed", dtype="float32")
    kwargs.update(overrides)
    return LLM(**kwargs)


def _bound(worker: Any) -> dict:
    """Every nvfp4_mixed layer's bound scales, K centering and the K/V formats of its cache
    pages (runs in the worker)."""
    ctx = worker.model_runner.compilation_config.static_forward_context
    return {name: {"k_scale": layer.impl.k_scale.tolist(), "v_scale": layer.impl.v_scale.tolist(),
                   "k_center": None if layer.impl.k_center is None else layer.impl.k_center.tolist(),
                   "formats": (layer.impl.layout.k_format.value, layer.impl.layout.v_format.value),
                   "key0_shift": None if layer.impl.key0_shift is None else layer.impl.key0_shift.tolist()}
            for name, layer in ctx.items() if hasattr(getattr(layer, "impl", None), "layout")}


def _record_policy_logs(mp: pytest.MonkeyPatch) -> list[str]:
    """Route the log of the front-end checks and of the start-up calibration (every place that
    states a policy) to a list, returned (vLLM's logging set-up drops handlers of loggers under
    "vllm", so the modules get a logger of their own)."""
    import vllm_nvfp4.integration.model as model
    import vllm_nvfp4.integration.startup_calibration as sc

    log, handler = logging.getLogger("test_startup_calibration.policy"), LogLines()
    log.setLevel(logging.INFO)
    log.handlers = [handler]
    log.propagate = False
    mp.setattr(model, "logger", log)
    mp.setattr(sc, "logger", log)
    return handler.lines


IN_FORCE = re.compile(r"^vllm-nvfp4: KV policy in force: (\S+) \(")


def _in_force(lines: list[str]) -> list[str]:
    """The compact policy of every "KV policy in force" statement in ``lines``."""
    return [m.group(1) for line in lines if (m := IN_FORCE.match(line))]


def _run_formats(bound: dict) -> str:
    """The compact string of the formats the layers' cache pages hold (``_bound``)."""
    from vllm_nvfp4.policy import LayerPolicy
    from vllm_nvfp4.policy.compact import format_compact

    rows = sorted((int(name.split(".")[2]), v["formats"]) for name, v in bound.items())
    assert [i for i, _ in rows] == list(range(len(rows)))
    return format_compact(tuple(LayerPolicy(k, v) for _, (k, v) in rows))


def _start(model_dir: Path, **overrides: Any) -> dict:
    """Start an engine and return what its worker bound."""
    llm = _engine(model_dir, **overrides)
    try:
        return llm.collective_rpc(_bound)[0]
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    import vllm_nvfp4.integration.startup_calibration as sc
    from vllm_nvfp4.testing.models import build_tiny_llama

    root = tmp_path_factory.mktemp("startup")
    model_dir = build_tiny_llama(root / "llama", dtype="float32")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_NVFP4_CACHE", str(root / "cache"))
    mp.delenv("VLLM_NVFP4_POLICY", raising=False)
    calls: list[int] = []
    observe = sc.observe_in_vllm

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return observe(*args, **kwargs)

    mp.setattr(sc, "observe_in_vllm", counting)
    lines = _record_policy_logs(mp)
    logs = {}
    try:
        first = _start(model_dir)
        logs["first"] = list(lines)
        after_first = len(calls)
        files = sorted((root / "cache" / "startup-calibration").glob("*.json"))
        mtimes = [f.stat().st_mtime_ns for f in files]
        second = _start(model_dir)
        logs["second"] = lines[len(logs["first"]):]
        after_second = len(calls)
        mp.setenv(STARTUP_ENV, "0")
        del lines[:]
        off = _start(model_dir)
        logs["off"] = list(lines)
        after_off = len(calls)
        mp.setenv(STARTUP_ENV, "scales")
        scales = _start(model_dir)
        scales_files = sorted(set((root / "cache" / "startup-calibration").glob("*.json")) - set(files))
    finally:
        mp.undo()
    return {"model": model_dir, "first": first, "second": second, "off": off, "files": files,
            "mtimes": mtimes, "calls": (after_first, after_second, after_off), "scales": scales,
            "scales_files": scales_files, "logs": logs}


def _calibrate_like(model_dir: Path, cache_file: Path) -> Any:
    """``vllm-nvfp4 calibrate --k-center --k-sink-uncentered`` (transformers, float32) with the
    text, windows and served length the start-up calibration recorded in ``cache_file``."""
    from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT
    from vllm_nvfp4.calibration.commands import run_calibrate

    cached = json.loads(cache_file.read_text())
    data = cached["provenance"]["data"]
    assert cached["provenance"]["tokens"] == data["window_tokens"] * data["calib_windows"] >= 2048
    return run_calibrate(model_dir, [BUILTIN_TEXT], None, window=data["window_tokens"],
                         windows=data["calib_windows"], dtype="float32", k_center=True,
                         k_sink_uncentered=True,
                         max_model_len=cached["provenance"]["position_range"]["max_model_len"])


def _served_formats(ref: Any, served: Any) -> Any:
    """``ref`` (scales of both formats for every slot) with the formats of ``served``."""
    for i, lp in served.kv_layers():
        ref = ref.with_layer(i, k=lp.k, v=lp.v)
    return ref


def _assert_bound_equals(bound: dict, ref: Any, heads: int, rel: float, atol: float) -> None:
    """Every layer's bound K/V scales and K centering offsets equal ``ref``'s (per-layer scales,
    repeated over ``heads`` KV heads)."""
    for i, row in enumerate(ref.layers):
        (layer,) = [v for name, v in bound.items() if name.startswith(f"model.layers.{i}.")]
        for kv in ("k", "v"):
            assert layer[f"{kv}_scale"] == pytest.approx([row.quant_scale(kv)] * heads, rel=rel), (i, kv)
        if row.k_center is None:  # a layer with learned sinks is never centered
            assert layer["k_center"] is None, i
        else:
            torch.testing.assert_close(torch.tensor(layer["k_center"]), torch.tensor(row.k_center),
                                       rtol=0, atol=atol)


def test_flag_only_engine_binds_the_scales_of_calibrate(runs):
    from vllm_nvfp4.policy import KVPolicy

    assert runs["calls"][0] == 1 and len(runs["files"]) == 1
    ref = _calibrate_like(runs["model"], runs["files"][0])
    assert ref.to_compact() == "0:fp8,1-2:nvfp4,3:fp8"
    served = KVPolicy.load(runs["files"][0])
    assert served.provenance["formats_from"] == "start-up sensitivity"
    assert sum(lp.format_of(kv) == "fp8" for lp in served.layers for kv in "kv") == 4  # the rule's 4
    ref = _served_formats(ref, served)  # each slot's scale for the format the selection gave it
    _assert_bound_equals(runs["first"], ref, heads=2, rel=2e-4, atol=2e-5)
    # the sink key uncentered where calibrate finds its first key fits (on some layers, not all)
    # when the policy measured better so, else centered everywhere (tests/test_sink_choice.py)
    flags, fits = [lp.k_sink_uncentered for lp in served.layers], [lp.k_sink_uncentered for lp in ref.layers]
    assert any(fits) and flags == (fits if served.provenance["sink_key"]["chosen"] == "uncentered"
                                   else [None] * len(fits))
    for i, row in enumerate(served.layers):
        assert (runs["first"][f"model.layers.{i}.self_attn.attn"]["key0_shift"] is None) == (
            row.k_sink_uncentered is None)
    for i, row in enumerate(ref.layers):
        bound = runs["first"][f"model.layers.{i}.self_attn.attn"]
        assert bound["k_scale"] != pytest.approx([1.0 if row.k == "fp8" else 1 / 6] * 2, rel=0.05)


def test_position_offsets_widen_the_range_as_calibrate_does(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    """With windows shorter than max_model_len the start-up also runs them at position offsets
    up to it: the bound scales and K centering equal ``calibrate --max-model-len`` on the same
    windows (vLLM's positions shifted as transformers' position ids are), and the K scales are
    wider than without the offsets, the centering offsets the same."""
    import vllm_nvfp4.integration.startup_recipe as recipe
    from vllm_nvfp4.calibration.commands import run_calibrate
    from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT
    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.models import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "llama", dtype="float32")
    monkeypatch.setenv("VLLM_NVFP4_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(STARTUP_ENV, "scales")  # the statistics only
    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    monkeypatch.setattr(recipe, "MAX_WINDOW", 256)
    bound = _start(model_dir, max_model_len=1024)
    (cache_file,) = (tmp_path / "cache" / "startup-calibration").glob("*.json")
    served = KVPolicy.load(cache_file)
    assert served.provenance["position_range"] == {"max_model_len": 1024, "offsets": [192, 384, 576, 768]}
    ref = _served_formats(_calibrate_like(model_dir, cache_file), served)
    _assert_bound_equals(bound, ref, heads=2, rel=2e-4, atol=2e-5)
    data = served.provenance["data"]
    off = run_calibrate(model_dir, [BUILTIN_TEXT], None, window=data["window_tokens"],
                        windows=data["calib_windows"], dtype="float32", k_center=True,
                        max_model_len=0)
    assert all(r.k_scale >= o.k_scale for r, o in zip(ref.layers, off.layers))
    assert any(r.k_scale > 1.05 * o.k_scale for r, o in zip(ref.layers, off.layers))
    assert [r.k_center for r in ref.layers] == [o.k_center for o in off.layers]


def test_sliding_window_and_sink_model_binds_the_scales_of_calibrate(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """gpt-oss style: sliding window 32 on even layers, attention sinks on every layer. The
    calibration forward attends as served, so every layer's statistics equal transformers'
    with the same windows and sinks, and differ from those of the same weights without a
    window (the check can fail)."""
    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid

    model_dir = build_tiny_hybrid("gpt_oss", tmp_path / "gpt_oss", qk_gain=1.0)
    monkeypatch.setenv("VLLM_NVFP4_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(STARTUP_ENV, "scales")  # the statistics only (the selection: a test below)
    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    bound = _start(model_dir, max_model_len=1024)
    (cache_file,) = (tmp_path / "cache" / "startup-calibration").glob("*.json")
    served = KVPolicy.load(cache_file)  # the selected formats (the scales are calibrate's)
    ref = _served_formats(_calibrate_like(model_dir, cache_file), served)
    assert {t.window for t in ref.layer_types} == {32, None} and all(t.sinks for t in ref.layer_types)
    assert all(lp.k == lp.v == "fp8" for lp in served.layers if lp.layer_type.kind == "sliding")
    assert all(lp.k_center is None and lp.k_sink_uncentered is None for lp in served.layers)
    # every layer has sinks, so nothing to center: no centering pass, no sink-key choice
    assert served.provenance["k_center"] is False and served.provenance["k_rot_pairs"] == 0
    assert served.provenance["cache_key"]["recipe"]["k_sink_uncentered"] is False
    assert "sink_key" not in served.provenance
    _assert_bound_equals(bound, ref, heads=2, rel=1e-3, atol=1e-4)

    unwindowed = tmp_path / "unwindowed"
    shutil.copytree(model_dir, unwindowed)
    cfg = json.loads((unwindowed / "config.json").read_text())
    cfg["sliding_window"] = 4096  # longer than every calibration window: full attention
    (unwindowed / "config.json").write_text(json.dumps(cfg))
    full = _served_formats(_calibrate_like(unwindowed, cache_file), served)
    with pytest.raises(AssertionError):
        _assert_bound_equals(bound, full, heads=2, rel=1e-2, atol=1e-3)


def test_flag_only_start_states_the_policy_in_force_once(runs):
    """A flag-only start logs exactly one "KV policy in force" statement, after the start-up
    calibration decided it: its compact string is the formats the layers' cache pages hold (and
    the cached policy's), its table has a row per layer with the calibrated scales; nothing
    before it states another policy or prints a table."""
    from vllm_nvfp4.policy import KVPolicy

    log = runs["logs"]["first"]
    (compact,) = _in_force(log)
    assert compact == _run_formats(runs["first"]) == KVPolicy.load(runs["files"][0]).to_compact()
    (statement,) = [line for line in log if IN_FORCE.match(line)]
    head, *rows = statement.splitlines()
    assert "K/V scales calibrated; from start-up calibration)" in head
    assert [row.split(":")[0] for row in rows] == [f"  layer   {i}" for i in range(4)]
    assert not any("scale default" in row for row in rows)
    before = log[:log.index(statement)]
    assert any(line.startswith("vllm-nvfp4: calibrated at start-up on 4096 tokens") for line in before)
    stated = re.compile(r"\d:(fp8|nvfp4|k=)|\n  layer")  # a compact policy or a table row
    assert not any(stated.search(line) for line in before), before


def test_cached_and_uncalibrated_starts_state_the_policy_in_force_once(runs):
    """The start that reuses the cache states the cached policy; the start with calibration off
    states the default rule with default scales (after its warning), each once and equal to
    what its layers run."""
    (cached,) = _in_force(runs["logs"]["second"])
    assert cached == _run_formats(runs["second"]) == _in_force(runs["logs"]["first"])[0]
    assert any(line.startswith("vllm-nvfp4: start-up calibration reused from")
               for line in runs["logs"]["second"])
    (off,) = _in_force(runs["logs"]["off"])
    assert off == _run_formats(runs["off"]) == "0:fp8,1-2:nvfp4,3:fp8"
    (statement,) = [line for line in runs["logs"]["off"] if IN_FORCE.match(line)]
    assert "default K/V scales (not calibrated); from default rule (first/last FP8))" in statement
    assert statement.count("scale default") == 8


def test_second_start_reuses_the_cache(runs):
    assert runs["calls"][1] == runs["calls"][0]  # no calibration forward on the second start
    assert [f.stat().st_mtime_ns for f in runs["files"]] == runs["mtimes"]
    assert runs["second"] == runs["first"]


def test_scales_mode_keeps_the_rule_with_calibrated_scales(runs):
    from vllm_nvfp4.policy import KVPolicy

    (path,) = runs["scales_files"]  # its own cache entry: the recipe differs
    policy = KVPolicy.load(path)
    assert policy.to_compact() == "0:fp8,1-2:nvfp4,3:fp8"
    assert policy.provenance["formats_from"] == "default rule" and "sensitivity" not in policy.provenance
    _assert_bound_equals(runs["scales"], _calibrate_like(runs["model"], path), heads=2, rel=2e-4,
                         atol=2e-5)


def test_off_switch_keeps_default_scales(runs):
    from vllm_nvfp4.policy import DEFAULT_FP8_SCALE, DEFAULT_NVFP4_GLOBAL_SCALE

    assert runs["calls"][2] == runs["calls"][1]
    defaults = {0: DEFAULT_FP8_SCALE, 1: DEFAULT_NVFP4_GLOBAL_SCALE, 2: DEFAULT_NVFP4_GLOBAL_SCALE,
                3: DEFAULT_FP8_SCALE}
    for i, scale in defaults.items():
        bound = runs["off"][f"model.layers.{i}.self_attn.attn"]
        assert bound["k_scale"] == pytest.approx([scale] * 2) and bound["k_center"] is None


def test_a_policy_file_is_never_overridden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.models import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "llama", dtype="float32")
    KVPolicy.from_compact("*:fp8", 4).with_layer(1, k_scale=0.5).save(model_dir / "nvfp4_policy.json")
    monkeypatch.setenv("VLLM_NVFP4_CACHE", str(tmp_path / "cache"))
    lines = _record_policy_logs(monkeypatch)
    bound = _start(model_dir)
    assert _in_force(lines) == [_run_formats(bound)] == ["0-3:fp8"]
    assert f"from {model_dir / 'nvfp4_policy.json'})" in [l for l in lines if IN_FORCE.match(l)][0]
    assert bound["model.layers.1.self_attn.attn"]["k_scale"] == [0.5, 0.5]
    assert bound["model.layers.2.self_attn.attn"]["k_scale"] == [1.0, 1.0]
    assert not (tmp_path / "cache" / "startup-calibration").exists()


# ---------------------------------------------------------------------------- start-up selection
SENSITIVE_LAYER = 2  # a middle layer: the default rule stores it in NVFP4


def _k_outlier_llama(out: Path) -> Path:
    """A tiny 6-layer Llama whose layer-2 keys carry large outlier channels (one per 16-block of
    every head: its k_proj rows scaled 12x), so NVFP4 crushes the block's other channels there."""
    from safetensors.torch import load_file, save_file

    from vllm_nvfp4.testing.models import build_tiny_llama

    model_dir = build_tiny_llama(out, num_layers=6, dtype="float32", qk_gain=1.0)
    weights = model_dir / "model.safetensors"
    sd = load_file(str(weights))
    name = f"model.layers.{SENSITIVE_LAYER}.self_attn.k_proj.weight"
    sd[name] = sd[name].clone()
    sd[name][5::16] *= 12.0  # [kv_heads * D, hidden]: channel 5 of every 16-block
    save_file(sd, str(weights), metadata={"format": "pt"})
    return model_dir


def _damage_resumed_and_whole(worker: Any, policy: dict) -> tuple[dict, dict]:
    """``slot_damage`` of every K/V slot on 2 x 96 random tokens, resumed at each slot's layer
    and (the stack hidden from it) through the whole model; with the calls of decoder layer 0
    (runs in the worker)."""
    from vllm_nvfp4.integration.startup_calibration import _our_layers
    from vllm_nvfp4.policy import KVPolicy

    runner = worker.model_runner
    scaled = KVPolicy.from_dict(policy)
    layers = _our_layers(runner.vllm_config, scaled.num_layers)
    windows = torch.randint(1, 200, (2, 96), generator=torch.Generator().manual_seed(0))
    slots = [(i, kv) for i in range(scaled.num_layers) for kv in ("k", "v")]
    resumed, whole = _slot_damage_two_ways(runner, layers, windows, scaled, slots)
    for run in (resumed, whole):
        run["damage"] = {f"{i}.{kv}": d for (i, kv), d in run["damage"].items()}
    return resumed, whole


def _slot_damage_two_ways(runner: Any, layers: dict[str, Any], windows: torch.Tensor,
                          scaled: Any, slots: list, states: Any = None) -> list[dict]:
    """``slot_damage`` of ``slots`` on ``windows [2, L]`` (2 per forward): resumed at each slot's
    layer, then with the decoder stack hidden from it (whole-model forwards); each with the
    calls of decoder layer 0. ``states``: the GDN layers, bound for each run (None: none)."""
    import vllm_nvfp4.integration.calibration_forward as cf

    stack, real = cf.decoder_stack(runner.get_model()), cf.decoder_stack
    out = []
    for hide in (False, True):
        calls = [0]
        handle = stack.layers[0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        cf.decoder_stack = (lambda model: None) if hide else real
        try:
            with states.bound(2) if states is not None else nullcontext():
                damage = cf.slot_damage(runner, layers, windows, 2, scaled, slots, states=states)
        finally:
            cf.decoder_stack = real
            handle.remove()
        out.append({"damage": damage, "layer0_calls": calls[0]})
    return out


def test_startup_selection_keeps_the_sensitive_slot_in_fp8(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    """The engine's policy (cached file, bound layouts) has layer 2's K in FP8 where the rule
    has NVFP4; the measured KL there is the largest, as ``vllm-nvfp4 analyze`` (transformers,
    other windows of the same text) measures too."""
    from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT
    from vllm_nvfp4.calibration.selection import marginals
    from vllm_nvfp4.calibration.sensitivity import analyze
    from vllm_nvfp4.policy import KVPolicy

    model_dir = _k_outlier_llama(tmp_path / "llama")
    monkeypatch.setenv("VLLM_NVFP4_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    llm = _engine(model_dir)
    try:
        layouts = llm.collective_rpc(lambda w: {
            n: (l.impl.layout.k_format, l.impl.layout.v_format)
            for n, l in w.model_runner.compilation_config.static_forward_context.items()
            if hasattr(getattr(l, "impl", None), "layout")})[0]
        (path,) = (tmp_path / "cache" / "startup-calibration").glob("*.json")
        policy = KVPolicy.load(path)
        resumed, whole = llm.collective_rpc(_damage_resumed_and_whole, args=(policy.to_dict(),))[0]
    finally:
        del llm
        gc.collect()
    # slots resumed at their layer (from the exact forward's residual stream) measure what the
    # whole model measures, running layer 0 only for the exact forward and layer 0's own slots
    assert resumed["damage"].keys() == whole["damage"].keys()
    for slot, d in whole["damage"].items():
        assert resumed["damage"][slot] == pytest.approx(d, rel=1e-3, abs=1e-7), slot
    assert whole["layer0_calls"] == 1 + len(whole["damage"])
    assert resumed["layer0_calls"] == 1 + 2
    sens = policy.provenance["sensitivity"]
    assert sens["tokens"] == 2048 and sens["candidates"] == 6 and sens["fp8_slots"] == 4
    kl = sens["kl"]
    assert max(kl, key=kl.get) == f"{SENSITIVE_LAYER}.k" and kl[f"{SENSITIVE_LAYER}.k"] > 3 * sorted(kl.values())[-2]
    assert f"{SENSITIVE_LAYER}.k" in sens["fp8"] and len(sens["fp8"]) == 4
    assert policy.layers[SENSITIVE_LAYER].k == "fp8"
    assert sum(lp.format_of(kv) == "fp8" for lp in policy.layers for kv in "kv") == 4
    assert layouts[f"model.layers.{SENSITIVE_LAYER}.self_attn.attn"][0] == "fp8"
    for i, lp in enumerate(policy.layers):  # every layer serves the cached formats
        assert layouts[f"model.layers.{i}.self_attn.attn"] == (lp.k, lp.v)
    report = analyze(model_dir, [BUILTIN_TEXT], tmp_path / "report", window=512, windows=1,
                     calib_windows=1, dtype="float32", k_center=True)
    assert marginals(report, "kl")[0][1:] == (SENSITIVE_LAYER, "k")


# ---------------------------------------------------------------------------- K-bias model
def _k_biased_qwen2(out: Path) -> Path:
    """A tiny Qwen2 whose keys carry a large bias on the lowest RoPE frequencies, where RoPE
    leaves it almost constant over a context (as Qwen2.5's keys do): a big constant part in a
    few channels of every NVFP4 16-block."""
    from safetensors.torch import load_file, save_file

    from vllm_nvfp4.testing.models import build_tiny_llama

    model_dir = build_tiny_llama(out, arch="qwen2", dtype="float32", qk_gain=1.0)
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    weights = model_dir / "model.safetensors"
    sd = load_file(str(weights))
    g = torch.Generator().manual_seed(1)
    for name in [n for n in sd if n.endswith("k_proj.bias")]:
        bias = sd[name].view(-1, head_dim)  # [kv_heads, D]; rotate-half pairs (i, i + D/2)
        for lo in (head_dim // 2 - 4, head_dim - 4):  # the 4 lowest frequencies
            bias[:, lo:lo + 4] += 30.0 * torch.randn(bias.shape[0], 4, generator=g)
    save_file(sd, str(weights), metadata={"format": "pt"})
    return model_dir


def _prompt_logprobs(llm: Any, prompts: list[list[int]]) -> torch.Tensor:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([o.prompt_logprobs[t][p[t]].logprob
                         for o, p in zip(outs, prompts) for t in range(1, len(p))])


def test_startup_calibration_recovers_a_k_biased_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Mean |prompt log-prob - unquantized| (fake quantization measured 0.96 nats with the
    default scales, 0.24 calibrated + K-centered)."""
    from transformers import AutoTokenizer

    model_dir = _k_biased_qwen2(tmp_path / "qwen2")
    monkeypatch.setenv("VLLM_NVFP4_CACHE", str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(inspect.getsource(textwrap), add_special_tokens=False)["input_ids"]
    prompts = [ids[i * 300:i * 300 + 256] for i in range(4)]
    results = {}
    for name, dtype, env in (("unquantized", "auto", "1"), ("default", "nvfp4_mixed", "0"),
                             ("startup", "nvfp4_mixed", "1")):
        monkeypatch.setenv(STARTUP_ENV, env)
        llm = _engine(model_dir, kv_cache_dtype=dtype)
        results[name] = _prompt_logprobs(llm, prompts)
        del llm
        gc.collect()
    err_default = (results["default"] - results["unquantized"]).abs().mean()
    err_startup = (results["startup"] - results["unquantized"]).abs().mean()
    assert err_startup < 0.4 * err_default, (float(err_startup), float(err_default))


# ---------------------------------------------------------------------------- tensor parallel
TP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from vllm import LLM

    def bound(worker):
        ctx = worker.model_runner.compilation_config.static_forward_context
        return {n: [l.impl.k_scale.tolist(), l.impl.v_scale.tolist(), l.impl.k_center.tolist()]
                for n, l in ctx.items() if hasattr(l.impl, "layout")}

    if __name__ == "__main__":
        out = {}
        for tp in (1, 2):
            os.environ["VLLM_NVFP4_CACHE"] = os.path.join(sys.argv[2], f"tp{tp}")
            llm = LLM(model=sys.argv[1], kv_cache_dtype="nvfp4_mixed", dtype="float32",
                      max_model_len=256, enforce_eager=True, tensor_parallel_size=tp,
                      distributed_executor_backend="mp", seed=0)
            out[tp] = llm.collective_rpc(bound)
            del llm
        print("RESULT " + json.dumps(out))
""")


def test_tp2_ranks_calibrate_their_heads_into_one_policy(tmp_path: Path):
    import subprocess
    import sys

    from conftest import vllm_subprocess_env
    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.models import build_tiny_llama

    model = build_tiny_llama(tmp_path / "m", dtype="float32")  # 2 KV heads: one per rank
    (tmp_path / "run.py").write_text(TP_SCRIPT)
    env = vllm_subprocess_env(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.pop("VLLM_NVFP4_POLICY", None)
    run = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(model), str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (run.stdout + run.stderr)[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    (tp1,), (rank0, rank1) = out["1"], out["2"]
    for name, (k1, v1, c1) in tp1.items():
        assert rank0[name][0] == pytest.approx(k1[:1], rel=1e-4)  # per-layer scale, both ranks
        assert rank1[name][1] == pytest.approx(v1[1:], rel=1e-4)
        torch.testing.assert_close(torch.tensor(rank0[name][2] + rank1[name][2]), torch.tensor(c1),
                                   rtol=0, atol=1e-5)  # each rank its head's centering offsets
    (f1,), (f2,) = ((tmp_path / f"tp{tp}" / "startup-calibration").glob("*.json") for tp in (1, 2))
    assert f1.name == f2.name  # same key: the TP degree is not part of it
    p1, p2 = KVPolicy.load(f1), KVPolicy.load(f2)
    for a, b in zip(p1.layers, p2.layers):
        assert (a.k_scale, a.v_global_scale) == pytest.approx((b.k_scale, b.v_global_scale), rel=1e-4)


AGREE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from contextlib import contextmanager
    from types import SimpleNamespace

    import torch
    import vllm.distributed

    from vllm_nvfp4.integration import startup_calibration as sc

    rank, store = int(sys.argv[1]), sys.argv[2]
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                         world_size=2)
    tp = SimpleNamespace(world_size=2, cpu_group=None)  # None: the default (gloo) group
    vllm.distributed.get_tp_group = lambda: tp
    out = {"ok": sc.agree_outcome(None, tp),
           "rank1": sc.agree_outcome(ValueError("boom") if rank == 1 else None, tp),
           "both": sc.agree_outcome(KeyError(f"r{rank}"), tp)}

    class States:  # binds on rank 0, runs out of memory on rank 1
        entered = exited = 0

        @contextmanager
        def bound(self, max_seqs):
            if rank == 1:
                raise RuntimeError(f"out of memory for {max_seqs} slots")
            States.entered += 1
            try:
                yield
            finally:
                States.exited += 1

    try:
        with sc._states_bound_on_every_rank(States(), 3):
            out["forward"] = True  # never reached: rank 1 failed to bind
    except sc.StartupCalibrationError as e:
        out["bind"] = str(e)
    out["entered_exited"] = [States.entered, States.exited]
    print("RESULT " + json.dumps(out), flush=True)
    # gloo's worker threads can abort the interpreter's exit ("terminate called without an
    # active exception") unless the group is torn down first; then leave without static teardown
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)
""")


def test_tp_ranks_agree_on_a_failure_of_one_rank(tmp_path: Path):
    """Two gloo ranks: :func:`agree_outcome` gives every rank the same verdict (None when all
    succeeded, the lowest failed rank's error otherwise), and binding GDN states that fails on
    rank 1 only raises on both ranks before any forward, rank 0's binding undone - no rank is
    left waiting in a collective."""
    import subprocess
    import sys

    from conftest import vllm_subprocess_env

    (tmp_path / "agree.py").write_text(AGREE_SCRIPT)
    env = vllm_subprocess_env()
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "agree.py"), str(rank),
                               str(tmp_path / "store")], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, (stdout + stderr)[-3000:]
        results.append(json.loads(lines[0][len("RESULT "):]))
    rank0, rank1 = results
    for r in results:
        assert r["ok"] is None
        assert r["rank1"] == "rank 1: ValueError: boom"
        assert r["both"] == "rank 0: KeyError: 'r0'"
        assert r["bind"] == ("binding the Gated DeltaNet states failed on rank 1: RuntimeError: "
                             "out of memory for 3 slots")
        assert "forward" not in r
    assert rank0["entered_exited"] == [1, 1] and rank1["entered_exited"] == [0, 0]


# ---------------------------------------------------------------------------- Gated DeltaNet
GDN_WINDOWS = (2, 192)  # the unit check's calibration forward: 2 sequences of 192 tokens


class _KVCapture:
    """A :class:`~vllm_nvfp4.calibration.kv_hooks.KVObserver` stand-in that keeps every
    observed K/V ``[batch, kv_heads, seq, head_dim]`` (FP32) by layer."""

    wants_positions = False  # no RoPE statistics: observe() takes no positions

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.kv.setdefault(layer, []).append((key.float().clone(), value.float().clone()))

    def stacked(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V of every observed batch laid along the batch dim."""
        return {i: tuple(torch.cat(t) for t in zip(*kvs)) for i, kvs in self.kv.items()}


def _state_bindings(worker: Any) -> dict[str, tuple]:
    """Per GDN layer: its bound state tensors (runs in the worker)."""
    from vllm_nvfp4.integration.calibration_states import state_layers

    layers = state_layers(worker.model_runner.vllm_config)
    return {name: tuple(layer.kv_cache) for name, layer in layers.items()}


def _gdn_worker_checks(worker: Any, ids: list[list[int]], policy: dict) -> dict:
    """In the started engine's worker: whether every GDN layer holds vLLM's own state (views of
    the runner's KV-cache tensors, as many slots as vLLM allocated); the attention layers' K/V
    of a calibration forward over ``ids [S, L]`` and of one forward per sequence;
    ``slot_damage`` of every K/V slot resumed and through the whole model, with the calls of
    decoder layer 0 (a GDN layer); whether the layers hold the same state tensors after all."""
    import vllm_nvfp4.integration.calibration_forward as cf
    from vllm_nvfp4.integration.calibration_states import StateLayers, state_layers
    from vllm_nvfp4.integration.model import layer_index
    from vllm_nvfp4.integration.startup_calibration import _our_layers
    from vllm_nvfp4.policy import KVPolicy

    runner = worker.model_runner
    vc = runner.vllm_config
    scaled = KVPolicy.from_dict(policy)
    before = _state_bindings(worker)
    storages = {t.untyped_storage().data_ptr() for t in runner.kv_caches}
    vllm_own = all(t.untyped_storage().data_ptr() in storages and t.shape[0] > len(ids) + 1
                   for states in before.values() for t in states)
    layers = _our_layers(vc, scaled.num_layers)
    states = StateLayers(vc, state_layers(vc), runner.device)
    rows = {n: layer_index(n, scaled.num_layers) for n in layers}
    batch, single = _KVCapture(scaled.num_layers), _KVCapture(scaled.num_layers)
    with torch.inference_mode(), states.bound(len(ids)):
        cf._forward(runner, rows, torch.tensor(ids), batch, states=states)
        for seq in ids:
            cf._forward(runner, rows, torch.tensor([seq]), single, states=states)
    windows = torch.randint(10, 4000, (2, 96), generator=torch.Generator().manual_seed(0))
    slots = [(i, kv) for i, _ in scaled.kv_layers() for kv in ("k", "v")]
    damage = _slot_damage_two_ways(runner, layers, windows, scaled, slots, states)
    after = _state_bindings(worker)
    same = before.keys() == after.keys() and all(
        len(before[n]) == len(after[n]) and all(a is b for a, b in zip(before[n], after[n]))
        for n in before)
    return {"vllm_own": vllm_own, "gdn_layers": sorted(before), "kv": batch.stacked(),
            "kv_single": single.stacked(),
            "resumed": damage[0], "whole": damage[1], "same_after": same}


def _transformers_kv(model_dir: Path, ids: list[list[int]], num_layers: int, dtype: str) -> dict:
    """The attention layers' K/V of a transformers forward in ``dtype`` of each sequence of
    ``ids`` alone (as the cache would store them: post-RoPE, this model's KV heads)."""
    from vllm_nvfp4.calibration.kv_hooks import kv_cache_quantization
    from vllm_nvfp4.calibration.modeling import load_model

    model, _, _ = load_model(model_dir, dtype=dtype)
    capture = _KVCapture(num_layers)
    with torch.no_grad(), kv_cache_quantization(model, observer=capture):
        for seq in ids:
            model(input_ids=torch.tensor([seq]))
    return capture.stacked()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def gdn_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny Qwen3-Next (Gated DeltaNet on 0-2 and 4-6, full attention on 3 and 7) started
    without a policy (bfloat16: vLLM's CPU GDN kernel's); the summary of its start-up
    calibration, what its worker bound and :func:`_gdn_worker_checks`."""
    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid

    from engine_helpers import engine, generate, recorded_startup_calibration, token_ids

    root = tmp_path_factory.mktemp("gdn")
    model_dir = build_tiny_hybrid("qwen3_next", root / "qwen3_next")
    ids = torch.randint(10, 4000, GDN_WINDOWS, generator=torch.Generator().manual_seed(1)).tolist()
    with recorded_startup_calibration(root / "cache") as summaries:
        llm = engine(model_dir, dtype="bfloat16")
        try:
            files = sorted((root / "cache" / "startup-calibration").glob("*.json"))
            policy = json.loads(files[0].read_text()) if files else None
            out = {"model": model_dir, "ids": ids, "summaries": summaries, "files": files,
                   "bound": llm.collective_rpc(_bound)[0],
                   "generated": token_ids(generate(llm, [ids[0][:100], ids[1][:60]], 8))}
            if policy is not None:
                out["worker"] = llm.collective_rpc(_gdn_worker_checks, args=(ids, policy))[0]
        finally:
            del llm
            gc.collect()
    return out


def test_gdn_model_calibrates_at_startup(gdn_run):
    """No policy, a Gated DeltaNet hybrid: calibrated at start-up on the built-in text (the
    summary the engine logs, the cached policy: scales and K centering for the two attention
    layers only), the attention layers bind those scales, the engine generates, and its GDN
    layers hold vLLM's own state tensors (not the calibration's temporaries)."""
    from vllm_nvfp4.policy import KVPolicy

    (summary,) = gdn_run["summaries"]
    assert "skipped" not in summary and not summary["cached"], summary
    assert summary["tokens"] == 4096  # 8 windows of 512 (max_model_len)
    (path,) = gdn_run["files"]
    policy = KVPolicy.load(path)
    assert policy.provenance["tokens"] == 4096
    assert [i for i, _ in policy.kv_layers()] == [3, 7]
    for i, lp in enumerate(policy.layers):
        if i in (3, 7):
            assert lp.k_scale is not None and lp.v_scale is not None and lp.k_center is not None
        else:
            assert lp.layer_type.kind == "none" and lp.k_scale is None and lp.k_center is None
    assert sorted(gdn_run["bound"]) == ["model.layers.3.self_attn.attn", "model.layers.7.self_attn.attn"]
    for name, layer in gdn_run["bound"].items():
        row = policy.layers[int(name.split(".")[2])]
        assert layer["k_scale"] == pytest.approx([row.quant_scale("k")] * 2, rel=1e-6)
        assert layer["v_scale"] == pytest.approx([row.quant_scale("v")] * 2, rel=1e-6)
    assert [len(t) for t in gdn_run["generated"]] == [8, 8]
    worker = gdn_run["worker"]
    assert worker["gdn_layers"] == [f"model.layers.{i}.linear_attn" for i in (0, 1, 2, 4, 5, 6)]
    assert worker["vllm_own"] and worker["same_after"]


def test_gdn_calibration_forward_matches_transformers(gdn_run):
    """The attention layers' K/V of a calibration forward over 2 sequences at once (every GDN
    layer on its prefill metadata and temporary states) equal those of one forward per sequence
    exactly (each sequence from its own zero state), and are as close to transformers' float32
    forward of each sequence as transformers' own bfloat16 forward is (the tolerance: the
    random model amplifies bfloat16 rounding to ~8% at layer 3 and ~21% at layer 7)."""
    worker, ids = gdn_run["worker"], gdn_run["ids"]
    kv, single = worker["kv"], worker["kv_single"]
    exact = _transformers_kv(gdn_run["model"], ids, 8, "float32")
    bf16 = _transformers_kv(gdn_run["model"], ids, 8, "bfloat16")
    assert sorted(kv) == sorted(single) == sorted(exact) == [3, 7]
    for layer in (3, 7):
        for j, name in enumerate("kv"):
            ours, ref = kv[layer][j], exact[layer][j]
            assert ours.shape == ref.shape == (len(ids), 2, len(ids[0]), 64)
            assert torch.equal(ours, single[layer][j]), (layer, name)
            for s in range(len(ids)):
                noise = _rel(bf16[layer][j][s], ref[s])
                assert _rel(ours[s], ref[s]) < GDN_NOISE_MARGIN * noise, (layer, name, s)


def test_gdn_slots_resume_at_their_layer(gdn_run):
    """The start-up sensitivity on a GDN model: slots resumed at their attention layer (the GDN
    layers after it on their metadata) measure what the whole model measures, without running layer 0
    again: layer 3's slots ranked above layer 7's in both, each damage within 30% or 5% of the
    largest, not exactly: the resumed stream enters in bfloat16 where the whole forward adds it in
    float32, which this random model amplifies through the GDN layers after the slot (measured
    0.6-27% on layer 3 on different CPUs, whose damages are ~0.05 nats; layer 7's are ~0.003 nats,
    and with the sink key stored uncentered its K differs by 0.001 nats, 30%; the final hidden
    states of a forward resumed at layer 3 differ by 7%, 1.7% for a bfloat16 Llama)."""
    resumed, whole = gdn_run["worker"]["resumed"], gdn_run["worker"]["whole"]
    assert resumed["damage"].keys() == whole["damage"].keys() == {(3, "k"), (3, "v"), (7, "k"), (7, "v")}
    top = max(whole["damage"].values())
    for slot, d in whole["damage"].items():
        r = resumed["damage"][slot]
        assert d > 0 and r > 0 and abs(r - d) <= max(0.3 * d, 0.05 * top), (slot, d, r)
    for run in (whole, resumed):  # the order the selection uses
        assert min(run["damage"][3, kv] for kv in "kv") > max(run["damage"][7, kv] for kv in "kv")
    for run in (resumed, whole):  # layer 3's slots 15x layer 7's here: a ranking no drift flips
        assert min(run["damage"][(3, kv)] for kv in "kv") > 3 * max(run["damage"][(7, kv)] for kv in "kv")
    assert whole["layer0_calls"] == 1 + 4 and resumed["layer0_calls"] == 1


def test_gdn_model_selects_its_fp8_slots_at_startup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A GDN hybrid with three attention layers (GDN on 0, 2, 4; attention on 1, 3, 5): the
    start-up selection measures all six K/V slots through the GDN layers (2048 tokens) and keeps
    the rule's count, four, in FP8; the attention layers serve the chosen formats and the engine
    generates."""
    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid

    from engine_helpers import engine, generate, token_ids

    model_dir = build_tiny_hybrid("qwen3_next", tmp_path / "qwen3_next",
                                  layer_types=["linear_attention", "full_attention"] * 3)
    monkeypatch.setenv("VLLM_NVFP4_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    monkeypatch.delenv(STARTUP_ENV, raising=False)
    llm = engine(model_dir, dtype="bfloat16")
    try:
        layouts = llm.collective_rpc(lambda w: {
            n: (l.impl.layout.k_format, l.impl.layout.v_format)
            for n, l in w.model_runner.compilation_config.static_forward_context.items()
            if hasattr(getattr(l, "impl", None), "layout")})[0]
        generated = token_ids(generate(llm, [list(range(10, 90))], 4))
    finally:
        del llm
        gc.collect()
    (path,) = (tmp_path / "cache" / "startup-calibration").glob("*.json")
    policy = KVPolicy.load(path)
    sens = policy.provenance["sensitivity"]
    assert policy.provenance["formats_from"] == "start-up sensitivity"
    assert sens["tokens"] == 2048 and sens["candidates"] == 3 and sens["fp8_slots"] == 4
    assert sorted(sens["kl"]) == ["1.k", "1.v", "3.k", "3.v", "5.k", "5.v"]
    assert all(kl > 0 for kl in sens["kl"].values())
    assert sum(lp.format_of(kv) == "fp8" for _, lp in policy.kv_layers() for kv in "kv") == 4
    assert layouts == {f"model.layers.{i}.self_attn.attn": (policy.layers[i].k, policy.layers[i].v)
                       for i in (1, 3, 5)}
    assert [len(t) for t in generated] == [4]


def test_state_layer_models_calibrate_at_startup_unless_not_gdn(tiny_model_dir: Path, tmp_path: Path):
    """Through vLLM's engine config a Qwen3-Next-style model is planned for start-up
    calibration like a dense one; in the worker, state layers other than Gated DeltaNet (a
    Mamba2 layer here) skip it with a reason."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    from vllm_nvfp4.integration.startup_calibration import _gdn_layers, skip_reason
    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid

    def config(model: Path, **kw: Any) -> Any:
        return EngineArgs(model=str(model), kv_cache_dtype="nvfp4_mixed", max_model_len=256,
                          **kw).create_engine_config()

    gdn = build_tiny_hybrid("qwen3_next", tmp_path / "qwen3_next")
    assert skip_reason(config(gdn, dtype="bfloat16")) is None
    assert skip_reason(config(tiny_model_dir, dtype="float32")) is None

    class Mamba2Like(MambaBase):
        mamba_type = MambaAttentionBackendEnum.MAMBA2

        def get_state_shape(self) -> tuple:
            return ()

        def get_state_dtype(self) -> tuple:
            return ()

    vc = SimpleNamespace(compilation_config=SimpleNamespace(
        static_forward_context={"model.layers.0.mixer": Mamba2Like()}))
    assert _gdn_layers(vc, torch.device("cpu")) == (
        "not supported for models with Mamba / linear-attention (state) layers other than "
        "Gated DeltaNet (first: model.layers.0.mixer)")
    vc.compilation_config.static_forward_context = {}
    assert _gdn_layers(vc, torch.device("cpu")) is None


def test_a_failing_gdn_calibration_starts_uncalibrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An error in the calibration forward of a GDN model does not fail the engine start: the
    default rule serves with default scales, nothing is cached, the engine generates and its GDN
    layers hold vLLM's states."""
    import vllm_nvfp4.integration.calibration_states as cs
    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid

    from engine_helpers import engine, generate, token_ids

    def broken(self: Any, num_seqs: int, seq_len: int) -> dict:
        raise RuntimeError("no metadata")

    monkeypatch.setenv("VLLM_NVFP4_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    monkeypatch.setattr(cs.StateLayers, "metadata", broken)
    llm = engine(build_tiny_hybrid("qwen3_next", tmp_path / "qwen3_next"), dtype="bfloat16")
    try:
        bound = llm.collective_rpc(_bound)[0]
        generated = token_ids(generate(llm, [list(range(10, 90))], 4))
        states = llm.collective_rpc(_state_bindings)[0]
    finally:
        del llm
        gc.collect()
    assert not list((tmp_path / "cache" / "startup-calibration").glob("*.json"))
    assert all(layer["k_scale"] == pytest.approx([1.0, 1.0]) for layer in bound.values())
    assert [len(t) for t in generated] == [4]
    assert len(states) == 6 and all(t.shape[0] > 3 for s in states.values() for t in s)

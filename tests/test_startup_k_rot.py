"""Start-up calibration with the rotating K center (policy ``k_rot``) through real vLLM on CPU.

An engine starts with the start-up calibration off; the calibration step itself
(``_calibrate``, what ``calibrate_worker`` runs) then runs in its worker with a recipe asking
for 8 pairs (``$VLLM_NVFP4_K_ROT_PAIRS``). Checked: the policy validates and
round-trips; every layer has ``k_rot`` of 8 pairs per KV head, the pairs of largest ``|b|``
with ``b`` the mean pre-RoPE key the calibration forward observed, ``theta`` the frequencies of
vLLM's rotary embedding at those pairs, ``k_center`` 0 on the rotated channels; everything
equals ``vllm-nvfp4 calibrate --k-rot-pairs 8`` (transformers) on the same windows; a K slot of
the sensitivity forwards is read back as the fake-quantized reference reads it. Where the
model's RoPE does not fit, the calibration logs why and keeps the constant offset. Under TP=2
(one KV head per rank) both ranks build the same rotating center, equal to the offline fit. An
engine started without a policy and with 8 pairs asked serves the center it calibrated. The
RoPE checks on vLLM's rotary classes, the recipe and its environment override run without an
engine.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import LogLines

PAIRS = 8
HEAD_DIM = 32


def _calibrate_in_worker(worker: Any, refuse: str = "") -> dict:
    """The start-up calibration step on the worker's model with the recipe of this engine
    (``$VLLM_NVFP4_K_ROT_PAIRS`` set by the test), selection on; with ``refuse``, vLLM's RoPE
    is reported not to fit for that reason. Returns the policy, the rotary embedding's
    frequencies, the observed mean pre-RoPE keys and a K slot read back both ways."""
    from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT
    from vllm_nvfp4.calibration.data import load_windows
    from vllm_nvfp4.calibration.kv_hooks import _layer_quants, stored_keys_read_back
    from vllm_nvfp4.integration import startup_calibration as sc
    from vllm_nvfp4.integration.calibration_forward import SlotPerturbation
    from vllm_nvfp4.model_shape import ModelShape

    runner = worker.model_runner
    vllm_config = runner.vllm_config
    shape = ModelShape.from_vllm_config(vllm_config)
    layers = sc._our_layers(vllm_config, shape.num_layers)
    tokenizer = sc.load_tokenizer(vllm_config.model_config)
    recipe, parts, _ = sc.calibration_plan(vllm_config, tokenizer, soft_cap=False)
    recipe = replace(recipe, select=not refuse)  # the engine runs with start-up calibration off
    windows = load_windows([BUILTIN_TEXT], tokenizer, recipe.window, count=0,
                           calib=recipe.windows).calib
    real = sc.vllm_rope
    if refuse:
        sc.vllm_rope = lambda *args: refuse
    try:
        policy = sc._calibrate(runner, layers, None, windows, recipe, shape, parts, True)
    finally:
        sc.vllm_rope = real
    out: dict = {"recipe": recipe.describe(), "policy": policy.to_dict()}
    if refuse:
        return out
    emb = runner.get_model().model.layers[0].self_attn.rotary_emb
    out["inv_freq"] = emb._compute_inv_freq(emb.base).tolist()
    rope = sc.startup_rope(runner, layers, recipe, shape.head_dim)
    observer = sc.observe_in_vllm(runner, layers, windows, recipe.per_forward, shape.num_layers,
                                  None, recipe.offsets, rope)
    out["b"] = [observer.k_pre_mean(i).tolist() for i in range(shape.num_layers)]
    # a K slot of the sensitivity forwards against the fake-quantized reference's read-back
    name = "model.layers.1.self_attn.attn"
    slot = SlotPerturbation.of(policy, 1, "k", "nvfp4", name, layers[name].impl, vllm_config)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 40, shape.head_dim, generator=g) for h in (4, 2, 2))
    pos = torch.arange(40)
    q1, k1, _ = slot.apply(q, k, v, pos)
    quant = _layer_quants(policy.with_layer(1, k="nvfp4"))[1]
    q2, _, k2 = stored_keys_read_back(quant, q, k, pos)
    _, k0, _ = replace(slot, k_rot=None).apply(q, k, v, pos)
    out["slot"] = {"query": float((q1 - q2).abs().max()), "key": float((k1 - k2).abs().max()),
                   "rot_moves": float((k0 - k1).abs().max())}
    return out


@pytest.fixture(scope="module")
def startup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from vllm import LLM

    import vllm_nvfp4.calibration.rot_center as rc
    from conftest import FAST_LLM_KWARGS
    from vllm_nvfp4.testing.models import build_tiny_llama

    root = tmp_path_factory.mktemp("startup-k-rot")
    model_dir = build_tiny_llama(root / "llama", dtype="float32")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_NVFP4_CACHE", str(root / "cache"))
    mp.delenv("VLLM_NVFP4_POLICY", raising=False)
    mp.setenv("VLLM_NVFP4_STARTUP_CALIBRATION", "0")  # the engine serves the default rule
    mp.setenv("VLLM_NVFP4_K_ROT_PAIRS", str(PAIRS))
    log, handler = logging.getLogger("test_startup_k_rot.rot_center"), LogLines()
    log.setLevel(logging.INFO)
    log.handlers, log.propagate = [handler], False
    mp.setattr(rc, "logger", log)
    llm = LLM(**dict(FAST_LLM_KWARGS, model=str(model_dir), kv_cache_dtype="nvfp4_mixed",
                     dtype="float32"))
    try:
        run = llm.collective_rpc(_calibrate_in_worker)[0]
        refused = llm.collective_rpc(_calibrate_in_worker, args=("its RoPE is made up",))[0]
    finally:
        del llm
        gc.collect()
        mp.undo()
    return {"model": model_dir, "run": run, "refused": refused, "log": handler.lines}


def _offline(model_dir: Path, policy: Any, pairs: int) -> Any:
    """``vllm-nvfp4 calibrate --k-center --k-sink-uncentered --k-rot-pairs`` (transformers,
    float32) on the windows and served length the start-up calibration recorded."""
    from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT
    from vllm_nvfp4.calibration.commands import run_calibrate

    data = policy.provenance["data"]
    return run_calibrate(model_dir, [BUILTIN_TEXT], None, window=data["window_tokens"],
                         windows=data["calib_windows"], dtype="float32", k_center=True,
                         k_sink_uncentered=True, k_rot_pairs=pairs,
                         max_model_len=policy.provenance["position_range"]["max_model_len"])


@pytest.mark.vllm
def test_startup_policy_has_the_rotating_center_of_every_layer(startup, tmp_path: Path):
    from vllm_nvfp4.kernels.launch import RotCenter
    from vllm_nvfp4.policy import KVPolicy

    run = startup["run"]
    assert run["recipe"]["k_rot_pairs"] == PAIRS and run["recipe"]["version"] == 9
    policy = KVPolicy.from_dict(run["policy"])
    path = tmp_path / "p.json"
    policy.save(path)
    assert KVPolicy.load(path).layers == policy.layers
    policy.check_model(4, 2)
    prov = policy.provenance
    assert prov["k_rot_pairs"] == PAIRS and prov["formats_from"] == "start-up sensitivity"
    assert "sink_key" in prov or not any(lp.k_sink_uncentered for lp in policy.layers)
    inv_freq = torch.tensor(run["inv_freq"])
    half = HEAD_DIM // 2
    assert torch.equal(inv_freq, 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    for i, lp in enumerate(policy.layers):
        rot = lp.k_rot
        assert rot is not None and rot.num_pairs == PAIRS, i
        pairs = torch.tensor(rot.pairs)
        b_stored, theta = torch.tensor(rot.b), torch.tensor(rot.theta)
        assert pairs.shape == (2, PAIRS) and b_stored.shape == (2, 2, PAIRS) and theta.shape == (2, PAIRS)
        # the pairs of largest |b| (the observed mean pre-RoPE key), b of both halves stored
        b = torch.tensor(run["b"][i])
        top = RotCenter.top_pairs(b, inv_freq, PAIRS)
        assert torch.equal(pairs, top.idx.long()), i
        norm = b[:, :half].square() + b[:, half:].square()
        for h in range(2):
            assert set(pairs[h].tolist()) == set(norm[h].topk(PAIRS).indices.tolist()), (i, h)
        torch.testing.assert_close(b_stored, torch.stack([b.gather(1, pairs), b.gather(1, pairs + half)], 1))
        assert torch.equal(theta, inv_freq[pairs]), i
        center = torch.tensor(lp.k_center)
        assert bool((center.gather(1, pairs) == 0).all() and (center.gather(1, pairs + half) == 0).all())
        assert int((center != 0).sum()) == 2 * (HEAD_DIM - 2 * PAIRS), i  # mu' elsewhere


@pytest.mark.vllm
def test_startup_k_rot_equals_the_offline_fit_on_the_same_windows(startup):
    from vllm_nvfp4.policy import KVPolicy

    served = KVPolicy.from_dict(startup["run"]["policy"])
    ref = _offline(startup["model"], served, PAIRS)
    assert ref.provenance["k_rot_pairs"] == PAIRS
    for i, (a, r) in enumerate(zip(served.layers, ref.layers)):
        assert a.k_rot.pairs == r.k_rot.pairs, i
        assert a.k_rot.theta == r.k_rot.theta, i
        torch.testing.assert_close(torch.tensor(a.k_rot.b), torch.tensor(r.k_rot.b), rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(torch.tensor(a.k_center), torch.tensor(r.k_center), rtol=0, atol=2e-5)
    for i, a in enumerate(served.layers):  # the scales of the formats the selection chose
        r = ref.with_layer(i, k=a.k, v=a.v).layers[i]
        assert (a.quant_scale("k"), a.quant_scale("v")) == pytest.approx(
            (r.quant_scale("k"), r.quant_scale("v")), rel=2e-4), i
        assert a.k_sink_uncentered in (None, r.k_sink_uncentered), i


@pytest.mark.vllm
def test_sensitivity_slots_read_k_rot_back_as_the_reference_does(startup):
    slot = startup["run"]["slot"]
    assert slot["query"] == 0.0 and slot["key"] < 1e-5
    assert slot["rot_moves"] > 1e-2  # the rotating offset changes what a slot reads back


@pytest.mark.vllm
def test_a_rope_that_does_not_fit_falls_back_to_the_constant_offset(startup):
    from vllm_nvfp4.policy import KVPolicy

    policy = KVPolicy.from_dict(startup["refused"]["policy"])
    assert policy.provenance["k_rot_pairs"] == 0
    assert all(lp.k_rot is None and lp.k_center is not None for lp in policy.layers)
    assert any("no rotating K center (8 RoPE pairs asked): its RoPE is made up; K is centered "
               "on a constant offset" in line for line in startup["log"])


# ---------------------------------------------------------------------------- vLLM's RoPE classes
def _rope(cls_name: str, **kw: Any) -> Any:
    """vLLM's rotary embedding class ``cls_name`` (a CustomOp: built under a default config)."""
    import vllm.model_executor.layers.rotary_embedding as re_
    from vllm.config import VllmConfig, set_current_vllm_config

    args = dict(head_size=HEAD_DIM, rotary_dim=HEAD_DIM, max_position_embeddings=256,
                base=10000.0, is_neox_style=True, dtype=torch.float32)
    args.update(kw)
    with set_current_vllm_config(VllmConfig()):
        return getattr(re_, cls_name)(**args)


def test_vllm_rope_takes_the_modules_own_frequencies():
    from vllm_nvfp4.calibration.rope import Rope
    from vllm_nvfp4.integration.calibration_rope import module_rope

    plain = module_rope(_rope("RotaryEmbedding"), HEAD_DIM)
    assert isinstance(plain, Rope) and plain.scaling == 1.0
    assert torch.equal(plain.inv_freq, 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    llama3 = _rope("Llama3RotaryEmbedding", scaling_factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, orig_max_position=64)
    got = module_rope(llama3, HEAD_DIM)
    assert isinstance(got, Rope) and torch.equal(got.inv_freq, llama3._compute_inv_freq(10000.0))
    assert not torch.equal(got.inv_freq, plain.inv_freq)  # the low frequencies scaled
    yarn = _rope("YaRNScalingRotaryEmbedding", scaling_factor=4.0)
    got = module_rope(yarn, HEAD_DIM)
    assert isinstance(got, Rope) and got.scaling == pytest.approx(yarn.mscale) and got.scaling > 1
    assert torch.equal(got.inv_freq, yarn._compute_inv_freq(4.0))


def test_vllm_ropes_the_rotating_center_does_not_fit_are_named():
    from vllm_nvfp4.integration.calibration_rope import module_rope, vllm_rope

    assert "neox" in module_rope(_rope("RotaryEmbedding", is_neox_style=False), HEAD_DIM)
    assert "partial" in module_rope(_rope("RotaryEmbedding", rotary_dim=HEAD_DIM // 2), HEAD_DIM)
    linear = _rope("LinearScalingRotaryEmbedding", scaling_factors=2.0)
    assert "position scaling" in module_rope(linear, HEAD_DIM)
    assert "M-RoPE" in vllm_rope(torch.nn.Module(), ["model.layers.0.self_attn.attn"], HEAD_DIM,
                                 uses_mrope=True)

    class Attn(torch.nn.Module):
        def __init__(self, emb: Any) -> None:
            super().__init__()
            self.rotary_emb, self.attn = emb, torch.nn.Identity()

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Attn(_rope("RotaryEmbedding")),
                                        Attn(_rope("RotaryEmbedding", base=1e6))])
    names = ["layers.0.attn", "layers.1.attn"]
    assert "different RoPEs" in vllm_rope(model, names, HEAD_DIM)
    assert "no rotary embedding" in vllm_rope(model, ["layers.0.other.attn"], HEAD_DIM)
    model.layers[1].rotary_emb = model.layers[0].rotary_emb
    assert not isinstance(vllm_rope(model, names, HEAD_DIM), str)


# ---------------------------------------------------------------------------- the recipe
def _config(head_dim: int = HEAD_DIM, mrope: bool = False, **rope: Any) -> SimpleNamespace:
    text = SimpleNamespace(rope_parameters={"rope_theta": 1e4, **rope})
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048),
        model_config=SimpleNamespace(max_model_len=2048, uses_mrope=mrope, hf_text_config=text,
                                     get_head_size=lambda: head_dim))


def test_recipe_asks_for_the_rotating_center_where_the_rope_fits(monkeypatch):
    import vllm_nvfp4.integration.startup_recipe as sr
    from vllm_nvfp4.model_shape import ModelShape

    monkeypatch.delenv("VLLM_NVFP4_K_ROT_PAIRS", raising=False)
    assert sr.recipe_for(_config(), 100_000, False).k_rot_pairs == sr.ROT_PAIRS
    monkeypatch.setattr(sr, "ROT_PAIRS", 8)  # the default switched on
    on = sr.recipe_for(_config(), 100_000, False)
    assert on.k_rot_pairs == 8 and on.describe()["k_rot_pairs"] == 8 and sr.RECIPE_VERSION == 9
    assert sr.recipe_for(_config(head_dim=16), 100_000, False).k_rot_pairs == 8  # head_dim / 2
    assert sr.recipe_for(_config(head_dim=8), 100_000, False).k_rot_pairs == 0  # < 8: no kernel
    assert sr.recipe_for(_config(), 100_000, True).k_rot_pairs == 0  # soft-cap: no centering
    assert sr.recipe_for(_config(mrope=True), 100_000, False).k_rot_pairs == 0
    assert sr.recipe_for(_config(partial_rotary_factor=0.5), 100_000, False).k_rot_pairs == 0
    monkeypatch.setenv("VLLM_NVFP4_K_ROT_PAIRS", "0")
    off = sr.recipe_for(_config(), 100_000, False)
    assert off.k_rot_pairs == 0 and off.describe() != on.describe()
    monkeypatch.setenv("VLLM_NVFP4_K_ROT_PAIRS", "16")
    assert sr.recipe_for(_config(), 100_000, False).k_rot_pairs == 16
    monkeypatch.setenv("VLLM_NVFP4_K_ROT_PAIRS", "64")  # head_dim 80: 40 pairs, 32 a power of 2
    assert sr.recipe_for(_config(head_dim=80), 100_000, False).k_rot_pairs == 32
    for bad in ("many", "4", "12", "-8"):
        monkeypatch.setenv("VLLM_NVFP4_K_ROT_PAIRS", bad)
        with pytest.raises(ValueError, match="VLLM_NVFP4_K_ROT_PAIRS"):
            sr.recipe_for(_config(), 100_000, False)
    with pytest.raises(ValueError, match="needs k_center"):
        replace(off, k_center=False, k_rot_pairs=8)
    shape = ModelShape(num_layers=4, total_num_kv_heads=2, num_kv_heads=2, head_dim=HEAD_DIM,
                       dtype="float32", max_positions=2048)
    assert sr.tokens_run(on, shape) - sr.tokens_run(off, shape) == on.window * on.windows * 5  # 4 offsets
    assert "rotating offset on 8 RoPE pairs per KV head" in sr.describe_recipe(on, shape)
    assert "rotating" not in sr.describe_recipe(off, shape)


# ---------------------------------------------------------------------------- tensor parallel
TP_SCRIPT = '''
import json, os, sys
from dataclasses import replace

from vllm import LLM


def calibrate(worker):
    from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT
    from vllm_nvfp4.calibration.data import load_windows
    from vllm_nvfp4.integration import startup_calibration as sc
    from vllm_nvfp4.model_shape import ModelShape

    runner = worker.model_runner
    shape = ModelShape.from_vllm_config(runner.vllm_config)
    layers = sc._our_layers(runner.vllm_config, shape.num_layers)
    tokenizer = sc.load_tokenizer(runner.vllm_config.model_config)
    recipe, parts, _ = sc.calibration_plan(runner.vllm_config, tokenizer, soft_cap=False)
    windows = load_windows([BUILTIN_TEXT], tokenizer, recipe.window, count=0,
                           calib=recipe.windows).calib
    policy = sc._calibrate(runner, layers, None, windows, replace(recipe, select=False), shape,
                           parts, True)
    return policy.to_dict()


if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], kv_cache_dtype="nvfp4_mixed", dtype="float32", max_model_len=512,
              enforce_eager=True, tensor_parallel_size=2, distributed_executor_backend="mp", seed=0)
    print("RESULT " + json.dumps(llm.collective_rpc(calibrate)))
'''


@pytest.mark.vllm
def test_tp2_ranks_fit_one_rotating_center_of_the_whole_model(startup, tmp_path: Path):
    """Two TP ranks, one KV head each: both ranks build the same policy, whose rotating center
    (fitted on the gathered statistics, its range from each rank's second pass, gathered)
    equals the offline fit on the same windows."""
    import json
    import subprocess
    import sys

    from conftest import vllm_subprocess_env
    from vllm_nvfp4.policy import KVPolicy

    (tmp_path / "run.py").write_text(TP_SCRIPT)
    env = vllm_subprocess_env(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                              VLLM_NVFP4_STARTUP_CALIBRATION="0", VLLM_NVFP4_K_ROT_PAIRS=str(PAIRS),
                              VLLM_NVFP4_CACHE=str(tmp_path / "cache"))
    env.pop("VLLM_NVFP4_POLICY", None)
    run = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(startup["model"])],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (run.stdout + run.stderr)[-4000:]
    rank0, rank1 = (KVPolicy.from_dict(p) for p in json.loads(lines[0][len("RESULT "):]))
    assert rank0.layers == rank1.layers and rank0.provenance["k_rot_pairs"] == PAIRS
    ref = _offline(startup["model"], rank0, PAIRS)
    for i, (a, r) in enumerate(zip(rank0.layers, ref.layers)):
        assert a.k_rot.pairs == r.k_rot.pairs and a.k_rot.theta == r.k_rot.theta, i
        torch.testing.assert_close(torch.tensor(a.k_rot.b), torch.tensor(r.k_rot.b), rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(torch.tensor(a.k_center), torch.tensor(r.k_center), rtol=0, atol=2e-5)
        assert a.k_scale == pytest.approx(r.k_scale, rel=2e-4), i  # the default rule's formats


def test_the_start_up_log_names_the_rotating_center():
    from vllm_nvfp4.integration.startup_calibration import rot_line

    assert rot_line({"k_rot_pairs": 8}) == "K centered on a rotating offset on 8 RoPE pairs per KV head"
    assert rot_line({"k_rot_pairs": 0}) == rot_line({}) == ""


# ---------------------------------------------------------------------------- served
def _bound_rot(worker: Any) -> dict:
    """Every nvfp4_mixed layer's bound rotating center and K centering (runs in the worker)."""
    ctx = worker.model_runner.compilation_config.static_forward_context
    return {name: None if layer.impl.rot_center is None else
            {"pairs": layer.impl.rot_idx.tolist(), "b": layer.impl.rot_b.tolist(),
             "theta": layer.impl.rot_theta.tolist(), "k_center": layer.impl.k_center.tolist()}
            for name, layer in ctx.items() if hasattr(getattr(layer, "impl", None), "layout")}


@pytest.mark.vllm
def test_an_engine_started_without_a_policy_serves_its_calibrated_rotating_center(startup, tmp_path: Path):
    """``$VLLM_NVFP4_K_ROT_PAIRS=8`` and no policy: the engine calibrates the rotating center
    at start-up, says so, caches it, binds exactly the cached ``k_rot`` on every layer and
    generates."""
    from engine_helpers import engine, generate, recorded_startup_calibration, token_ids
    from vllm_nvfp4.policy import KVPolicy

    with recorded_startup_calibration(tmp_path / "cache") as summaries:
        mp = pytest.MonkeyPatch()
        mp.setenv("VLLM_NVFP4_K_ROT_PAIRS", str(PAIRS))
        llm = None
        try:
            llm = engine(startup["model"])
            bound = llm.collective_rpc(_bound_rot)[0]
            out = token_ids(generate(llm, [[5, 17, 300, 42] * 8, list(range(100, 160))], 8))
        finally:
            mp.undo()
            del llm
            gc.collect()
    (summary,) = summaries
    assert not summary["cached"] and "rotating offset on 8 RoPE pairs" in summary["formats"]
    (path,) = (tmp_path / "cache" / "startup-calibration").glob("*.json")
    policy = KVPolicy.load(path)
    assert policy.provenance["k_rot_pairs"] == PAIRS
    for i, lp in enumerate(policy.layers):
        got = bound[f"model.layers.{i}.self_attn.attn"]
        assert got is not None and got["pairs"] == [list(r) for r in lp.k_rot.pairs], i
        torch.testing.assert_close(torch.tensor(got["b"]), torch.tensor(lp.k_rot.b))
        torch.testing.assert_close(torch.tensor(got["theta"]), torch.tensor(lp.k_rot.theta))
        torch.testing.assert_close(torch.tensor(got["k_center"]), torch.tensor(lp.k_center))
    assert [len(t) for t in out] == [8, 8]

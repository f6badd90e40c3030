"""Start-up calibration of an M-RoPE model through real vLLM on CPU: the tiny PaddleOCR-VL
(:mod:`vllm_nvfp4.testing.mrope_models`; vLLM's Qwen2/2.5/3-VL modules need torchvision, which
this CPU environment lacks) served with ``kv_cache_dtype="nvfp4_mixed"`` and no policy.

Checked: it calibrates at start-up (the summary logged, the cached policy with calibrated scales
and K centering, the scales bound) and generates from text prompts; a calibration forward's
post-RoPE K of layer 0 equals the K vLLM's own prefill of the same tokens writes to the cache
(and differs with the positions shifted: the check sees the positions); the positions are the
model's own ``[3, tokens]`` M-RoPE positions of text; the sensitivity forwards resume in the
language model's decoder stack (``model.language_model.model``).
"""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import LogLines

pytestmark = pytest.mark.vllm

PROMPT = (2, 160)  # the K check's prompts: 2 sequences of 160 token ids


class _KV:
    """A :class:`~vllm_nvfp4.calibration.kv_hooks.KVObserver` stand-in keeping each layer's
    observed K ``[S, kv_heads, L, D]`` (FP32)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.k[layer] = key.float().clone()


def _record_prefill_keys(worker: Any) -> None:
    """Make every ``nvfp4_mixed`` layer record the K its cache writes get (runs in the worker)."""
    ctx = worker.model_runner.compilation_config.static_forward_context
    worker.prefill_keys = {}
    for name, layer in ctx.items():
        impl = getattr(layer, "impl", None)
        if not hasattr(impl, "layout"):
            continue
        write = impl.do_kv_cache_update

        def recording(lyr: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, _name: str = name, _write: Any = write) -> None:
            if kv_cache.numel():
                n = min(key.shape[0], slot_mapping.shape[0])
                worker.prefill_keys.setdefault(_name, []).append(key[:n].float().clone())
            _write(lyr, key, value, kv_cache, slot_mapping)

        impl.do_kv_cache_update = recording


def _worker_checks(worker: Any, ids: list[list[int]]) -> dict:
    """In the worker, after a prefill of each of ``ids`` alone: vLLM's prefill K per layer name,
    a calibration forward's K over ``ids`` (positions as served, and shifted by 7), its positions
    and the model's own, the decoder stack found and whether a resumed forward reproduces it."""
    import vllm_nvfp4.integration.calibration_forward as cf
    from vllm_nvfp4.integration.model import layer_index

    runner = worker.model_runner
    model = runner.get_model()
    names = sorted(worker.prefill_keys)
    rows = {n: layer_index(n, len(names)) for n in names}
    chunk = torch.tensor(ids)
    served, shifted = _KV(), _KV()
    real = cf.text_positions
    with torch.inference_mode():
        exact = cf._forward(runner, rows, chunk, served)
        cf._forward(runner, rows, chunk, shifted, offset=7)
        stack = cf.decoder_stack(model)
        streams = cf.LayerStreams(stack, [2])
        try:
            cf._forward(runner, rows, chunk)
        finally:
            streams.close()
        resumes = cf._resumes_exactly(runner, rows, [chunk], [exact], streams)
    own = torch.cat([model.get_mrope_input_positions(seq, [])[0] for seq in ids], dim=1)
    return {"prefill": {rows[n]: [k.clone() for k in worker.prefill_keys[n]] for n in names},
            "served": served.k, "shifted": shifted.k,
            "positions": real(runner, chunk).cpu(), "own_positions": own,
            "shifted_positions": real(runner, chunk, 7).cpu(),
            "stack_is_language_model": stack is model.language_model.model, "resumes": resumes}


@pytest.fixture(scope="module")
def mrope_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny PaddleOCR-VL started without a policy: what start-up calibration returned and
    logged, the cache files, the bound scales, generated text and :func:`_worker_checks`."""
    import vllm_nvfp4.integration.startup_calibration as sc
    from vllm_nvfp4.testing.mrope_models import build_tiny_paddleocr_vl

    from engine_helpers import engine, greedy, recorded_startup_calibration

    root = tmp_path_factory.mktemp("mrope")
    model_dir = build_tiny_paddleocr_vl(root / "paddleocr_vl")
    ids = torch.randint(10, 4000, PROMPT, generator=torch.Generator().manual_seed(1)).tolist()
    # the module's own logger: vLLM's logging set-up drops the handlers of loggers under "vllm"
    log, handler = logging.getLogger("test_startup_calibration_mrope"), LogLines()
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    mp = pytest.MonkeyPatch()
    mp.setattr(sc, "logger", log)
    try:
        with recorded_startup_calibration(root / "cache") as summaries:
            llm = engine(model_dir)
            try:
                from test_startup_calibration import _bound

                texts = llm.generate(["def main():\n    return", "The quick brown fox"],
                                     greedy(8), use_tqdm=False)
                llm.collective_rpc(_record_prefill_keys)
                llm.generate([{"prompt_token_ids": p} for p in ids], greedy(1), use_tqdm=False)
                out = {"summaries": summaries, "log": list(handler.lines),
                       "files": sorted((root / "cache" / "startup-calibration").glob("*.json")),
                       "bound": llm.collective_rpc(_bound)[0],
                       "generated": [list(o.outputs[0].token_ids) for o in texts],
                       "worker": llm.collective_rpc(_worker_checks, args=(ids,))[0]}
            finally:
                del llm
                gc.collect()
    finally:
        log.removeHandler(handler)
        mp.undo()
    return out


def test_mrope_model_calibrates_at_startup(mrope_run):
    """No policy, an M-RoPE model: calibrated at start-up (not skipped) on the built-in text,
    the summary logged, the policy cached with scales and K centering for every layer and
    bound; the engine generates from text prompts."""
    from vllm_nvfp4.policy import KVPolicy

    (summary,) = mrope_run["summaries"]
    assert "skipped" not in summary and not summary["cached"], summary
    assert summary["tokens"] == 4096  # 8 windows of 512 (max_model_len)
    assert any(line.startswith("vllm-nvfp4: calibrated at start-up on 4096 tokens")
               for line in mrope_run["log"]), mrope_run["log"]
    (path,) = mrope_run["files"]
    policy = KVPolicy.load(path)
    assert policy.provenance["tool"] == "vllm-nvfp4 start-up calibration"
    assert [i for i, _ in policy.kv_layers()] == [0, 1, 2, 3]
    for lp in policy.layers:
        assert lp.k_scale is not None and lp.v_scale is not None and lp.k_center is not None
    assert sorted(mrope_run["bound"]) == [f"language_model.model.layers.{i}.self_attn.attn"
                                          for i in range(4)]
    for name, layer in mrope_run["bound"].items():
        row = policy.layers[int(name.split(".")[3])]
        assert layer["k_scale"] == pytest.approx([row.quant_scale("k")] * 2, rel=1e-6)
        assert layer["v_scale"] == pytest.approx([row.quant_scale("v")] * 2, rel=1e-6)
    assert [len(t) for t in mrope_run["generated"]] == [8, 8]


def test_calibration_forward_k_equals_vllm_prefill_k(mrope_run):
    """Layer 0's post-RoPE K of a calibration forward over the two prompts at once equals the K
    vLLM's prefill of each prompt wrote (float32, one rounding apart at most); with every
    position shifted by 7 it does not (relative difference > 0.1)."""
    worker = mrope_run["worker"]
    s, n = PROMPT
    (prefill,) = [torch.cat(worker["prefill"][0])]  # [2 * 160, kv_heads, D], prompt by prompt
    ours = worker["served"][0].transpose(1, 2).reshape(s * n, *prefill.shape[1:])
    torch.testing.assert_close(ours, prefill, rtol=1e-5, atol=1e-5)
    shifted = worker["shifted"][0].transpose(1, 2).reshape(s * n, *prefill.shape[1:])
    assert float((shifted - prefill).norm() / prefill.norm()) > 0.1


def test_calibration_positions_are_the_models_mrope_positions(mrope_run):
    """The calibration forward's positions are ``[3, S * L]``, the model's own M-RoPE positions
    of each text sequence (every row ``0..L-1``)."""
    s, n = PROMPT
    positions, own = mrope_run["worker"]["positions"], mrope_run["worker"]["own_positions"]
    assert positions.shape == (3, s * n) and positions.dtype == torch.int64
    assert torch.equal(positions, own.to(torch.int64))
    assert torch.equal(positions, torch.arange(n).repeat(s).expand(3, -1))
    assert torch.equal(mrope_run["worker"]["shifted_positions"], positions + 7)  # every row


def test_mrope_slots_resume_in_the_language_model(mrope_run):
    """The sensitivity forwards resume in the language model's decoder stack."""
    assert mrope_run["worker"]["stack_is_language_model"]
    assert mrope_run["worker"]["resumes"]


def test_dense_positions_stay_one_dimensional():
    """A model without M-RoPE keeps ``[S * L]`` positions, ``0..L-1`` per sequence."""
    from vllm_nvfp4.integration.calibration_forward import text_positions

    runner = SimpleNamespace(device=torch.device("cpu"),
                             vllm_config=SimpleNamespace(model_config=SimpleNamespace(uses_mrope=False)))
    assert torch.equal(text_positions(runner, torch.zeros(2, 5, dtype=torch.long)),
                       torch.tensor([0, 1, 2, 3, 4] * 2))
    assert torch.equal(text_positions(runner, torch.zeros(2, 3, dtype=torch.long), offset=40),
                       torch.tensor([40, 41, 42] * 2))

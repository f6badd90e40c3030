"""Start-up calibration: a model served without a policy calibrates its K/V scales before serving.

When ``kv_cache_dtype=nvfp4_mixed``, ``$VLLM_NVFP4_POLICY`` is unset and the model directory has
no ``nvfp4_policy.json`` (the default layer rule is in force), every worker runs the loaded model
IN vLLM over the package's calibration text (:mod:`vllm_nvfp4.calibration.builtin_text`) once,
after the KV cache is allocated and before vLLM's warm-up and CUDA-graph capture:

1. Each attention layer of ours gets a :class:`CalibrationBatch` as its attention metadata: the
   impl hands it the post-RoPE K and V of its heads (the tensors the cache would store), which it
   records (:class:`~vllm_nvfp4.calibration.kv_hooks.KVObserver`: amax, channel means) and then
   attends exactly (causal, with the layer's sliding window, attention sinks and soft-cap;
   nothing quantized), so every later layer sees the unquantized model's hidden states - the
   same statistics ``vllm-nvfp4 calibrate`` collects with transformers. No cache page is
   written (no slot mapping).
2. Under tensor parallelism each rank observes its own KV heads; the statistics are gathered
   over the TP group's CPU group, so every rank builds the same whole-model policy.
3. The policy = the default layer rule with calibrated scales (FP8 ``amax/448``, NVFP4
   ``amax/2688``, one per layer) and K centering offsets (not for models with a logits
   soft-cap), exactly :func:`~vllm_nvfp4.calibration.scales.scaled_policy` as ``calibrate
   --k-center`` writes it. It replaces the default rule for this engine
   (:func:`~vllm_nvfp4.integration.model.set_startup_policy`) and is bound into every layer's
   persistent scale tensors in place, before any graph is captured.
4. The policy is cached (:mod:`vllm_nvfp4.calibration.startup_cache`, rank 0 writes) and reused
   by the next start of the same model, weights, dtype, text and recipe.

Off: ``VLLM_NVFP4_STARTUP_CALIBRATION=0`` (the default rule keeps scale 1.0 / 1/6, with a
warning). Skipped with a warning under pipeline parallelism, for M-RoPE models and for models
with Mamba / linear-attention (state) layers such as Qwen3-Next (calibrate offline with
``vllm-nvfp4 calibrate``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT, builtin_text_sha256
from vllm_nvfp4.calibration.kv_hooks import KVObserver
from vllm_nvfp4.calibration.startup_cache import (
    cache_key,
    cache_path,
    load_cached,
    save_cached,
    weights_fingerprint,
)
from vllm_nvfp4.policy import POLICY_ENV, POLICY_FILENAME, KVPolicy, default_policy

from vllm_nvfp4.integration.dtype import is_ours
from vllm_nvfp4.integration.model import is_draft_layer, layer_index, layer_plan, set_startup_policy
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.paged_torch import attend_one_sequence

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers

STARTUP_CALIBRATION_ENV = "VLLM_NVFP4_STARTUP_CALIBRATION"
MAX_WINDOW = 1024  # tokens per calibration sequence (fewer if max_model_len or the batch is smaller)
TARGET_TOKENS = 4096  # calibration tokens in all (fewer if the text is shorter)
RECIPE_VERSION = 1  # bump when the statistics or the policy built from them change


# ---------------------------------------------------------------------------- when and how much
def skip_reason(vllm_config: Any) -> Optional[str]:
    """Why this engine does not calibrate at start-up (None: it does). ``"policy given"`` when
    the user supplied a policy (nothing to log)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if not is_ours(vllm_config.cache_config.cache_dtype):
        return "policy given"  # not our dtype: nothing to do
    if os.environ.get(POLICY_ENV, "").strip():
        return "policy given"
    shape = ModelShape.from_vllm_config(vllm_config)
    if shape.model_dir is not None and (Path(shape.model_dir) / POLICY_FILENAME).is_file():
        return "policy given"
    if os.environ.get(STARTUP_CALIBRATION_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"${STARTUP_CALIBRATION_ENV}={os.environ[STARTUP_CALIBRATION_ENV]}"
    if pc.pipeline_parallel_size > 1:
        return "not supported with pipeline parallelism"
    if getattr(mc, "uses_mrope", False):
        return "not supported for M-RoPE models"
    if any(not t.holds_kv for t in shape.layer_types):
        # their layers' forward needs vLLM's per-step state metadata, which a calibration
        # forward outside the scheduler does not have
        return "not supported for models with Mamba / linear-attention (state) layers"
    return None


def planned(vllm_config: Any) -> bool:
    """Whether this engine calibrates at start-up (the default scales are then provisional)."""
    return skip_reason(vllm_config) is None


@dataclass(frozen=True)
class Recipe:
    """How much text is run: ``windows`` sequences of ``window`` tokens, ``per_forward`` of them
    per model forward; K centering unless the model has a logits soft-cap."""

    window: int
    windows: int
    per_forward: int
    k_center: bool

    def describe(self) -> dict[str, Any]:
        return {"window": self.window, "windows": self.windows, "k_center": self.k_center,
                "per_head": False, "version": RECIPE_VERSION}


def recipe_for(vllm_config: Any, text_tokens: int, soft_cap: bool) -> Recipe:
    """The recipe for an engine: windows no longer than ``MAX_WINDOW``, ``max_model_len``, one
    batch (``max_num_batched_tokens``) or the text, ``TARGET_TOKENS`` tokens in all."""
    batch = vllm_config.scheduler_config.max_num_batched_tokens
    window = min(MAX_WINDOW, vllm_config.model_config.max_model_len, batch, text_tokens)
    windows = max(1, min(TARGET_TOKENS // window, text_tokens // window))
    return Recipe(window, windows, max(1, batch // window), k_center=not soft_cap)


# ---------------------------------------------------------------------------- inside the forward
@dataclass
class CalibrationBatch:
    """Attention metadata of a calibration forward: ``num_seqs`` sequences of ``seq_len`` tokens
    laid end to end. The impl calls :meth:`attend` instead of its cache path."""

    observer: KVObserver
    layer_rows: dict[str, int]  # layer name -> policy row
    num_seqs: int
    seq_len: int

    def attend(self, impl: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               output: torch.Tensor) -> torch.Tensor:
        """Record ``key``/``value`` ``[T, kv_heads, D]`` of ``impl``'s layer, then write exact causal
        attention of ``query [T, heads, D]`` into ``output [T, heads, D]``: the layer's sliding
        window, attention sinks and logits soft-cap as served (model dtype; FP32 with a soft-cap
        or sinks)."""
        s, n = self.num_seqs, self.seq_len
        t = s * n

        def seqs(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [S, H, L, D]
            return x[:t].reshape(s, n, x.shape[1], x.shape[2]).transpose(1, 2)

        k, v = seqs(key), seqs(value)
        self.observer.observe(self.layer_rows[impl.layer_name], k, v)
        q = seqs(query)
        if impl.logits_soft_cap is None and impl.sinks is None and impl.sliding_window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=impl.scale,
                                                 enable_gqa=True)
        else:  # per sequence, FP32: [L, H, D] in and out
            sinks = None if impl.sinks is None else impl.sinks.float()
            out = torch.stack([
                attend_one_sequence(qi.transpose(0, 1).float(), ki.transpose(0, 1).float(),
                                    vi.transpose(0, 1).float(), impl.scale, impl.sliding_window,
                                    impl.logits_soft_cap, sinks).transpose(0, 1)
                for qi, ki, vi in zip(q, k, v)]).to(q.dtype)
        output[:t].copy_(out.transpose(1, 2).reshape(t, q.shape[1], q.shape[3]))
        return output


def _our_layers(vllm_config: Any, num_layers: int) -> dict[str, Any]:
    """This rank's ``nvfp4_mixed`` attention layers of the target model by name (a speculative
    draft's layers keep their fixed rule and never see the calibration forward)."""
    ctx = vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in ctx.items()
            if is_ours(getattr(layer, "kv_cache_dtype", None)) and hasattr(layer, "impl")
            and not is_draft_layer(vllm_config, name, num_layers)}


@torch.inference_mode()
def observe_in_vllm(runner: Any, layers: dict[str, Any], windows: torch.Tensor, recipe: Recipe,
                    num_layers: int) -> KVObserver:
    """Run ``windows [n, T]`` through the runner's model, ``recipe.per_forward`` per forward;
    returns this rank's K/V statistics."""
    from vllm.forward_context import set_forward_context

    vllm_config = runner.vllm_config
    model = runner.get_model()
    rows = {name: layer_index(name, num_layers) for name in layers}
    observer = KVObserver(num_layers)
    for chunk in windows.split(recipe.per_forward):
        s, n = chunk.shape
        batch = CalibrationBatch(observer, rows, s, n)
        ids = chunk.reshape(-1).to(device=runner.device, dtype=torch.int32)
        positions = torch.arange(n, device=runner.device, dtype=torch.int64).repeat(s)
        with set_forward_context({name: batch for name in layers}, vllm_config,
                                 num_tokens=s * n, slot_mapping={}):
            model(input_ids=ids, positions=positions, intermediate_tensors=None,
                  inputs_embeds=None)
    missing = sorted(set(rows.values()) - {i for i in range(num_layers) if observer.k_amax[i] is not None})
    if missing:
        raise RuntimeError(f"vllm-nvfp4 start-up calibration: layers {missing} never reached the "
                           "attention impl; set VLLM_NVFP4_STARTUP_CALIBRATION=0 and calibrate "
                           "offline with `vllm-nvfp4 calibrate`")
    return observer


# ---------------------------------------------------------------------------- tensor parallel
_HEAD_FIELDS = ("k_amax", "v_amax", "k_channel_amax", "k_channel_max", "k_channel_min", "k_channel_sum")


def gather_heads(local: KVObserver, total_heads: int) -> KVObserver:
    """The whole model's statistics from every TP rank's (heads in rank order; with fewer KV
    heads than ranks, each head from the first rank that holds it)."""
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    if tp.world_size == 1:
        return local
    parts: list[Any] = [None] * tp.world_size
    state = {f: getattr(local, f) for f in _HEAD_FIELDS}
    torch.distributed.all_gather_object(parts, state, group=tp.cpu_group)
    if total_heads >= tp.world_size:
        ranks = list(range(tp.world_size))
    else:  # replicated heads: rank r holds head r * total // tp
        ranks = [min(r for r in range(tp.world_size) if r * total_heads // tp.world_size == h)
                 for h in range(total_heads)]
    merged = KVObserver(local.num_layers)
    merged.tokens = list(local.tokens)
    for f in _HEAD_FIELDS:
        setattr(merged, f, [None if parts[0][f][i] is None else
                            torch.cat([parts[r][f][i] for r in ranks], dim=0)
                            for i in range(local.num_layers)])
    return merged


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every TP rank."""
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    return obj if tp.world_size == 1 else tp.broadcast_object(obj, src=0)


# ---------------------------------------------------------------------------- the worker's job
def _model_files_dir(model_config: Any) -> Optional[Path]:
    """The local directory of the model's files (a hub id: its cached snapshot), or None."""
    if os.path.isdir(str(model_config.model)):
        return Path(model_config.model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_config.model, revision=model_config.revision,
                                      local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub model, or not cached: key on the name only
        return None


def _key_parts(vllm_config: Any, recipe: Recipe) -> dict[str, Any]:
    from vllm_nvfp4.calibration.modeling import config_sha256

    model_config = vllm_config.model_config
    files = _model_files_dir(model_config)
    model = ({"config_sha256": config_sha256(files), "weights": weights_fingerprint(files)}
             if files is not None and (files / "config.json").is_file()
             else {"name": str(model_config.model), "revision": model_config.revision})
    return {"model": model, "dtype": str(model_config.dtype).replace("torch.", ""),
            "load_format": str(vllm_config.load_config.load_format),  # "dummy": random weights
            "text_sha256": builtin_text_sha256(), "recipe": recipe.describe()}


def _load_tokenizer(model_config: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer,
                                         revision=model_config.tokenizer_revision,
                                         trust_remote_code=model_config.trust_remote_code)


def calibrate_worker(worker: Any) -> dict[str, Any]:
    """Calibrate (or load the cached calibration) on one worker and bind the scales into its
    layers. Runs on every rank at once (``collective_rpc``). Returns a summary for the log."""
    from vllm.distributed import get_tp_group

    from vllm_nvfp4.calibration.data import load_windows
    from vllm_nvfp4.calibration.scales import scaled_policy

    start = time.perf_counter()
    runner = worker.model_runner
    vllm_config, mc = runner.vllm_config, runner.vllm_config.model_config
    shape = ModelShape.from_vllm_config(vllm_config)
    layers = _our_layers(vllm_config, shape.num_layers)
    soft_cap = any(layer.impl.logits_soft_cap is not None for layer in layers.values())
    try:
        tokenizer = _load_tokenizer(mc)
    except (OSError, ValueError, ImportError) as e:  # same outcome on every rank: no collective yet
        return {"skipped": f"cannot load the tokenizer of {mc.tokenizer} with transformers ({e})"}
    text_tokens = len(tokenizer(BUILTIN_TEXT.read_text(encoding="utf-8"),
                                add_special_tokens=False, verbose=False)["input_ids"])
    recipe = recipe_for(vllm_config, text_tokens, soft_cap)
    parts = _key_parts(vllm_config, recipe)
    path = cache_path(cache_key(parts))
    rank0 = get_tp_group().rank_in_group == 0
    cached = load_cached(path, shape.num_layers, shape.total_num_kv_heads, shape.head_dim) if rank0 else None
    cached_dict = _broadcast(None if cached is None else cached.to_dict())
    if cached_dict is not None:
        policy = KVPolicy.from_dict(cached_dict, source=f"start-up calibration (cached {path})")
        tokens = int(policy.provenance.get("tokens", 0))
    else:
        windows = load_windows([BUILTIN_TEXT], tokenizer, recipe.window, count=0,
                               calib=recipe.windows).calib
        observer = gather_heads(observe_in_vllm(runner, layers, windows, recipe, shape.num_layers),
                                shape.total_num_kv_heads)
        tokens = int(windows.numel())
        provenance = {"tool": "vllm-nvfp4 start-up calibration", "tokens": tokens,
                      "data": {"files": [{"path": "builtin_text.txt",
                                          "sha256": parts["text_sha256"]}],
                               "window_tokens": recipe.window, "calib_windows": recipe.windows},
                      "formats_from": "default rule", "scales": "per layer",
                      "k_center": recipe.k_center, "cache_key": parts,
                      "conventions": {"fp8_scale": "amax/448", "nvfp4_global_scale": "amax/2688"}}
        rule = default_policy(shape.num_layers, shape.layer_types or None)
        policy = scaled_policy(rule, observer, per_head=False, provenance=provenance,
                               k_center=recipe.k_center)
        policy = KVPolicy(policy.layers, policy.provenance, source="start-up calibration")
        if rank0:
            save_cached(policy, path)
    set_startup_policy(vllm_config, policy)
    for name, layer in layers.items():
        index, row, layout = layer_plan(vllm_config, layer)
        layer.impl.bind(name, index, row, layout, vllm_config, runner.device)
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "cached": cached_dict is not None,
            "path": str(path), "policy": policy.to_compact()}


def calibrate_engine(executor: Any) -> None:
    """The executor's part (hook ``startup_calibration``): run :func:`calibrate_worker` on every
    worker when :func:`skip_reason` allows, and log the outcome once."""
    reason = skip_reason(executor.vllm_config)
    if reason == "policy given":
        return
    if reason is not None:
        logger.warning("vllm-nvfp4: no policy and no start-up calibration (%s): the default rule "
                       "runs with default scales; calibrate with `vllm-nvfp4 calibrate` for "
                       "accuracy", reason)
        return
    summary = executor.collective_rpc(calibrate_worker)[0]
    if "skipped" in summary:
        logger.warning("vllm-nvfp4: no start-up calibration (%s): the default rule runs with "
                       "default scales; calibrate with `vllm-nvfp4 calibrate` for accuracy",
                       summary["skipped"])
    elif summary["cached"]:
        logger.info("vllm-nvfp4: start-up calibration reused from %s (%d tokens; %.1f s)",
                    summary["path"], summary["tokens"], summary["seconds"])
    else:
        logger.info("vllm-nvfp4: calibrated at start-up on %d tokens in %.1f s (%s, K/V scales and "
                    "K centering of the built-in text; cached in %s; set %s=0 to switch off)",
                    summary["tokens"], summary["seconds"], summary["policy"], summary["path"],
                    STARTUP_CALIBRATION_ENV)

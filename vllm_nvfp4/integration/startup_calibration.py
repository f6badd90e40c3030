"""Start-up calibration: a model served without a policy calibrates its K/V scales and picks
its FP8 slots before serving (docs/CALIBRATION.md, "Zero-config start").

With ``kv_cache_dtype=nvfp4_mixed`` and no policy (no ``$VLLM_NVFP4_POLICY``, no
``nvfp4_policy.json``), every worker runs the loaded model in vLLM over the built-in text
(:mod:`vllm_nvfp4.calibration.builtin_text`) after loading and before memory profiling, KV-cache
allocation and CUDA-graph capture (the formats chosen here size the pages):

1. Each of our attention layers gets a
   :class:`~vllm_nvfp4.integration.calibration_forward.CalibrationBatch` as metadata: it records
   the post-RoPE K/V (:class:`~vllm_nvfp4.calibration.kv_hooks.KVObserver`) and attends exactly,
   so later layers see the unquantized hidden states. No cache page is written. Under TP the
   statistics are gathered over the TP CPU group: every rank builds the same policy.
   Then every window runs again from each position offset up to ``max_model_len``
   (:mod:`vllm_nvfp4.calibration.position_range`), for the K/V range only.
2. Scales as ``calibrate --k-center --k-sink-uncentered --max-model-len`` writes them
   (:func:`~vllm_nvfp4.calibration.scales.scaled_policy`; no K centering under a logits soft-cap;
   the sink key flagged uncentered where the first key, as served requests start, fits the K range).
   With ``k_rot_pairs`` in the recipe, also ``--k-rot-pairs`` (the rotating K center,
   :mod:`vllm_nvfp4.calibration.rot_center`): step 1 inverts RoPE on the recorded keys at the
   forward's positions with the frequencies of vLLM's rotary embedding
   (:func:`~vllm_nvfp4.integration.calibration_rope.vllm_rope`; models whose RoPE does not fit
   are logged and keep the constant offset), and a second pass over the same runs takes the
   range of the keys the rotating center stores.
3. Formats (:mod:`.startup_selection`): on :data:`~.startup_recipe.SENSITIVITY_TOKENS` tokens
   the model runs once exactly and once per full-attention K or V slot stored alone in NVFP4;
   the slots of largest next-token KL stay FP8. Under TP rank 0 ranks them and broadcasts the
   choice. Then the sink key (:mod:`vllm_nvfp4.calibration.sink_choice`, where some head is
   flagged): the policy with and without its flags, every slot as served, one forward each on
   the same tokens against the same exact forward; the lower KL is kept (``"sink_key"`` in the
   provenance and the log). Added cost: :data:`~.startup_recipe.SINK_KEY_FORWARDS`.
4. The policy replaces the default rule for this engine
   (:func:`~vllm_nvfp4.integration.model.set_startup_policy`), is cached
   (:mod:`vllm_nvfp4.calibration.startup_cache`) for the next start of the same model, weights,
   dtype, text and recipe, and :func:`calibrate_engine` logs it as the engine's one
   ``KV policy in force`` statement; an engine with a given policy states its policy the same way.

Modes: :data:`STARTUP_MODES`. Skipped under pipeline parallelism and for state layers other than
Gated DeltaNet, whose layers get vLLM's prefill metadata and temporary states
(:mod:`.calibration_states`); a failure falls back to the default rule's scales on every TP rank
together (:func:`agree_outcome`).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from vllm_nvfp4.calibration import rot_center
from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT, builtin_text_sha256
from vllm_nvfp4.calibration.kv_hooks import KVObserver
from vllm_nvfp4.calibration.rope import Rope
from vllm_nvfp4.calibration.rot_center import RotFit
from vllm_nvfp4.calibration.position_range import describe as describe_range
from vllm_nvfp4.calibration.sink_choice import (CENTERED, UNCENTERED, choose, chosen_policy,
                                                has_sink_key, sink_line, without_sink_key)
from vllm_nvfp4.calibration.startup_cache import (cache_key, cache_path, load_cached, save_cached,
                                                  weights_fingerprint)
from vllm_nvfp4.env_vars import STARTUP_CALIBRATION_ENV
from vllm_nvfp4.policy import POLICY_ENV, POLICY_FILENAME, KVPolicy, default_policy

from vllm_nvfp4.integration.dtype import is_ours
from vllm_nvfp4.integration.calibration_forward import (ExactReference, observe_in_vllm,
                                                         policy_damage, rot_range_in_vllm,
                                                         slot_damage)
from vllm_nvfp4.integration.calibration_rope import vllm_rope
from vllm_nvfp4.integration.calibration_states import StateLayers, state_layers, unsupported_state_layers
from vllm_nvfp4.integration.model import is_draft_layer, model_policy, set_startup_policy
from vllm_nvfp4.integration.rank_params import rank_heads
from vllm_nvfp4.integration.startup_recipe import Recipe, describe_recipe, recipe_for
from vllm_nvfp4.integration.startup_selection import (
    METRIC,
    candidate_slots,
    formats_line,
    fp8_slot_count,
    sensitivity_policy,
)
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.model_shape import ModelShape

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers

#: values of ``$VLLM_NVFP4_STARTUP_CALIBRATION`` (lower case) -> mode
STARTUP_MODES = {"": "select", "1": "select", "on": "select", "true": "select", "yes": "select",
                 "scales": "scales", "0": "off", "off": "off", "false": "off", "no": "off"}
PROGRESS_SECONDS = 10.0  # a progress line at most this often during the sensitivity forwards
#: the title of the one start-up statement of the policy an engine runs (its per-layer table)
IN_FORCE = "KV policy in force"


def startup_mode() -> str:
    """``"select"``, ``"scales"`` or ``"off"`` from ``$VLLM_NVFP4_STARTUP_CALIBRATION``
    (:data:`STARTUP_MODES`); ``ValueError`` naming the accepted values for any other."""
    raw = os.environ.get(STARTUP_CALIBRATION_ENV, "")
    mode = STARTUP_MODES.get(raw.strip().lower())
    if mode is None:
        raise ValueError(f"${STARTUP_CALIBRATION_ENV}={raw!r} is not understood; use 1 (scales "
                         "and formats, the default), scales (the default rule with calibrated "
                         "scales) or 0 (off)")
    return mode


# ---------------------------------------------------------------------------- when and how much
def skip_reason(vllm_config: Any) -> Optional[str]:
    """Why this engine does not calibrate at start-up (None: it does, M-RoPE models included).
    ``"policy given"`` when the user supplied a policy (nothing to log)."""
    pc = vllm_config.parallel_config
    if not is_ours(vllm_config.cache_config.cache_dtype):
        return "policy given"  # not our dtype: nothing to do
    if os.environ.get(POLICY_ENV, "").strip():
        return "policy given"
    shape = ModelShape.from_vllm_config(vllm_config)
    if shape.model_dir is not None and (Path(shape.model_dir) / POLICY_FILENAME).is_file():
        return "policy given"
    if startup_mode() == "off":
        return f"${STARTUP_CALIBRATION_ENV}={os.environ[STARTUP_CALIBRATION_ENV]}"
    if pc.pipeline_parallel_size > 1:
        return "not supported with pipeline parallelism"
    return None


def planned(vllm_config: Any) -> bool:
    """Whether this engine calibrates at start-up (the default scales are then provisional)."""
    return skip_reason(vllm_config) is None


# ---------------------------------------------------------------------------- the layers
def _our_layers(vllm_config: Any, num_layers: int) -> dict[str, Any]:
    """This rank's ``nvfp4_mixed`` attention layers of the target model by name (a speculative
    draft's layers keep their fixed rule and never see the calibration forward)."""
    ctx = vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in ctx.items()
            if is_ours(getattr(layer, "kv_cache_dtype", None)) and hasattr(layer, "impl")
            and not is_draft_layer(vllm_config, name, num_layers)}


# ---------------------------------------------------------------------------- tensor parallel
_HEAD_FIELDS = ("k_amax", "v_amax", "k_channel_amax", "k_channel_max", "k_channel_min", "k_channel_sum",
                "k_first_max", "k_first_min", "k_pre_sum")


def _head_ranks(total_heads: int, world: int) -> list[int]:
    """The TP ranks whose heads make up the whole model's, in head order: every rank (heads
    split), or with fewer KV heads than ranks the first rank that replicates each head."""
    if total_heads >= world:
        return list(range(world))
    return [min(r for r in range(world) if r * total_heads // world == h) for h in range(total_heads)]


def _gather_head_lists(local: dict[str, list[Optional[torch.Tensor]]],
                       total_heads: int) -> dict[str, list[Optional[torch.Tensor]]]:
    """Per name, the per-layer tensors (heads on dim 0) of every TP rank joined into the whole
    model's (:func:`_head_ranks`); ``local`` itself without TP."""
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    if tp.world_size == 1:
        return local
    parts: list[Any] = [None] * tp.world_size
    torch.distributed.all_gather_object(parts, local, group=tp.cpu_group)
    ranks = _head_ranks(total_heads, tp.world_size)
    return {name: [None if parts[0][name][i] is None else
                   torch.cat([parts[r][name][i] for r in ranks], dim=0)
                   for i in range(len(layers))] for name, layers in local.items()}


def gather_heads(local: KVObserver, total_heads: int) -> KVObserver:
    """The whole model's statistics from every TP rank's (heads in rank order; with fewer KV
    heads than ranks, each head from the first rank that holds it)."""
    from vllm.distributed import get_tp_group

    if get_tp_group().world_size == 1:
        return local
    merged = KVObserver(local.num_layers, local.kv_layers, local.rope)
    merged.tokens, merged.range_tokens = list(local.tokens), list(local.range_tokens)
    for f, per_layer in _gather_head_lists({f: getattr(local, f) for f in _HEAD_FIELDS},
                                           total_heads).items():
        setattr(merged, f, per_layer)
    return merged


def _rank_rows(vllm_config: Any, layers: dict[str, Any], total_heads: int) -> list[int]:
    """The whole model's KV heads this TP rank holds, in its order."""
    from vllm.distributed import get_tensor_model_parallel_rank

    tp = vllm_config.parallel_config.tensor_parallel_size
    local = next(iter(layers.values())).impl.num_kv_heads
    rank = get_tensor_model_parallel_rank() if tp > 1 else 0
    return rank_heads(list(range(total_heads)), total_heads, local, rank, tp)


def _rank_fit(fit: RotFit, rows: list[int]) -> RotFit:
    """``fit`` (the whole model's heads) on this rank's heads ``rows``."""
    r, index = fit.rot, torch.tensor(rows)
    return RotFit(fit.center[index], RotCenter(r.idx[index], r.b[index], r.theta[index]))


def fit_rot_center(runner: Any, layers: dict[str, Any], windows: torch.Tensor, recipe: Recipe,
                   observer: KVObserver, layer_types: Any, total_heads: int,
                   states: Optional[StateLayers] = None) -> dict[int, RotFit]:
    """The rotating K center of every centered layer (module doc, step 2) from the whole model's
    statistics ``observer`` (with its RoPE): ``mu'``, pairs, ``b`` and ``theta``
    (:func:`~vllm_nvfp4.calibration.rot_center.fit`), then their range from the second pass over
    the same runs, each rank on its heads, gathered."""
    fits = rot_center.fit(observer, rot_center.centered_layers(layer_types), recipe.k_rot_pairs)
    if not fits:
        return fits
    rows = _rank_rows(runner.vllm_config, layers, total_heads)
    local = rot_range_in_vllm(runner, layers, windows, recipe.per_forward, observer.num_layers,
                              {i: _rank_fit(f, rows) for i, f in fits.items()}, states,
                              recipe.offsets)
    local.k_amax = _gather_head_lists({"k_amax": local.k_amax}, total_heads)["k_amax"]
    return rot_center.with_range(fits, local)


def startup_rope(runner: Any, layers: dict[str, Any], recipe: Recipe,
                 head_dim: int) -> Optional[Rope]:
    """The model's RoPE for the recipe's rotating K center (None: the recipe asks for none, or
    the model's RoPE does not fit it, logged as the offline calibration logs it)."""
    mc = runner.vllm_config.model_config

    def find(model: torch.nn.Module, dim: int) -> Any:
        return vllm_rope(model, sorted(layers), dim, bool(getattr(mc, "uses_mrope", False)))

    return rot_center.rope_for(runner.get_model(), head_dim, recipe.k_rot_pairs, find)


def agree_outcome(error: Optional[BaseException], tp: Any) -> Optional[str]:
    """Every rank's outcome of a step, agreed over the TP group ``tp`` (vLLM's ``GroupCoordinator``:
    ``world_size``, ``cpu_group``): None where each rank succeeded (``error`` None), else
    ``"rank R: Type: message"`` of the lowest failed rank - the same string on every rank, so
    that all of them fall back or raise together instead of one waiting in a collective the
    others never reach."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if tp.world_size == 1:
        return None if mine is None else f"rank 0: {mine}"
    outcomes: list[Optional[str]] = [None] * tp.world_size
    torch.distributed.all_gather_object(outcomes, mine, group=tp.cpu_group)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
    return None if not failed else f"rank {failed[0][0]}: {failed[0][1]}"


class StartupCalibrationError(RuntimeError):
    """The start-up calibration failed on some TP rank (the message names it)."""


@contextmanager
def _states_bound_on_every_rank(states: Optional[StateLayers], max_seqs: int) -> Iterator[None]:
    """``states.bound(max_seqs)`` (nothing for None), entered only when it succeeded on every
    TP rank (:func:`agree_outcome`, before any forward and its collectives); else
    :class:`StartupCalibrationError` on every rank."""
    from vllm.distributed import get_tp_group

    if states is None:
        yield
        return
    with ExitStack() as stack:
        error = None
        try:
            stack.enter_context(states.bound(max_seqs))
        except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
            error = e
        failure = agree_outcome(error, get_tp_group())
        if failure is not None:
            raise StartupCalibrationError(
                f"binding the Gated DeltaNet states failed on {failure}") from error
        yield


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


def load_tokenizer(model_config: Any) -> Any:
    """The engine's tokenizer, loaded with transformers (vLLM's ``ModelConfig`` fields)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer,
                                         revision=model_config.tokenizer_revision,
                                         trust_remote_code=model_config.trust_remote_code)


def cached_source(path: Path) -> str:
    """The ``source`` of a policy reused from the start-up cache file ``path``."""
    return f"start-up calibration (cached {path})"


def calibration_plan(vllm_config: Any, tokenizer: Any,
                     soft_cap: bool) -> tuple[Recipe, dict[str, Any], Path]:
    """``(recipe, cache-key parts, cache file)`` of this engine's start-up calibration over the
    built-in text; the mode from ``$VLLM_NVFP4_STARTUP_CALIBRATION``. K is centered unless
    ``soft_cap`` (its attention layers have a logits soft-cap) or every KV layer has attention
    sinks (:func:`~vllm_nvfp4.calibration.rot_center.centered_layers`: none to center)."""
    text_tokens = len(tokenizer(BUILTIN_TEXT.read_text(encoding="utf-8"),
                                add_special_tokens=False, verbose=False)["input_ids"])
    layer_types = ModelShape.from_vllm_config(vllm_config).layer_types
    no_k_center = soft_cap or not rot_center.centered_layers(layer_types)
    recipe = recipe_for(vllm_config, text_tokens, no_k_center, select=startup_mode() == "select")
    parts = _key_parts(vllm_config, recipe)
    return recipe, parts, cache_path(cache_key(parts))


def _progress_logger(total: int, start: float, rank0: bool) -> Callable[[int], None]:
    """A ``progress(done)`` that logs on rank 0 at most every :data:`PROGRESS_SECONDS`."""
    last = [start]

    def progress(done: int) -> None:
        now = time.perf_counter()
        if rank0 and done < total and now - last[0] >= PROGRESS_SECONDS:
            last[0] = now
            logger.info("vllm-nvfp4: start-up sensitivity: %d of %d slots measured (%.0f s)",
                        done, total, now - start)

    return progress


def _select(runner: Any, layers: dict[str, Any], windows: torch.Tensor, recipe: Recipe,
            scaled: KVPolicy, provenance: dict[str, Any], rank0: bool,
            states: Optional[StateLayers] = None) -> tuple[KVPolicy, Optional[ExactReference]]:
    """The start-up selection (module doc, step 3) on the first sensitivity windows; fills in
    ``provenance`` and returns the policy and its exact forward (None: nothing measured)."""
    candidates, fp8_slots = fp8_slot_count(scaled.layer_types)
    if fp8_slots >= 2 * len(candidates):  # every candidate FP8: nothing to choose
        provenance["formats_from"] = "default rule (every candidate slot FP8)"
        return KVPolicy(scaled.layers, provenance, source="start-up calibration"), None
    start = time.perf_counter()
    sens = windows[:recipe.sensitivity_windows]
    slots = candidate_slots(candidates)
    reference = ExactReference(runner, layers, sens, recipe.per_forward, scaled.num_layers,
                               states, [layer for layer, _ in slots])
    damage = _broadcast(slot_damage(runner, layers, sens, recipe.per_forward, scaled, slots,
                                    _progress_logger(len(slots), start, rank0), states, reference))
    if damage is None:
        raise RuntimeError("vllm-nvfp4 start-up selection: rank 0 computed no logits; set "
                           f"{STARTUP_CALIBRATION_ENV}=scales for the default rule's formats")
    return sensitivity_policy(scaled, damage, candidates, fp8_slots, provenance,
                              tokens=int(sens.numel()), seconds=time.perf_counter() - start), reference


def _choose_sink_key(runner: Any, layers: dict[str, Any], windows: torch.Tensor, recipe: Recipe,
                     policy: KVPolicy, reference: Optional[ExactReference],
                     states: Optional[StateLayers] = None) -> KVPolicy:
    """The sink key of ``policy`` (module doc, step 3; nothing where no head is flagged): the
    policy with and without its flags scored by KL on the sensitivity windows against
    ``reference`` (the selection's exact forward; None: one is run here), the better kept and
    recorded in its provenance (``"sink_key"``). Under TP rank 0's scores decide."""
    if not has_sink_key(policy):
        return policy
    start = time.perf_counter()
    sens = windows[:recipe.sensitivity_windows]
    if reference is None:
        reference = ExactReference(runner, layers, sens, recipe.per_forward, policy.num_layers,
                                   states)
    scores = _broadcast({UNCENTERED: policy_damage(reference, layers, policy),
                         CENTERED: policy_damage(reference, layers, without_sink_key(policy))})
    if None in scores.values():
        raise RuntimeError("vllm-nvfp4 start-up calibration: rank 0 computed no logits for the "
                           "sink key's choice")
    record = choose(scores, METRIC, tokens=int(sens.numel()),
                    seconds=round(time.perf_counter() - start, 1))
    return KVPolicy(chosen_policy(policy, record).layers, {**policy.provenance, "sink_key": record},
                    source=policy.source)


def _calibrate(runner: Any, layers: dict[str, Any], states: Optional[StateLayers],
               windows: torch.Tensor, recipe: Recipe, shape: ModelShape, parts: dict[str, Any],
               rank0: bool) -> KVPolicy:
    """Module doc, steps 1-3 on ``windows [n, window]`` (``states``: the model's GDN layers,
    bound here for the forwards; None: it has none)."""
    from vllm_nvfp4.calibration.scales import scaled_policy

    rope = startup_rope(runner, layers, recipe, shape.head_dim)
    rule = default_policy(shape.num_layers, shape.layer_types or None)
    with _states_bound_on_every_rank(states, recipe.per_forward):
        observer = gather_heads(observe_in_vllm(runner, layers, windows, recipe.per_forward,
                                                shape.num_layers, states, recipe.offsets, rope),
                                shape.total_num_kv_heads)
        fits = None if rope is None else fit_rot_center(
            runner, layers, windows, recipe, observer, rule.layer_types,
            shape.total_num_kv_heads, states)
        provenance = {"tool": "vllm-nvfp4 start-up calibration", "tokens": int(windows.numel()),
                      "data": {"files": [{"path": "builtin_text.txt",
                                          "sha256": parts["text_sha256"]}],
                               "window_tokens": recipe.window, "calib_windows": recipe.windows},
                      "position_range": describe_range(recipe.max_model_len, recipe.offsets),
                      "formats_from": "default rule", "scales": "per layer",
                      "k_center": recipe.k_center, "k_rot_pairs": recipe.k_rot_pairs if fits else 0,
                      "cache_key": parts,
                      "conventions": {"fp8_scale": "amax/448", "nvfp4_global_scale": "amax/2688"}}
        scaled = scaled_policy(rule, observer, per_head=False, provenance=provenance,
                               k_center=recipe.k_center, k_sink_uncentered=recipe.k_center,
                               k_rot=fits)
        reference: Optional[ExactReference] = None
        if recipe.select:
            policy, reference = _select(runner, layers, windows, recipe, scaled, provenance, rank0,
                                        states)
        else:
            policy = KVPolicy(scaled.layers, provenance, source="start-up calibration")
        return _choose_sink_key(runner, layers, windows, recipe, policy, reference, states)


def _gdn_layers(vllm_config: Any, device: torch.device) -> Optional[StateLayers] | str:
    """The model's Gated DeltaNet layers (None: no state layers), or why its state layers
    cannot run in a calibration forward."""
    unsupported = unsupported_state_layers(vllm_config)
    if unsupported:
        return ("not supported for models with Mamba / linear-attention (state) layers other "
                f"than Gated DeltaNet (first: {unsupported[0]})")
    gdn = state_layers(vllm_config)
    return StateLayers(vllm_config, gdn, device) if gdn else None


def calibrate_worker(worker: Any) -> dict[str, Any]:
    """Calibrate and select (or load the cached result) on one worker and make the policy the
    one in force there. Runs on every rank at once (``collective_rpc``). Returns a summary for
    the log."""
    from vllm.distributed import get_tp_group

    from vllm_nvfp4.calibration.data import load_windows

    start = time.perf_counter()
    runner = worker.model_runner
    vllm_config, mc = runner.vllm_config, runner.vllm_config.model_config
    shape = ModelShape.from_vllm_config(vllm_config)
    layers = _our_layers(vllm_config, shape.num_layers)
    states = _gdn_layers(vllm_config, runner.device)
    if isinstance(states, str):  # same outcome on every rank: no collective yet
        return {"skipped": states}
    soft_cap = any(layer.impl.logits_soft_cap is not None for layer in layers.values())
    try:
        tokenizer = load_tokenizer(mc)
    except (OSError, ValueError, ImportError) as e:  # same outcome on every rank: no collective yet
        return {"skipped": f"cannot load the tokenizer of {mc.tokenizer} with transformers ({e})"}
    recipe, parts, path = calibration_plan(vllm_config, tokenizer, soft_cap)
    rank0 = get_tp_group().rank_in_group == 0
    cached = load_cached(path, shape.num_layers, shape.total_num_kv_heads, shape.head_dim) if rank0 else None
    cached_dict = _broadcast(None if cached is None else cached.to_dict())
    if cached_dict is not None:
        policy = KVPolicy.from_dict(cached_dict, source=cached_source(path))
    else:
        if rank0:
            logger.info("vllm-nvfp4: no policy given, so start-up calibrates: %s",
                        describe_recipe(recipe, shape))
        windows = load_windows([BUILTIN_TEXT], tokenizer, recipe.window, count=0,
                               calib=recipe.windows).calib
        error = None
        try:
            policy = _calibrate(runner, layers, states, windows, recipe, shape, parts, rank0)
        except Exception as e:  # noqa: BLE001 - agreed below: every rank falls back or raises
            error = e
        finally:
            if runner.device.type == "cuda":
                torch.cuda.empty_cache()  # give the forwards' memory back before memory profiling
        failure = agree_outcome(error, get_tp_group())
        if failure is not None:
            if states is None:  # a model without GDN layers: a failure is a bug, never hidden
                if error is not None:
                    raise error
                raise StartupCalibrationError(f"start-up calibration failed on {failure}")
            logger.warning("vllm-nvfp4: start-up calibration through the Gated DeltaNet layers "
                           "failed on %s", failure, exc_info=error)
            return {"skipped": "the calibration forward through the Gated DeltaNet layers "
                               f"failed ({failure})"}
        if rank0:
            save_cached(policy, path)
    set_startup_policy(vllm_config, policy)
    return {"tokens": int(policy.provenance.get("tokens", 0)),
            "seconds": time.perf_counter() - start, "cached": cached_dict is not None,
            "statistics": "K/V scales" + (" and K centering" if any(
                lp.k_center is not None for lp in policy.layers) else ""),
            "path": str(path), "formats": "; ".join(filter(None, (
                formats_line(policy.provenance), sink_line(policy.provenance.get("sink_key")),
                rot_line(policy.provenance)))),
            "in_force": policy.describe(IN_FORCE)}


def rot_line(provenance: dict[str, Any]) -> str:
    """The rotating K center of a calibrated policy, for the log ("" without one)."""
    pairs = provenance.get("k_rot_pairs")
    return f"K centered on a rotating offset on {pairs} RoPE pairs per KV head" if pairs else ""


def calibrate_engine(executor: Any) -> None:
    """The executor's part (hook ``startup_calibration``): run :func:`calibrate_worker` on every
    worker when :func:`skip_reason` allows, and log the outcome, then the policy in force: one
    ``KV policy in force`` statement per engine, with its per-layer table, whichever way the
    policy was decided (given, calibrated, cached, or the default rule)."""
    reason = skip_reason(executor.vllm_config)
    if reason is None:
        summary = executor.collective_rpc(calibrate_worker)[0]
        reason = summary.get("skipped")
        if reason is None:
            _log_calibrated(summary)
            logger.info("vllm-nvfp4: %s", summary["in_force"])
            return
    if reason != "policy given":
        logger.warning("vllm-nvfp4: no policy and no start-up calibration (%s): the default rule "
                       "runs with default scales; calibrate with `vllm-nvfp4 calibrate` for "
                       "accuracy", reason)
    # given or the default rule: every process resolves it the same way (integration.model)
    logger.info("vllm-nvfp4: %s", model_policy(executor.vllm_config).describe(IN_FORCE))


def _log_calibrated(summary: dict[str, Any]) -> None:
    """How the start-up calibration decided (its policy: the ``KV policy in force`` line)."""
    if summary["cached"]:
        logger.info("vllm-nvfp4: start-up calibration reused from %s (%d tokens; %.1f s): %s",
                    summary["path"], summary["tokens"], summary["seconds"], summary["formats"])
    else:
        logger.info("vllm-nvfp4: calibrated at start-up on %d tokens in %.1f s (%s of the "
                    "built-in text; %s; cached in %s; set %s=scales for the default rule's "
                    "formats, =0 to switch off)",
                    summary["tokens"], summary["seconds"], summary["statistics"], summary["formats"],
                    summary["path"], STARTUP_CALIBRATION_ENV)

"""The calibration forwards of the start-up calibration (:mod:`.startup_calibration`): the loaded
model run IN vLLM over token windows, outside the scheduler, with a :class:`CalibrationBatch` as
every attention layer's metadata - exact attention that records the layer's K/V
(:func:`observe_in_vllm`), or stores some K/V slots as the cache would (:class:`SlotPerturbation`)
to measure what that costs in next-token KL of the final logits against the exact forward
(:class:`ExactReference`): one slot in NVFP4 (:func:`slot_damage`) or a whole policy
(:func:`policy_damage`). A rotating K center (policy ``k_rot``) gets its second pass here too
(:func:`rot_range_in_vllm`), and a perturbed K slot is read back as the fake-quantized
reference reads it (:func:`~vllm_nvfp4.calibration.kv_hooks.stored_keys_read_back`: the
rotating offset at each key's position, the sink key uncentered).
Gated DeltaNet layers, where the model has them, get vLLM's own prefill metadata and temporary
states (:class:`~vllm_nvfp4.integration.calibration_states.StateLayers`, bound by the caller).
Positions are those vLLM gives text tokens: ``[tokens]``, or ``[num_dims, tokens]`` for M-RoPE
models (:func:`text_positions`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import torch
import torch.nn.functional as F

from vllm_nvfp4.calibration import rot_center
from vllm_nvfp4.calibration.kv_hooks import (KVObserver, LayerQuant, RotRangeObserver,
                                             fake_quantize, stored_keys_read_back)
from vllm_nvfp4.calibration.metrics import kl_divergence
from vllm_nvfp4.calibration.rope import Rope
from vllm_nvfp4.calibration.rot_center import RotFit
from vllm_nvfp4.integration.calibration_states import StateLayers
from vllm_nvfp4.integration.model import layer_index
from vllm_nvfp4.integration.rank_params import rank_heads, rank_row_values
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.paged_torch import attend_one_sequence
from vllm_nvfp4.policy import KVPolicy

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers
LOGIT_ROWS = 256  # positions per logits chunk: the extra memory is 2 x LOGIT_ROWS x vocab fp32


@dataclass(frozen=True)
class SlotPerturbation:
    """One slot stored as the cache would store it on this rank: ``kv`` ("k" or "v") of policy
    row ``row`` in ``fmt`` with ``scale [kv_heads]`` (FP32) and, for K, the K centering offsets
    and smoothing factors ``[kv_heads, head_dim]`` of this rank's heads (None: none), which
    of them store the sink key uncentered (bool ``[kv_heads]``, None: none) and their rotating
    center (``k_rot``; None: none)."""

    row: int
    kv: str
    fmt: str
    scale: torch.Tensor
    k_center: Optional[torch.Tensor] = None
    k_smooth: Optional[torch.Tensor] = None
    k_sink: Optional[torch.Tensor] = None
    k_rot: Optional[RotCenter] = None

    @classmethod
    def of(cls, policy: KVPolicy, row: int, kv: str, fmt: str, layer_name: str, impl: Any,
           vllm_config: Any) -> "SlotPerturbation":
        """``kv`` of ``row`` in ``fmt`` with ``policy``'s scales, as the rank's ``impl`` of
        ``layer_name`` binds them
        (:func:`~vllm_nvfp4.integration.rank_params.rank_row_values`)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        tp = vllm_config.parallel_config.tensor_parallel_size
        rank = get_tensor_model_parallel_rank() if tp > 1 else 0
        total = vllm_config.model_config.get_total_num_kv_heads()
        row_policy = policy.with_layer(row, **{kv: fmt}).layers[row]
        values = rank_row_values(row_policy, layer_name, total, impl.num_kv_heads, impl.num_heads,
                                 impl.head_size, rank, tp)
        rows = {n: torch.tensor(values[n], dtype=torch.float32) if kv == "k" and n in values
                else None for n in ("k_center", "k_smooth")}
        sink = row_policy.sink_heads(total) if kv == "k" else None
        if sink is not None:
            rows["k_sink"] = torch.tensor(rank_heads(sink, total, impl.num_kv_heads, rank, tp))
        rot = row_policy.k_rot if kv == "k" else None
        if rot is not None:
            rows["k_rot"] = RotCenter(*(
                torch.tensor(rank_heads(field, total, impl.num_kv_heads, rank, tp), dtype=dtype)
                for field, dtype in ((rot.pairs, torch.int32), (rot.b, torch.float32),
                                     (rot.theta, torch.float32))))
        return cls(row, kv, fmt, torch.tensor(values[f"{kv}_scale"], dtype=torch.float32), **rows)

    def apply(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              positions: Optional[torch.Tensor] = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query [S, heads, L, D]``, ``key``/``value [S, kv_heads, L, D]`` as the layer attends
        them with this slot quantized: K read back as the fake-quantized reference reads it
        (:func:`~vllm_nvfp4.calibration.kv_hooks.stored_keys_read_back`: centered / smoothed
        first, the query smoothed back; the sink key uncentered; with ``k_rot`` the rotating
        offset at ``positions``, int64 ``[L]``, the keys' positions)."""
        if self.kv == "v":
            return query, key, fake_quantize(value, self.fmt, self.scale)
        quant = LayerQuant(self.fmt, self.fmt, self.scale, self.scale, self.k_smooth,
                           self.k_center, None, self.k_sink, self.k_rot)
        query, _, stored = stored_keys_read_back(quant, query, key, positions)
        return query, stored.to(query.dtype), value


@dataclass
class CalibrationBatch:
    """Attention metadata of one layer (policy row ``row``) in a calibration forward:
    ``num_seqs`` sequences of ``seq_len`` tokens laid end to end, the keys of each at
    ``positions`` (int64 ``[seq_len]``, from the forward's positions; None for M-RoPE). The impl
    calls :meth:`attend` instead of its cache path. ``observer`` (None: nothing recorded)
    records the layer's K/V; the slots of ``perturb`` of this row are quantized."""

    observer: Optional[Union[KVObserver, RotRangeObserver]]
    row: int
    num_seqs: int
    seq_len: int
    perturb: tuple[SlotPerturbation, ...] = ()
    positions: Optional[torch.Tensor] = None

    def attend(self, impl: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               output: torch.Tensor) -> torch.Tensor:
        """Record ``key``/``value`` ``[T, kv_heads, D]`` of ``impl``'s layer, then write causal
        attention of ``query [T, heads, D]`` into ``output [T, heads, D]``: the layer's sliding
        window, attention sinks and logits soft-cap as served (model dtype; FP32 with a soft-cap
        or sinks), exact but for the ``perturb`` slots."""
        s, n = self.num_seqs, self.seq_len
        t = s * n

        def seqs(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [S, H, L, D]
            return x[:t].reshape(s, n, x.shape[1], x.shape[2]).transpose(1, 2)

        k, v = seqs(key), seqs(value)
        if self.observer is not None:
            if getattr(self.observer, "wants_positions", False):
                self.observer.observe(self.row, k, v, positions=self.positions)
            else:
                self.observer.observe(self.row, k, v)
        q = seqs(query)
        for slot in self.perturb:  # K and V of one row touch different tensors: any order
            if slot.row == self.row:
                q, k, v = slot.apply(q, k, v, self.positions)
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


def _forward(runner: Any, rows: dict[str, int], chunk: torch.Tensor,
             observer: Optional[Union[KVObserver, RotRangeObserver]] = None,
             perturb: Sequence[SlotPerturbation] = (),
             resume: Optional[tuple[int, torch.Tensor]] = None,
             states: Optional[StateLayers] = None, offset: int = 0) -> torch.Tensor:
    """The runner's model over ``chunk [S, L]`` (token ids, each sequence from position
    ``offset``: :func:`text_positions`), every layer of ``rows`` (name -> policy row) with a
    :class:`CalibrationBatch`, every GDN layer of ``states`` (bound, at least ``S + 1`` slots)
    with its prefill metadata; returns the final hidden states
    ``[S * L, hidden]``. ``resume = (layer, stream)``: run only the decoder layers from
    ``layer`` on, from the residual stream ``[S * L, hidden]`` at that layer's input (see
    :class:`LayerStreams`)."""
    from vllm.forward_context import set_forward_context

    s, n = chunk.shape
    ids = chunk.reshape(-1).to(device=runner.device, dtype=torch.int32)
    positions = text_positions(runner, chunk, offset)
    keys = positions[:n] if positions.dim() == 1 else None  # every sequence's: the first one's
    batches: dict[str, Any] = {name: CalibrationBatch(observer, row, s, n, tuple(perturb), keys)
                               for name, row in rows.items()}
    if states is not None:
        batches.update(states.metadata(s, n))
    model = runner.get_model()
    stack, first = (decoder_stack(model), resume[0]) if resume is not None else (None, 0)
    # eager (skip_compiled): this runs before vLLM compiles the model; a call of the compiled
    # wrapper here would compile it with our metadata and make vLLM compile it again
    with set_forward_context(batches, runner.vllm_config, num_tokens=s * n, slot_mapping={},
                             skip_compiled=True):
        if stack is None:
            return model(input_ids=ids, positions=positions, intermediate_tensors=None,
                         inputs_embeds=None)
        start = stack.start_layer
        stack.start_layer = first
        try:  # the stream enters layer `first` as embeddings would enter layer 0
            return model(input_ids=None, positions=positions, intermediate_tensors=None,
                         inputs_embeds=resume[1])
        finally:
            stack.start_layer = start


def text_positions(runner: Any, chunk: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """The positions vLLM's runner gives the text-only sequences ``chunk [S, L]`` (token ids), each
    prefilled from position 0, plus ``offset`` (a range calibration's shifted run,
    :mod:`~vllm_nvfp4.calibration.position_range`): ``[S * L]`` (``offset..offset+L-1`` per
    sequence) or, for an M-RoPE model, ``[num_dims, S * L]`` from the model's own
    ``get_mrope_input_positions`` of each sequence with no multimodal features (for text, every
    row ``0..L-1``), ``offset`` added to every row."""
    s, n = chunk.shape
    if not getattr(runner.vllm_config.model_config, "uses_mrope", False):
        return torch.arange(offset, offset + n, device=runner.device, dtype=torch.int64).repeat(s)
    model = runner.get_model()
    if not callable(getattr(model, "get_mrope_input_positions", None)):
        raise RuntimeError(f"{type(model).__name__} uses M-RoPE but has no "
                           "get_mrope_input_positions (vLLM's SupportsMRoPE)")
    rows = [model.get_mrope_input_positions(seq.tolist(), [])[0] for seq in chunk]
    return torch.cat(rows, dim=1).to(device=runner.device, dtype=torch.int64) + offset


def decoder_stack(model: Any) -> Optional[Any]:
    """The decoder-layer stack of a vLLM causal LM (``model.model``; for a multimodal model, its
    language model's: ``model.language_model.model`` in Qwen2/2.5/3-VL) when it can resume at a
    layer: its forward runs ``layers[start_layer:end_layer]`` from ``inputs_embeds`` (Llama,
    Qwen2/3, Mistral, Gemma 3, gpt-oss and most others); None otherwise."""
    if callable(getattr(model, "get_language_model", None)):
        model = model.get_language_model()
    stack = getattr(model, "model", None)
    if stack is None or not isinstance(getattr(stack, "start_layer", None), int) \
            or getattr(stack, "start_layer") != 0 or not hasattr(stack, "layers"):
        return None
    return stack


class LayerStreams:
    """The residual stream at the input of chosen decoder layers, recorded during an exact forward
    (forward hooks on the layer before each): ``hidden + residual`` of that layer's output
    ``[S * L, hidden]``, per chunk. A slot of layer ``l`` perturbs nothing before ``l``, so its
    forward can start there (:func:`_forward` ``resume``), about half the work on average."""

    def __init__(self, stack: Any, layers: Sequence[int]) -> None:
        self.streams: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers if layer > 0}
        self.unrecognised = False  # a layer output that is not (hidden, residual)
        self._handles = [stack.layers[layer - 1].register_forward_hook(self._recorder(layer))
                         for layer in self.streams]

    def _recorder(self, layer: int) -> Callable[..., None]:
        def record(module: Any, args: Any, output: Any) -> None:
            if not (isinstance(output, tuple) and len(output) == 2
                    and isinstance(output[0], torch.Tensor)):
                self.unrecognised = True
                return
            hidden, residual = output
            self.streams[layer].append(hidden if residual is None else hidden + residual)
        return record

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@torch.inference_mode()
def observe_in_vllm(runner: Any, layers: dict[str, Any], windows: torch.Tensor, per_forward: int,
                    num_layers: int, states: Optional[StateLayers] = None,
                    offsets: Sequence[int] = (), rope: Optional[Rope] = None) -> KVObserver:
    """Run ``windows [n, T]`` through the runner's model, ``per_forward`` windows per forward
    (``states``: the model's GDN layers, bound), then again from each position offset of
    ``offsets`` for the range statistics only
    (:meth:`~vllm_nvfp4.calibration.kv_hooks.KVObserver.range_only`); returns this rank's K/V
    statistics (with the model's ``rope``, also the mean pre-RoPE key of the rotating K center,
    RoPE inverted at the forward's positions)."""
    rows = {name: layer_index(name, num_layers) for name in layers}
    return _observe(runner, rows, windows, per_forward,
                    KVObserver(num_layers, sorted(set(rows.values())), rope), states, offsets)


@torch.inference_mode()
def rot_range_in_vllm(runner: Any, layers: dict[str, Any], windows: torch.Tensor,
                      per_forward: int, num_layers: int, fits: dict[int, RotFit],
                      states: Optional[StateLayers] = None,
                      offsets: Sequence[int] = ()) -> RotRangeObserver:
    """The second pass of the rotating K center over the same runs as :func:`observe_in_vllm`:
    per layer of ``fits`` (this rank's heads of each layer's ``mu'`` and rotating center) the
    amax of the keys it stores (:class:`~vllm_nvfp4.calibration.kv_hooks.RotRangeObserver`)."""
    rows = {name: layer_index(name, num_layers) for name in layers}
    return _observe(runner, rows, windows, per_forward,
                    rot_center.range_observer(fits, num_layers, sorted(set(rows.values()))),
                    states, offsets)


ObserverT = TypeVar("ObserverT", bound=Union[KVObserver, RotRangeObserver])


def _observe(runner: Any, rows: dict[str, int], windows: torch.Tensor, per_forward: int,
             observer: ObserverT, states: Optional[StateLayers],
             offsets: Sequence[int]) -> ObserverT:
    """``observer`` after the windows from position 0, then from each of ``offsets`` inside its
    ``range_only()``; ``RuntimeError`` where a layer never reached the attention impl."""
    for chunk in windows.split(per_forward):
        _forward(runner, rows, chunk, observer, states=states)
    with observer.range_only():
        for offset in offsets:
            for chunk in windows.split(per_forward):
                _forward(runner, rows, chunk, observer, states=states, offset=offset)
    missing = observer.missing_layers()
    if missing:
        raise RuntimeError(f"vllm-nvfp4 start-up calibration: layers {missing} never reached the "
                           "attention impl; set VLLM_NVFP4_STARTUP_CALIBRATION=0 and calibrate "
                           "offline with `vllm-nvfp4 calibrate`")
    return observer


class ExactReference:
    """The exact forward of the runner's model over ``windows [n, T]`` (``per_forward`` per
    forward; ``states``: the model's GDN layers, bound), kept to score perturbed forwards against
    (:meth:`kl`). ``resume_layers``: where the model can resume at a layer
    (:func:`decoder_stack`), the residual stream at those layers' inputs is recorded, once the
    exact forward resumed at the deepest is checked to reproduce the full one."""

    @torch.inference_mode()
    def __init__(self, runner: Any, layers: dict[str, Any], windows: torch.Tensor,
                 per_forward: int, num_layers: int, states: Optional[StateLayers] = None,
                 resume_layers: Sequence[int] = ()) -> None:
        self.runner, self.model, self.states = runner, runner.get_model(), states
        self.rows = {name: layer_index(name, num_layers) for name in layers}
        self.chunks = list(windows.split(per_forward))
        stack = decoder_stack(self.model)
        streams = LayerStreams(stack, sorted(set(resume_layers))) if stack is not None else None
        try:
            self.exact = [_forward(runner, self.rows, c, states=states) for c in self.chunks]
        finally:
            if streams is not None:
                streams.close()
        if streams is not None and not _resumes_exactly(runner, self.rows, self.chunks, self.exact,
                                                        streams, states):
            streams = None
        self.streams = streams
        # the exact forward's log-probs, computed once where memory is the host's: on a CPU the
        # reference's lm_head and softmax are ~1/4 of a slot's work for SmolLM2-135M, and they
        # take positions x vocab FP32 (0.4 GB for its 2048 x 49k, 1.2 GB for Qwen2.5's 152k
        # vocabulary); on a GPU that memory would be taken before vLLM's profiling, so each
        # measurement recomputes them
        self.refs = [[_log_probs(self.model, r) for r in hidden.split(LOGIT_ROWS)]
                     for hidden in self.exact] if runner.device.type == "cpu" else None

    @torch.inference_mode()
    def kl(self, perturb: Sequence[SlotPerturbation], layer: int = 0) -> Optional[float]:
        """Mean next-token KL (nats) of the final logits with ``perturb`` against the exact
        forward, over every position; None on ranks without logits. ``layer``: no slot of
        ``perturb`` is before it, so the forward resumes there where its stream was recorded."""
        total = torch.zeros((), dtype=torch.float64, device=self.runner.device)
        count = 0
        streams = self.streams.streams if self.streams is not None else {}
        for i, (chunk, hidden) in enumerate(zip(self.chunks, self.exact)):
            resume = (layer, streams[layer][i]) if layer in streams else None
            moved = _forward(self.runner, self.rows, chunk, perturb=perturb, resume=resume,
                             states=self.states)
            for j, (ref_rows, q_rows) in enumerate(zip(hidden.split(LOGIT_ROWS),
                                                       moved.split(LOGIT_ROWS))):
                ref = self.refs[i][j] if self.refs is not None else _log_probs(self.model, ref_rows)
                if ref is None:  # TP: the logits are gathered to rank 0
                    continue
                kl = kl_divergence(ref, _log_probs(self.model, q_rows))
                total, count = total + kl.double().sum(), count + kl.numel()  # no host sync
        return float(total) / count if count else None


@torch.inference_mode()
def slot_damage(runner: Any, layers: dict[str, Any], windows: torch.Tensor, per_forward: int,
                scaled: KVPolicy, slots: Sequence[tuple[int, str]],
                progress: Optional[Callable[[int], None]] = None,
                states: Optional[StateLayers] = None,
                reference: Optional[ExactReference] = None) -> Optional[dict[tuple[int, str], float]]:
    """Mean next-token KL (nats) of the final logits with each slot ``(layer, "k"|"v")`` alone in
    NVFP4 (``scaled``'s scales and K centering as served, every other layer exact) against the
    exact forward, over every position of ``windows [n, T]``; None on ranks without logits.
    Where the model can resume at a layer (:func:`decoder_stack`) a slot's forward starts at its
    layer from the exact forward's residual stream (:class:`ExactReference`, made here unless
    ``reference`` is given, recording the slots' layers). ``progress(done)`` is called after
    each slot; ``states``: the model's GDN layers, bound."""
    if reference is None:
        reference = ExactReference(runner, layers, windows, per_forward, scaled.num_layers, states,
                                   [layer for layer, _ in slots])
    by_row = {row: name for name, row in reference.rows.items()}
    damage: Optional[dict[tuple[int, str], float]] = {}
    for done, (layer, kv) in enumerate(slots, 1):
        name = by_row[layer]
        perturb = SlotPerturbation.of(scaled, layer, kv, "nvfp4", name, layers[name].impl,
                                      runner.vllm_config)
        d = reference.kl((perturb,), layer)
        if d is None:
            damage = None
        elif damage is not None:
            damage[(layer, kv)] = d
        if progress is not None:
            progress(done)
    return damage


def policy_damage(reference: ExactReference, layers: dict[str, Any],
                  policy: KVPolicy) -> Optional[float]:
    """Mean next-token KL (nats) of the final logits with every K and V slot of ``layers``
    stored as ``policy`` stores it (formats, scales, K centering, sink key) against
    ``reference``'s exact forward; None on ranks without logits. One whole-model forward."""
    vllm_config = reference.runner.vllm_config
    perturb = [SlotPerturbation.of(policy, row, kv, policy.layers[row].format_of(kv).value, name,
                                   layers[name].impl, vllm_config)
               for name, row in reference.rows.items() for kv in ("k", "v")]
    return reference.kl(perturb)


def _log_probs(model: Any, hidden: torch.Tensor) -> Optional[torch.Tensor]:
    """FP32 next-token log-probs ``[rows, vocab]`` of final hidden states ``[rows, hidden]``;
    None on tensor-parallel ranks other than the one that gathers the logits."""
    logits = model.compute_logits(hidden)
    return None if logits is None else logits.float().log_softmax(-1)


#: largest relative RMS difference between the final hidden states of a resumed and a full exact
#: forward for the resumed forwards to be used (the model dtype's rounding of the stream's sum)
RESUME_TOLERANCE = 2e-2


def _resumes_exactly(runner: Any, rows: dict[str, int], chunks: Sequence[torch.Tensor],
                     exact: Sequence[torch.Tensor], streams: LayerStreams,
                     states: Optional[StateLayers] = None) -> bool:
    """Whether the exact forward resumed at the deepest recorded layer reproduces the full one
    (a model whose stack does not resume like Llama's would not); logs and returns False if not."""
    layer = max(streams.streams, default=None)
    if layer is None or streams.unrecognised \
            or any(len(chunk_streams) != len(chunks) for chunk_streams in streams.streams.values()):
        return False
    try:  # a model whose forward needs input_ids past layer 0 (per-layer inputs) fails here
        again = _forward(runner, rows, chunks[0], resume=(layer, streams.streams[layer][0]),
                         states=states).float()
    except Exception as e:  # noqa: BLE001 - any failure means: run the whole model per slot
        logger.warning("vllm-nvfp4: start-up sensitivity: the model does not resume at layer %d "
                       "(%s: %s); every slot runs the whole model", layer, type(e).__name__, e)
        return False
    ref = exact[0].float()
    err = float((again - ref).norm() / ref.norm().clamp_min(1e-30))
    if err <= RESUME_TOLERANCE:
        return True
    logger.warning("vllm-nvfp4: start-up sensitivity: resuming the model at layer %d changed its "
                   "output by %.3g (relative); every slot runs the whole model", layer, err)
    return False

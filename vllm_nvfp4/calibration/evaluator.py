"""Measure policies on held-out windows: one forward per window per policy, through kv_hooks.

Prefix reuse: the sensitivity sweep changes one layer at a time from a fixed baseline policy.
Layers before the first changed layer see exactly the baseline's inputs, so after one baseline
forward that records every decoder layer's input hidden states, a policy whose first difference
from the baseline is at layer ``s`` is run from layer ``s`` on: the earlier decoder layers are
swapped for pass-throughs and the recorded input of layer ``s`` is fed as ``inputs_embeds``. The
result is the same computation (verified at capture time against a full forward, bit for bit on
CPU; otherwise reuse is switched off with a warning), and the sweep costs about half.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Optional, Sequence

import torch

from vllm_nvfp4.calibration.hf_model import attention_modules
from vllm_nvfp4.calibration.kv_hooks import KVOption, kv_cache_quantization
from vllm_nvfp4.calibration.modeling import input_device
from vllm_nvfp4.calibration.metrics import Metrics, Reference, per_token_damage, reference_from_logits, summarize
from vllm_nvfp4.policy import KVPolicy

logger = logging.getLogger(__name__)


class _PassThrough(torch.nn.Module):
    """Stands in for a skipped decoder layer: returns its input hidden states."""

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return hidden_states


def _decoder_layers(model: torch.nn.Module) -> Optional[torch.nn.ModuleList]:
    """The ModuleList of decoder layers whose ``self_attn`` are the attention layers, in order."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    layers = getattr(decoder, "layers", None)
    attn = attention_modules(model)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != len(attn):
        return None
    if any(getattr(layer, "self_attn", None) is not a for layer, a in zip(layers, attn)):
        return None
    return layers


class Evaluator:
    """Scores policies against a reference forward on ``windows [n, T]`` (token ids).

    Call :meth:`reference` first (policy ``None``: unquantized model dtype), optionally
    :meth:`set_baseline` to enable prefix reuse, then :meth:`measure` per policy. ``options``
    (:class:`~vllm_nvfp4.calibration.kv_hooks.KVOption`, e.g. the study options of
    ``studies/kv_options.py``) change what the quantized forwards store; set them between
    measurements. Prefix reuse assumes the options without a ``first_layer`` stay as they were
    for the baseline, and starts at the ``first_layer`` of the others (options set per
    measurement, e.g. per-head formats).
    """

    def __init__(self, model: torch.nn.Module, windows: torch.Tensor, reuse_prefix: bool = True,
                 options: Sequence[KVOption] = ()) -> None:
        self.model = model
        self.options: tuple[KVOption, ...] = tuple(options)
        self.windows = windows.to(input_device(model))
        self.refs: list[Reference] = []
        self.layers = _decoder_layers(model) if reuse_prefix else None
        self.baseline: Optional[KVPolicy] = None
        self.baseline_metrics: Optional[Metrics] = None
        self.captured: list[list[torch.Tensor]] = []  # [window][layer] -> [1, T, hidden]
        self.baseline_nll: Optional[list[torch.Tensor]] = None  # [window] -> [T-1]
        self.forwards = 0

    # ------------------------------------------------------------------ forwards
    @torch.no_grad()
    def _logits(self, policy: Optional[KVPolicy], w: int, start: int = 0) -> torch.Tensor:
        """Logits ``[T, vocab]`` of window ``w`` under ``policy``, from layer ``start`` on."""
        self.forwards += 1
        ids = self.windows[w].unsqueeze(0)
        with (kv_cache_quantization(self.model, policy, options=self.options)
              if policy is not None
              else contextlib.nullcontext()):
            if start == 0:
                return self.model(ids, use_cache=False).logits[0]
            assert self.layers is not None
            with self._skip_layers(start):
                return self.model(inputs_embeds=self.captured[w][start], use_cache=False).logits[0]

    @contextlib.contextmanager
    def _skip_layers(self, start: int) -> Iterator[None]:
        assert self.layers is not None
        saved = [self.layers[i] for i in range(start)]
        try:
            for i in range(start):
                self.layers[i] = _PassThrough()
            yield
        finally:
            for i, layer in enumerate(saved):
                self.layers[i] = layer

    @contextlib.contextmanager
    def _capture(self, store: list[torch.Tensor]) -> Iterator[None]:
        assert self.layers is not None

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            store.append(h.detach().clone())

        handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in self.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    # ------------------------------------------------------------------ public API
    def reference(self, desc_progress: Optional[object] = None) -> Metrics:
        """Run the unquantized model on every window and keep its log-probs as the reference."""
        t0 = time.time()
        self.refs = []
        for w in range(len(self.windows)):
            self.refs.append(reference_from_logits(self._logits(None, w), self.windows[w]))
            _tick(desc_progress)
        n = sum(r.nll.numel() for r in self.refs)
        nll = float(torch.cat([r.nll for r in self.refs]).double().mean())
        return Metrics(kl=0.0, dnll=0.0, dnll_se=0.0, nll=nll, tokens=n, seconds=time.time() - t0,
                       top1=1.0)

    def set_baseline(self, policy: KVPolicy, desc_progress: Optional[object] = None) -> Metrics:
        """Measure ``policy`` and record its per-layer inputs for prefix reuse."""
        self._need_reference()
        if self._option_start() is not None:
            raise ValueError("set_baseline with a per-measurement option set (one with a "
                             "first_layer, e.g. HeadFormats): a baseline is the policy alone (drop "
                             "it from options first, then set it before each measure)")
        t0 = time.time()
        kls, nlls, agree = [], [], []
        self.captured = []
        for w in range(len(self.windows)):
            store: list[torch.Tensor] = []
            with self._capture(store) if self.layers is not None else contextlib.nullcontext():
                logits = self._logits(policy, w)
            self.captured.append(store)
            kl, nll, top1 = per_token_damage(logits, self.refs[w])
            kls.append(kl)
            nlls.append(nll)
            agree.append(top1)
            _tick(desc_progress)
            if w == 0 and self.layers is not None:
                self._check_reuse(policy, logits)
        self.baseline = policy
        self.baseline_nll = nlls
        self.baseline_metrics = summarize(kls, nlls, agree, self.refs, time.time() - t0)
        return self.baseline_metrics

    def _check_reuse(self, policy: KVPolicy, full: torch.Tensor) -> None:
        start = len(self.layers) // 2  # type: ignore[arg-type]
        part = self._logits(policy, 0, start=start)
        if not torch.equal(part, full):
            diff = float((part.float() - full.float()).abs().max())
            logger.warning("prefix reuse does not reproduce the full forward (max |diff| %.3g); "
                           "falling back to full forwards", diff)
            self.layers = None
            self.captured = []

    def first_difference(self, policy: KVPolicy) -> int:
        """Index of the first layer where ``policy`` (or a per-measurement option, its
        ``first_layer``) differs from the baseline (0 without one)."""
        if self.baseline is None or self.layers is None or not self.captured:
            return 0
        first = len(policy.layers)
        for i, (a, b) in enumerate(zip(policy.layers, self.baseline.layers)):
            if a != b:
                first = i
                break
        start = self._option_start()
        return first if start is None else min(first, start)

    def _option_start(self) -> Optional[int]:
        """The lowest ``first_layer`` of the options (None: none has one)."""
        return min((o.first_layer for o in self.options if o.first_layer is not None), default=None)

    def measure(self, policy: Optional[KVPolicy], desc_progress: Optional[object] = None) -> Metrics:
        """Damage of ``policy`` against the reference (prefix reuse when it applies).

        ``policy=None`` repeats the unquantized forward: the noise floor (0 on a deterministic CPU).
        """
        self._need_reference()
        start = 0 if policy is None else self.first_difference(policy)
        if policy is not None and start == policy.num_layers and self.baseline_metrics is not None:
            return self.baseline_metrics
        t0 = time.time()
        kls, nlls, agree = [], [], []
        for w in range(len(self.windows)):
            kl, nll, top1 = per_token_damage(self._logits(policy, w, start), self.refs[w])
            kls.append(kl)
            nlls.append(nll)
            agree.append(top1)
            _tick(desc_progress)
        return summarize(kls, nlls, agree, self.refs, time.time() - t0, self.baseline_nll)

    def _need_reference(self) -> None:
        if not self.refs:
            raise RuntimeError("call Evaluator.reference() before measuring policies")


def _tick(bar: Optional[object]) -> None:
    if bar is not None:
        bar.update(1)  # type: ignore[attr-defined]

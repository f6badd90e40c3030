"""What the window studies share: their arguments, the model and text they load, a progress sink,
the gap-recovery figure and the printed row, and FP8 slot lists (``LAYERk`` / ``LAYERv``).

Windows: calibration = the first ``--window`` tokens of TEXT, analysis = the next
``--analysis-windows``, held-out = the last ``--heldout-windows`` windows of TEXT's final
``TAIL_CHARS`` characters. Transformers on the CPU with the cache fake-quantized
(:mod:`vllm_nvfp4.calibration.kv_hooks`), one thread.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any, Optional, Sequence

HEAD_CHARS, TAIL_CHARS = 100_000, 50_000  # text tokenized for the first / the held-out windows
Z95 = 1.96  # two-sided 95% normal quantile: the delta-NLL interval of :func:`row`


class Progress:
    """A progress sink for :class:`~vllm_nvfp4.calibration.evaluator.Evaluator`: a line every 20
    forwards."""

    def __init__(self) -> None:
        self.n, self.t0 = 0, time.time()

    def update(self, k: int) -> None:
        self.n += k
        if self.n % 20 == 0:
            print(f"  {self.n} forwards, {time.time() - self.t0:.0f} s", flush=True)


def study_parser(doc: str, steps: Sequence[str]) -> argparse.ArgumentParser:
    """The arguments the window studies share: STEP MODEL TEXT --out and the window options; with
    no ``steps``, MODEL TEXT --out and the held-out window options only (a study without an
    analysis sweep or a budget)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if steps:
        ap.add_argument("step", choices=steps)
    ap.add_argument("model", type=Path)
    ap.add_argument("text", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--window", type=int, default=512)
    if steps:
        ap.add_argument("--analysis-windows", type=int, default=2)
    ap.add_argument("--heldout-windows", type=int, default=4)
    if steps:
        ap.add_argument("--budget", type=float, default=0.62)
    ap.add_argument("--dtype", default="float32")
    return ap


def load_study(model_dir: Path, text_path: Path, dtype: str) -> tuple[Any, Any, list[int], list[int]]:
    """``(model, info, head, tail)``: the transformers model on the CPU (one thread, seed 0), its
    :func:`~vllm_nvfp4.calibration.modeling.load_model` info, and the token ids of TEXT's first
    ``HEAD_CHARS`` and last ``TAIL_CHARS`` characters."""
    import torch

    from vllm_nvfp4.calibration.modeling import load_model

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tok, info = load_model(model_dir, dtype, "cpu")
    text = text_path.read_text(encoding="utf-8")
    head = tok(text[:HEAD_CHARS], add_special_tokens=False)["input_ids"]
    tail = tok(text[-TAIL_CHARS:], add_special_tokens=False)["input_ids"]
    return model, info, head, tail


def load_slot_study(a: argparse.Namespace) -> tuple[Any, Any, list[int], list[int]]:
    """:func:`load_study` for a study with ``--fp8-slots``: the slots checked before the model
    loads and against its KV layers after, ``--out`` made."""
    check_fp8_slots(a.fp8_slots)
    a.out.mkdir(parents=True, exist_ok=True)
    model, info, head, tail = load_study(a.model, a.text, a.dtype)
    check_fp8_slots(a.fp8_slots, info.kv_layers)
    return model, info, head, tail


def row(name: str, m: dict[str, Any]) -> str:
    """One printed line of a measurement: top-1, delta NLL with its 95% interval, KL."""
    lo, hi = m["dnll"] - Z95 * m["dnll_se"], m["dnll"] + Z95 * m["dnll_se"]
    return (f"{name:34s} top-1 {m['top1']:.4f}  dNLL {m['dnll']:+.4f} [{lo:+.4f}, {hi:+.4f}]  "
            f"KL {m['kl']:.4f}")


def recovery(m: dict[str, Any], fp8: dict[str, Any], nv: dict[str, Any]) -> dict[str, float]:
    """The share of the all-NVFP4 -> all-FP8 gap that ``m`` recovers, in top-1 and in delta NLL:
    ``(x - all-NVFP4) / (all-FP8 - all-NVFP4)``."""
    return {"top1_gap_recovery": round((m["top1"] - nv["top1"]) / (fp8["top1"] - nv["top1"]), 4),
            "dnll_gap_recovery": round((nv["dnll"] - m["dnll"]) / (nv["dnll"] - fp8["dnll"]), 4)}


def check_fp8_slots(slots: Sequence[str], kv_layers: Optional[Sequence[int]] = None) -> None:
    """``SystemExit`` unless every entry of ``--fp8-slots`` is ``LAYERk`` / ``LAYERv`` (and, given
    ``kv_layers``, names a KV layer)."""
    bad = [s for s in slots if not re.fullmatch(r"\d+[kv]", s)]
    if bad:
        raise SystemExit(f"--fp8-slots {bad}: expected LAYERk or LAYERv, e.g. 14k 3v")
    outside = [s for s in slots if kv_layers is not None and int(s[:-1]) not in kv_layers]
    if outside:
        raise SystemExit(f"--fp8-slots {outside}: the model's KV layers are {kv_layers[0]}-{kv_layers[-1]}")


def with_fp8_slots(policy: Any, slots: Sequence[str]) -> Any:
    """``policy`` with each slot of ``slots`` (``LAYERk`` / ``LAYERv``) in FP8."""
    from vllm_nvfp4.calibration.sensitivity import upgrade

    for s in slots:
        policy = upgrade(policy, int(s[:-1]), s[-1])
    return policy

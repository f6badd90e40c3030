"""What each decoder layer keeps in the KV cache: its :class:`LayerType`, read from the model config.

* ``full``    - full (global) attention: its cache grows with the context;
* ``sliding`` - sliding-window (local) attention with its ``window`` (tokens attended, the
  current one included): vLLM frees its blocks outside the window;
* either of them with ``sinks`` - gpt-oss's learned per-head logit in the softmax denominator;
* ``none``    - no KV cache (linear attention, Mamba, Gated DeltaNet): the state is vLLM's own,
  the policy row carries no formats and no scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from vllm_nvfp4.policy.errors import PolicyError

LAYER_KINDS = ("full", "sliding", "none")
#: config ``layer_types`` entries -> kind (transformers' names; ``attention`` is MiniMax's)
CONFIG_LAYER_KINDS = {
    "full_attention": "full", "attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "none", "mamba": "none", "conv": "none",
}
#: model types whose attention layers all carry sinks (a config has no flag for them)
SINK_MODEL_TYPES = ("gpt_oss",)


@dataclass(frozen=True)
class LayerType:
    """What one decoder layer keeps in the KV cache (see the module doc)."""

    kind: str = "full"
    window: Optional[int] = None  # sliding: tokens attended, the current one included
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise PolicyError(f"unknown layer type {self.kind!r}; expected one of {', '.join(LAYER_KINDS)}")
        if self.kind == "sliding":
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window <= 0:
                raise PolicyError(f"a sliding layer needs a window (int > 0), got {self.window!r}")
        elif self.window is not None:
            raise PolicyError(f"a {self.kind} layer has no window (got {self.window!r})")
        if self.sinks and self.kind == "none":
            raise PolicyError("a layer without KV cache cannot have attention sinks")

    @property
    def holds_kv(self) -> bool:
        return self.kind != "none"

    def label(self) -> str:
        """``full``, ``sliding(512)``, ``full+sinks``, ``none``."""
        base = f"sliding({self.window})" if self.kind == "sliding" else self.kind
        return base + ("+sinks" if self.sinks else "")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.window is not None:
            out["window"] = self.window
        if self.sinks:
            out["sinks"] = True
        return out


FULL_ATTENTION = LayerType()
NO_KV = LayerType("none")


def layer_types_from_config(config: Any) -> tuple[LayerType, ...]:
    """Per decoder layer, its :class:`LayerType`, from a (text) model config.

    Reads ``num_hidden_layers``, ``layer_types`` (transformers' per-layer list), ``sliding_window``
    (with ``use_sliding_window``) and ``model_type``. Without ``layer_types`` every layer is
    sliding if the config sets a window (Mistral), else full attention.
    """
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 0:
        raise PolicyError(f"model config has no valid num_hidden_layers ({n!r})")
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    sinks = getattr(config, "model_type", None) in SINK_MODEL_TYPES
    names = getattr(config, "layer_types", None)
    if names is None:
        kind = "sliding" if window else "full"
        return tuple(LayerType(kind, window if window else None, sinks) for _ in range(n))
    if len(names) != n:
        raise PolicyError(f"model config lists {len(names)} layer_types for {n} layers")
    out = []
    for i, name in enumerate(names):
        kind = CONFIG_LAYER_KINDS.get(name)
        if kind is None:
            raise PolicyError(
                f"layer {i} of the model has type {name!r}, which vllm-nvfp4 does not know; "
                f"supported: {', '.join(sorted(CONFIG_LAYER_KINDS))}")
        if kind == "sliding" and not window:
            raise PolicyError(f"layer {i} is sliding_attention but the config sets no sliding_window")
        out.append(LayerType(kind, window if kind == "sliding" else None, sinks and kind != "none"))
    return tuple(out)


def check_layer_count(types: Sequence[LayerType], num_layers: int) -> None:
    """Raise :class:`PolicyError` unless there is one type per layer."""
    if len(types) != num_layers:
        raise PolicyError(f"{len(types)} layer types given for {num_layers} layers")


def format_types(types: Sequence[LayerType]) -> str:
    """``0-4 sliding(512), 5 full, ...``: runs of equal types, for error messages."""
    runs: list[str] = []
    start = 0
    for i in range(1, len(types) + 1):
        if i < len(types) and types[i] == types[start]:
            continue
        rng = str(start) if i - 1 == start else f"{start}-{i - 1}"
        runs.append(f"{rng} {types[start].label()}")
        start = i
    return ", ".join(runs[:8]) + (" ..." if len(runs) > 8 else "")

"""Load a Hugging Face causal LM for calibration and describe the shape of its KV cache.

Devices (``--device``): ``cpu``; ``cuda`` = every visible GPU, the model split across them as
users load big models (``device_map="auto"``, needs ``accelerate``; one visible GPU without it:
loaded and moved); ``cuda:N`` = that GPU alone; ``auto`` (the default) = ``cuda`` when CUDA is
available, else ``cpu``. Before loading, :func:`check_fits` compares an estimate of the memory the
command needs with what the device has and refuses with the numbers when it does not fit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from vllm_nvfp4.calibration.hf_model import attention_modules, model_layer_types, text_config
from vllm_nvfp4.policy import LayerType

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
GiB = float(1 << 30)
FIT_MARGIN = 0.9  # use at most this fraction of the free memory


class ModelError(ValueError):
    """The model directory is missing, unreadable or of an unsupported kind."""


@dataclass(frozen=True)
class ModelInfo:
    """What a policy depends on: decoder layers and their types, KV heads, head size, and the
    config it came from."""

    path: str
    num_layers: int  # decoder layers = policy rows (KV-holding or not)
    num_kv_heads: int
    head_dim: int
    dtype: str
    config_sha256: str
    max_positions: int
    layer_types: tuple[LayerType, ...] = ()
    device: str = "cpu"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layer_types"] = [t.to_json() for t in self.layer_types]
        return out

    @property
    def kv_layers(self) -> list[int]:
        """Decoder layers that hold a KV cache (all of them in a dense model)."""
        return [i for i, t in enumerate(self.layer_types) if t.holds_kv]


def read_config(model_dir: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model directory (:class:`ModelError` if unreadable)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{model_dir}: cannot read config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{model_dir}/config.json is not a JSON object")
    return cfg


def read_text_config(model_dir: Path) -> dict[str, Any]:
    """The decoder's part of ``config.json`` (``text_config`` of multimodal wrappers)."""
    cfg = read_config(model_dir)
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def config_sha256(model_dir: Path) -> str:
    """SHA-256 of ``config.json`` parsed and re-serialised with sorted keys (formatting-proof)."""
    return hashlib.sha256(json.dumps(read_config(model_dir), sort_keys=True).encode()).hexdigest()


def config_shape(model_dir: Path) -> tuple[Optional[int], Optional[int]]:
    """``(num_hidden_layers, max_position_embeddings)`` from ``config.json`` (text config if
    nested), for checking arguments before loading weights; ``None`` where absent."""
    cfg = read_text_config(model_dir)
    layers, pos = cfg.get("num_hidden_layers"), cfg.get("max_position_embeddings")
    return (layers if isinstance(layers, int) else None, pos if isinstance(pos, int) else None)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` or ``cpu``; validates ``cpu`` / ``cuda`` / ``cuda:N``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ModelError(f"--device {device}: CUDA is not available here (torch "
                             f"{torch.__version__}); use --device cpu")
        if device != "cuda" and int(device[5:]) >= torch.cuda.device_count():
            raise ModelError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
        return device
    raise ModelError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")


def weight_bytes(model_dir: Path, dtype: str) -> float:
    """Bytes of the weights in ``dtype``: the checkpoint files' size rescaled from their dtype."""
    files = [p for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".bin")]
    stored = sum(p.stat().st_size for p in files)
    cfg, text = read_config(model_dir), read_text_config(model_dir)
    stored_dtype = str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or "float32")
    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    return stored * size[dtype] / size.get(stored_dtype, 4)


def memory_estimate(model_dir: Path, dtype: str, window: int, windows: int) -> dict[str, float]:
    """GiB the calibration commands need: ``weights`` (in ``dtype``) and ``work`` (the reference
    log-probs of ``windows`` windows, one forward's logits and hidden states kept for prefix reuse)."""
    text = read_text_config(model_dir)
    vocab, hidden = int(text.get("vocab_size", 0)), int(text.get("hidden_size", 0))
    layers = int(text.get("num_hidden_layers", 0))
    elem = DTYPES[dtype].itemsize
    work = (windows * window * vocab * 4  # reference log-probs, FP32
            + window * vocab * (elem + 8)  # one forward's logits + FP32 log-softmax chunk copies
            + windows * layers * window * hidden * elem  # decoder-layer inputs (prefix reuse)
            + 8 * window * hidden * 4 * elem)  # activations of one layer (MLP ~4x hidden)
    return {"weights": weight_bytes(model_dir, dtype) / GiB, "work": work / GiB}


def free_memory(device: str) -> float:
    """Free GiB on ``device`` (``cuda``: summed over the visible GPUs)."""
    if device == "cpu":
        import psutil

        return psutil.virtual_memory().available / GiB
    ids = range(torch.cuda.device_count()) if device == "cuda" else [int(device[5:])]
    return sum(torch.cuda.mem_get_info(i)[0] for i in ids) / GiB


def check_fits(model_dir: Path, dtype: str, device: str, window: int, windows: int) -> dict[str, float]:
    """Raise :class:`ModelError` with the numbers when the estimate exceeds the free memory."""
    est = memory_estimate(model_dir, dtype, window, windows)
    free = free_memory(device)
    need = est["weights"] + est["work"]
    if need > FIT_MARGIN * free:
        hint = ("use --device cpu, fewer/shorter windows, or more GPUs (CUDA_VISIBLE_DEVICES)"
                if device != "cpu" else "use a GPU (--device cuda) or fewer/shorter windows")
        raise ModelError(
            f"{model_dir} needs about {need:.1f} GiB on {device} ({est['weights']:.1f} GiB of "
            f"{dtype} weights + {est['work']:.1f} GiB for {windows} window(s) of {window} tokens), "
            f"but only {free:.1f} GiB are free; {hint}")
    return dict(est, free=free)


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's token ids go (the embedding's device; with ``device_map`` the first GPU)."""
    return model.get_input_embeddings().weight.device


def shifted_position_ids(model: torch.nn.Module, length: int, offset: int) -> torch.Tensor:
    """Position ids ``[1, length]`` from ``offset`` on the model's input device: a window run at
    them stores the keys of positions ``offset .. offset+length-1``
    (:mod:`~vllm_nvfp4.calibration.position_range`; M-RoPE text positions are equal on every
    dimension, and transformers' Qwen2/2.5/3-VL expand ``[1, length]`` to them). ``ValueError``
    when they pass the model's ``max_position_embeddings``."""
    limit = getattr(text_config(model), "max_position_embeddings", None)
    if offset < 0 or (isinstance(limit, int) and offset + length > limit):
        raise ValueError(f"positions {offset}..{offset + length - 1} are outside the model's "
                         f"{limit} positions; serve a shorter length (--max-model-len)")
    return torch.arange(offset, offset + length, device=input_device(model)).unsqueeze(0)


def _from_pretrained(path: Path, dtype: str, device: str) -> torch.nn.Module:
    """SDPA attention, eager where the architecture has no SDPA path (gpt-oss: its sinks)."""
    try:
        return _from_pretrained_with(path, dtype, device, "sdpa")
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        return _from_pretrained_with(path, dtype, device, "eager")


def _from_pretrained_with(path: Path, dtype: str, device: str, attention: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype], "attn_implementation": attention}
    if device == "cpu":
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    try:
        import accelerate  # noqa: F401  (device_map needs it)
    except ImportError:
        if device == "cuda" and torch.cuda.device_count() > 1:
            raise ModelError("--device cuda on several GPUs needs accelerate (pip install "
                             "accelerate), or pick one GPU with --device cuda:N") from None
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        return model.to("cuda:0" if device == "cuda" else device)
    device_map: Any = "auto" if device == "cuda" else {"": int(device[5:])}
    return AutoModelForCausalLM.from_pretrained(str(path), device_map=device_map, **kwargs)


def load_model(model_dir: str | Path, dtype: str = "bfloat16", device: str = "cpu",
               window: int = 0, windows: int = 0) -> tuple[torch.nn.Module, Any, ModelInfo]:
    """Load ``(model, tokenizer, info)`` from a local HF directory onto ``device`` (module doc),
    eval mode, SDPA attention; with ``window``, first :func:`check_fits` for ``windows`` windows."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a Hugging Face model directory (no config.json); "
                         "for SmolLM2 run: python scripts/prepare_assets.py smollm2")
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device = resolve_device(device)
    if window:
        check_fits(path, dtype, device, window, windows)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = _from_pretrained(path, dtype, device)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load {path} with transformers: {e}") from None
    except torch.cuda.OutOfMemoryError as e:
        raise ModelError(f"{path} does not fit on {device}: {e}") from None
    model.eval()
    mods = attention_modules(model)
    if not mods:
        raise ModelError(f"{path}: no Llama/Qwen2/Mistral-style attention layers found")
    cfg = text_config(model)
    try:
        types = model_layer_types(model)
    except (RuntimeError, ValueError) as e:
        raise ModelError(f"{path}: {e}") from None
    info = ModelInfo(
        path=str(path.resolve()),
        num_layers=len(types),
        num_kv_heads=int(cfg.num_key_value_heads),
        head_dim=int(mods[0].head_dim),
        dtype=dtype,
        config_sha256=config_sha256(path),
        max_positions=int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 30,
        layer_types=types,
        device=device,
    )
    if info.head_dim % 16:
        raise ModelError(f"{path}: head_dim {info.head_dim} is not a multiple of 16; NVFP4 needs 16-blocks")
    return model, tokenizer, info

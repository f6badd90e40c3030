"""Calibration / evaluation text -> fixed-length token windows.

Accepted files: plain text (anything but ``.jsonl``), or JSON Lines with a ``text`` field or
GSM8K-style ``question`` / ``answer`` fields (rendered ``Question: ...\\nAnswer: ...``). Several
files are concatenated in the order given, separated by blank lines. The concatenated text is
tokenized once (no special tokens added) and cut into consecutive, non-overlapping pieces; each
window is one of the :func:`served_prefixes` (what position 0 of a served request holds) followed
by one piece, the prefixes taken in turn. The first ``calib`` windows calibrate the scales, the
next ``count`` are held out for evaluation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch


class DataError(ValueError):
    """Unreadable or too short calibration data; the message says what is wrong."""


def _jsonl_record(obj: Any, where: str) -> str:
    if isinstance(obj, dict):
        if isinstance(obj.get("text"), str):
            return obj["text"]
        if isinstance(obj.get("question"), str) and isinstance(obj.get("answer"), str):
            return f"Question: {obj['question']}\nAnswer: {obj['answer']}"
    raise DataError(f"{where}: expected an object with 'text' or 'question'+'answer' strings")


def read_text(path: Path) -> str:
    """The text of one data file (see the module docstring for the formats)."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist "
                        "(prepare the defaults with: python scripts/prepare_assets.py)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read data file {path}: {e}") from None
    if path.suffix != ".jsonl":
        return raw
    records = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: malformed JSON at column {e.colno}: {e.msg}") from None
        records.append(_jsonl_record(obj, f"{path}:{n}"))
    return "\n\n".join(records)


def text_prefix(tokenizer: Any) -> list[int]:
    """Token ids the tokenizer puts before every text: ``[bos]`` for tokenizers that add a BOS, else ``[]``.

    Raises :class:`DataError` when the tokenizer's special tokens do not wrap the plain encoding.
    """
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    raise DataError(f"the tokenizer's encoding with special tokens {full} does not contain the plain one {plain}")


def chat_first_token(tokenizer: Any) -> Optional[int]:
    """The token a chat request starts with: the first token of the tokenizer's chat template
    rendered (vLLM tokenizes that text without adding special tokens), or None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if ids else None


def served_prefixes(tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """What served requests hold before their text, position 0 included: the tokenizer's
    :func:`text_prefix` (completions), and the chat template's first token where chat requests
    start with another token (for a tokenizer that adds no BOS: ``<|im_start|>`` of ChatML
    templates). Calibration and evaluation windows take these in turn, so the first key the
    cache stores in serving is among the calibrated ones."""
    prefixes = [tuple(text_prefix(tokenizer))]
    chat = chat_first_token(tokenizer)
    if chat is not None and prefixes[0][:1] != (chat,):
        prefixes.append((chat,))
    return tuple(prefixes)


def prefixed_pieces(prefixes: Sequence[Sequence[int]], ids: Sequence[int], count: int,
                    window: int) -> list[list[int]]:
    """``count`` windows of ``window`` tokens: window ``i`` is ``prefixes[i % len(prefixes)]``
    followed by the next consecutive piece of ``ids`` (raises ``ValueError`` when ``ids`` is
    shorter than :func:`text_tokens_needed`)."""
    need = text_tokens_needed(prefixes, count, window)
    if len(ids) < need:
        raise ValueError(f"{need} text tokens needed, {len(ids)} given")
    out, pos = [], 0
    for i in range(count):
        prefix = list(prefixes[i % len(prefixes)])
        piece = window - len(prefix)
        out.append(prefix + list(ids[pos:pos + piece]))
        pos += piece
    return out


def text_tokens_needed(prefixes: Sequence[Sequence[int]], count: int, window: int) -> int:
    """Text tokens that ``count`` windows of ``window`` tokens hold after their prefixes."""
    return sum(window - len(prefixes[i % len(prefixes)]) for i in range(count))


def _tokenize_enough(tokenizer: Any, text: str, need: int, chunk_chars: int = 1 << 18) -> list[int]:
    """Token ids of ``text``, tokenizing line-aligned chunks only until ``need`` tokens exist.

    Chunks end at a newline, so only tokens spanning a chunk boundary (a line break) could differ
    from tokenizing the whole text at once; the result is deterministic either way.
    """
    ids: list[int] = []
    pos = 0
    while pos < len(text) and len(ids) < need:
        end = min(len(text), pos + chunk_chars)
        if end < len(text):
            nl = text.rfind("\n", pos, end)
            end = nl + 1 if nl > pos else end
        ids.extend(tokenizer(text[pos:end], add_special_tokens=False, verbose=False)["input_ids"])
        pos = end
    return ids


@dataclass(frozen=True)
class TokenWindows:
    """Token windows cut from the data: ``calib`` ``[n_calib, T]`` and ``eval`` ``[n_eval, T]`` (int64)."""

    calib: torch.Tensor
    eval: torch.Tensor
    files: tuple[dict, ...]  # [{"path", "sha256", "bytes"}] provenance
    total_tokens: int  # tokens tokenized (at least what the windows need)
    prefixes: tuple[tuple[int, ...], ...] = ((),)  # :func:`served_prefixes`, taken in turn

    @property
    def window_tokens(self) -> int:
        return int(self.eval.shape[1])

    def describe(self) -> dict:
        """JSON-ready summary for reports and policy provenance."""
        return {"files": list(self.files), "window_tokens": self.window_tokens,
                "calib_windows": int(self.calib.shape[0]), "eval_windows": int(self.eval.shape[0]),
                "tokens_tokenized": self.total_tokens,
                "prefixes": [list(p) for p in self.prefixes]}


def load_windows(
    paths: Sequence[Path], tokenizer: Any, window: int, count: int, calib: int = 0,
    max_positions: int | None = None,
) -> TokenWindows:
    """Tokenize ``paths`` and cut ``calib`` calibration windows followed by ``count`` eval windows.

    Raises :class:`DataError` when there are not enough tokens or the window is too long.
    """
    if window < 16:
        raise DataError(f"window must be at least 16 tokens, got {window}")
    if count < 0 or calib < 0 or count + calib == 0:
        raise DataError(f"need at least one window (got {calib} calibration + {count} evaluation)")
    if max_positions is not None and window > max_positions:
        raise DataError(f"window of {window} tokens exceeds the model's {max_positions} positions")
    if not paths:
        raise DataError("no data files given (--data FILE [FILE ...])")
    texts, files = [], []
    for p in paths:
        p = Path(p)
        text = read_text(p)
        texts.append(text)
        files.append({"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                      "bytes": p.stat().st_size})
    prefixes = served_prefixes(tokenizer)
    need = text_tokens_needed(prefixes, calib + count, window)
    ids = _tokenize_enough(tokenizer, "\n\n".join(texts), need)
    if len(ids) < need:
        raise DataError(
            f"the data holds {len(ids)} tokens, but {calib} calibration + {count} evaluation windows "
            f"of {window} tokens need {need} after their prefixes; add data or use fewer/shorter windows"
        )
    t = torch.tensor(prefixed_pieces(prefixes, ids, calib + count, window), dtype=torch.long)
    return TokenWindows(calib=t[:calib], eval=t[calib:], files=tuple(files), total_tokens=len(ids),
                        prefixes=prefixes)


def add_text_arguments(p: argparse.ArgumentParser, window: int, windows: int,
                       number: Callable[[str], Any] = int) -> None:
    """The ``model`` directory and the text a command scores it on: ``--data``, ``--window``
    (tokens per window) and ``--windows``, as :func:`load_windows` takes them; ``number`` parses
    the two counts."""
    p.add_argument("model", type=Path, help="local Hugging Face model directory")
    p.add_argument("--data", type=Path, nargs="+", required=True, metavar="FILE",
                   help="text files or JSONL (fields 'text' or 'question'+'answer'), concatenated")
    p.add_argument("--window", type=number, default=window, help=f"tokens per window (default {window})")
    p.add_argument("--windows", type=number, default=windows, help=f"number of windows (default {windows})")

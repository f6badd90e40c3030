"""Evaluation windows of real text, held out from calibration.

``vllm-nvfp4 calibrate/analyze`` cut their windows from the *start* of the data; evaluation takes
consecutive windows from the *end* of the text (for the Brown corpus: the last genres, far away
from the calibration text), so the selected policy is not scored on the text it was chosen on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_nvfp4.calibration.data import prefixed_pieces, served_prefixes, text_tokens_needed


def tail_windows(text_path: Path, tokenizer: Any, count: int, tokens: int) -> list[list[int]]:
    """``count`` windows of ``tokens`` token ids: the tokenizer's :func:`served_prefixes` in turn,
    each followed by consecutive text from the end of ``text_path``.

    Raises ``ValueError`` if the text is too short.
    """
    if count <= 0 or tokens < 16:
        raise ValueError(f"need count >= 1 and tokens >= 16, got {count} x {tokens}")
    try:
        text = Path(text_path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read {text_path}: {e} (prepare it: python scripts/prepare_assets.py brown)") from None
    prefixes = served_prefixes(tokenizer)
    need = text_tokens_needed(prefixes, count, tokens)
    chars = need * 6
    while True:
        start = max(len(text) - chars, 0)
        if start > 0:  # begin at a paragraph boundary
            nl = text.find("\n", start)
            start = nl + 1 if nl >= 0 else start
        ids = tokenizer(text[start:], add_special_tokens=False)["input_ids"]
        if len(ids) >= need or start == 0:
            break
        chars *= 2
    if len(ids) < need:
        raise ValueError(f"{text_path} holds {len(ids)} tokens; {count} windows of {tokens} tokens need {need} after their prefixes")
    return prefixed_pieces(prefixes, ids[len(ids) - need:], count, tokens)

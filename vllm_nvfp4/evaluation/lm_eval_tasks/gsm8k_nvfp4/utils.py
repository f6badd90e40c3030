"""Data loader of the ``gsm8k_nvfp4`` lm-eval task: the GSM8K test JSONL from a local file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from vllm_nvfp4.testing.assets import assets_dir

GSM8K_ENV = "VLLM_NVFP4_GSM8K"


def gsm8k_path(data_path: Optional[str] = None) -> Path:
    """``data_path``, else ``$VLLM_NVFP4_GSM8K``, else the prepare_assets cache location."""
    if data_path:
        return Path(data_path).expanduser()
    if os.environ.get(GSM8K_ENV):
        return Path(os.environ[GSM8K_ENV]).expanduser()
    return assets_dir() / "gsm8k" / "test.jsonl"


def read_items(path: Path) -> list[dict[str, str]]:
    """``[{"question", "answer"}]`` from a GSM8K JSONL file (clear error when missing/malformed)."""
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file {path} not found; run: python scripts/prepare_assets.py gsm8k "
                                f"(or pass --metadata '{{\"data_path\": \"...\"}}' / set ${GSM8K_ENV})")
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if not isinstance(obj.get("question"), str) or not isinstance(obj.get("answer"), str):
            raise ValueError(f"{path}:{n}: expected 'question' and 'answer' strings")
        items.append({"question": obj["question"], "answer": obj["answer"]})
    return items


def load_gsm8k(data_path: Optional[str] = None, **_: Any) -> Any:
    """lm-eval ``custom_dataset`` hook: a ``DatasetDict`` with the ``test`` split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(read_items(gsm8k_path(data_path)))})

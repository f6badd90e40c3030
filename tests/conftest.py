"""Shared pytest set-up: vLLM-on-CPU environment, the tiny model, the ``gpu`` marker.

Markers (declared in pytest.ini): ``gpu`` (skipped here without CUDA), ``vllm`` (starts an engine).

Environment (set before any test imports vLLM; values already set win):

* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB): the CPU worker refuses to start without a KV-cache size.
* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core and worker run inside the test process.
  With ``enforce_eager=True`` and ``distributed_executor_backend="uni"`` (see
  :data:`FAST_LLM_KWARGS`) an engine starts in ~3 s instead of ~25 s (multiprocessing) or ~35 s
  (torch.compile), and in-process hooks are visible to the test. Tests of the multi-process path
  start a subprocess with :func:`vllm_subprocess_env`.
* Offline Hugging Face, no usage stats.

The Triton interpreter skips re-patching the language on nested calls (:mod:`interpreter_speedup`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import interpreter_speedup

_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
for _k, _v in _ENV_DEFAULTS.items():
    os.environ.setdefault(_k, _v)

#: The fastest ``LLM(...)`` settings on a CPU machine (engine start ~3 s with the tiny model).
FAST_LLM_KWARGS: dict = dict(
    enforce_eager=True,  # no torch.compile (~30 s on 2 cores)
    max_model_len=512,
    max_num_seqs=8,
    distributed_executor_backend="uni",  # worker in this process
    seed=0,
)


def vllm_subprocess_env(**overrides: str) -> dict[str, str]:
    """``os.environ`` for a child process that runs vLLM (multiprocessing back on by default)."""
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(overrides)
    return env


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_finish(session: pytest.Session) -> None:
    interpreter_speedup.install()  # after the test modules chose TRITON_INTERPRET


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA (no NVIDIA GPU here)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the default tiny Llama (4 layers, hidden 128, 4/2 heads, head_dim 32, bf16).

    Built once per session into a temp dir (~2 s; the tokenizer is cached under
    ``~/.cache/vllm-nvfp4``), so tests may add files such as ``nvfp4_policy.json`` to it.
    """
    from vllm_nvfp4.testing.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def fast_llm_kwargs() -> dict:
    """A copy of :data:`FAST_LLM_KWARGS` for ``LLM(model=..., **fast_llm_kwargs)``."""
    return dict(FAST_LLM_KWARGS)


class LogLines(logging.Handler):
    """A log handler that keeps each record's message (``lines``), for tests that read the log."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

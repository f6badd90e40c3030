"""Correctness soak under KV pressure: greedy outputs of many requests, served with preemption,
shared prefixes, chunked prefill and ngram speculation, against each request served alone.

    python -m benchmarks.serving.soak --out out/soak --configs nvfp4-mixed,fp8     # 1000 requests
    python -m benchmarks.serving.soak --out out/soak --configs fp8 --passes alone --budget-s 500
    python -m benchmarks.serving.soak --out out/soak --compare-only
    python -m benchmarks.serving.soak --out /tmp/soak --cpu-tiny                   # CPU smoke run

The request set (:mod:`~benchmarks.serving.soak.requests`) is rebuilt from its parameters in every
pass: ``--requests`` prompts of ``--prompt-len`` tokens (1-32k, log-uniform unless ``--uniform``),
``--prefix-fraction`` (30%) of them starting with one of ``--num-prefixes`` shared prefixes of
``--prefix-len`` tokens, ``--spec-fraction`` of them speculative (a repeated segment, served with
ngram speculation), ``--output-len`` greedy tokens each (``ignore_eos``). Per configuration, each
pass is one offline ``LLM()`` engine in its own process (:mod:`~benchmarks.serving.soak.worker`):

* ``pressure``: the non-speculative requests at once on a cache of ``--pressure-kv-tokens`` (3 x
  max_model_len by default), prefix caching on, chunked prefill of ``--chunk-tokens``: vLLM
  preempts and recomputes. Preemptions are vLLM's ``vllm:num_preemptions`` counter
  (``LLM.get_metrics()``), recorded per pass; the run's summary shows them;
* ``spec``: the speculative requests the same way, with ``ngram`` speculation (vLLM takes one
  speculative configuration per engine, hence a pass of its own);
* ``alone``: the reference: every request by itself, the prefix cache emptied before each, on
  the pressure pass's engine (one engine start for both).

The passes run in order, every configuration's pressure and alone passes before the speculative
ones; with ``--budget-s`` each gets all the time left (no pass starts with less than
``MIN_PASS_S``), and the next call resumes what was cut off.

Outputs are appended per request (``outputs_CONFIG_PASS.jsonl``: tokens, per token the log-prob
and the runner-up's, finish reason), so a pass cut off by ``--budget-s`` or a time limit is
resumed by the next call with the same ``--out``. Each call ends with the comparison
(:mod:`~benchmarks.serving.soak.compare`) of what is there: ``soak_summary.json`` (per
configuration and pass: compared, mismatched requests with first position and the alone pass's
top-2 margin there, near ties, bad outputs - empty, short, NaN log-probs -, crashes, preemptions,
drafted / accepted tokens) and ``soak_summary.md``; ``soak_records.jsonl`` holds the pass
records, ``soak_workers.log`` the engine logs. The exit status is 1 when a pass crashed.

The default model is the weight-less Llama-3.1-8B preset with random weights (as
:mod:`benchmarks.e2e`); ``--model DIR`` serves a checkpoint with its weights, where greedy
choices have real margins.
"""

"""The vLLM integration of the ``nvfp4_mixed`` KV-cache dtype.

Read :mod:`vllm_nvfp4.integration.hooks` first: it lists every place where vLLM is patched and
why. The other modules hold the logic those hooks call:

* :mod:`.dtype`     - the dtype name and its registration with vLLM's config machinery;
* :mod:`.model`     - the resolved policy of the model being served, layer names -> policy rows,
                      start-up validation;
* :mod:`.selection` - which attention backend serves ``nvfp4_mixed``;
* :mod:`.spec`      - the per-layer KV-cache spec (page size from the layer's formats);
* :mod:`.backend`   - the attention backend, its metadata and builder, and the impl calling
                      :mod:`vllm_nvfp4.ops`;
* :mod:`.rank_params` - a policy row's per-KV-head values on one tensor-parallel rank;
* :mod:`.dense_prefill` - prefill through FlashAttention over dequantized K/V (CUDA);
* :mod:`.startup_calibration` - without a policy, K/V scales calibrated in vLLM before serving;
* :mod:`.startup_selection` - which K/V slots stay FP8 after the start-up sensitivity forwards;
* :mod:`.connectors` - which KV connectors may move ``nvfp4_mixed`` blocks.
"""

"""Triton kernels of vllm-nvfp4 (torch + triton only; no vLLM imports).

* :mod:`.cache_write` - quantize K/V and store them into a :class:`~vllm_nvfp4.layout.KVPageLayout` page.
* :mod:`.attention` - paged attention with inline FP8/NVFP4 dequantization (decode split-KV + reduce,
  and varlen prefill).
* :mod:`.dequant` - whole sequences of a layer's cache dequantized into dense K/V (prefill).
* :mod:`.e2m1_bytes` - the data-plane byte of two E2M1 codes (the layout's bit positions).

On CPU tensors the kernels run only under ``TRITON_INTERPRET=1`` (tests); :mod:`vllm_nvfp4.ops`
routes CPU tensors to :mod:`vllm_nvfp4.paged_torch` instead.
"""

"""The calibrated mixed policy of the GPU checks' tiny fp16 Llama: every format pair, K smoothing
and K centering (with the sink key stored uncentered) each on some layer, so one engine
exercises every cache path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_nvfp4.calibration.kv_hooks import KVObserver, kv_cache_quantization
from vllm_nvfp4.calibration.scales import smoothing_factors
from vllm_nvfp4.formats import KVFormat, fp8_scale_from_amax, nvfp4_global_scale
from vllm_nvfp4.policy import KVPolicy

POLICY = "0:fp8,1:k=fp8,v=nvfp4,2:k=nvfp4,v=fp8,3-6:nvfp4,7:fp8"
#: layers whose keys are stored smoothed (K / lam, queries x lam; one NVFP4, one FP8 layer)
SMOOTHED_LAYERS = (2, 7)
#: layers whose keys are stored centered (K - mu, mu = the calibration mean; FP8 K, NVFP4 K),
#: each with its sink key (position 0) stored uncentered (``k_sink_uncentered``)
CENTERED_LAYERS = (1, 3)


def calibrated_policy(model_dir: Path, device: str) -> dict[str, Any]:
    """The JSON policy of :data:`POLICY`'s formats for the 8-layer model in ``model_dir``, scales
    from the K/V amax (x1.25) of one random 512-token prompt run in fp16 on ``device``, K
    smoothing (exponent 0.5) on :data:`SMOOTHED_LAYERS`, K centering and the sink key uncentered
    on :data:`CENTERED_LAYERS`."""
    import torch
    from transformers import AutoModelForCausalLM

    policy = KVPolicy.from_compact(POLICY, 8, source="check_policy")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16).to(device).eval()
    observer = KVObserver(8)
    ids = torch.randint(5, 4096, (1, 512), generator=torch.Generator().manual_seed(0)).to(device)
    with kv_cache_quantization(model, None, observer), torch.no_grad():
        model(ids)
    for i, row in enumerate(policy.layers):
        changes: dict[str, Any] = {}
        k_amax = observer.k_amax[i]
        if i in SMOOTHED_LAYERS:
            lam = smoothing_factors(observer.k_channel_amax[i], 0.5)
            k_amax = (observer.k_channel_amax[i] / lam).amax(dim=1)
            changes["k_smooth"] = tuple(tuple(float(x) for x in row) for row in lam)
        if i in CENTERED_LAYERS:
            k_amax = observer.k_centered_channel_amax(i).amax(dim=1)
            changes["k_center"] = tuple(tuple(float(x) for x in row) for row in observer.k_channel_mean(i))
            changes["k_sink_uncentered"] = True
        for kv, amax in (("k", k_amax), ("v", observer.v_amax[i])):
            amax = amax.float().cpu() * 1.25
            if row.format_of(kv) is KVFormat.FP8:
                changes[f"{kv}_scale"] = float(fp8_scale_from_amax(amax.max()))
            else:
                changes[f"{kv}_global_scale"] = tuple(float(s) for s in nvfp4_global_scale(amax))
        policy = policy.with_layer(i, **changes)
    del model
    return policy.to_dict()

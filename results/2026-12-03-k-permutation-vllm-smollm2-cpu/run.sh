#!/usr/bin/env bash
# the same 0.62x mix through vLLM without and with the K channel permutation (see README.md)
set -euo pipefail
A=${A:-~/.cache/vllm-nvfp4/assets}; R=$(dirname "${BASH_SOURCE[0]}")
F="0-1:nvfp4,2:k=fp8,v=nvfp4,3-13:nvfp4,14-15:k=fp8,v=nvfp4,16:nvfp4,17:k=fp8,v=nvfp4,18:nvfp4,19:k=fp8,v=nvfp4,20-21:nvfp4,22:k=fp8,v=nvfp4,23-24:nvfp4,25:k=fp8,v=nvfp4,26-29:nvfp4"
for perm in plain k_permute; do
  flags="--k-center"; [ $perm = k_permute ] && flags="--k-center --k-permute"
  vllm-nvfp4 calibrate $A/SmolLM2-135M-Instruct --data $A/brown/brown.txt --policy "$F" \
      --window 1024 --windows 1 --dtype float32 --device cpu $flags --out $R/mix_$perm.json --force
  VLLM_CPU_KVCACHE_SPACE=1 python scripts/eval_accuracy.py $A/SmolLM2-135M-Instruct --text $A/brown/brown.txt \
      --policy $R/mix_$perm.json --configs auto,mixed_calibrated,nvfp4_all,ours_fp8 --dtype float32 \
      --out $R/eval_$perm --nll-windows 4 --window-tokens 1024 --passkey-context 1024 --passkey-trials 10
done

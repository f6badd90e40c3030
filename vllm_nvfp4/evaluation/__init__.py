"""Accuracy evaluation: through vLLM (:mod:`.accuracy`, ``scripts/eval_accuracy.py``: KV configurations,
teacher-forced log-prob comparison, passkey retrieval, GSM8K through the lm-eval CLI, reports) and in transformers
(``scripts/kv_rounding_sensitivity.py``: how a quantized cache amplifies last-bit K/V changes)."""

"""Accuracy evaluation through vLLM (``scripts/eval_accuracy.py``): KV configurations, teacher-forced
log-prob comparison, passkey retrieval, GSM8K through the lm-eval CLI, reports."""

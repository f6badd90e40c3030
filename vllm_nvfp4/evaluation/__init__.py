"""Accuracy evaluation through vLLM (:mod:`.accuracy`, ``scripts/eval_accuracy.py``): KV configurations,
teacher-forced log-prob comparison, passkey retrieval, GSM8K through the lm-eval CLI, reports."""

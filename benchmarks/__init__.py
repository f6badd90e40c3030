"""Benchmarks of vllm-nvfp4 (run from the repository root, e.g. ``python -m benchmarks.e2e``)."""

"""Random-weight and weight-less model checkpoints for tests, demos and benchmarks.

Not used by serving: :mod:`.models` writes Hugging Face model directories that vLLM loads like
downloaded models, :mod:`.tokenizers` the local tokenizers they use.
"""

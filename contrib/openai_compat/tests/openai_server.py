"""vLLM's OpenAI-compatible server on loopback, serving a model folder, for the tests.

Started as ``python -m vllm.entrypoints.openai.api_server`` (the CPU build's ``vllm`` script
does not run). Flags that make it a server this plugin can use as a policy:
``--logprobs-mode processed_logprobs`` (logprobs of the temperature-scaled distribution,
as forgerl's contract asks; vLLM's default is the raw logits'), fp32, and on the CPU build
whole-prompt prefill (a seeded request prefilled in chunks kills its CPU engine).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

SERVED_NAME = "tiny-policy"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def vllm_openai_server(model_dir: Path, log: Path, wait_s: float) -> Iterator[str]:
    """Yield the server's API root (``http://127.0.0.1:PORT/v1``) once it answers ``/health``
    (at most ``wait_s`` seconds); its whole process group is stopped at the end."""
    port = _free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
        "--kv-cache-memory-bytes", str(256 * 2**20),
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "1024",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM did not answer /health within {wait_s:g} s: {log.read_text()[-2000:]}"
                )
            time.sleep(0.5)  # polling a server that is starting, bounded by the deadline above
        yield url + "/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)

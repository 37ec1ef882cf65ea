"""Run the plugin's tests from a checkout without installing it (src layout), and the
OpenAI-compatible server they talk to."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SERVER_WAIT_S = 420.0  # a vLLM server's start-up on a busy two-core machine


class Served(NamedTuple):
    base_url: str  # the API root: http://127.0.0.1:PORT/v1
    api_key: str | None  # the bearer token it wants, if any
    model_dir: Path  # the weights it serves


@pytest.fixture(scope="module")
def openai_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """vLLM's OpenAI server for the kit's tiny model at hidden size 128 (vLLM's CPU
    attention needs heads at least 32 wide). Within forgerl's own test session, the vLLM
    server its tests share (the ``shared_vllm`` fixture of forgerl's tests/helpers/
    shared_vllm.py: one start fewer); elsewhere, one started here for the module."""
    try:
        shared = request.getfixturevalue("shared_vllm")
    except pytest.FixtureLookupError:
        shared = None
    if shared is not None:
        endpoint = shared.openai_endpoint()
        yield Served(endpoint.base_url, endpoint.api_key, endpoint.model_dir)
        return
    from openai_server import vllm_openai_server

    from forgerl.testing.generator_support import tiny_model
    from forgerl.testing.timing import scaled

    model = tiny_model(tmp_path_factory.mktemp("model"), {"hidden_size": 128}, ("forgerl_openai_compat.plugin",))
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with vllm_openai_server(model, log, scaled(SERVER_WAIT_S)) as base_url:
        yield Served(base_url, None, model)

"""One real vLLM server for the tiny model, shared by every test of a session that only
needs one serving it (a vLLM CPU server takes 30-60 s to start here).

A pytest plugin (the repository's root conftest.py loads it), so that contrib's tests see
its ``shared_vllm`` fixture too. The server is the ``vllm`` generator's own: its role
started by the local scheduler in a run directory, as ``forge run`` starts it, for the
tiny model at hidden size 128 (vLLM's CPU attention needs heads at least 32 wide). So:

- the ``vllm`` Generator kit (tests/conformance/test_generator_kit.py) runs on
  :meth:`SharedVLLM.site`, building its generators in that run;
- OpenAI-compatible clients (contrib's ``openai`` generator: its kit, and forge runs in
  tests/integration/test_contrib_openai.py) take :meth:`SharedVLLM.openai_endpoint`: the
  API root, the server's API key and the model folder it serves;
- tests of the server itself (tests/integration/test_vllm_security.py: every route wants
  the run's key) take :meth:`SharedVLLM.endpoint`, the role's endpoint file.

The kit's weight updates change the served weights; an endpoint is handed out only once
the server is back on the model folder's (version 0), which the ``vllm`` generator
reloads into it (tests/integration/test_shared_vllm.py checks that).

A test that needs a server of its own (one it kills, a replica count, other options)
starts its own, as before. Modules that request ``shared_vllm`` run last in the session,
together, so that the server (about 3 GB) is up only for them and the few tests that ask
for it at run time (contrib's kit, through ``request.getfixturevalue``); it stops when
the session ends.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .timing import scaled, wait_until

FIXTURE = "shared_vllm"
#: The tiny model's options: vLLM's CPU attention kernels need heads at least 32 wide.
TINY_MODEL_OPTIONS = {"hidden_size": 128}
SERVER_WAIT_S = 420.0  # start-up (and resync) of a vLLM server on a busy two-core machine
#: The ``vllm`` generator's options for the shared server (the vllm kit's).
VLLM_OPTIONS = {
    "replicas": 1,
    "kv_cache_gb": 0.25,
    "health_interval": 0.5,
    # Patience, not what is tested: scaled, so a loaded machine is no "hang".
    "liveness_timeout": scaled(60),
    "startup_timeout": scaled(SERVER_WAIT_S),
}


@dataclass(frozen=True)
class OpenAIEndpoint:
    """What an OpenAI-compatible client needs: ``base_url`` (``http://127.0.0.1:PORT/v1``),
    the bearer ``api_key``, and the ``model_dir`` served (the same weights)."""

    base_url: str
    api_key: str
    model_dir: Path


class SharedVLLM:
    """The session's vLLM server, started on first use (see the module's docstring)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._stack: contextlib.ExitStack | None = None
        self._site: Any = None

    def site(self) -> Any:
        """The ``vllm`` generator's run (a forgerl.testing GeneratorSite), its server up."""
        if self._site is None:
            from forgerl.testing.generator_support import open_site, tiny_model

            if importlib.util.find_spec("vllm") is None:
                pytest.skip("vllm is not installed (pip install 'forgerl[vllm]')")
            model = tiny_model(self._tmp.mktemp("shared-vllm-model"), TINY_MODEL_OPTIONS)
            stack = contextlib.ExitStack()
            try:
                self._site = stack.enter_context(
                    open_site("vllm", VLLM_OPTIONS, (), model, self._tmp.mktemp("shared-vllm-run"))
                )
            except BaseException:
                stack.close()
                raise
            self._stack = stack
        return self._site

    def endpoint(self) -> dict[str, Any]:
        """The replica's endpoint file (host, port, api_key, model: the served name, pids),
        once the server serves the model folder's weights (version 0) again."""
        from forgerl_plugins.generators.common.replica import read_endpoint
        from forgerl_plugins.generators.vllm.server import endpoint_file

        site = self.site()
        # A new vllm generator brings every replica back to version 0 (the folder's
        # weights) if a test left other weights in it; wait until each says so.
        with site.open() as opened:
            gen = opened.generator
            wait_until(
                lambda: all(r["version"] == 0 and r["serving"] for r in gen.replica_info()),
                120,
                "the shared vLLM server to serve the model folder's weights again",
            )
        data = read_endpoint(endpoint_file(site.run_dir, 0))
        assert data is not None and data.get("api_key"), f"no endpoint file in {site.run_dir}"
        return data

    def openai_endpoint(self) -> OpenAIEndpoint:
        """The server's OpenAI API, serving the model folder's weights (version 0)."""
        from forgerl_plugins.generators.common.replica import url_host

        data = self.endpoint()
        return OpenAIEndpoint(
            f"http://{url_host(data['host'])}:{data['port']}/v1", str(data["api_key"]), self.site().model_dir
        )

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack = self._site = None


@pytest.fixture(scope="session")
def shared_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedVLLM]:
    """The session's shared vLLM server (started by the first test that asks it for
    something; skipped where vLLM is not installed)."""
    shared = SharedVLLM(tmp_path_factory)
    try:
        yield shared
    finally:
        shared.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with a test that requests ``shared_vllm`` run last, in their order."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    users = {module(i) for i in items if FIXTURE in getattr(i, "fixturenames", ())}
    if users:
        items[:] = [i for i in items if module(i) not in users] + [i for i in items if module(i) in users]

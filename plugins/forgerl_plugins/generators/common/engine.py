"""What a server generator's pool (:mod:`.pool`) needs of one engine (vllm, sglang).

An engine adapter knows how to reach one of its replicas and what to say to it; the pool,
its watcher (:mod:`.watch`) and its updater (:mod:`.updates`) decide when. Every method
runs on the pool's event loop and is given the :class:`~.replica.Replica` to speak to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.types import Completion, GenerationRequest

    from .client import HealthClient
    from .replica import Replica


class Engine(Protocol):
    role: str  # "vllm": the replicas' role (their endpoint and log files), who speaks in logs
    label: str  # "vLLM": in errors

    @property
    def client(self) -> HealthClient:
        """Made by :meth:`connect`; the pool closes it, the watcher checks health with it."""

    def connect(self, connections: int) -> None:
        """Make ``client`` (on the loop that uses it), pooling ``connections``."""

    async def introduce(self, r: Replica) -> None:
        """What to ask a replica that answers for the first time (or again): its model
        info, the weights it holds (``r.version``, ``r.probed``)."""

    async def send(self, r: Replica, request: GenerationRequest, version: int) -> list[Completion]:
        """``request``'s completions from ``r``, labelled ``version``. Raises
        :class:`~.pool.ReplicaFailed` or httpx's errors where another replica should be asked."""

    async def pause(self, r: Replica, policy: str) -> None:
        """Pause ``r`` in the engine's mode for update ``policy`` (``wait``: in place,
        our requests drained; ``abort``: what runs is aborted; ``keep``: what runs stops
        where it is, sampling nothing, to go on with the new weights after the resume)."""

    async def sampled_so_far(self, r: Replica, keys: list[str]) -> dict[str, dict[int, int]]:
        """While ``r`` is paused in place: how many tokens each of our requests ``keys``
        (:attr:`.replica.Replica.flights`) has sampled, per choice index; a request (or
        choice) not started yet may be left out (:mod:`.crossings`). An engine whose
        answers say which weights sampled each token (SGLang) returns ``{}``."""

    async def stage(self, r: Replica, version: int) -> None:
        """Before the pause, while ``r`` still generates: have ``r`` read ``version`` from
        the transport ahead of :meth:`load`, and return once it has it (an engine that
        cannot: at once). Never fatal: a stage that fails leaves the load to read itself."""

    async def load(self, r: Replica, version: int) -> None:
        """Load ``version`` into paused ``r`` (0: the model folder's). Raises TransportError
        when it could not, setting ``r.version = None`` where it may have loaded part of it."""

    async def resume(self, r: Replica, policy: str) -> None:
        """Drop what ``r`` cached under the old weights (what ``policy`` allows: under
        ``keep`` the frozen requests keep their own) and let it run again."""

    def close(self) -> None:
        """Release what the adapter holds beside its client (which the pool closes)."""

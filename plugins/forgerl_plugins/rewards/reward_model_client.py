"""How the ``reward_model`` reward scores through a vLLM pooling server.

The reward renders and tokenizes each sample itself (the same text and the same
left-truncated token ids as in-process scoring), and POSTs a batch of token-id lists to
the server's ``/classify`` with ``use_activation: false``: the answer holds each sample's
raw logits, to which the reward applies its own activation. Both ways of scoring thus
share everything but the forward pass.

The server is the run's own (``server: vllm``: its launcher, :mod:`.reward_server`,
publishes host, port and key in an endpoint file under the run directory, found through
``$FORGE_RUN_DIR``) or one the user runs (``url``, its key from ``auth_env``). Finding it,
waiting for it and following its restarts is the served roles' shared client's
(:class:`forgerl_plugins.serving.role_client.RoleEndpoint`). Requests are blocking and
run on the reward's worker thread. When the run's server fails a request, that request's
samples fail and later samples wait for the server to be back in service
(:meth:`ServedClassifier.wait_in_service`, awaited before a sample's
``loop.reward_timeout`` starts), as long as a restart may take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forgerl.errors import RewardError
from forgerl_plugins.serving.role_client import RoleEndpoint
from forgerl_plugins.serving.service import restart_allowance

from .reward_server import ENDPOINT_DIR, LIVENESS_TIMEOUT, SERVED_MODEL_NAME, role_name

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.rewards.reward_model_options import Options

WHO, WHAT = "reward_model", "the reward model server"


class ServedClassifier:
    """``logits(batch of token-id lists) -> list of logit lists`` through ``/classify``."""

    def __init__(self, options: Options, *, wait: float | None = None) -> None:
        self.options = options
        timeout = options.request_timeout
        if options.url is not None:
            self.server = RoleEndpoint.at_url(
                options.url, auth_env=options.auth_env, who=WHO, what=WHAT, error=RewardError, timeout=timeout
            )
        else:
            wait = options.startup_timeout if wait is None else wait
            allowance = restart_allowance(startup_timeout=options.startup_timeout, liveness_timeout=LIVENESS_TIMEOUT)
            self.server = RoleEndpoint.of_role(
                role_name(options), ENDPOINT_DIR, wait=wait, allowance=allowance,
                who=WHO, what=WHAT, error=RewardError, timeout=timeout,
            )  # fmt: skip
            self.server.model = self.server.model or SERVED_MODEL_NAME

    def in_service(self) -> bool:
        """Whether samples may go to the server now (:meth:`RoleEndpoint.in_service`)."""
        return self.server.in_service()

    async def wait_in_service(self) -> None:
        """Return once the server may take samples; RewardError when it stayed out of
        service for as long as a restart may take."""
        await self.server.wait_in_service()

    def logits(self, batch: list[list[int]]) -> list[list[float]]:
        """Raw logits of each token-id list (blocking)."""
        body: dict[str, Any] = {"input": batch, "use_activation": False}
        if self.server.model is not None:
            body["model"] = self.server.model
        answer = self.server.post("/classify", body)
        data = sorted(answer.get("data") or [], key=lambda d: d.get("index", 0))
        if len(data) != len(batch):
            raise RewardError(
                f"reward_model: /classify answered {len(data)} results for {len(batch)} samples"
            )
        return [[float(v) for v in d["probs"]] for d in data]

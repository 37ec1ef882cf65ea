"""The public path of black-box agents as environments (docs/environments.md).

Kept for plugins and embedding code: the names live in :mod:`forgerl.rollouts.agent_runner`, which
forgerl itself imports.
"""

from forgerl.rollouts.agent_runner import AgentEnvironment, AgentEpisode

__all__ = ["AgentEnvironment", "AgentEpisode"]

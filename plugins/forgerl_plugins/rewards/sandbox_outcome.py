"""How a sandboxed program ended: what :class:`~forgerl_plugins.rewards.sandbox.Sandbox`
returns, and what a :class:`~forgerl_plugins.rewards.conversation.Conversation` holds once
its program is over (a module of its own, so that neither imports the other for it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOutcome:
    """How one program ended. ``setup_error``: the sandbox itself failed (not the program)."""

    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float
    setup_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.setup_error is None

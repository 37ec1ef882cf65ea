"""Secrets never land in sample records: the run's keys (the agent endpoint's, a generator
server's), a remote reward's token, a tracker's token. A model can be made to echo what it
sees (an agent reads its key; a prompt may quote an environment), so every text of a
record is scrubbed before it is written."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

#: Environment variables whose values are secrets by their name (WANDB_API_KEY,
#: MLFLOW_TRACKING_TOKEN, HF_TOKEN, a remote reward's ``auth_env``, ...).
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$|^(AWS_|AZURE_).*", re.IGNORECASE)
#: Shorter values are not treated as secrets (a key of "1" would blank every digit).
MIN_SECRET_LEN = 8
REDACTED = "[redacted]"


class Redactor:
    """Replaces every known secret in text with ``[redacted]``. ``sources`` are called at
    each :meth:`refresh` (a key may exist only once its server started)."""

    def __init__(self, secrets: Iterable[str] = (), sources: Iterable[Callable[[], Iterable[str]]] = (),
                 environ: bool = True):
        self._fixed = {s for s in secrets if s and len(s) >= MIN_SECRET_LEN}
        self._sources = list(sources)
        self._environ = environ
        self._pattern: re.Pattern[str] | None = None
        self._known: frozenset[str] = frozenset()
        self.refresh()

    def refresh(self) -> None:
        """Collect the secrets again (environment and sources)."""
        found = set(self._fixed)
        if self._environ:
            found.update(v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_LEN)
        for source in self._sources:
            found.update(s for s in source() if s and len(s) >= MIN_SECRET_LEN)
        if found != self._known:
            self._known = frozenset(found)
            # Longest first: a secret containing another is replaced whole.
            ordered = sorted(found, key=len, reverse=True)
            self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def text(self, value: str) -> str:
        if self._pattern is None or not value:
            return value
        return self._pattern.sub(REDACTED, value)

    def value(self, value: Any) -> Any:
        """``value`` with every string in it redacted (dicts, lists; other values as they are)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k: self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        return value


def reward_secrets(config: Any) -> list[str]:
    """The tokens the run's rewards read from the environment (an ``auth_env`` option, as
    the remote reward has), whatever the variable's name."""
    found = []
    for choice in getattr(config, "rewards", ()):
        options = choice.options
        name = options.get("auth_env") if isinstance(options, dict) else getattr(options, "auth_env", None)
        if isinstance(name, str) and os.environ.get(name):
            found.append(os.environ[name])
    return found


#: Files of a run directory that hold the run's keys (written by plugins: the transports'
#: ``transport.secret``, the server generators' ``generators/<role>-<replica>.json``).
RUN_SECRET_FILE = "transport.secret"
RUN_ENDPOINTS_DIR = "generators"


def run_keys(run_dir: Path | str) -> list[str]:
    """The keys a run keeps in its directory: the transport secret and each server's API key."""
    run_dir = Path(run_dir)
    found = []
    try:
        found.append((run_dir / RUN_SECRET_FILE).read_text().strip())
    except (OSError, UnicodeDecodeError):
        pass
    try:
        described = sorted((run_dir / RUN_ENDPOINTS_DIR).glob("*.json"))
    except OSError:
        described = []
    for path in described:
        try:
            key = json.loads(path.read_text()).get("api_key")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(key, str):
            found.append(key)
    return found

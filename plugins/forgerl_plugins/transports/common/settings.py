"""What a transport object derives from its options and its run, for the transports that
authenticate with the run's secret (``nccl``, ``rdma``, ``delta``): how long a send or a
receive may take, and the secret itself."""

from __future__ import annotations

import threading
from typing import Any

from forgerl_plugins.transports.common import auth

#: Seconds a send or receive may take when neither the options nor the run say.
DEFAULT_TIMEOUT = 120.0


class RunSettings:
    """Mixed into a transport object that sets ``options`` (with ``timeout`` and
    ``secret_file``), ``ctx`` (the run context or None), ``_secret = None`` and ``_lock``
    (a ``threading.Lock``) in its constructor."""

    options: Any
    ctx: Any
    _secret: str | None
    _lock: threading.Lock

    def default_timeout(self) -> float:
        """The transport's own ``timeout`` option, else the run's ``transport.timeout``."""
        if self.options.timeout is not None:
            return float(self.options.timeout)
        if self.ctx is not None:
            return float(self.ctx.transport_timeout)
        return DEFAULT_TIMEOUT

    def secret(self) -> str:
        """``options.secret_file``'s, else the run's (from the run directory), else this
        object's own (no run: it reaches receivers through ``receiver_spec()``)."""
        with self._lock:
            if self._secret is None:
                if self.options.secret_file:
                    self._secret = auth.secret_from_file(self.options.secret_file)
                elif self.ctx is not None:
                    self._secret = auth.run_secret(self.ctx.run_dir)
                else:
                    self._secret = auth.new_secret()
            return self._secret

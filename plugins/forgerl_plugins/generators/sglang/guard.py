"""Runs an SGLang server with every path behind the run's key.

SGLang's own ``--api-key`` check lets ``/health``, ``/health_generate``, ``/metrics`` and
CORS preflights through, takes the key only on its command line (which ``ps`` shows every
user), and SGLang has no way to add a middleware. So the launcher does not start
``python -m sglang.launch_server ARGS`` but::

    python -m forgerl_plugins.generators.sglang.guard -m sglang.launch_server ARGS

with the key in ``$FORGE_SGLANG_KEY``. In the same process, before the server starts, this
module:

* takes the key out of the environment (SGLang's subprocesses do not inherit it);
* makes uvicorn, which serves SGLang's app, put
  :class:`~forgerl_plugins.serving.require_key.RequireKey` in front of the app it
  loads: the outermost layer, so every request is checked before routing;
* refuses a uvicorn with several worker processes or reload (those load the app in
  processes this guard never reaches; SGLang itself refuses an API key with several
  tokenizer workers);
* runs the program as ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) would, with
  ``--api-key=KEY`` added to its own ``sys.argv`` only: SGLang's own check agrees, its own
  requests to itself carry the key, and the kernel's copy of the command line never holds it.

The program must serve its app with uvicorn, as SGLang (and the tests' SGLang double) do;
the launcher checks that a request without the key is refused before it uses the server.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

from forgerl_plugins.serving.require_key import RequireKey

#: The variable the launcher puts the key in.
KEY_ENV = "FORGE_SGLANG_KEY"
MODULE = "forgerl_plugins.generators.sglang.guard"


def guard_uvicorn(key: str) -> None:
    """Every app uvicorn loads from now on in this process is wrapped in :class:`RequireKey`."""
    from uvicorn.config import Config

    if getattr(Config, "_forge_guarded", False):
        return
    load, init = Config.load, Config.__init__

    def guarded_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if (self.workers or 1) > 1 or self.reload:
            raise RuntimeError(
                f"{MODULE}: uvicorn with {self.workers} workers or reload serves from processes this guard "
                "does not reach; run the server in one process (SGLang: tokenizer_worker_num 1)"
            )

    def guarded_load(self: Any) -> None:
        load(self)
        self.loaded_app = RequireKey(self.loaded_app, key)

    Config.__init__ = guarded_init  # type: ignore[method-assign]
    Config.load = guarded_load  # type: ignore[method-assign]
    Config._forge_guarded = True  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        sys.exit(f"{MODULE}: no key in ${KEY_ENV}; refusing to serve without it")
    if not args or (args[0] == "-m" and len(args) < 2):
        sys.exit(f"usage: python -m {MODULE} (-m MODULE | SCRIPT) [ARGS...], the key in ${KEY_ENV}")
    guard_uvicorn(key)
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest, f"--api-key={key}"]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = args[0], args[1:]
        sys.argv = [script, *rest, f"--api-key={key}"]
        # As `python SCRIPT` would: the script's folder first on the path, not the working directory.
        sys.path[0] = str(Path(script).resolve().parent)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

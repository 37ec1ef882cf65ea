"""Before ``forge run`` starts anything: ``engine_args`` are arguments vLLM's server takes.

A key vLLM does not know (``max_num_seq``), or a value it cannot parse, otherwise ends every
replica at start-up and the run after its restarts. The check asks vLLM's own argument
parser, the one its OpenAI server builds, so it follows the installed version. Building
that parser imports vLLM (seconds), so it runs only when ``engine_args`` is not empty.
"""

from __future__ import annotations

import difflib
import logging
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError
from forgerl_plugins.serving import launcher

if TYPE_CHECKING:  # pragma: no cover
    import argparse

    from .options import Options


class _ParseError(Exception):
    pass


def preflight(options: Options) -> None:
    if not options.engine_args:
        return
    parser = _server_parser()
    if parser is None:
        return  # a vLLM whose parser lives elsewhere: its servers say what they refuse
    known = [flag for flag in parser._option_string_actions if flag.startswith("--")]
    for key, value in options.engine_args.items():
        flag = launcher.cli_flags({key: value}, negative=True)[:1]  # none for a null value
        if flag and flag[0] not in known:
            raise ConfigError(_unknown(key, flag[0], known))
    flags = launcher.cli_flags(options.engine_args, negative=True)
    try:
        parser.parse_args(flags)
    except _ParseError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else "refused"
        raise ConfigError(f"generator.options.engine_args: vLLM {_version()} refuses them: {text}") from None


def _unknown(key: str, flag: str, known: list[str]) -> str:
    where = f"generator.options.engine_args: {key!r}"
    if flag.startswith("--no-") and "--" + flag[5:] in known:
        return f"{where} takes a value, not false (vLLM {_version()} has no {flag}); remove it for vLLM's default"
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
    hint = f"; did you mean {close[0][2:].replace('-', '_')!r}?" if close else ""
    return f"{where} is not an argument of vLLM {_version()}'s server ({flag}){hint} See `vllm serve --help`"


def _server_parser() -> argparse.ArgumentParser | None:
    # Importing vLLM logs warnings about this machine ("Triton ... Disabling Triton") through
    # logging's last resort: a second stderr line under a one-line error. Its servers log them.
    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level
    vllm_log.setLevel(logging.ERROR)
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser: Any = make_arg_parser(FlexibleArgumentParser())
    except Exception:  # noqa: BLE001 - another vLLM layout, or one failing to import: its servers will say
        return None
    finally:
        vllm_log.setLevel(level)

    def error(message: str) -> Any:  # argparse would print usage and exit
        raise _ParseError(message)

    parser.error = error
    return parser


def _version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "(unknown version)"))

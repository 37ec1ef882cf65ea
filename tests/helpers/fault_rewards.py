"""Rewards that misbehave, registered as a plugin (``FORGE_PLUGINS=tests.helpers.fault_rewards``
or ``build_registry(plugins=["tests.helpers.fault_rewards"])``), so that reward worker
processes build them by name like any backend.

- ``fault_spin``: loops forever in Python and ignores SIGTERM.
- ``fault_raise``: raises on every sample.
- ``fault_exit``: ends its process with ``os._exit(3)``.
- ``fault_segv``: crashes its process with a segmentation fault.
- ``fault_nan``: returns NaN.
- ``fault_pid``: 1.0, with the scoring process's pid as component ``pid`` (which worker ran it);
  option ``seconds`` sleeps first.
- ``fault_trigger``: misbehaves (``how``: spin, exit) only when the completion text
  contains ``trigger``; otherwise 1.0 with ``pid``.
"""

from __future__ import annotations

import os
import signal
import time

from pydantic import BaseModel, ConfigDict

from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Reward
from forgerl.types import RewardResult


def _spin() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        pass


class Spin(Reward):
    name = "fault_spin"

    def __init__(self, options):
        pass

    def score(self, sample):
        _spin()


class Raise(Reward):
    name = "fault_raise"

    def __init__(self, options):
        pass

    def score(self, sample):
        raise RuntimeError("this reward always raises")


class Exit(Reward):
    name = "fault_exit"

    def __init__(self, options):
        pass

    def score(self, sample):
        os._exit(3)


class Segfault(Reward):
    name = "fault_segv"

    def __init__(self, options):
        pass

    def score(self, sample):
        import ctypes

        ctypes.string_at(0)


class NaN(Reward):
    name = "fault_nan"

    def __init__(self, options):
        pass

    def score(self, sample):
        return float("nan")


class Pid(Reward):
    name = "fault_pid"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        seconds: float = 0.0

    def __init__(self, options: Options):
        self.seconds = options.seconds

    def score(self, sample):
        if self.seconds:
            time.sleep(self.seconds)
        return RewardResult(1.0, {"pid": float(os.getpid())})


class Trigger(Reward):
    name = "fault_trigger"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        trigger: str = "HANG"
        how: str = "spin"

    def __init__(self, options: Options):
        self.options = options

    def score(self, sample):
        if self.options.trigger in sample.completion_text:
            if self.options.how == "exit":
                os._exit(3)
            _spin()
        return RewardResult(1.0, {"pid": float(os.getpid())})


@hookimpl
def forge_rewards():
    return [Spin, Raise, Exit, Segfault, NaN, Pid, Trigger]

"""Built-in environments: ``calculator`` (arithmetic with a ``calculate`` tool),
``python`` (arithmetic with a sandboxed ``run_python`` tool), ``guess`` (a
number-guessing game with higher/lower feedback), ``agent`` (an agent program that
calls the run's OpenAI-compatible endpoint) and ``verifiers`` (an environment written for
the verifiers library, through that endpoint)."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_environments():
    return [
        "forgerl_plugins.environments.calculator:CalculatorEnvironment",
        "forgerl_plugins.environments.guess:GuessEnvironment",
        "forgerl_plugins.environments.python:PythonEnvironment",
        "forgerl_plugins.environments.agent:AgentProgram",
        "forgerl_plugins.environments.verifiers_env:VerifiersEnvironment",
    ]

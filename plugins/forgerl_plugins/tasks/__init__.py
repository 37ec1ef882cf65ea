"""Built-in tasks: ``arithmetic`` (generated problems), ``file`` (JSONL/Parquet) and
``code_basics`` (a handful of very easy Python functions, for the ``code`` reward)."""

from __future__ import annotations

from forgerl.backends import TaskBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_tasks():
    return [
        TaskBackend(
            name="arithmetic",
            factory="forgerl_plugins.tasks.arithmetic:ArithmeticTask",
            options="forgerl_plugins.tasks.options:ArithmeticOptions",
            description="generated integer problems, answer in a tag",
        ),
        TaskBackend(
            name="file",
            factory="forgerl_plugins.tasks.file:FileTask",
            options="forgerl_plugins.tasks.options:FileTaskOptions",
            description="prompts and answers from a JSONL or Parquet file",
            preflight="forgerl_plugins.tasks.file:preflight",
        ),
        TaskBackend(
            name="code_basics",
            factory="forgerl_plugins.tasks.code_basics:CodeBasicsTask",
            options="forgerl_plugins.tasks.options:CodeBasicsOptions",
            description="very easy Python functions with assert tests (for the code reward)",
        ),
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("ArithmeticOptions", "FileTaskOptions", "CodeBasicsOptions"))

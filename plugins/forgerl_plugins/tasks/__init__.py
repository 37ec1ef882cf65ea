"""Built-in tasks: ``arithmetic`` (generated problems), ``file`` (JSONL/Parquet),
``dataset`` (files, folders and cached Hugging Face datasets with a column mapping),
``mixture`` (several datasets with weights, each with its own rewards),
``code_basics`` (a handful of very easy Python functions, for the ``code`` reward) and
``verifiers`` (the dataset of an environment written for the verifiers library)."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_tasks():
    return [
        "forgerl_plugins.tasks.arithmetic:ArithmeticTask",
        "forgerl_plugins.tasks.file:FileTask",
        "forgerl_plugins.tasks.dataset:DatasetTask",
        "forgerl_plugins.tasks.mixture:MixtureTask",
        "forgerl_plugins.tasks.code_basics:CodeBasicsTask",
        "forgerl_plugins.tasks.verifiers_task:VerifiersTask",
    ]


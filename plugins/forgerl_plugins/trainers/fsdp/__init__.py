"""``fsdp``: torch FSDP2 (``fully_shard``) on 1..N ranks; gloo on CPU, NCCL on GPU.

Also ``forge export``, which writes a run's policy at a checkpoint of this trainer (or of
``torchtitan``, which converts its own names) as a Hugging Face model folder
(:mod:`..shared.export`)."""

from __future__ import annotations

from typing import Any

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_trainers():
    return ["forgerl_plugins.trainers.fsdp.trainer:FSDPTrainer"]


@hookimpl
def forge_commands(cli: Any) -> None:
    import click

    @cli.command("export")
    @click.argument("run_dir", type=click.Path(file_okay=False))
    @click.option("--output", "-o", required=True, type=click.Path(), help="Folder to write (new or empty).")
    @click.option("--step", type=click.IntRange(min=0), help="The checkpoint of this step (default: the newest).")
    @click.option("--adapter-only", is_flag=True,
                  help="LoRA runs: write the PEFT adapter folder instead of the merged model.")
    def export(run_dir: str, output: str, step: int | None, adapter_only: bool) -> None:
        """Write the policy of a run's checkpoint as a Hugging Face model folder
        (config.json, safetensors, tokenizer); a LoRA adapter is merged into the weights."""
        from forgerl_plugins.trainers.shared.export import export_run  # torch only here

        click.echo(str(export_run(run_dir, output, step, adapter_only)))

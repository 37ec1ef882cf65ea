"""``forge export``: a run's policy at one checkpoint as a Hugging Face model folder.

The trainer state of a checkpoint is a DCP folder (:meth:`.base.ShardedTrainer.save`)
holding the trainable parameters under the names ``get_state_dict`` gives them: every
weight of the model for a full-weight run, only the adapter's A and B matrices for a
LoRA run (the frozen base weights are the model folder's). It is read here in one
process, without a process group (DCP loads with ``no_dist`` when none is running),
through the same safe reader as a resume (:mod:`.checkpointing`: nothing is unpickled
but plain data). The run's trainer class gives the tensors Hugging Face names
(:meth:`.base.ShardedTrainer.checkpoint_as_hf`: ``fsdp``'s have them already,
``torchtitan`` converts its own through TorchTitan's state-dict adapter), so what
follows is the same for every trainer.

* Full weights: the base model folder gives the architecture, config and tokenizer; the
  checkpoint's tensors replace every weight, and ``save_pretrained`` writes the folder.
* LoRA: each targeted layer's weight becomes ``W + (alpha / rank) * B @ A`` (a plain
  model, no PEFT needed to load it); ``adapter_only`` writes the PEFT adapter folder
  (``adapter_config.json`` + ``adapter_model.safetensors``) instead.

The folder appears whole or not at all: everything is written into a temporary folder
beside the output, renamed into place at the end, and removed on any failure.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from forgerl.errors import CheckpointUnusable, ConfigError, NotSupported

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.adapters import LoraOptions

#: The DCP key prefix of the model's tensors (beside ``optimizer.``).
MODEL_PREFIX = "model."
#: What PEFT puts before a base model's parameter names.
PEFT_PREFIX = "base_model.model."
#: Files of a model folder that ``save_pretrained`` of the model does not write.
_TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model",
                    "*.tiktoken", "chat_template.*", "added_tokens.json")


def export_run(run_dir: str, output: str, step: int | None, adapter_only: bool) -> Path:
    """Write the policy of ``run_dir``'s checkpoint (the newest usable one, or ``step``)
    to ``output``; the folder written. UserError (one line) for anything a user can fix."""
    from forgerl.adapters import LoraOptions
    from forgerl.checkpoints import checkpoint
    from forgerl.configuration.config import read_yaml, validate_config
    from forgerl.registry.plugins import build_registry
    from forgerl.rundirs.runs import CONFIG_FILE, existing_run_dir

    run = existing_run_dir(run_dir)
    config = validate_config(read_yaml(run / CONFIG_FILE), source=str(run / CONFIG_FILE))
    registry = build_registry()
    trainer_class = _sharded_trainer(registry, config.trainer.name, run)
    options = config.trainer.options  # plain data as read (a model once resolved)
    raw_lora = options.get("lora") if isinstance(options, dict) else getattr(options, "lora", None)
    lora = LoraOptions.model_validate(raw_lora) if raw_lora is not None else None
    if adapter_only and lora is None:
        raise ConfigError(f"--adapter-only: {run} trained every weight, not a LoRA adapter; leave --adapter-only out")
    folder = _checkpoint_folder(run, step)
    target = _check_output(Path(output))
    model_path = _model_path(config, registry)

    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()
    except OSError as exc:
        raise ConfigError(f"--output {output}: cannot write beside it ({exc.strerror or exc}); choose another folder") from None
    try:
        state = trainer_class.checkpoint_as_hf(read_model_state(folder / checkpoint.TRAINER), model_path, lora)
        if adapter_only:
            assert lora is not None
            write_adapter(state, lora, tmp)
        else:
            write_model(state, lora, model_path, config.model.dtype, tmp)
        if target.is_dir():
            target.rmdir()  # empty (checked above); rename needs it gone
        os.replace(tmp, target)
    except OSError as exc:
        raise ConfigError(f"--output {output}: writing failed ({exc.strerror or exc}); nothing was kept") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _sharded_trainer(registry: Any, name: str, run: Path) -> Any:
    """The class of the run's trainer, which converts its checkpoints' names
    (:meth:`.base.ShardedTrainer.checkpoint_as_hf`); BackendUnavailable (one line) when
    its packages are not installed here (TorchTitan for a torchtitan run)."""
    from forgerl.errors import BackendUnavailable

    backend = registry.get("trainer", name)
    reason = backend.unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(f"exporting {run} needs the {name} trainer it was trained with, unavailable here: {reason}")
    trainer_class = backend.load_factory()
    # A sharded trainer (.base.ShardedTrainer) converts its checkpoints' names; asked by
    # what it can do, not by its class, which would make this part import its assembler.
    if not (isinstance(trainer_class, type) and callable(getattr(trainer_class, "checkpoint_as_hf", None))):
        raise NotSupported(
            f"forge export reads checkpoints of the fsdp and torchtitan trainers (DCP, written by a sharded "
            f"trainer); {run} was trained with {name!r}"
        )
    return trainer_class


def _checkpoint_folder(run: Path, step: int | None) -> Path:
    """The checkpoint to export, checked as a resume checks it (manifest, every file's
    size, the loop state): the newest usable one, as a resume would take, or ``step``'s."""
    from forgerl.checkpoints import checkpoint

    folders = checkpoint.checkpoints(run)  # newest first
    newest = checkpoint.latest(run) if step is None and folders else None
    if newest is None and step is None:
        raise CheckpointUnusable(f"{run} has no checkpoint (one is written every checkpoint.every steps and at the end)")
    if newest is not None:
        return newest
    wanted = checkpoint.final_dir(run, cast(int, step))
    if wanted not in folders:
        steps = ", ".join(str(int(f.name.split("-")[1])) for f in reversed(folders)) or "none"
        raise CheckpointUnusable(f"{run} has no checkpoint of step {step}; its checkpoints are of steps: {steps}")
    checkpoint.load(wanted)
    return wanted


def _check_output(target: Path) -> Path:
    target = target.expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--output {target} is a file; give a new or empty folder")
    if target.is_dir() and any(target.iterdir()):
        raise ConfigError(f"--output {target} exists and is not empty; give a new or empty folder")
    if not target.parent.is_dir():
        raise ConfigError(f"--output {target}: {target.parent} does not exist; create it or choose another folder")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {target}: {target.parent} is not writable; choose another folder")
    return target


def _model_path(config: Any, registry: Any) -> Path:
    """The run's base model folder, from the local cache only (nothing is downloaded)."""
    from forgerl.models.resolve import resolve_model

    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # a hub model must already be in the hub cache
    try:
        return resolve_model(config.model, registry)
    finally:  # an embedding program keeps its own setting
        if before is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def read_model_state(trainer_dir: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP trainer checkpoint, read in this one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .checkpointing import SafePlanner, SafeReader, one_line_errors, read_metadata_safely

    if not (trainer_dir / ".metadata").is_file():
        raise CheckpointUnusable(f"{trainer_dir} is not a trainer checkpoint (no .metadata)")
    metadata = read_metadata_safely(trainer_dir)
    state: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata):
            state[key[len(MODEL_PREFIX):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not state:
        raise CheckpointUnusable(f"{trainer_dir} holds no model tensors")
    with one_line_errors(trainer_dir, saving=False), warnings.catch_warnings():
        # One process on purpose: DCP warns that it assumes so.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": state}, storage_reader=SafeReader(trainer_dir, metadata), planner=SafePlanner(),
                 no_dist=True)
    return state


def _lora_pairs(state: dict[str, torch.Tensor], lora: LoraOptions) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{base module name: (A, B)}`` of a LoRA checkpoint; CheckpointUnusable when it holds
    anything else or its shapes do not match the run's rank."""
    from .lora import ADAPTER

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.{ADAPTER}.weight"
            if name.startswith(PEFT_PREFIX) and name.endswith(suffix):
                pairs.setdefault(name[len(PEFT_PREFIX):-len(suffix)], {})[part] = tensor
                break
        else:
            raise CheckpointUnusable(f"the LoRA checkpoint holds {name!r}, which is not an adapter matrix")
    out = {}
    for module, ab in sorted(pairs.items()):
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None or a.shape[0] != lora.rank or b.shape[1] != lora.rank:
            raise CheckpointUnusable(
                f"the adapter of {module} is not a rank-{lora.rank} pair of A and B (the run's trainer.options.lora)"
            )
        out[module] = (a, b)
    return out


def write_model(
    state: dict[str, torch.Tensor], lora: LoraOptions | None, model_path: Path, dtype: str, folder: Path
) -> None:
    """The policy as a plain Hugging Face model folder in ``folder``, in ``dtype`` (the
    run's model.dtype, the one the trainer loaded the base model in)."""
    import torch
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the command prints the folder, not loading bars
    try:
        _merge_and_save(state, lora, model_path, getattr(torch, dtype), folder)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    _copy_tokenizer(model_path, folder)


def _merge_and_save(
    state: dict[str, torch.Tensor], lora: LoraOptions | None, model_path: Path, dtype: torch.dtype, folder: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    params = dict(model.named_parameters())  # one name per tensor (a tied head is not listed)
    with torch.no_grad():
        if lora is None:
            missing = sorted(set(params) - set(state))
            unknown = sorted(set(state) - set(model.state_dict()))
            if missing or unknown:
                raise CheckpointUnusable(
                    f"the checkpoint's weights do not fit the model {model_path}: "
                    f"missing {missing[:3]}, unknown {unknown[:3]}"
                )
            for name, param in params.items():
                param.copy_(state[name])
        else:
            for module, (a, b) in _lora_pairs(state, lora).items():
                weight = params.get(f"{module}.weight")
                if weight is None:
                    raise CheckpointUnusable(f"the adapter targets {module}, which the model {model_path} lacks")
                delta = lora.scale * (b.to(torch.float32) @ a.to(torch.float32))
                weight.copy_((weight.to(torch.float32) + delta).to(weight.dtype))
    model.save_pretrained(folder, safe_serialization=True)


def write_adapter(state: dict[str, torch.Tensor], lora: LoraOptions, folder: Path) -> None:
    """The adapter as PEFT's folder: ``adapter_config.json`` + ``adapter_model.safetensors``."""
    import json

    from safetensors.torch import save_file

    from .lora import exported_names

    targets = list(_lora_pairs(state, lora))
    save_file({k: v.contiguous() for k, v in exported_names(state).items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(lora.peft_config(targets), indent=2))


def _copy_tokenizer(model_path: Path, folder: Path) -> None:
    for pattern in _TOKENIZER_GLOBS:
        for f in model_path.glob(pattern):
            if f.is_file() and not (folder / f.name).exists():
                shutil.copyfile(f, folder / f.name)

"""A sharded trainer's state, in and out: its DCP checkpoints and its full state dict.

A checkpoint holds the trainable parameters and their optimizer state. Frozen weights (a
LoRA adapter's base model) are the model folder's, loaded again at every start, so they
are left out on save and not asked for on load. Loading unpickles nothing but plain data
(:mod:`.checkpointing`). The full state dict (an export) is gathered on rank 0 as CPU
tensors nothing changes later.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from forgerl.errors import CheckpointUnusable
from forgerl.types import tie_key

if TYPE_CHECKING:  # pragma: no cover
    import torch


def save_checkpoint(model: Any, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Write ``model``'s trainable state and ``optimizer``'s to ``path`` (a collective);
    CheckpointWriteError (one line, the same on every rank) when it cannot be written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .checkpointing import one_line_errors

    model_state, optim_state = get_state_dict(model, optimizer, options=checkpoint_options(model))
    # Collective: every rank gets every rank's errors, so all raise the same line.
    with one_line_errors(path, saving=True):
        dcp.save({"model": only_trainable(model, model_state), "optimizer": optim_state}, checkpoint_id=str(path))


def load_checkpoint(model: Any, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Load what :func:`save_checkpoint` wrote into ``model`` and ``optimizer``;
    CheckpointUnusable when it is missing or refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .checkpointing import SafePlanner, SafeReader, one_line_errors, read_metadata_safely

    if not (path / ".metadata").is_file():
        raise CheckpointUnusable(f"{path} is not a trainer checkpoint (no .metadata written by save())")
    metadata = read_metadata_safely(path)
    options = checkpoint_options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state: dict[str, Any] = {"model": only_trainable(model, model_state), "optimizer": optim_state}
    with one_line_errors(path, saving=False):
        dcp.load(state, storage_reader=SafeReader(path, metadata), planner=SafePlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)


def only_trainable(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without ``model``'s frozen tensors. DCP's ``ignore_frozen_params`` keeps a
    frozen weight that a second name shares (a tied output layer is no parameter of its own)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if not frozen:
        return state
    # State dicts leave out the wrapper that activation checkpointing puts around a
    # layer (TorchTitan's); parameter names have it.
    trainable = {
        name.replace("_checkpoint_wrapped_module.", "") for name, p in model.named_parameters() if p.requires_grad
    }
    return {k: v for k, v in state.items() if k in trainable}


def checkpoint_options(model: Any) -> Any:
    """DCP's options for ``model``'s checkpoints: DCP's load fails on any trainable tensor
    the checkpoint lacks, so loading leaves out only the frozen ones (strict would ask for
    those too)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def full_state(
    model: Any, *, rank: int, world_size: int, device: torch.device, trainable_only: bool = False
) -> dict[str, torch.Tensor] | None:
    """``model``'s full state dict on rank 0 (CPU tensors that nothing changes later), None
    elsewhere; only its trainable parameters with ``trainable_only`` (a LoRA adapter). A
    collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    if trainable_only:
        state = only_trainable(model, state)
    if rank != 0:
        return None
    # A full state dict holds plain tensors (no sharded ones).
    tensors = cast("dict[str, torch.Tensor]", state)
    if world_size == 1 and device.type == "cpu":
        # One CPU rank: the "offloaded" state dict is the live parameters themselves, which
        # the next step changes in place while a transport may still hold this version
        # (for a worker that joins late). Gathered or offloaded tensors are copies already.
        # A tensor under two names (tied embeddings) is copied once and stays one tensor,
        # so a transport can send it once.
        tensors = copy_keeping_ties(tensors)
    return tensors


def copy_keeping_ties(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of every tensor, where names that view the same memory the same way (tied
    weights) get one copy between them."""
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    out = {}
    for name, t in tensors.items():
        key = tie_key(t)
        if t.numel() == 0 or key not in copies:
            copies[key] = t.detach().clone()
        out[name] = copies[key]
    return out

"""Process-group set-up for the trainers: join the launcher's rendezvous or make one."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.interfaces import RunContext
    from forgerl_plugins.trainers.shared.options import ShardedTrainerOptions


def local_preflight(options: ShardedTrainerOptions) -> None:
    """Before ``forge run`` starts the ranks on this machine: an explicit ``backend`` (nccl,
    mpi, ...) exists in this torch and has its device here, so that a mistake is one line
    now rather than every rank's traceback after the generator servers have started."""
    if options.backend is None:
        return  # nccl on GPU, gloo on CPU: always formable
    from forgerl_plugins.torch_dist import backend_problem

    problem = backend_problem(options.backend)
    if problem:
        raise ConfigError(
            f"trainer.options.backend is {options.backend!r}, but {problem}; leave it unset "
            "(NCCL on GPUs, gloo on CPUs) or use 'gloo'"
        )


def pick_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is present, else the CPU."""
    import torch

    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        count = torch.cuda.device_count()
        if local_rank >= count:
            # torch would say "invalid device ordinal"; NCCL cannot share one GPU between ranks.
            raise ConfigError(
                f"trainer rank with LOCAL_RANK={local_rank} has no GPU of its own: this node has "
                f"{count} CUDA device(s), one per rank; set trainer.ranks (per node) to at most {count}"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def native_bf16(device: torch.device, cpu_flags: str | None = None) -> bool:
    """Whether ``device`` computes in bfloat16 natively, so that bf16 autocast pays off.

    On CPU that takes ``avx512_bf16`` or AMX (``amx_bf16``): on a Xeon without them bf16
    autocast made the trainer about 3x *slower*; with AMX it made a SmolLM2-135M step
    1.9x faster (docs/performance.md). On CUDA, compute capability 8.0 (Ampere) or later.
    ``cpu_flags`` (the ``flags`` line of /proc/cpuinfo) is read from the machine unless given.
    """
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type != "cpu":
        return False
    if cpu_flags is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpu_flags = next((line for line in f if line.startswith("flags")), "")
        except OSError:  # not Linux: nothing to read, assume the slow path
            return False
    flags = set(cpu_flags.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def init_distributed(backend: str | None, ctx: RunContext, device: torch.device) -> bool:
    """Initialise the default process group unless someone already has.

    Returns whether this call created it (then the trainer destroys it on close). Ranks
    launched by torchrun, srun or the local scheduler find ``MASTER_ADDR``/``MASTER_PORT``
    (and ``RANK``/``WORLD_SIZE``) in the environment. A single rank started without them
    (tests, notebooks) gets an in-process store: no port to pick, no file left behind.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    rank = int(os.environ.get("RANK", ctx.rank))
    world_size = int(os.environ.get("WORLD_SIZE", ctx.world_size))
    if (rank, world_size) != (ctx.rank, ctx.world_size):
        raise ConfigError(
            f"trainer rank {ctx.rank}/{ctx.world_size} from the run context disagrees with "
            f"RANK={rank} WORLD_SIZE={world_size} from the environment; launch the trainer "
            "through the scheduler or set both consistently"
        )
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if "MASTER_ADDR" in os.environ:
        if "MASTER_PORT" not in os.environ:
            raise ConfigError("MASTER_ADDR is set but MASTER_PORT is not; set both (torchrun and srun do)")
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    elif world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        raise ConfigError(
            f"{world_size} trainer ranks need a rendezvous: set MASTER_ADDR and MASTER_PORT "
            "(launch with torchrun/srun or the local scheduler)"
        )
    return True


def sum_gradients(model: Any) -> None:
    """Make every FSDP2 unit of ``model`` sum gradients over ranks instead of averaging
    them (the losses are already normalised over the whole batch) with a plain SUM
    reduce-scatter, which gloo supports (not PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

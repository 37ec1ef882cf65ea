"""Whether a torch.distributed backend asked for in a config can run on this machine.

The trainers' ``backend`` and the nccl transport's ``backend`` are refused before a run
starts when this torch was built without them, or (NCCL, XCCL) when the device they drive
is missing; otherwise the run would start its servers and fail minutes later, inside a
rank or a worker, on a timeout or a raw RuntimeError. Imports torch: call it only for a
backend the user chose explicitly.
"""

from __future__ import annotations

#: The device each device-bound backend drives.
DEVICE_OF = {"nccl": "cuda", "xccl": "xpu"}


def backend_problem(spec: str) -> str | None:
    """None when ``spec`` (``"nccl"``, or per device ``"cpu:gloo,cuda:nccl"``) can form a
    process group here, else why not, as a phrase for a one-line message."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return f"this torch ({torch.__version__}) has no torch.distributed"
    entries = [part.split(":") for part in spec.split(",")]
    for entry in entries:
        name = entry[-1]
        if not dist.is_backend_available(name):
            return f"this torch ({torch.__version__}) was built without {name.upper()}"
    # The device a trainer rank picks here (trainers.shared.distributed.pick_device).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if len(entries) == 1 and len(entries[0]) == 1:
        needs = DEVICE_OF.get(spec)
        if needs is not None and needs != device:
            return f"{spec.upper()} drives {needs.upper()} devices and this machine has none ({needs} is not available)"
        return None
    # Per device: the trainer's tensors live on ``device``, which needs an entry of its own.
    if device not in {entry[0] for entry in entries if len(entry) == 2}:
        return f"it names no backend for {device!r}, the device the trainer runs on here"
    return None


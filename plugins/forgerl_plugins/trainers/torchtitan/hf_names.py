"""A TorchTitan state dict under Hugging Face names, for the ``torchtitan`` trainer's
weight exports (to generators) and for ``forge export`` of its checkpoints
(:mod:`..shared.export`), which both need the weights as the Hugging Face model (or PEFT,
for an adapter) names them.

Everything here needs only the model folder's ``config.json`` (through :mod:`.models`):
the state-dict adapter converts names and permutes q/k rows from the model config alone,
so ``forge export`` builds no model, no trainer and no process group.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import CheckpointUnusable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.adapters import LoraOptions


def full_to_hf(spec: Any, adapter: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full TorchTitan state dict as the Hugging Face model's state dict."""
    tensors: dict[str, torch.Tensor] = adapter.to_hf(state)
    if spec.model.enable_weight_tying:
        # Hugging Face's state dict names the tied matrix twice; the adapter once.
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def lora_rows(spec: Any, adapter: Any) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """How a LoRA B matrix's rows go from TorchTitan's layout to Hugging Face's (for
    :func:`.lora.exported`): the Llama adapter permutes q and k rows (RoPE pairs), as it
    does their weights; None where the layouts agree."""
    if spec.name != "llama3":
        return None
    attention = spec.model.layers[0].attention
    heads = {"wq": attention.n_heads, "wk": attention.n_kv_heads or attention.n_heads}

    def permute(module: str, b: torch.Tensor) -> torch.Tensor:
        n = heads.get(module.rpartition(".")[2])
        return b if n is None else adapter._permute(b, n, b.shape[0], b.shape[1])

    return permute


def checkpoint_as_hf(
    spec: Any, state: dict[str, torch.Tensor], lora: LoraOptions | None, model_path: Path
) -> dict[str, torch.Tensor]:
    """The model tensors of a ``torchtitan`` checkpoint under the names a checkpoint of
    the ``fsdp`` trainer holds for the same model: the Hugging Face model's, or for a
    LoRA adapter PEFT's (``base_model.model.<module>.lora_A.default.weight``), B's rows in
    Hugging Face's layout. CheckpointUnusable for tensors that do not fit the model."""
    from ..shared.lora import ADAPTER
    from .lora import exported, hf_module_name

    adapter = spec.state_dict_adapter(spec.model, None)
    if lora is None:
        try:
            return full_to_hf(spec, adapter, state)
        except KeyError as exc:  # the adapter knows every name outside the layers
            raise CheckpointUnusable(
                f"the checkpoint's weights do not fit the model {model_path} as the torchtitan trainer builds it: "
                f"it holds {exc.args[0]!r}"
            ) from None
        except RuntimeError as exc:  # q/k rows of another shape than the config's heads
            raise CheckpointUnusable(f"the checkpoint's weights do not fit the model {model_path}: {exc}") from None
    targets = {}
    for key in state:
        module = key.partition(".lora_")[0]
        hf = hf_module_name(adapter, module)
        if hf is None:
            raise CheckpointUnusable(
                f"the LoRA checkpoint holds {key!r}, which is not an adapter matrix of a projection of the model "
                f"{model_path}"
            )
        targets[module] = hf
    try:
        return exported(state, targets, lora_rows(spec, adapter), suffix=f".{ADAPTER}.weight")
    except (ValueError, RuntimeError) as exc:  # not a LoRA matrix; B rows the heads do not split
        raise CheckpointUnusable(f"the LoRA checkpoint does not fit the model {model_path}: {exc}") from None

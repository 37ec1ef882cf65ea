"""The trainer's LoRA adapter on SGLang servers (``context.adapter``).

SGLang (the release in :data:`..SGLANG_VERSION`) serves LoRA when started with
``--enable-lora``; without adapters at start it needs the largest rank
(``--max-lora-rank``) and the module kinds (``--lora-target-modules``) up front, to size
its adapter memory pool (:func:`server_flags`). Adapters come and go by name over HTTP:
``/load_lora_adapter`` reads a PEFT folder (``adapter_config.json`` beside safetensors),
``/unload_lora_adapter`` drops one; a ``/generate`` names its adapter in ``lora_path``.

Each version is therefore loaded from a folder: the transport's ``files`` engine receiver
stages the version's tensors (PEFT's names, :mod:`forgerl.adapters`), the generator writes
the adapter's ``adapter_config.json`` beside them, unloads the last version and loads this
one under :data:`~forgerl.adapters.ADAPTER_NAME` (no merge, the base weights untouched).
SGLang's other routes do not fit: ``/load_lora_adapter_from_tensors`` takes tensors
pickled as CUDA IPC handles (a process on the same GPU node only), and there is no
adapter counterpart of ``/update_weights_from_distributed`` in this release, so the
``broadcast`` (nccl) weight sync cannot carry an adapter.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.adapters import ADAPTER_NAME
from forgerl.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.adapters import LoraOptions

#: The linear layers SGLang serves LoRA on in the Llama/Qwen/Mistral family (its names;
#: SGLang packs q/k/v and gate/up itself).
SGLANG_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: What SGLang's unload says of a name it does not hold (``LoRARegistry.unregister``).
NOT_LOADED = "does not exist"


def module_kinds(lora: LoraOptions) -> list[str]:
    """SGLang's names of the modules ``lora`` may target: each pattern's last component
    (``model.layers.1.mlp.*_proj`` → ``*_proj``) matched against :data:`SGLANG_MODULES`.
    A pattern that names some layers only reserves room in every layer: a layer without
    tensors has a zero adapter."""
    kinds = sorted(
        name
        for name in SGLANG_MODULES
        if any(fnmatch.fnmatchcase(name, pattern.rpartition(".")[2]) for pattern in lora.target_modules)
    )
    if not kinds:
        raise ConfigError(
            f"trainer.options.lora.target_modules {lora.target_modules} name no module SGLang serves LoRA on "
            f"({', '.join(SGLANG_MODULES)}): use the vllm or hf generator for this model"
        )
    return kinds


def server_flags(lora: LoraOptions) -> list[str]:
    """LoRA on, with a pool that holds this adapter (its rank, its module kinds)."""
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *module_kinds(lora)]


def write_config(folder: Path, lora: LoraOptions) -> None:
    """``adapter_config.json`` of ``lora`` in ``folder`` (beside the staged tensors)."""
    config = lora.peft_config(module_kinds(lora))
    (folder / "adapter_config.json").write_text(json.dumps(config))


def load_body(folder: Path) -> dict[str, Any]:
    """``/load_lora_adapter``: the adapter in ``folder`` under the run's adapter name."""
    return {"lora_name": ADAPTER_NAME, "lora_path": str(folder)}


def unload_body() -> dict[str, Any]:
    return {"lora_name": ADAPTER_NAME}

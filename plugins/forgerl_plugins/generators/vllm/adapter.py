"""A LoRA adapter version, loaded in place inside a vLLM worker from the tensors the
transport delivered (no file, no merge; the base weights are never touched).

vLLM's own in-place load (``/v1/load_lora_adapter`` with ``load_inplace``) reads a folder
on every version. Here the worker does what that load does after reading the files: it
builds vLLM's ``LoRAModel`` from the tensors (PEFT's names, :mod:`forgerl.adapters`),
replaces the adapter of the same id in the worker's LoRA manager and activates it (which
copies it into the slot the forward pass reads).

Version 0 is an all-zero adapter (:func:`install_zero`: A and B zero, so every layer
computes exactly what the base model does), installed when the generator first meets a
server. So every request names the adapter from the first one on, and one that runs
across an update (update policy ``keep``) goes on with the new adapter from its next
token: vLLM looks a running request's adapter up by id at every step, and the in-place
replace rewrites the slot that id points to.

The API server must know the adapter's *name* before a request can use it. The generator
names it once per server, once the zero adapter is in place, through
``/v1/load_lora_adapter`` (:func:`register_body`): the server gives the first adapter it
is told of the id :data:`ADAPTER_ID` and asks the workers to add it, which they then
already have, so nothing is read from the path it names. If a server gave another id,
its workers would try to read that path and the registration fails loudly.
"""

from __future__ import annotations

from typing import Any

from forgerl.adapters import ADAPTER_NAME

#: The id vLLM's API server gives the first adapter it is told of (its counter starts at 1).
ADAPTER_ID = 1
#: What the registration names as the adapter's folder; never read (see above).
IN_MEMORY_PATH = "/nonexistent/forgerl-adapter-loaded-in-memory"


def register_body() -> dict[str, Any]:
    """The body of ``/v1/load_lora_adapter`` that names the in-memory adapter."""
    return {"lora_name": ADAPTER_NAME, "lora_path": IN_MEMORY_PATH, "load_inplace": False}


def install(worker_manager: Any, tensors: dict[str, Any], config: dict[str, Any]) -> None:
    """Replace adapter :data:`ADAPTER_ID` of ``worker_manager`` (vLLM's worker LoRA
    manager) with ``tensors`` (PEFT names) and ``config`` (an ``adapter_config.json``)."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager = worker_manager._adapter_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings})
    helper.validate_legal(worker_manager.lora_config)  # the rank fits --max-lora-rank, no bias
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    supported = _expected_modules(manager)
    for name in tensors:
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        if module.rpartition(".")[2] not in supported:
            raise ValueError(f"adapter tensor {name!r}: vLLM serves no LoRA on {module!r} (it does on {sorted(supported)})")
    lora = worker_manager._lora_model_cls.from_lora_tensors(
        lora_model_id=ADAPTER_ID,
        # Copies: the transport may reuse its buffers for the next version.
        tensors={name: t.clone() for name, t in tensors.items()},
        peft_helper=helper,
        device="cpu",
        dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    if not lora.loras:
        raise ValueError(f"none of the {len(tensors)} adapter tensors names a LoRA module")
    manager.remove_adapter(ADAPTER_ID)  # deactivates it too: the activation below copies afresh
    manager.add_adapter(lora)
    manager.activate_adapter(ADAPTER_ID)


def install_zero(worker_manager: Any, rank: int) -> None:
    """Replace adapter :data:`ADAPTER_ID` with one of rank ``rank`` whose A and B are zero
    on every module vLLM serves LoRA on (version 0: the base model's outputs exactly, as
    ``x + 0``), built by vLLM's own warm-up helper."""
    manager = worker_manager._adapter_manager
    zero = manager.create_dummy_lora(ADAPTER_ID, rank, worker_manager.embedding_modules)
    manager.remove_adapter(ADAPTER_ID)
    manager.add_adapter(zero)
    manager.activate_adapter(ADAPTER_ID)


def loaded(worker_manager: Any) -> list[int]:
    """The adapter ids the worker holds."""
    return sorted(worker_manager.list_adapters())


def _expected_modules(manager: Any) -> set[str]:
    """The module names vLLM serves LoRA on for this model, packed ones unpacked
    (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``), as its file loader checks them."""
    packed = manager.packed_modules_mapping
    out: set[str] = set()
    for module in manager.supported_lora_modules:
        out.update(packed.get(module, [module]))
    return out

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
    manager = worker_manager._adapter_manager
    lora = build(worker_manager, ADAPTER_ID, tensors, config)
    manager.remove_adapter(ADAPTER_ID)  # deactivates it too: the activation below copies afresh
    manager.add_adapter(lora)
    manager.activate_adapter(ADAPTER_ID)


def build(worker_manager: Any, lora_id: int, tensors: dict[str, Any], config: dict[str, Any]) -> Any:
    """vLLM's ``LoRAModel`` of id ``lora_id`` from ``tensors`` (PEFT names, copied) and
    ``config``; ValueError where the server cannot serve them (rank, modules)."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker_manager._adapter_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings})
    helper.validate_legal(worker_manager.lora_config)  # the rank fits --max-lora-rank, no bias
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    check_modules(worker_manager, tensors)
    lora = worker_manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_id,
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
    return lora


def check_modules(worker_manager: Any, tensors: dict[str, Any]) -> None:
    """ValueError unless vLLM serves LoRA on every module ``tensors`` name."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager = worker_manager._adapter_manager
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    supported = _expected_modules(manager)
    for name in tensors:
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        if module.rpartition(".")[2] not in supported:
            raise ValueError(f"adapter tensor {name!r}: vLLM serves no LoRA on {module!r} (it does on {sorted(supported)})")


# ------------------------------------------------------------- named adapters (a fleet)
#
# On a shared fleet's server each run's adapter has a name of its own, and the API server
# chooses its id (a counter, in the order names are first registered), so the worker
# cannot install it ahead under a known id as above. Instead each version's tensors are
# kept in the worker under the adapter's name (:class:`NamedAdapters`), and then
# registered through ``/v1/load_lora_adapter`` with ``load_inplace`` under a path naming
# name and version (:func:`named_register_body`). vLLM then loads it in place through the
# worker manager's own ``_load_adapter``, which reads that path from the kept tensors
# (:meth:`NamedAdapters.hook`) and everything else from disk as before. A new path per
# version also gives the version's requests prefix-cache keys of their own (vLLM keys a
# LoRA request's blocks by name and path). The kept tensors stay: a server holding more
# adapters than its ``--max-cpu-loras`` evicts the least used and loads it again later.

#: The root of the paths that name kept adapters (never a real folder).
NAMED_ROOT = "/nonexistent/forgerl-adapters"


def named_path(name: str, version: int) -> str:
    return f"{NAMED_ROOT}/{name}/v{version}"


def named_register_body(name: str, version: int) -> dict[str, Any]:
    """The body of ``/v1/load_lora_adapter`` that loads kept version ``version`` of ``name``."""
    return {"lora_name": name, "lora_path": named_path(name, version), "load_inplace": True}


class NamedAdapters:
    """The adapters a worker keeps by name: ``{name: (version, tensors, config)}``."""

    def __init__(self, worker_manager: Any) -> None:
        self.worker_manager = worker_manager
        self.kept: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {}
        self.ids: dict[str, int] = {}  # name -> the id the API server gave it
        self._original = worker_manager._load_adapter
        worker_manager._load_adapter = self.hook

    def keep(self, name: str, version: int, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        check_modules(self.worker_manager, tensors)  # refused here, with the transport's answer
        # Copies: the transport may reuse its buffers for the next version.
        self.kept[name] = (version, {k: t.clone() for k, t in tensors.items()}, config)

    def version(self, name: str) -> int:
        found = self.kept.get(name)
        return found[0] if found is not None else 0

    def drop(self, name: str) -> None:
        """Forget ``name`` (and take its id out of the worker's adapters)."""
        self.kept.pop(name, None)
        lora_id = self.ids.pop(name, None)
        if lora_id is not None:
            self.worker_manager._adapter_manager.remove_adapter(lora_id)

    def hook(self, lora_request: Any) -> Any:
        """vLLM's ``_load_adapter`` for a kept adapter's path; the original for any other."""
        path = str(lora_request.lora_path or "")
        if not path.startswith(NAMED_ROOT + "/"):
            return self._original(lora_request)
        name, _, version = path[len(NAMED_ROOT) + 1 :].rpartition("/v")
        found = self.kept.get(name)
        if found is None or str(found[0]) != version:
            held = "none" if found is None else f"version {found[0]}"
            raise ValueError(f"adapter {name!r} version {version} is not in this worker (it holds {held})")
        self.ids[name] = int(lora_request.lora_int_id)
        return build(self.worker_manager, int(lora_request.lora_int_id), found[1], found[2])


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

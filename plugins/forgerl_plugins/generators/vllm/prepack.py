"""Packing a staged weight version before the pause (vLLM on CPU, full weights).

On CPU, vLLM computes each unquantized linear layer through ``layer.cpu_linear``, a
closure over a packed copy of its weight (oneDNN's blocked layout, made by
``dispatch_cpu_unquantized_gemm``); the layer's own ``weight`` is then an empty tensor.
vLLM's reload therefore rebuilds every layer under the pause: fresh checkpoint-format
tensors, the shards copied in, a new pack. :func:`build` does that work while the replica
still generates, into scratch tensors the model does not see, and :meth:`Prepacked.swap`
(under the pause) only copies the unpacked tensors (embedding, norms, biases) in place and
points each packed layer's ``cpu_linear`` at its new closure.

It leans on vLLM internals (checked, never assumed): the model class's
``hf_to_vllm_mapper`` (checkpoint name to parameter and shard), the checkpoint-format
records vLLM keeps for its own reload (``get_layerwise_info(layer).restore_metadata``),
the layers' weight loaders, the unquantized linear and embedding methods, and the
dispatch itself (called on a stand-in module holding the new weight, so whatever kernel
vLLM picks is the one built). Anything else raises :class:`Unsupported` before the model is
touched; the caller then loads the version through vLLM's reload.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class Unsupported(Exception):
    """This model, or this version, cannot be packed ahead: load it through vLLM's reload."""


class NothingToPack(Unsupported):
    """Not a CPU server: its layers compute from their own weights, which the reload
    replaces in place (nothing is wrong, there is just nothing to gain)."""


@dataclass
class Prepacked:
    """A version built beside the serving one: nothing of the model has changed yet."""

    #: (live tensor, its new value): copied in place by :meth:`swap`.
    copies: list[tuple[Any, Any]] = field(default_factory=list)
    #: (layer, its new ``cpu_linear``): set by :meth:`swap`.
    linears: list[tuple[Any, Callable[..., Any]]] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def swap(self) -> None:
        """Put the version in (under the pause). Shapes were checked when it was built;
        the old packed weights are freed with the closures replaced here."""
        for live, new in self.copies:
            live.data.copy_(new)
        for layer, cpu_linear in self.linears:
            layer.cpu_linear = cpu_linear
        self.copies, self.linears = [], []


def build(model: Any, tensors: list[tuple[str, Any]]) -> Prepacked:
    """The version ``tensors`` (checkpoint names) built for ``model``, ready to swap in.
    Raises :class:`Unsupported` (the model untouched) when some part of it is not what
    this expects."""
    import torch

    start = time.perf_counter()
    vllm = _internals()
    out = Prepacked(tensors=len(tensors), bytes=sum(t.numel() * t.element_size() for _, t in tensors))
    with torch.no_grad():  # grad mode is per thread: this one runs beside the engine's
        targets = _load_into_scratch(model, tensors, vllm)
        out.linears = _pack(model, targets, vllm)
        for target in targets.values():
            if target.live.numel() == 0:
                if not target.packed:
                    raise Unsupported(f"{target.name}: packed, but no layer computing with it was found")
                continue
            if tuple(target.scratch.shape) != tuple(target.live.shape):
                raise Unsupported(f"{target.name}: built {tuple(target.scratch.shape)}, serving {tuple(target.live.shape)}")
            out.copies.append((target.live, target.scratch))
    out.seconds = time.perf_counter() - start
    return out


def _internals() -> SimpleNamespace:
    """The vLLM pieces this uses, or :class:`Unsupported` naming the one missing."""
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise Unsupported(f"this vLLM lacks {exc.name or exc}") from exc
    if not current_platform.is_cpu():
        raise NothingToPack("not a CPU platform: its layers keep their weights, there is nothing to pack")
    return SimpleNamespace(
        dispatch=dispatch_cpu_unquantized_gemm,
        methods=(UnquantizedLinearMethod, UnquantizedEmbeddingMethod),
        original_loader=_get_original_loader,
        info=get_layerwise_info,
        materialize=materialize_meta_tensor,
        restore_refs=restore_layer_refs,
    )


class _Target:
    """One parameter of the model the version writes, and its new value being built."""

    def __init__(self, name: str, layer: Any, attr: str, live: Any, vllm: SimpleNamespace) -> None:
        import torch

        self.name, self.live, self.packed = name, live, False
        if live.numel() > 0:
            # Unpacked (embedding, norm, bias): start from the serving values, so that a
            # part the version leaves out stays as it was, as under vLLM's reload.
            scratch = live.detach().clone()
            scratch.__class__ = live.__class__
            scratch.__dict__ = live.__dict__.copy()
        else:
            # Packed: its checkpoint shape and loader are only in vLLM's record for reloads.
            meta = vllm.info(layer).restore_metadata[0].get(attr)
            if meta is None or not meta.is_meta:
                raise Unsupported(f"{name}: packed, and vLLM keeps no checkpoint-format record of it")
            scratch = vllm.restore_refs(vllm.materialize(meta), layer)
            scratch.data.fill_(float("nan"))  # to see that every element was loaded
        if scratch.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise Unsupported(f"{name}: {scratch.dtype} weights (quantized?)")
        self.scratch = scratch
        self.loader = vllm.original_loader(scratch)

    def load(self, tensor: Any, shard: Any) -> None:
        if shard is None:
            self.loader(self.scratch, tensor)
        else:
            self.loader(self.scratch, tensor, shard)


def _load_into_scratch(model: Any, tensors: list[tuple[str, Any]], vllm: SimpleNamespace) -> dict[int, _Target]:
    """Each checkpoint tensor loaded, by its layer's own loader, into a scratch copy of the
    parameter it names (q/k/v and gate/up fused as vLLM fuses them). Keyed by the live
    parameter's id: a tied head and its embedding are one target."""
    mapper = getattr(type(model), "hf_to_vllm_mapper", None)
    map_name = getattr(mapper, "_map_name_with_shard", None)
    if map_name is None:
        raise Unsupported(f"{type(model).__name__} has no hf_to_vllm_mapper: which layer a weight fills is not known")
    params = dict(model.named_parameters(remove_duplicate=False))
    targets: dict[int, _Target] = {}
    for name, tensor in tensors:
        mapped = map_name(name)
        if mapped is None:
            continue  # the model's own loader drops it as well
        param_name, shard = mapped
        if isinstance(shard, list):
            raise Unsupported(f"{name}: loaded into several shards ({shard})")
        live = params.get(param_name)
        if live is None:
            raise Unsupported(f"{name} (as {param_name}) names no parameter of {type(model).__name__}")
        target = targets.get(id(live))
        if target is None:
            layer_name, _, attr = param_name.rpartition(".")
            target = targets[id(live)] = _Target(param_name, model.get_submodule(layer_name), attr, live, vllm)
        target.load(tensor, shard)
    for target in targets.values():
        if target.live.numel() == 0 and bool(target.scratch.isnan().any()):
            raise Unsupported(f"{target.name}: the version leaves part of it unwritten (a shard missing?)")
    return targets


def _pack(model: Any, targets: dict[int, _Target], vllm: SimpleNamespace) -> list[tuple[Any, Callable[..., Any]]]:
    """The new ``cpu_linear`` of every layer whose weight the version writes, built by
    vLLM's dispatch on a stand-in module (a tied head shares its embedding's)."""
    import torch

    built: dict[int, Callable[..., Any]] = {}
    out: list[tuple[Any, Callable[..., Any]]] = []
    for layer_name, layer in model.named_modules():
        weight = layer._parameters.get("weight")
        target = targets.get(id(weight)) if weight is not None else None
        if target is None or not hasattr(layer, "cpu_linear"):
            continue  # computes from its parameters (copied in place), or not in this version
        if type(getattr(layer, "quant_method", None)) not in vllm.methods:
            raise Unsupported(f"{layer_name}: quant method {type(getattr(layer, 'quant_method', None)).__name__}")
        if getattr(layer, "_cpu_skip_gemm_dispatch", False):
            continue  # never packed: F.linear on its weight
        remove = weight.numel() == 0  # linear layers drop theirs; embeddings and heads keep it
        cpu_linear = built.get(id(weight))
        if cpu_linear is None:
            stand_in: Any = torch.nn.Module()
            stand_in.weight = torch.nn.Parameter(target.scratch.data, requires_grad=False)
            vllm.dispatch(stand_in, remove_weight=remove)
            if remove and stand_in.weight.numel() != 0:
                raise Unsupported(f"{layer_name}: vLLM's dispatch kept the weight (an unpacked GEMM)")
            cpu_linear = built[id(weight)] = stand_in.cpu_linear
        out.append((layer, cpu_linear))
        target.packed = True
        if remove:
            target.scratch = None  # the packed copy is all the layer needs: free the fused one
    return out

"""Packing a weight version before the pause (generators/vllm/prepack.py), on a small model
made of vLLM's own CPU pieces: its unquantized linear method (whose weights vLLM's dispatch
packs, as in a served model), its name mapper and its record for reloads. The served
model's check (logprobs after a prepacked update equal transformers'):
tests/integration/test_vllm.py."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from forgerl_plugins.generators.vllm import prepack
from forgerl_plugins.generators.vllm.worker_extension import ForgeWorkerExtension

IN, OUT = 64, 48  # each of the two fused shards: OUT rows


@pytest.fixture(scope="module")
def vllm_model() -> SimpleNamespace:
    """The small model's classes, made of vLLM's pieces (imported here, not at collection:
    vLLM takes seconds to import, on every xdist worker)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading
    from vllm.model_executor.models.utils import WeightsMapper
    from vllm.model_executor.utils import set_weight_attrs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build packs linear weights")

    class Fused(torch.nn.Module):
        """Two checkpoint weights stacked into one linear layer, as vLLM's gate_up_proj."""

        def __init__(self) -> None:
            super().__init__()
            self.quant_method = UnquantizedLinearMethod()
            self.weight = torch.nn.Parameter(torch.empty(2 * OUT, IN), requires_grad=False)
            set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

        def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
            param.data[shard * OUT : (shard + 1) * OUT].copy_(loaded)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.quant_method.apply(self, x)

    class Small(torch.nn.Module):
        # The checkpoint's first and second are the two shards of fused, as q/k/v of qkv_proj.
        hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={"first.": ("fused.", 0), "second.": ("fused.", 1)})

        def __init__(self) -> None:
            super().__init__()
            self.fused = Fused()
            self.scale = torch.nn.Parameter(torch.ones(2 * OUT), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fused(x) * self.scale

    class Unmapped(Small):
        hf_to_vllm_mapper = None  # type: ignore[assignment]

    class OtherMethod(UnquantizedLinearMethod):
        """Stands for a quantized or otherwise different linear method."""

    return SimpleNamespace(Small=Small, Unmapped=Unmapped, OtherMethod=OtherMethod, record=record_metadata_for_reloading)


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "first.weight": torch.randn(OUT, IN, generator=g),
        "second.weight": torch.randn(OUT, IN, generator=g),
        "scale": torch.rand(2 * OUT, generator=g) + 0.5,
    }


def reference(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w = torch.cat([weights["first.weight"], weights["second.weight"]])
    return (x @ w.t()) * weights["scale"]


def served(vllm_model: SimpleNamespace, kind: str = "Small") -> Any:
    """A model as vLLM leaves it after loading version 0: its record for reloads taken, the
    linear weight packed (the parameter itself emptied)."""
    m = getattr(vllm_model, kind)()
    vllm_model.record(m)
    weights = checkpoint(0)
    for shard, name in enumerate(("first.weight", "second.weight")):
        m.fused.weight_loader(m.fused.weight, weights[name], shard)
    m.scale.data.copy_(weights["scale"])
    m.fused.quant_method.process_weights_after_loading(m.fused)
    assert m.fused.weight.numel() == 0, "vLLM did not pack the layer: nothing here to test"
    return m


def test_a_version_built_ahead_computes_as_the_new_weights_once_swapped_and_not_before(vllm_model):
    model = served(vllm_model)
    x = torch.randn(5, IN)
    old = model(x)
    torch.testing.assert_close(old, reference(checkpoint(0), x), rtol=1e-4, atol=1e-4)
    new = checkpoint(1)
    built = prepack.build(model, list(new.items()))
    torch.testing.assert_close(model(x), old)  # built beside the serving model: untouched
    built.swap()
    torch.testing.assert_close(model(x), reference(new, x), rtol=1e-4, atol=1e-4)
    assert (built.tensors, built.bytes) == (3, sum(t.numel() * 4 for t in new.values()))



@pytest.mark.parametrize(
    "case, kind, weights, why",
    [
        ("no name mapper", "Unmapped", lambda w: w, "no hf_to_vllm_mapper"),
        ("a name the model lacks", "Small", lambda w: {**w, "third.weight": w["first.weight"]}, "names no parameter"),
        ("a fused layer's shard missing", "Small", lambda w: {k: v for k, v in w.items() if k != "second.weight"},
         "unwritten"),
        ("another linear method", "Small", lambda w: w, "quant method OtherMethod"),
    ],
)  # fmt: skip
def test_a_model_not_as_expected_is_refused_whole_and_left_serving_the_old_weights(
    vllm_model, case, kind, weights, why
):
    model = served(vllm_model, kind)
    if case == "another linear method":
        model.fused.quant_method.__class__ = vllm_model.OtherMethod
    x = torch.randn(3, IN)
    old, cpu_linear = model(x), model.fused.cpu_linear
    with pytest.raises(prepack.Unsupported, match=why):
        prepack.build(model, list(weights(checkpoint(1)).items()))
    assert model.fused.cpu_linear is cpu_linear
    torch.testing.assert_close(model(x), old)


class Receiver:
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def receive(self, version: int, timeout: float | None = None) -> Any:
        return iter(self.weights.items())


class Worker(ForgeWorkerExtension):
    """The worker extension over ``model`` (no engine: the RPCs are called directly); its
    reload records what it was given, as test_vllm_staging's."""

    rank = 0

    def __init__(self, model: Any, weights: dict[str, torch.Tensor]) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.receiver = Receiver(weights)
        self.reloaded: list[list[str]] = []

    def _forge_receiver(self, req: dict[str, Any], owner: Any = None) -> Any:
        return self.receiver

    def reload_weights(self, *, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        self.reloaded.append([name for name, _ in weights_iterator])

    def _forge_refresh_tied_head(self) -> None:
        pass


def _update(worker: Worker, version: int) -> dict[str, Any]:
    request = json.dumps({"version": version, "timeout": 30.0, "source": "transport", "transport": {}, "prepack": True})
    worker.forge_stage_weights(request)
    staging = worker._forge_staging
    assert staging is not None and staging.done.wait(30.0)
    return worker.forge_load_weights(request)


def test_the_worker_swaps_a_version_packed_while_staging_and_reports_both_parts(vllm_model):
    model, new = served(vllm_model), checkpoint(1)
    worker = Worker(model, new)
    x = torch.randn(4, IN)
    result = _update(worker, 1)
    assert result["ok"] and result["prepacked"] and result["prepack_fallback"] is None, result
    assert worker.reloaded == []  # vLLM's reload never ran
    assert result["prepack_seconds"] > 0 and result["swap_seconds"] > 0 and result["tensors"] == 3
    torch.testing.assert_close(model(x), reference(new, x), rtol=1e-4, atol=1e-4)


def test_the_worker_loads_a_version_it_could_not_pack_through_vllms_reload(vllm_model):
    model = served(vllm_model, "Unmapped")
    worker = Worker(model, checkpoint(1))
    result = _update(worker, 1)
    assert result["ok"] and not result["prepacked"], result
    assert "no hf_to_vllm_mapper" in result["prepack_fallback"]
    assert worker.reloaded == [list(checkpoint(1))]  # the staged tensors, all of them

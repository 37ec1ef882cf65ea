"""The ``torchtitan`` trainer: the run's Hugging Face model rebuilt with TorchTitan's model
definitions (:mod:`.models`), sharded by TorchTitan's ``parallelize_fn`` (FSDP2 over the
data-parallel ranks, tensor parallelism over ``tp`` ranks, optional activation
checkpointing and ``torch.compile``), trained with forgerl's loss.

The step, logprobs, metrics and DCP checkpoints are the shared ones
(:class:`forgerl_plugins.trainers.shared.base.ShardedTrainer`), so on the same batch this
trainer and ``fsdp`` make the same update (tests/integration/test_torchtitan_trainer.py).

Set-up follows TorchTitan's RL ``PolicyTrainer``: build the model on the meta device,
parallelize, ``to_empty`` on the real device, initialise the buffers (RoPE), then load
the Hugging Face weights through the model's state-dict adapter. Like ``fsdp``, a single
rank with nothing to compile or checkpoint trains the plain module: FSDP2 on a world of
one only copies parameters around.

TorchTitan 0.3.0 on CPU (/work/shared/MACHINE-NOTES.md): its device meshes would be CUDA
meshes when no accelerator exists (``tools/utils.py`` falls back to "cuda"), and its
default SPMD backend types every tensor; here meshes use the trainer's device and the
``partial_dtensor`` backend (DTensor for the model-parallel axes only), and FSDP sums
gradients with plain SUM collectives (gloo has no PREMUL_SUM).

With ``lora`` set, PEFT's LoRA layers are injected into the decoder's projections on the
meta device, before sharding (:mod:`.lora`): only the adapter gets gradients, optimizer
state, checkpoints and weight exports (under the Hugging Face names the ``fsdp`` trainer
exports), and the KL reference is the same model with the adapter off.

Weight exports and ``forge export`` of this trainer's checkpoints give TorchTitan's names
Hugging Face's the same way (:mod:`.hf_names`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from forgerl.adapters import LoraOptions
from forgerl.errors import ConfigError
from forgerl.types import TrainBatch, WeightSet
from forgerl_plugins.trainers.shared.base import ShardedTrainer
from forgerl_plugins.trainers.shared.batching import check_batch
from forgerl_plugins.trainers.shared.distributed import sum_gradients
from forgerl_plugins.trainers.shared.options import ShardedTrainerOptions

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

#: TorchTitan's backend for DTensor on model-parallel axes only; the one that runs on gloo.
SPMD_BACKEND = "partial_dtensor"


def torch_mismatch(error: ImportError) -> str:
    """One line for TorchTitan failing to import against the installed torch: each release
    imports the torch APIs of its own time (0.3.0 needs torch.distributed.fsdp's
    DataParallelMeshDims, which torch 2.11 lacks), so a mismatch surfaces as an ImportError
    deep inside torchtitan."""
    import importlib.metadata

    import torch

    try:
        titan = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        titan = "(version unknown)"
    return (
        f"TorchTitan {titan} does not import with torch {torch.__version__} ({error}); install the "
        "torch it was released for (constraints.txt pins torchtitan==0.3.0 with torch==2.13.0)"
    )


def load_spec(model_path: Path) -> Any:
    """The TorchTitan model spec of the folder (:func:`.models.model_spec`); a TorchTitan
    that does not import with this torch is one line (ConfigError)."""
    from .models import model_spec

    try:
        return model_spec(model_path)
    except ImportError as e:
        if (e.name or "").split(".")[0] == "torchtitan":
            raise  # TorchTitan itself (or part of it) is missing: not a version mismatch
        raise ConfigError(torch_mismatch(e)) from e


class TorchTitanTrainer(ShardedTrainer):
    name = "torchtitan"
    description = "TorchTitan Llama 3 / Qwen models, FSDP2 + tensor parallel, DCP checkpoints"
    requires = ("torch", "torchtitan", "spmd_types", "tyro", "safetensors")
    extra = "torchtitan"
    # Not the plain extra: TorchTitan's declared dependencies would replace torch.
    install_hint = (
        "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro typeguard (scripts/setup.sh does)"
    )

    class Options(ShardedTrainerOptions):
        """The shared trainer options (the same update as ``fsdp``), plus TorchTitan's parallelism."""

        tp: int = Field(
            1, ge=1, le=1024,
            description="Tensor-parallel degree: ranks that split each layer's heads and feed-forward "
            "(must divide trainer.ranks and the model's key/value heads).",
        )
        dp_shard: int | None = Field(
            None, ge=1, le=65_536,
            description="FSDP degree: ranks the parameters are sharded over (default: trainer.ranks / tp; "
            "dp_shard * tp must equal trainer.ranks).",
        )
        activation_checkpointing: Literal["none", "full", "selective"] = Field(
            "none",
            description="Recompute activations in the backward pass: 'full' whole decoder layers, 'selective' "
            "per op (less memory, more compute).",
        )
        compile: bool = Field(
            False,
            description="torch.compile each decoder layer (off by default: minutes to compile, and on CPU a C++ "
            "compiler).",
        )
        lora: LoraOptions | None = Field(
            None,
            description="Train a LoRA adapter on the decoder layers' projections instead of every weight (None: "
            "full fine-tuning); target_modules use Hugging Face names (q_proj, ...). Needs PEFT: "
            "pip install 'forgerl[lora]'. Not with tp > 1 or compile.",
        )

    options: TorchTitanTrainer.Options

    def _build(self) -> None:
        options = self.options
        self.spec = load_spec(self._model_path)
        self.adapter = self.spec.state_dict_adapter(self.spec.model, None)
        tp = options.tp
        if options.lora is not None and (tp > 1 or options.compile):
            # Untried: the tensor-parallel plan names the projections PEFT wraps, and
            # compiling PEFT's layers is unchecked.
            raise ConfigError(
                "torchtitan trainer: trainer.options.lora works without tensor parallelism and torch.compile "
                "(tp 1, compile false) for now; unset one or the other, or use the fsdp trainer"
            )
        # With LoRA: TorchTitan module name -> Hugging Face name of each adapted layer,
        # and the Hugging Face names alone (as the fsdp trainer's lora_targets).
        self.lora_modules: dict[str, str] = {}
        self.lora_targets: list[str] = []
        dp_shard = options.dp_shard or self.world_size // tp
        if dp_shard * tp != self.world_size:
            raise ConfigError(
                f"torchtitan trainer: dp_shard ({dp_shard}) * tp ({tp}) must equal the trainer's "
                f"{self.world_size} ranks (trainer.ranks); set trainer.options.tp and dp_shard to fit"
            )
        attention = self.spec.model.layers[0].attention
        kv_heads = attention.n_kv_heads or attention.n_heads
        if kv_heads % tp:
            raise ConfigError(
                f"torchtitan trainer: tp {tp} does not divide the model's {kv_heads} key/value heads; "
                "choose a tp that does"
            )
        self.parallel_dims = self.parallelism = None
        if self.world_size > 1 or options.activation_checkpointing != "none" or options.compile:
            self._set_up_parallelism(dp_shard, tp)
        if tp > 1:
            self._set_up_data_parallel_groups(tp)
        hf_weights = self._read_hf_weights()
        self.model = self._build_model(hf_weights, trainable=True)
        # The reference model costs a full copy of the weights: only with a KL term, and
        # never with LoRA (the base model is the policy with its adapter off).
        needs_copy = self.algorithm.kl_coef > 0 and options.lora is None
        self.reference_model = self._build_model(hf_weights, trainable=False) if needs_copy else None
        del hf_weights
        self.optimizer = self._adamw()
        # The decoder's forward ends in ``self.lm_head(h)`` on [b, L, dim] hidden states:
        # the head hook of shared/head.py always applies.
        self._select_head = True

    # ----------------------------------------------------------------- set-up

    def _set_up_parallelism(self, dp_shard: int, tp: int) -> None:
        from torchtitan.config import ParallelismConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import parallel_dims as parallel_dims_module
        from torchtitan.distributed import utils as titan_dist

        from .models import fill_sharding_plan

        # TorchTitan picks "cuda" when no accelerator is present; its meshes must live
        # on the device this trainer computes on.
        parallel_dims_module.device_type = self.device.type
        titan_dist.set_spmd_backend(SPMD_BACKEND)
        self.parallelism = ParallelismConfig(
            data_parallel_shard_degree=dp_shard,
            tensor_parallel_degree=tp,
            # Micro-batches are cut to their longest row: any length, no sequence sharding.
            enable_sequence_parallel=False,
            spmd_backend=SPMD_BACKEND,
        )
        self.parallel_dims = ParallelDims.from_config(self.parallelism, self.world_size)
        fill_sharding_plan(self.spec)

    def _set_up_data_parallel_groups(self, tp: int) -> None:
        """With tensor parallelism, the ``tp`` consecutive ranks of a group (TorchTitan's
        mesh puts ``tp`` innermost) share one data-parallel rank and so the same rows; the
        metrics and logprobs are gathered over the ranks holding different rows."""
        import torch.distributed as dist

        self.dp_rank, self.dp_size = self.rank // tp, self.world_size // tp
        # new_group is collective: every rank creates every group, in the same order.
        for offset in range(tp):
            group = dist.new_group([offset + tp * i for i in range(self.dp_size)])
            if offset == self.rank % tp:
                self.dp_group = group

    def _read_hf_weights(self) -> dict[str, Any]:
        """The folder's safetensors as TorchTitan state-dict entries (each rank reads them:
        a trainer's ranks share the model folder, as they do for ``fsdp``)."""
        from safetensors.torch import load_file

        files = sorted(self._model_path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{self._model_path}: no *.safetensors weights for the torchtitan trainer")
        weights: dict[str, Any] = {}
        for f in files:
            weights.update(load_file(f))
        return self.adapter.from_hf(weights)

    def _build_model(self, weights: dict[str, Any], trainable: bool) -> Any:
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torchtitan.tools.utils import set_default_dtype

        with torch.device("meta"), set_default_dtype(self.dtype):
            model = self.spec.model.build()
        if not trainable:
            model.requires_grad_(False)
        elif self.options.lora is not None:
            from . import lora

            self.lora_modules = lora.target_names(model, self.adapter, self.options.lora)
            self.lora_targets = sorted(self.lora_modules.values())
            lora.inject(model, self.lora_modules, self.options.lora)
            weights = {
                **lora.base_weight_names(weights, self.lora_modules),
                **lora.initial_state(model, self.lora_modules, self.ctx.seed),
            }
        if self.parallel_dims is not None:
            model = self._parallelize(model, trainable)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)  # RoPE caches; the weights come next
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))
        return model

    def _parallelize(self, model: Any, trainable: bool) -> Any:
        from torchtitan.config import CompileConfig, TrainingConfig
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        options = self.options
        dtype = str(self.dtype).removeprefix("torch.")
        ac = {"full": FullAC.Config, "selective": SelectiveAC.Config}.get(options.activation_checkpointing)
        model = self.spec.parallelize_fn(
            model,
            parallel_dims=self.parallel_dims,
            # Parameters stay in the model's dtype (bf16 compute is the shared autocast
            # option, as for fsdp); gradients are reduced in fp32.
            training=TrainingConfig(dtype=dtype, mixed_precision_param=dtype, mixed_precision_reduce="float32"),
            parallelism=self.parallelism,
            compile_config=CompileConfig(enable=options.compile and trainable),
            # The frozen reference model runs no backward: nothing to recompute.
            ac_config=ac() if ac is not None and trainable else None,
            dump_folder=str(self.ctx.run_dir),
        )
        sum_gradients(model)
        return model

    # ---------------------------------------------------------------- forward

    def _head(self, model: Any) -> Any:
        return model.lm_head

    def _logits(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Causal SDPA, no mask: exact for right-padded rows (checked in _check_batch).
        logits = model(input_ids)
        if hasattr(logits, "full_tensor"):
            # Tensor parallel: the head's output is a DTensor (vocabulary-sharded); the
            # loss reads whole rows. full_tensor's backward hands each rank its shard.
            logits = logits.full_tensor()
        return logits

    def _check_batch(self, batch: TrainBatch) -> None:
        check_batch(batch)
        attended = batch.attention_mask != 0
        if (attended[:, 1:] & ~attended[:, :-1]).any():
            raise ValueError(
                "the torchtitan trainer needs right-padded rows (attention_mask 1...1 0...0), "
                "as TrainBatch promises: a row has attended tokens after padding"
            )

    # ---------------------------------------------------------------- weights

    def export_weights(self, version: int) -> WeightSet | None:
        from . import hf_names

        # A collective: every rank takes part, rank 0 receives the full CPU tensors
        # (with LoRA: the adapter's A and B alone, under PEFT's Hugging Face names).
        state = self._full_state(trainable_only=self.options.lora is not None)
        if state is None:
            return None
        if self.options.lora is not None:
            from .lora import exported

            rows = hf_names.lora_rows(self.spec, self.adapter)
            return WeightSet(version=version, tensors=exported(state, self.lora_modules, rows))
        return WeightSet(version=version, tensors=hf_names.full_to_hf(self.spec, self.adapter, state))

    @classmethod
    def checkpoint_as_hf(
        cls, state: dict[str, torch.Tensor], model_path: Path, lora: LoraOptions | None
    ) -> dict[str, torch.Tensor]:
        # TorchTitan's parameter names -> the Hugging Face ones, from the model folder's
        # config alone (no model, no process group).
        from .hf_names import checkpoint_as_hf

        return checkpoint_as_hf(load_spec(model_path), state, lora, model_path)

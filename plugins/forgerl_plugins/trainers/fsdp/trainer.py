"""The ``fsdp`` trainer: a Hugging Face causal LM sharded with FSDP2 ``fully_shard``.

The step, logprobs, metrics and checkpoints are the shared ones
(:class:`forgerl_plugins.trainers.shared.base.ShardedTrainer`, which explains the
gradient scaling); here is how the model is loaded, sharded and exported.

Where the time goes (benchmarks/trainer_floor.py measures it against a bare step):
one rank trains a plain module (FSDP2 on a world of one only copies parameters and
gradients around), the LM head runs only at the positions the loss reads (shared/head.py),
rows of like length share a micro-batch, the "old" policy's logprobs are the update
forward's own (detached), and a single rank steps a fused AdamW.

With ``lora`` set, the model trains a LoRA adapter (:mod:`..shared.lora`, PEFT) on
the base weights, which stay frozen: only the adapter gets gradients, optimizer state,
checkpoints and weight exports, and the KL reference is the same model with the
adapter off.

A vision-language model (docs/vision.md) trains with its vision encoder frozen unless
``train_vision_tower`` is set (LoRA never targets it); rows with prompt images run one
forward each, with the image features the generator saw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from forgerl.errors import NotSupported
from forgerl.types import ImageInputs, WeightSet
from forgerl_plugins.models.vision import (
    freeze_vision_tower,
    image_kwargs,
    load_model,
    placeholder_ids,
    text_config,
)
from forgerl_plugins.trainers.shared.base import ShardedTrainer
from forgerl_plugins.trainers.shared.distributed import sum_gradients
from forgerl_plugins.trainers.shared.head import head_selection_works
from forgerl_plugins.trainers.shared.options import ShardedTrainerOptions

if TYPE_CHECKING:  # pragma: no cover
    import torch


class FSDPTrainer(ShardedTrainer):
    name = "fsdp"
    description = "torch FSDP2 fully_shard, AdamW, DCP checkpoints"
    requires = ("torch", "transformers")
    #: Batches may carry prompt images (a vision-language model's).
    accepts_images: ClassVar[bool] = True

    class Options(ShardedTrainerOptions):
        """The shared trainer options (LoRA included); FSDP2 itself needs none (one unit per decoder layer)."""

        train_vision_tower: bool = Field(
            False,
            description="Train a vision-language model's vision encoder too (frozen by default; LoRA never targets it).",
        )

    options: FSDPTrainer.Options

    def _build(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.lora_targets: list[str] = []
        self.model = self._load_model(trainable=True)
        # The reference model costs a full copy of the weights: only with a KL term, and
        # never with LoRA (the base model is the policy with its adapter off).
        needs_copy = self.algorithm.kl_coef > 0 and self.options.lora is None
        self.reference_model = self._load_model(trainable=False) if needs_copy else None
        self.optimizer = self._adamw()
        # After the optimizer: a forward through an FSDP2 model before its optimizer
        # exists made 2 ranks update the final norm differently from 1 (seen with the
        # tied tiny Qwen2; the 2-rank test catches it).
        self._select_head = head_selection_works(
            lambda ids: self._logits(self.model, ids, ids.new_ones(ids.shape)),
            self.model.get_output_embeddings(),
            text_config(self.model).vocab_size,
            self.device,
        )

    def _load_model(self, trainable: bool) -> Any:
        from torch.distributed.fsdp import fully_shard

        model = load_model(self._model_path, self.dtype)
        # Dropout off: the trainer's logprobs must be those of the policy the generator
        # samples from (most causal LMs have none, but some configs set it).
        model.eval()
        model.config.use_cache = False
        if not trainable:
            model.requires_grad_(False)
        elif not self.options.train_vision_tower:
            freeze_vision_tower(model)
        # The decoder block classes, read before PEFT wraps the model.
        block_names = set(getattr(model, "_no_split_modules", None) or ())
        if trainable and self.options.lora is not None:
            from forgerl_plugins.trainers.shared.lora import apply_lora, seed_adapter

            model, self.lora_targets = apply_lora(model, self.options.lora)
            seed_adapter(model, self.lora_targets, self.ctx.seed)
        if self.world_size == 1:
            # Nothing to shard: FSDP2 on one rank still copies every parameter in before
            # each forward and backward and every gradient out after it, and makes the
            # optimizer step DTensors. The update is the same (divide factor 1 on one rank).
            # from_pretrained loads on the CPU; fully_shard would move it, so here we do.
            return model.to(self.device)
        # One FSDP unit per decoder layer (parameters gathered layer by layer), then the
        # root for embeddings, final norm and head (tied embeddings stay in one unit).
        # Bottom-up (reversed pre-order), as fully_shard requires for nested units.
        for module in reversed(list(model.modules())):
            if type(module).__name__ in block_names:
                fully_shard(module, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        sum_gradients(model)
        return model

    def _logits(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def _image_logits(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: list[ImageInputs | None]
    ) -> torch.Tensor:
        import torch

        if self.world_size > 1:
            # Ranks would run different numbers of forwards (one per prompt), and FSDP2's
            # gathers must match across ranks: one rank only, for now.
            raise NotSupported(
                f"the fsdp trainer trains on images on one rank only for now ({self.world_size} ranks); "
                "see docs/vision.md"
            )
        # One forward per prompt: the samples of one prompt share its ImageInputs (the same
        # object) and run together, its features repeated; rows of different prompts may
        # have different numbers of images, which the model's image inputs cannot batch
        # without model-specific padding. Text rows run together.
        groups: dict[int, list[int]] = {}
        for b, row_images in enumerate(images):
            groups.setdefault(id(row_images), []).append(b)
        placeholders = placeholder_ids(model)
        out: torch.Tensor | None = None
        for rows in groups.values():
            shared = images[rows[0]]
            idx = torch.tensor(rows, device=input_ids.device)
            ids, mask = input_ids[idx], attention_mask[idx]
            extra: dict[str, Any] = {}
            if shared is not None:
                extra = image_kwargs(shared, self.device, self.dtype, repeat=len(rows))
                ids = ids.clone()
                for r in range(len(rows)):
                    last = int(mask[r].nonzero().max())
                    if int(ids[r, last]) in placeholders:
                        # A sampled placeholder ends its completion (the generator stops
                        # there): fed as padding, as its logits score nothing, so the model
                        # seeks no pixels for it.
                        ids[r, last] = 0
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **extra).logits
            if out is None:
                out = logits.new_empty((len(images), *logits.shape[1:]))
            out[idx] = logits
        assert out is not None, "a micro-batch has rows"
        return out

    def export_weights(self, version: int) -> WeightSet | None:
        # A collective: every rank takes part, rank 0 receives the full CPU tensors
        # (with LoRA: the adapter's A and B alone, under PEFT's file names).
        tensors = self._full_state(trainable_only=self.options.lora is not None)
        if tensors is None:
            return None
        if self.options.lora is not None:
            from forgerl_plugins.trainers.shared.lora import exported_names

            tensors = exported_names(tensors)
        return WeightSet(version=version, tensors=tensors)

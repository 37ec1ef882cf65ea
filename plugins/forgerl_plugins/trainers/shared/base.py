"""What every sharded trainer does the same way, whatever model it trains.

Every trainer rank builds one trainer and calls every method in the same order (SPMD).
Each rank receives the full batch and trains on its contiguous share of rows (see
:mod:`.batching`); with tensor parallelism the ranks of one tensor-parallel group share
one data-parallel rank and so the same rows.

Gradient scaling, the one subtle part. The GRPO loss of a batch is normalised over the
*whole* batch (token-mean divides by all loss tokens of all rows), so each micro-batch's
loss is divided by that global count (``policy_loss(..., global_count=)``): the
micro-batch losses of all ranks then *sum* to the batch loss. FSDP2 would average
gradients over ranks; a subclass makes it sum them instead (divide factor 1, plain SUM
reduce-scatter, which gloo also supports: :func:`sum_gradients`), so 2 ranks make the
same update as 1.

A subclass builds the model (``_build_model``), runs it (``_logits``) and exports its
weights under Hugging Face names (``export_weights``); the step, the logprobs, the
metrics and the DCP checkpoints (:mod:`.state`) are shared, so two trainers given the same model make the
same update (tests/integration/test_torchtitan_trainer.py). Each phase carries a
``forge.*`` profiler label.
"""

from __future__ import annotations

import abc
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from forgerl.errors import ConfigError, NotSupported
from forgerl.interfaces import RunContext, Trainer
from forgerl.types import ImageInputs, TrainBatch

from .batching import MicroBatch, check_batch, global_count, loss_ages, micro_batches, rank_rows, row_lengths
from .distributed import init_distributed, native_bf16, pick_device
from .distributed import local_preflight as check_backend_here
from .head import head_at
from .metrics import MetricAccumulator
from .state import full_state, load_checkpoint, save_checkpoint

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.adapters import LoraOptions

    from .options import ShardedTrainerOptions

log = logging.getLogger(__name__)


class ShardedTrainer(Trainer, abc.ABC):
    #: The name in messages ("the fsdp trainer needs ..."), and the one users select a
    #: subclass by (each sets its own; forgerl.registry.backend_classes).
    name = "sharded"
    #: The policy loss, and supervised fine-tuning (:meth:`_sft_step`).
    objectives: ClassVar[frozenset[str]] = frozenset({"grpo", "sft"})
    #: :meth:`export_checkpoint` writes a checkpoint as a Hugging Face folder (:mod:`.export`).
    exports_checkpoints: ClassVar[bool] = True

    @staticmethod
    def local_preflight(options: ShardedTrainerOptions) -> None:
        """Every trainer built on this base checks its process-group ``backend`` on the
        machine its ranks start on (:func:`.distributed.local_preflight`)."""
        check_backend_here(options)

    def __init__(self, options: ShardedTrainerOptions, *, context: RunContext) -> None:
        import torch
        import torch.distributed as dist

        if context.model_path is None:
            raise ConfigError(f"the {self.name} trainer needs a model folder (model.name in the config)")
        self._model_path: Path = context.model_path
        self.options = options
        self.ctx = context
        from forgerl.algorithms.config import AlgorithmConfig

        self.algorithm: AlgorithmConfig = context.algorithm or AlgorithmConfig()
        temperature = context.temperature
        # Logprobs are those of the distribution the generator samples from: logits / T.
        # Greedy (T = 0) samples no distribution; score plain logits then.
        self.temperature = temperature if temperature > 0 else 1.0
        self.dtype = getattr(torch, context.dtype)  # "float32" | "bfloat16"

        self.device = pick_device()
        native = native_bf16(self.device)
        # bf16 autocast made a SmolLM2 step 1.9x faster on a CPU with AMX and 3x slower on
        # one without native bf16 (docs/performance.md): "auto" asks for it where it pays.
        self.autocast_bf16 = native if options.autocast_bf16 == "auto" else options.autocast_bf16
        if self.autocast_bf16 and not native:
            log.warning(
                "autocast_bf16 is on but %s has no native bfloat16 (CPU: avx512_bf16 or AMX; CUDA: "
                "compute capability 8.0+): expect it slower than float32, not faster",
                self.device,
            )
        ratio = self.algorithm.effective_ratio(trainer_bf16=bool(self.autocast_bf16))
        if ratio != self.algorithm.ratio:
            self.algorithm = self.algorithm.model_copy(update={"ratio": ratio})
        log.info(
            "trainer computes in %s on %s; importance ratio against the %s logprobs",
            "bf16 autocast" if self.autocast_bf16 else "float32",
            self.device,
            "trainer's own" if ratio == "old" else "sampler's",
        )
        self._owns_process_group = init_distributed(options.backend, context, self.device)
        self._closed = False
        self.model: Any = None
        self.reference_model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._select_head = False
        try:
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            # Who trains on which rows: every rank its own, unless a subclass shards the
            # model's tensors too (then a tensor-parallel group shares one share of rows).
            self.dp_rank, self.dp_size = self.rank, self.world_size
            self.dp_group: Any = None
            torch.manual_seed(context.seed)
            self._build()
        except BaseException:
            self.close()  # do not leave a process group behind for the next attempt
            raise

    # ------------------------------------------------------------ for subclasses

    @abc.abstractmethod
    def _build(self) -> None:
        """Set ``self.model`` (trainable), ``self.reference_model`` (frozen, only when
        ``self.algorithm.kl_coef > 0``), ``self.optimizer`` (usually :meth:`_adamw`) and,
        where the model allows it, ``self._select_head`` (see :mod:`.head`)."""

    @abc.abstractmethod
    def _logits(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The model's logits for right-padded rows: ``[b, L, V]``, or ``[1, N, V]`` while
        :meth:`_head` restricts the output projection to N positions."""

    def _image_logits(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: list[ImageInputs | None]
    ) -> torch.Tensor:
        """:meth:`_logits` for rows with prompt images (``images[b]`` for row ``b``, None for
        a text row). A trainer that trains on images overrides it and sets ``accepts_images``."""
        raise NotSupported(f"the {self.name} trainer does not train on images; use trainer fsdp (docs/vision.md)")

    def _micro_images(self, batch: TrainBatch, mb: MicroBatch) -> list[ImageInputs | None] | None:
        """The prompt images of a micro-batch's rows (None when the batch has none)."""
        if batch.images is None:
            return None
        return [batch.images[r] for r in mb.rows]

    def _reference(self) -> tuple[Any, contextlib.AbstractContextManager[Any]] | None:
        """The model the KL term compares against and the context to run it in (None:
        no KL term). Default: ``self.reference_model`` as it is; a LoRA trainer gives its
        own model with the adapter switched off."""
        if self.options.lora is not None and self.algorithm.kl_coef > 0:
            from .lora import adapter_off

            return self.model, adapter_off(self.model)
        if self.reference_model is None:
            return None
        return self.reference_model, contextlib.nullcontext()

    def _update_mode(self) -> contextlib.AbstractContextManager[Any]:
        """The context of the update forward (a LoRA trainer turns its adapter's dropout on)."""
        if self.options.lora is None:
            return contextlib.nullcontext()
        from .lora import adapter_dropout

        return adapter_dropout(self.model, self.options.lora.dropout)

    def _head(self, model: Any) -> Any:
        """The output projection module that :mod:`.head` hooks (when ``_select_head``)."""
        return model.get_output_embeddings()

    def _adamw(self) -> torch.optim.Optimizer:
        import torch
        from torch.distributed.tensor import DTensor

        options = self.options
        # Only what trains: with a LoRA adapter, its A and B (no state for frozen weights).
        params = [p for p in self.model.parameters() if p.requires_grad]
        sharded = any(isinstance(p, DTensor) for p in params)
        return torch.optim.AdamW(
            params,
            lr=options.lr,
            betas=(options.betas[0], options.betas[1]),
            weight_decay=options.weight_decay,
            # The fused kernel is 4-5x faster than the per-tensor loop on CPU (0.12 vs
            # 0.54 s for 135M parameters); it takes plain tensors, not FSDP's DTensors.
            fused=None if sharded else True,
        )

    # ---------------------------------------------------------------------- forward

    def _autocast(self) -> Any:
        import torch

        if self.autocast_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward_logprobs(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        entropy: bool = False,
        positions: torch.Tensor | None = None,
        temperature: float | None = None,
        images: list[ImageInputs | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs ``[b, L-1]`` of tokens 1..L-1 (position t-1's logits predict token t),
        of the logits divided by ``temperature`` (default: the sampling temperature's).

        With ``positions`` (``[b, L-1]`` bool), only those are computed (the LM head runs
        on those hidden states alone, see :mod:`.head`); the others are 0. ``images``
        (one entry per row) are the rows' prompt images (:meth:`_image_logits`).
        """
        import torch

        from forgerl.algorithms.logprobs import selective_logprobs, token_entropy

        targets = input_ids[:, 1:]
        if images is not None and not any(i is not None for i in images):
            images = None
        # Image rows run one by one (:meth:`_image_logits`): the head hook's row order
        # assumes one forward, so the head runs everywhere then.
        select = positions if self._select_head and images is None else None
        with self._autocast(), head_at(self._head(model), select) if select is not None else contextlib.nullcontext():
            if images is None:
                logits = self._logits(model, input_ids, attention_mask)
            else:
                logits = self._image_logits(model, input_ids, attention_mask, images)
        if select is not None:
            targets = targets[select].unsqueeze(0)  # [1, N], the order of the hook's rows
        else:
            logits = logits[:, :-1]
        temperature = self.temperature if temperature is None else temperature
        if temperature != 1.0:
            logits = logits / temperature
        chunk = self.options.logprob_chunk_size
        logprobs = selective_logprobs(logits, targets, chunk)
        ent = None
        if entropy:
            with torch.no_grad():
                ent = token_entropy(logits.detach(), chunk)
        if select is not None:
            # Back to [b, L-1]: the loss masks the zeros, and their gradient goes nowhere.
            logprobs = logprobs.new_zeros(select.shape).masked_scatter(select, logprobs)
            if ent is not None:
                ent = ent.new_zeros(select.shape).masked_scatter(select, ent)
        return logprobs, ent

    def _micro_tensors(self, batch: TrainBatch, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """The rows of one micro-batch on the device, trailing all-padding columns cut."""
        import torch

        idx = torch.tensor(mb.rows, dtype=torch.long, device=batch.input_ids.device)
        attention = batch.attention_mask[idx]
        loss_mask = batch.loss_mask[idx]
        used = ((attention != 0) | (loss_mask != 0)).any(0).nonzero()
        length = int(used.max()) + 1 if used.numel() else attention.shape[1]
        length = max(length, min(2, attention.shape[1]))
        attention = attention[:, :length]
        # Padding ids may be anything (-100 included); position t's id only matters where
        # attention is on, and the embedding lookup needs a valid id everywhere.
        ids = torch.where(attention != 0, batch.input_ids[idx, :length], 0)
        loss_mask = loss_mask[:, 1:length]
        if mb.padding:
            loss_mask = torch.zeros_like(loss_mask)
        advantages = batch.advantages[idx]
        if advantages.dim() == 2:
            advantages = advantages[:, 1:length]
        out = {
            "input_ids": ids,
            "attention_mask": attention,
            "loss_mask": loss_mask,
            "behaviour_logprobs": batch.behaviour_logprobs[idx, 1:length],
            "advantages": advantages,
        }
        ages = batch.token_ages()
        if ages is not None:
            out["token_ages"] = ages[idx, 1:length]
        return {k: v.to(self.device, non_blocking=True) for k, v in out.items()}

    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        return micro_batches(
            batch.size,
            self.dp_size,
            self.dp_rank,
            self.options.micro_batch_size,
            row_lengths(batch),
            max_tokens=self.options.micro_batch_tokens,
        )

    # ------------------------------------------------------------------- Trainer API

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        import torch
        from torch.profiler import record_function

        from forgerl.algorithms.loss import gap_age_key, policy_loss

        self._check_batch(batch)
        if batch.objective not in self.objectives:
            raise ValueError(f"the {self.name} trainer trains {sorted(self.objectives)}, not {batch.objective!r}")
        if batch.objective == "sft":
            return self._sft_step(batch)
        alg = self.algorithm
        shifted_mask = batch.loss_mask[:, 1:]
        count = global_count(shifted_mask, alg.loss_agg)
        # The ages whose logprob gap is reported: those of the whole batch, which every rank
        # holds, so every micro-batch of every rank reports the same keys.
        ages = loss_ages(batch)
        acc = MetricAccumulator()
        for mb in self._micro_batches(batch):
            t = self._micro_tensors(batch, mb)
            positions = t["loss_mask"] != 0
            ref = None
            reference = self._reference()
            if reference is not None:
                ref_model, ref_mode = reference
                with torch.no_grad(), ref_mode, record_function("forge.reference_forward"):
                    ref, _ = self._forward_logprobs(
                        ref_model, t["input_ids"], t["attention_mask"], positions=positions,
                        images=self._micro_images(batch, mb),
                    )
            with self._update_mode(), record_function("forge.forward"):
                logprobs, entropy = self._forward_logprobs(
                    self.model, t["input_ids"], t["attention_mask"], self.options.log_entropy, positions,
                    images=self._micro_images(batch, mb),
                )
            # Parameters change only at optimizer.step(), after the last micro-batch: the
            # "old" policy is the current one, and its logprobs are this forward's own.
            old = logprobs.detach() if alg.ratio == "old" else None  # resolved in __init__
            with record_function("forge.loss"):
                loss, metrics = policy_loss(
                    logprobs,
                    old,
                    t["behaviour_logprobs"],
                    t["advantages"],
                    t["loss_mask"],
                    alg,
                    ref_logprobs=ref,
                    entropy=entropy,
                    global_count=count,
                    token_ages=t.get("token_ages"),
                    ages=ages,
                )
            with record_function("forge.backward"):
                loss.backward()
            # A gap by age is a mean over that age's tokens: it weighs by their number.
            by_age = {} if not ages else dict(zip(
                [gap_age_key(a) for a in ages],
                torch.stack([(positions & (t["token_ages"] == a)).sum() for a in ages]).tolist(),
            ))
            acc.add(metrics, tokens=int(positions.sum()), weights=by_age)
        metrics = self._optimizer_step(acc, shifted_mask)
        metrics["loss"] = metrics.get("loss/policy", 0.0) + metrics.get("loss/kl", 0.0)
        return metrics

    def _sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on the cross-entropy of the tokens under the loss mask
        (:func:`forgerl.sft.loss.sft_loss`): the logits as the model gives them (no
        sampling temperature), no reference model, the mean over every loss token of the
        batch (each micro-batch divides by the batch's count, so they add up)."""
        from torch.profiler import record_function

        from forgerl.sft.loss import sft_loss

        shifted_mask = batch.loss_mask[:, 1:]
        count = global_count(shifted_mask, "token_mean")
        acc = MetricAccumulator()
        for mb in self._micro_batches(batch):
            t = self._micro_tensors(batch, mb)
            positions = t["loss_mask"] != 0
            with self._update_mode(), record_function("forge.forward"):
                logprobs, entropy = self._forward_logprobs(
                    self.model, t["input_ids"], t["attention_mask"], self.options.log_entropy, positions,
                    temperature=1.0, images=self._micro_images(batch, mb),
                )
            with record_function("forge.loss"):
                loss, metrics = sft_loss(logprobs, t["loss_mask"], global_count=count, entropy=entropy)
            with record_function("forge.backward"):
                loss.backward()
            acc.add(metrics, tokens=int(positions.sum()))
        metrics = self._optimizer_step(acc, shifted_mask)
        metrics["loss"] = metrics.get("loss/sft", 0.0)
        return metrics

    def _optimizer_step(self, acc: MetricAccumulator, shifted_mask: torch.Tensor) -> dict[str, float]:
        """Clip, step and clear the gradients the micro-batches left; the step's metrics
        (the accumulated ones over every rank, the gradient norm, the learning rate and
        what was trained on)."""
        from torch.profiler import record_function

        _, optimizer = self._live()
        with record_function("forge.clip_gradients"):
            grad_norm = self._clip_gradients()
        with record_function("forge.optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        with record_function("forge.metrics"):
            metrics = acc.reduce(self.device, self.dp_group)
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = float(optimizer.param_groups[0]["lr"])
        metrics["train/tokens"] = float((shifted_mask != 0).sum())
        metrics["train/sequences"] = float((shifted_mask != 0).any(-1).sum())
        return metrics

    def _clip_gradients(self) -> float:
        import torch

        model, _ = self._live()
        params = [p for p in model.parameters() if p.grad is not None]
        # max_norm = inf measures the norm and scales by exactly 1.
        max_norm = self.options.max_grad_norm if self.options.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2 parameters are DTensors: reduce over shards
            norm = norm.full_tensor()
        return float(norm)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` fp32 logprobs of every attended token but the first (0 at position 0
        and at padding), the same on every rank, on the batch's device."""
        import torch
        import torch.distributed as dist

        self._check_batch(batch)
        size, length = batch.input_ids.shape
        mine = rank_rows(size, self.dp_size, self.dp_rank)
        share = -(-size // self.dp_size)
        local = torch.zeros(share, length, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for mb in self._micro_batches(batch):
                t = self._micro_tensors(batch, mb)
                lp, _ = self._forward_logprobs(
                    self.model, t["input_ids"], t["attention_mask"], images=self._micro_images(batch, mb)
                )
                if mb.padding:
                    continue
                lp = torch.where(t["attention_mask"][:, 1:] != 0, lp.float(), 0.0)
                rows = torch.tensor([r - mine.start for r in mb.rows], device=self.device)
                local[rows, 1:1 + lp.shape[1]] = lp
        # all_gather needs equal shapes: every rank sends `share` rows, the extra ones dropped.
        gathered = [torch.empty_like(local) for _ in range(self.dp_size)]
        dist.all_gather(gathered, local, group=self.dp_group)
        parts = [g[: len(rank_rows(size, self.dp_size, r))] for r, g in enumerate(gathered)]
        return torch.cat(parts).to(batch.input_ids.device)

    def save(self, path: Path) -> None:
        save_checkpoint(*self._live(), Path(path))

    def load(self, path: Path) -> None:
        """Load a checkpoint written by :meth:`save` (:func:`.state.load_checkpoint`)."""
        load_checkpoint(*self._live(), Path(path))

    @classmethod
    def export_checkpoint(
        cls, state: Path, output: Path, *, options: ShardedTrainerOptions, model_path: Path, dtype: str
    ) -> None:
        """The policy of a checkpoint's trainer state as a Hugging Face folder (a LoRA
        adapter merged in): what ``forge export`` writes (:mod:`.export`)."""
        from .export import read_model_state, write_model

        write_model(cls.checkpoint_as_hf(read_model_state(Path(state)), model_path, options.lora), options.lora,
                    model_path, dtype, Path(output))  # fmt: skip

    @classmethod
    def checkpoint_as_hf(
        cls, state: dict[str, torch.Tensor], model_path: Path, lora: LoraOptions | None
    ) -> dict[str, torch.Tensor]:
        """``forge export`` (:mod:`.export`): the model tensors of a checkpoint :meth:`save`
        wrote, read in one process without building a trainer, under the names a
        checkpoint of the Hugging Face model holds (PEFT's model names for a LoRA
        adapter: ``base_model.model.<module>.lora_A.default.weight``). A trainer whose
        parameter names are others converts them (``torchtitan``); CheckpointUnusable
        for tensors that do not fit the model in ``model_path``."""
        return state  # the Hugging Face model's own parameters (fsdp)

    def _live(self) -> tuple[Any, torch.optim.Optimizer]:
        """The model and its optimizer, set from construction until :meth:`close`."""
        assert self.model is not None and self.optimizer is not None, f"the {self.name} trainer is closed"
        return self.model, self.optimizer

    def _full_state(self, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The model's full state dict on rank 0, None elsewhere (:func:`.state.full_state`);
        a collective: every rank calls it."""
        model, _ = self._live()
        return full_state(model, rank=self.rank, world_size=self.world_size, device=self.device,
                          trainable_only=trainable_only)  # fmt: skip

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        import torch.distributed as dist

        self.model = self.reference_model = self.optimizer = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def _check_batch(self, batch: TrainBatch) -> None:
        check_batch(batch)

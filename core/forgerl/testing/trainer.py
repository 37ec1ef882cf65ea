"""The Trainer kit: what a run relies on from a trainer, checked against one backend by name
on a tiny model built offline.

What it checks (each a test of :class:`TrainerContract`):

- the backend builds through the registry, as its class, ``Class(options, *,
  context=RunContext)``, into a :class:`~forgerl.interfaces.Trainer` on one rank;
- ``export_weights(version)`` returns a WeightSet of that version whose names, shapes and
  values are the model's Hugging Face ``state_dict()`` (what every generator loads by
  name), as fresh tensors: the next ``train_step`` does not change a version already
  handed to the transport (a transport keeps it for workers that join late);
- ``train_step`` returns finite numbers including the algorithm's metrics
  (:data:`forgerl.algorithms.METRIC_KEYS` that apply: ``kl/ref`` only with a KL term,
  ``entropy`` optional), and changes the weights;
- the trainer's logprobs are ``log_softmax(logits / T)`` of a plain transformers forward
  pass at the run's sampling temperature: trained on a batch whose behaviour logprobs
  come from that forward pass, its ``logprob_gap/max`` is about 0;
- a batch whose advantages are all 0 has a zero loss gradient: the first step leaves every
  weight where it was, up to a uniform shrink per tensor (weight decay), and a reported
  ``grad_norm`` is 0;
- per-token advantages (``TrainBatch.advantages`` ``[B, T]``, on-policy distillation's) are
  honoured: a ``[B, T]`` batch whose rows are constant trains exactly like the ``[B]`` one,
  and on an on-policy batch (ratio 1) the first step's ``loss/policy`` is minus the
  aggregate of each loss token's own advantage (read at its token, not its row's first);
- a checkpoint resumes exactly: ``save``, then ``load`` into a fresh trainer, restores the
  weights, and the next step gives the same metrics and weights as without the break;
- a KL term (``algorithm.kl_coef > 0``) is honoured (``kl/ref`` is reported) or refused
  when the trainer is built, with a one-line :class:`~forgerl.errors.UserError`;
- a trainer that lists ``sft`` in its ``objectives`` trains a batch of that objective on
  the cross-entropy transformers computes for labels ``-100`` outside the loss mask (its
  ``loss``, within ``sft_tolerance``), at the plain logits whatever the sampling
  temperature (supervised fine-tuning, docs/sft.md);
- ``close()`` (twice: it is idempotent) leaves no threads or child processes it started
  and no default ``torch.distributed`` process group it created;
- with :attr:`TrainerContract.two_ranks`, two ranks in their own processes (a gloo group
  on loopback, as a scheduler starts them: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``) take the same step as one rank: the weights after a step agree, the
  loss agrees, every rank reports the same metrics, only rank 0 gets the exported
  weights, and a checkpoint saved and loaded on two ranks resumes exactly.

A subclass names the backend (``backend``), its options as a config holds them
(``options``), the plugins to load when it is not installed (``plugins``) and, if not the
``tiny`` model, the model backend to build the test model with (``model``,
``model_options``); ``config`` overrides the run config (e.g. ``{"algorithm": {"loss_agg":
"token_mean"}}``). Tolerances are class attributes.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from forgerl.testing.registry import backend_under_test, registry_for
from forgerl.testing.timing import hard_limit, scaled, wait_until
from forgerl.testing.trainer_support import (
    beside_two_ranks,
    compared_metrics,
    finite_number,
    live_children,
    make_batch,
    max_difference,
    merged,
    moved_beyond_decay,
    on_policy,
    rank_scenario,
    reference_model,
    relative_step_difference,
    run_config,
    run_context,
    snapshot_one_rank,
    temperature_of,
)

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import Trainer

#: Model folders built by the kits of this session, by (model backend, options).
_MODELS: dict[str, Path] = {}


class TrainerContract:
    """Base class of a plugin's trainer conformance tests (see the module's docstring)."""

    #: The trainer's backend name, as ``trainer.name`` in a config.
    backend: ClassVar[str] = ""
    #: Its options, as ``trainer.options`` holds them (plain data).
    options: ClassVar[Mapping[str, Any]] = {}
    #: Plugin modules to load besides the installed ones (import paths).
    plugins: ClassVar[Sequence[str]] = ()
    #: Fail, rather than skip, when the backend cannot be used here.
    required: ClassVar[bool] = False
    #: The model backend that builds the test model (``tiny``: a random Qwen2, offline).
    model: ClassVar[str] = "tiny"
    model_options: ClassVar[Mapping[str, Any]] = {}
    #: Run config overrides (plain data), merged over a fixed seed and the temperature.
    config: ClassVar[Mapping[str, Any]] = {}
    #: The sampling temperature the trainer's logprobs must be computed at.
    temperature: ClassVar[float] = 0.7
    #: Whether to check two ranks (gloo on CPU) against one.
    two_ranks: ClassVar[bool] = False
    #: Most |trainer logprob - transformers logprob| allowed (fp32).
    logprob_tolerance: ClassVar[float] = 1e-4
    #: Most difference allowed between the step of one rank and of two, relative to the
    #: step (over all weights; see trainer_support.relative_step_difference).
    rank_tolerance: ClassVar[float] = 1e-3
    #: Most difference allowed between a resumed step and the original (0: bit-exact).
    resume_tolerance: ClassVar[float] = 0.0
    #: Most |trainer's sft loss - transformers' cross-entropy| allowed (fp32).
    sft_tolerance: ClassVar[float] = 1e-5
    #: Seconds (scaled) each test may run before it fails instead of hanging the suite.
    hard_limits: ClassVar[Mapping[str, float]] = {"test_two_ranks_take_the_same_step_as_one": 420}
    default_hard_limit: ClassVar[float] = 180

    # ---------------------------------------------------------------- fixtures

    @pytest.fixture
    def model_dir(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The test model's Hugging Face folder, built once per session and options."""
        key = json.dumps([self.model, dict(self.model_options)], sort_keys=True)
        if key not in _MODELS or not _MODELS[key].is_dir():
            record = backend_under_test("model", self.model, self.plugins)
            cache = tmp_path_factory.mktemp("kit-models")
            _MODELS[key] = Path(record.build(dict(self.model_options), cache_dir=cache))
        return _MODELS[key]

    @pytest.fixture(autouse=True)
    def _hard_timeout(self, request: pytest.FixtureRequest) -> Iterator[None]:
        name = getattr(request.function, "__name__", "")
        limit = max(1, int(scaled(self.hard_limits.get(name, self.default_hard_limit))))
        with hard_limit(limit, f"{request.node.nodeid} ran past its hard timeout of {limit} s"):
            yield

    # ----------------------------------------------------------------- helpers

    def config_data(self, **overrides: Any) -> dict[str, Any]:
        """The run config (plain data) a trainer of this kit is built with."""
        return merged(run_config(self.config, self.temperature), overrides)

    def build(self, model_dir: Path, run_dir: Path, config: Mapping[str, Any] | None = None) -> Trainer:
        """A new trainer on one rank, built as a run builds it."""
        record = backend_under_test("trainer", self.backend, self.plugins, required=self.required)
        context = run_context(model_dir, run_dir, config or self.config_data())
        return record.build(dict(self.options), context=context)

    def batch(self, model_dir: Path, seed: int, rows: int = 4, zero_advantages: bool = False) -> Any:
        """An on-policy batch: behaviour logprobs from a plain transformers forward pass."""
        batch = make_batch(model_dir, rows=rows, seed=seed, zero_advantages=zero_advantages)
        return on_policy(batch, reference_model(model_dir), temperature_of(self.config_data()))

    # ------------------------------------------------------------------- tests

    def test_builds_a_trainer_through_the_registry(self, model_dir: Path, tmp_path: Path) -> None:
        from forgerl.interfaces import Trainer

        trainer = self.build(model_dir, tmp_path)
        try:
            assert isinstance(trainer, Trainer), (
                f"trainer {self.backend!r} built a {type(trainer).__name__}, not a forgerl.interfaces.Trainer"
            )
        finally:
            trainer.close()

    def test_exports_the_models_weights_under_hugging_face_names(self, model_dir: Path, tmp_path: Path) -> None:
        import torch

        original = reference_model(model_dir).state_dict()
        trainer = self.build(model_dir, tmp_path)
        try:
            exported = trainer.export_weights(7)
            assert exported is not None, "export_weights returned None on rank 0 of 1"
            assert exported.version == 7, f"export_weights(7) returned version {exported.version}"
            tensors = exported.tensors
            missing, extra = sorted(original.keys() - tensors.keys()), sorted(tensors.keys() - original.keys())
            assert not missing and not extra, (
                f"exported names are not the Hugging Face model's state_dict() keys: missing {missing[:8]}, "
                f"unexpected {extra[:8]} (strip wrappers' prefixes such as 'module.' or '_orig_mod.')"
            )
            shapes = {n: (tuple(tensors[n].shape), tuple(t.shape)) for n, t in original.items()}
            wrong = {n: s for n, s in shapes.items() if s[0] != s[1]}
            assert not wrong, f"exported shapes differ from the model's (exported, model): {wrong}"
            values = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
            differ = [n for n, t in original.items() if not torch.equal(values[n], t.to(values[n].dtype))]
            assert not differ, f"before any step, exported {differ[:8]} differ from the model folder's weights"
            trainer.train_step(self.batch(model_dir, seed=1))
            changed = [n for n, t in tensors.items() if not torch.equal(t.detach().cpu(), values[n])]
            assert not changed, (
                f"train_step changed the tensors of a version already exported ({changed[:5]}...): "
                "export fresh tensors (a copy), since a transport keeps a version for workers that join late"
            )
        finally:
            trainer.close()

    def test_train_step_reports_the_algorithms_metrics_and_changes_the_weights(
        self, model_dir: Path, tmp_path: Path
    ) -> None:
        from forgerl.algorithms import METRIC_KEYS

        trainer = self.build(model_dir, tmp_path)
        try:
            before = snapshot_one_rank(trainer, 0)
            metrics = trainer.train_step(self.batch(model_dir, seed=2))
            after = snapshot_one_rank(trainer, 1)
        finally:
            trainer.close()
        assert isinstance(metrics, Mapping), f"train_step returned a {type(metrics).__name__}, not a dict"
        optional = {"entropy", "kl/ref"}  # entropy: optional; kl/ref: only with a KL term
        missing = [k for k in METRIC_KEYS if k not in optional and k not in metrics]
        assert not missing, f"train_step's metrics lack the algorithm's {missing} (forgerl.algorithms.policy_loss)"
        bad = {k: v for k, v in metrics.items() if not finite_number(v)}
        assert not bad, f"train_step returned metrics that are not finite numbers: {bad}"
        diff, _ = max_difference(before, after)
        assert diff > 0, "train_step on a batch with non-zero advantages left every weight unchanged"

    def test_logprobs_match_a_plain_hugging_face_forward(self, model_dir: Path, tmp_path: Path) -> None:
        trainer = self.build(model_dir, tmp_path)
        try:
            metrics = trainer.train_step(self.batch(model_dir, seed=3))
        finally:
            trainer.close()
        gap = metrics.get("logprob_gap/max")
        assert gap is not None, "train_step reports no logprob_gap/max (pass behaviour_logprobs to policy_loss)"
        assert gap <= self.logprob_tolerance, (
            f"the trainer's logprobs are {gap:.3g} away from log_softmax(logits / T) of a plain transformers "
            f"forward pass at T = {self.temperature} (tolerance {self.logprob_tolerance}): the run would train "
            "on logprobs its generator did not sample with"
        )

    def test_sft_loss_is_transformers_cross_entropy(self, model_dir: Path, tmp_path: Path) -> None:
        import dataclasses

        import torch

        record = backend_under_test("trainer", self.backend, self.plugins, required=self.required)
        if "sft" not in getattr(record.load_factory(), "objectives", frozenset({"grpo"})):
            return  # a trainer that does not train the objective is refused before a run starts
        raw = make_batch(model_dir, rows=4, seed=8)
        batch = dataclasses.replace(raw, objective="sft", advantages=torch.zeros(raw.size))
        ids = torch.where(batch.attention_mask != 0, batch.input_ids, 0)
        labels = torch.where(batch.loss_mask != 0, ids, -100)
        with torch.no_grad():
            expected = float(reference_model(model_dir)(input_ids=ids, attention_mask=batch.attention_mask,
                                                        labels=labels).loss)  # fmt: skip
        trainer = self.build(model_dir, tmp_path)
        try:
            loss = trainer.train_step(batch).get("loss")
        finally:
            trainer.close()
        assert loss is not None, "train_step on an sft batch reports no loss"
        assert abs(loss - expected) <= self.sft_tolerance, (
            f"the sft loss is {loss:.7g}, transformers' cross-entropy of the same labels {expected:.7g} (tolerance "
            f"{self.sft_tolerance}): the mean negative log-likelihood of the loss-mask tokens over the whole batch, "
            "at the plain logits (no sampling temperature)"
        )

    def test_zero_advantages_leave_the_weights_alone(self, model_dir: Path, tmp_path: Path) -> None:
        trainer = self.build(model_dir, tmp_path)
        try:
            before = snapshot_one_rank(trainer, 0)
            metrics = trainer.train_step(self.batch(model_dir, seed=4, zero_advantages=True))
            after = snapshot_one_rank(trainer, 1)
        finally:
            trainer.close()
        moved = moved_beyond_decay(before, after)
        assert not moved, (
            "a batch whose advantages are all 0 has a zero loss gradient, but the first step moved weights "
            f"beyond a weight-decay shrink: {moved[:5]}"
        )
        if "grad_norm" in metrics:
            assert abs(metrics["grad_norm"]) <= 1e-6, f"grad_norm {metrics['grad_norm']} with all advantages 0"
        assert abs(metrics.get("loss/policy", 0.0)) <= 1e-6, f"loss/policy {metrics['loss/policy']} with advantages 0"

    def test_per_token_advantages_constant_along_rows_train_like_per_row_ones(
        self, model_dir: Path, tmp_path: Path
    ) -> None:
        per_row = self.batch(model_dir, seed=11)
        per_token = copy.copy(per_row)
        per_token.advantages = per_row.advantages.unsqueeze(-1).expand_as(per_row.behaviour_logprobs).clone()
        results = []
        for name, batch in (("per-row", per_row), ("per-token", per_token)):
            trainer = self.build(model_dir, tmp_path / name)
            try:
                metrics = compared_metrics(trainer.train_step(batch))
                results.append((metrics, snapshot_one_rank(trainer, 1)))
            finally:
                trainer.close()
        (row_metrics, row_weights), (token_metrics, token_weights) = results
        differ = {k: (row_metrics[k], token_metrics.get(k)) for k in row_metrics
                  if not math.isclose(row_metrics[k], token_metrics.get(k, math.inf), rel_tol=1e-5, abs_tol=1e-6)}
        assert not differ, (
            "advantages [B, T] equal to the row's [B] value at every token train differently from the [B] ones "
            f"(per-row, per-token): {differ}; read TrainBatch.advantages per token when it is [B, T]"
        )
        diff, name = max_difference(row_weights, token_weights)
        assert diff <= 1e-5, f"after the same step with [B] and [B, T] advantages {name} differs by {diff:.3g}"

    def test_per_token_advantages_are_read_at_their_tokens(self, model_dir: Path, tmp_path: Path) -> None:
        import torch

        from forgerl.algorithms.loss import aggregate_loss
        from forgerl.configuration.config import RunConfig

        batch = self.batch(model_dir, seed=12)
        gen = torch.Generator().manual_seed(12)
        # Different at every token: a trainer that reads them one token off, or one value
        # per row, takes another step.
        batch.advantages = torch.randn(batch.behaviour_logprobs.shape, generator=gen) * batch.loss_mask
        algorithm = RunConfig.model_validate(self.config_data()).algorithm  # as the trainer gets it
        mask = batch.loss_mask[:, 1:] != 0
        advantages = batch.advantages[:, 1:]
        # On-policy, the first step's ratio is 1: the loss is -agg(A_t) and its gradient
        # -agg(A_t grad log p_t), computed here with plain transformers.
        model = reference_model(model_dir)
        ids = torch.where(batch.attention_mask != 0, batch.input_ids, 0)
        logits = model(input_ids=ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits / temperature_of(self.config_data()), -1).gather(-1, ids[:, 1:, None])[..., 0]
        per_token = -advantages * torch.exp(logprobs - logprobs.detach())
        reference = aggregate_loss(per_token, mask, algorithm.loss_agg, algorithm.loss_norm_constant)
        reference.backward()  # type: ignore[no-untyped-call]  # the model's output is untyped
        expected = float(reference.detach())
        expected_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))
        trainer = self.build(model_dir, tmp_path)
        try:
            metrics = trainer.train_step(batch)
        finally:
            trainer.close()
        got = metrics.get("loss/policy")
        assert got is not None, "train_step reports no loss/policy"
        assert abs(got - expected) <= 1e-3, (
            f"with per-token advantages loss/policy is {got:.6g}, expected {expected:.6g} (minus the "
            f"{algorithm.loss_agg} of each loss token's advantage at ratio 1): TrainBatch.advantages[:, t] is the "
            "advantage of token input_ids[:, t], as behaviour_logprobs[:, t] is its logprob"
        )
        if "grad_norm" in metrics:
            norm = metrics["grad_norm"]
            assert math.isclose(norm, expected_norm, rel_tol=1e-3), (
                f"with per-token advantages the gradient's norm is {norm:.6g}, expected {expected_norm:.6g} (that of "
                "-agg(A_t log p_t) with each token's own advantage): TrainBatch.advantages[:, t] weighs token "
                "input_ids[:, t] alone"
            )

    def test_checkpoint_resumes_exactly_in_a_fresh_trainer(self, model_dir: Path, tmp_path: Path) -> None:
        first, second = self.batch(model_dir, seed=5), self.batch(model_dir, seed=6)
        checkpoint = tmp_path / "checkpoint"
        checkpoint.mkdir()  # forgerl creates the directory and hands it to save()
        trainer = self.build(model_dir, tmp_path / "run")
        try:
            trainer.train_step(first)
            trainer.save(checkpoint)
            saved = snapshot_one_rank(trainer, 1)
            expected = compared_metrics(trainer.train_step(second))
            expected_weights = snapshot_one_rank(trainer, 2)
        finally:
            trainer.close()
        fresh = self.build(model_dir, tmp_path / "resumed")
        try:
            fresh.load(checkpoint)
            loaded = snapshot_one_rank(fresh, 1)
            got = compared_metrics(fresh.train_step(second))
            got_weights = snapshot_one_rank(fresh, 2)
        finally:
            fresh.close()
        tol = self.resume_tolerance
        diff, name = max_difference(saved, loaded)
        assert diff <= tol, f"load() of the checkpoint restored {name} {diff:.3g} away from what save() saw"
        assert got.keys() == expected.keys(), f"metric keys differ after resume: {sorted(got.keys() ^ expected.keys())}"
        differ = {k: (expected[k], got[k]) for k in got if not abs(got[k] - expected[k]) <= tol}
        assert not differ, (
            "the step after resuming from the checkpoint reports other metrics than the step without the "
            f"break (expected, resumed): {differ}"
        )
        diff, name = max_difference(expected_weights, got_weights)
        assert diff <= tol, (
            f"after the resumed step {name} is {diff:.3g} away from the uninterrupted run's: save and load "
            "the optimiser's state (Adam's moments, its step count) with the model's"
        )

    def test_kl_term_is_honoured_or_refused_when_built(self, model_dir: Path, tmp_path: Path) -> None:
        from forgerl.errors import UserError

        config = self.config_data(algorithm={"kl_coef": 0.1})
        try:
            trainer = self.build(model_dir, tmp_path, config)
        except UserError as exc:
            assert "\n" not in str(exc).strip(), f"the refusal is not one line: {exc}"
            return
        try:
            metrics = trainer.train_step(self.batch(model_dir, seed=7))
        finally:
            trainer.close()
        assert "kl/ref" in metrics, (
            "with algorithm.kl_coef 0.1 train_step reports no kl/ref: give policy_loss the reference model's "
            "logprobs, or refuse kl_coef > 0 with a UserError when built"
        )
        assert finite_number(metrics["kl/ref"]), f"kl/ref is {metrics['kl/ref']}"

    def test_close_releases_processes_threads_and_the_process_group(self, model_dir: Path, tmp_path: Path) -> None:
        import torch.distributed as dist

        from forgerl.testing.transport_support import threads_left

        threads_before = set(threading.enumerate())
        children_before = live_children()
        group_before = dist.is_available() and dist.is_initialized()
        trainer = self.build(model_dir, tmp_path)
        try:
            trainer.train_step(self.batch(model_dir, seed=8))
            trainer.export_weights(1)
        finally:
            trainer.close()
        trainer.close()  # idempotent: forgerl may close again while unwinding
        if not group_before:
            initialised = dist.is_available() and dist.is_initialized()
            if initialised:
                dist.destroy_process_group()  # so that the checks after this one start clean
            assert not initialised, (
                "close() left the default torch.distributed process group it created: another trainer built "
                "in this process cannot create its own"
            )
        stacks = threads_left(threads_before, 15)
        assert not stacks, f"threads the trainer started still run after close():\n{stacks}"
        wait_until(lambda: not (live_children() - children_before), 15, "the trainer's child processes to exit")

    def test_two_ranks_take_the_same_step_as_one(self, model_dir: Path, tmp_path: Path) -> None:
        if not self.two_ranks:
            pytest.skip(f"{type(self).__name__}.two_ranks is False: the trainer is checked on one rank only")
        backend_under_test("trainer", self.backend, self.plugins, required=self.required)
        out = tmp_path / "two-ranks"
        (out / "checkpoint").mkdir(parents=True)
        spec: dict[str, Any] = {
            "backend": self.backend,
            "options": dict(self.options),
            "plugins": list(registry_for(self.plugins).plugin_refs),
            "model_dir": str(model_dir),
            "run_dir": str(out),
            "config": self.config_data(),
            "checkpoint": str(out / "checkpoint"),
            "out": str(out),
        }
        (out / "spec.json").write_text(json.dumps(spec))

        def one_rank() -> dict[str, Any]:
            (tmp_path / "one-rank").mkdir()
            trainer = self.build(model_dir, tmp_path / "one-rank")
            try:
                return rank_scenario(trainer, model_dir, tmp_path / "one-rank", temperature_of(spec["config"]))
            finally:
                trainer.close()

        command = [sys.executable, "-m", "forgerl.testing.trainer_rank", str(out / "spec.json")]
        one = beside_two_ranks(command, out, one_rank, scaled(300))
        self._compare_ranks(one, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], out)

    def _compare_ranks(self, one: dict[str, Any], two: list[dict[str, Any]], out: Path) -> None:
        from safetensors.torch import load_file

        assert two[0]["exported"] == [True] * 3, f"rank 0 of 2: export_weights returned None ({two[0]['exported']})"
        assert two[1]["exported"] == [False] * 3, "rank 1 of 2: export_weights must return None off rank 0"
        for step, (a, b) in enumerate(zip(two[0]["metrics"], two[1]["metrics"])):
            a, b = compared_metrics(a), compared_metrics(b)
            differ = {k: (a[k], b.get(k)) for k in a if b.get(k) is None or not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-7)}
            assert not differ, f"step {step + 1}: ranks 0 and 1 report different metrics (rank 0, rank 1): {differ}"
        first_one, first_two = one["metrics"][0], two[0]["metrics"][0]
        assert compared_metrics(first_one).keys() == compared_metrics(first_two).keys(), (
            f"metric keys differ between 1 and 2 ranks: {sorted(first_one.keys() ^ first_two.keys())}"
        )
        for key, why in (("loss/policy", "normalise the loss over the whole batch, not each rank's rows"),
                         ("grad_norm", "sum gradients over ranks (FSDP and DDP average them by default)")):
            if key in first_one and key in first_two:
                a, b = first_one[key], first_two[key]
                assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), f"{key} {a} on 1 rank, {b} on 2: {why}"
        gap = first_two.get("logprob_gap/max", 0.0)
        assert gap <= self.logprob_tolerance, f"on 2 ranks logprob_gap/max is {gap:.3g}"
        two_weights = load_file(str(out / "weights.safetensors"))
        rel, name = relative_step_difference(one["initial"], one["weights"], two_weights)
        assert rel <= self.rank_tolerance, (
            f"the step on 2 ranks differs from the step on 1 by {rel:.3g} of its size (most at {name}; tolerance "
            f"{self.rank_tolerance}): sum gradients over ranks, with the loss normalised over the whole batch"
        )
        resumed, original = compared_metrics(two[0]["metrics"][2]), compared_metrics(two[0]["metrics"][1])
        tol = self.resume_tolerance
        differ = {k: (original[k], resumed.get(k)) for k in original if not abs(resumed.get(k, math.inf) - original[k]) <= tol}
        assert not differ, f"on 2 ranks the step after load() differs from the step after save(): {differ}"
        diff, name = two[0]["resume_diff"]
        assert diff <= tol, f"on 2 ranks, after load() and the same step, {name} is {diff:.3g} away"


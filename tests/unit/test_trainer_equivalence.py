"""The ``fsdp`` trainer's fast paths give the update a plain implementation gives.

The trainer skips FSDP on one rank, runs the LM head only at loss positions, groups
rows of like length into micro-batches, takes the "old" logprobs from the update
forward and steps a fused AdamW (see plugins/forgerl_plugins/trainers/fsdp/trainer.py). None of that may
change what a step computes: here the same batch goes through a reference written the
obvious way (one forward over the whole batch, full-vocabulary ``log_softmax``, a separate
no-grad forward for the old policy, ``clip_grad_norm_``, the per-tensor AdamW loop) and
through ``train_step``; per-token logprobs, loss, metrics and the updated policy must agree
to fp32 precision. 2 ranks (FSDP) against 1 are compared in
tests/integration/test_trainers.py::test_two_gloo_ranks_match_fsdp_on_one_rank.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.helpers import trainer_worker as worker  # noqa: E402

RTOL = 1e-5


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs() / want.abs().clamp(min=1.0)).max())


class PlainGRPO:
    """A GRPO step with nothing clever in it: the reference the trainer is held to."""

    def __init__(self, model_dir: Path, algorithm, lr: float, max_grad_norm: float) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.reference = copy.deepcopy(self.model).requires_grad_(False) if algorithm.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, foreach=False)
        self.algorithm = algorithm
        self.max_grad_norm = max_grad_norm

    def logprobs(self, model, batch) -> torch.Tensor:
        """[B, T-1]: log_softmax(logits / T) of tokens 1..T-1, every position."""
        from forgerl.algorithms.logprobs import naive_selective_logprobs

        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        return naive_selective_logprobs(logits / worker.TEMPERATURE, batch.input_ids[:, 1:])

    def step(self, batch) -> tuple[float, float, float]:
        """(loss, mean entropy over loss tokens, gradient norm)."""
        from forgerl.algorithms.logprobs import naive_token_entropy
        from forgerl.algorithms.loss import masked_mean, policy_loss

        mask = batch.loss_mask[:, 1:]
        with torch.no_grad():
            old = self.logprobs(self.model, batch) if self.algorithm.ratio == "old" else None
            ref = self.logprobs(self.reference, batch) if self.reference is not None else None
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        logprobs = torch.log_softmax(logits / worker.TEMPERATURE, -1).gather(
            -1, batch.input_ids[:, 1:].unsqueeze(-1)
        ).squeeze(-1)
        loss, _ = policy_loss(
            logprobs, old, batch.behaviour_logprobs[:, 1:], batch.advantages, mask, self.algorithm,
            ref_logprobs=ref,
        )
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        entropy = masked_mean(naive_token_entropy(logits.detach() / worker.TEMPERATURE), mask)
        return float(loss.detach()), float(entropy), float(norm)


@pytest.mark.parametrize(
    "algorithm",
    [
        {},  # the default: grpo, behaviour ratio, no KL
        {"ratio": "old", "kl_coef": 0.1, "loss_agg": "token_mean"},  # old logprobs, reference model
        {"sequence_level_ratio": True, "loss_agg": "seq_mean_token_mean", "clip_high": 0.28},
    ],
    ids=["grpo", "old+kl", "gspo"],
)
def test_train_step_matches_a_plain_grpo_step(tiny_model_dir: Path, tmp_path: Path, algorithm: dict) -> None:
    # 7 rows of varied length in micro-batches of 3: rows are regrouped by length, the
    # last micro-batch is short, and every micro-batch is cut to its own length.
    batch = worker.make_batch(tiny_model_dir, rows=7, seed=11, length=20)
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=3, algorithm=algorithm)
    try:
        assert trainer._select_head, "the tiny Qwen2 must take the LM-head-at-loss-positions path"
        options = trainer.options
        plain = PlainGRPO(tiny_model_dir, trainer.algorithm, options.lr, options.max_grad_norm)
        attended = batch.attention_mask[:, 1:] != 0
        with torch.no_grad():
            want_before = plain.logprobs(plain.model, batch)
        got_before = trainer.logprobs(batch)[:, 1:]
        assert _rel_err(got_before[attended], want_before[attended]) < RTOL, "logprobs before the step"

        # Behaviour logprobs a little off the policy, so ratios differ from 1 and clip.
        noise = 0.3 * torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
        behaviour = torch.zeros_like(batch.loss_mask)
        behaviour[:, 1:] = (want_before + noise[:, 1:]) * batch.loss_mask[:, 1:]
        batch = dataclasses.replace(batch, behaviour_logprobs=behaviour)

        metrics = trainer.train_step(batch)
        loss, entropy, grad_norm = plain.step(batch)
        got_after = trainer.logprobs(batch)[:, 1:]
        with torch.no_grad():
            want_after = plain.logprobs(plain.model, batch)
    finally:
        trainer.close()
    for key, want in (("loss", loss), ("entropy", entropy), ("grad_norm", grad_norm)):
        assert metrics[key] == pytest.approx(want, rel=RTOL, abs=1e-7), f"{key}: {metrics[key]}, plain {want}"
    moved = float((want_after - want_before)[attended].abs().max())
    assert moved > 1e-3, f"the step hardly moved the policy ({moved}): the comparison would prove nothing"
    err = _rel_err(got_after[attended], want_after[attended])
    assert err < RTOL, f"logprobs after the step differ from the plain step's by {err} (relative)"


def test_rows_of_like_length_share_a_micro_batch() -> None:
    from forgerl_plugins.trainers.shared.batching import micro_batches

    lengths = [5, 20, 6, 19, 7, 18]
    assert [mb.rows for mb in micro_batches(6, 1, 0, 2, lengths)] == [[1, 3], [5, 4], [2, 0]]
    # Still each rank's own contiguous share, the same count of micro-batches everywhere.
    assert [mb.rows for mb in micro_batches(6, 2, 1, 2, lengths)] == [[3, 5], [4]]
    padded = [(mb.rows, mb.padding) for mb in micro_batches(5, 2, 1, 2, lengths[:5])]
    assert padded == [([3, 4], False), ([0], True)]


def test_micro_batches_fill_up_to_a_token_budget() -> None:
    """The default micro-batching: rows of like length share a pass up to
    ``micro_batch_tokens`` positions (rows x the longest), so short rows go many at a time
    and long ones few, with the same count of passes on every rank."""
    from forgerl_plugins.trainers.shared.batching import micro_batches

    lengths = [5, 20, 6, 19, 7, 18]

    def rows(rank: int = 0, world: int = 1, size: int | None = None, **limits) -> list:
        return [(mb.rows, mb.padding) for mb in micro_batches(6, world, rank, size, lengths, **limits)]

    assert rows(max_tokens=40) == [([1, 3], False), ([5, 4], False), ([2, 0], False)]
    assert rows(max_tokens=1000) == [([1, 3, 5, 4, 2, 0], False)]
    assert rows(max_tokens=1000, size=4) == [([1, 3, 5, 4], False), ([2, 0], False)]  # both limits hold
    # A row longer than the budget still runs, alone.
    assert rows(max_tokens=12) == [([1], False), ([3], False), ([5], False), ([4], False), ([2, 0], False)]
    # Rank 0 holds the long rows (three passes), rank 1 the short ones (one): rank 1 pads to three.
    lengths = [30, 30, 30, 2, 2, 2]
    assert rows(0, 2, max_tokens=30) == [([0], False), ([1], False), ([2], False)]
    assert rows(1, 2, max_tokens=30) == [([3, 4, 5], False), ([0], True), ([0], True)]
    with pytest.raises(ValueError, match="needs the rows' lengths"):
        micro_batches(6, 1, 0, None, None, max_tokens=30)


def test_some_micro_batch_limit_is_required() -> None:
    from pydantic import ValidationError

    from forgerl_plugins.trainers.fsdp.trainer import FSDPTrainer

    assert FSDPTrainer.Options().micro_batch_tokens == 2048 and FSDPTrainer.Options().micro_batch_size is None
    with pytest.raises(ValidationError, match="set one of them"):
        FSDPTrainer.Options(micro_batch_size=None, micro_batch_tokens=None)


def test_native_bf16_reads_the_cpu_flags() -> None:
    from forgerl_plugins.trainers.shared.distributed import native_bf16

    cpu = torch.device("cpu")
    assert native_bf16(cpu, "flags\t\t: fpu avx512f avx512_bf16 avx512vl")
    assert native_bf16(cpu, "flags\t\t: fpu avx512f amx_tile amx_bf16")
    # The Xeon where bf16 autocast was 3x slower: AVX-512 but neither bf16 extension.
    assert not native_bf16(cpu, "flags\t\t: fpu avx512f avx512bw avx512_vnni")
    assert not native_bf16(cpu, "")


def test_a_rank_beyond_the_nodes_gpus_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from forgerl.errors import ConfigError
    from forgerl_plugins.trainers.shared.distributed import pick_device

    # A one-GPU node asked for two ranks: rank 1 has no device (torch would say "invalid
    # device ordinal" later, and NCCL cannot put two ranks on one GPU).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1 .* 1 CUDA device.*trainer.ranks .* at most 1"):
        pick_device()

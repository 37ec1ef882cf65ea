"""The hf generator on the tiny model: logprob contract, seeded sampling, weight updates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from forgerl.configuration.config import RunConfig
from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import RunContext
from forgerl.types import Completion, GenerationRequest, SamplingParams, WeightSet
from forgerl_plugins.generators.hf.generator import HFGenerator
from forgerl_plugins.transports.shm.transport import ShmTransport
from tests.helpers.timing import scaled

pytestmark = pytest.mark.integration

ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Two-core machine shared with other test runs: intra-op threads on 64-wide matrices
    # only contend (10x slower under load). Restored for the rest of the session.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its (tied) embeddings rescaled to std 0.1: at the builder's
    scale every position copies its input token with probability ~1, so every seed would
    sample the same tokens and seeded-sampling tests would prove nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(0.1 / emb.std())
    out = tmp_path_factory.mktemp("tiny-varied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def _ctx(model_dir: Path, run_dir: Path, *, timeout: float | None = None) -> RunContext:
    # Default: how long the test waits for weights; a test of the timeout itself passes one.
    timeout = scaled(30.0) if timeout is None else timeout
    config = RunConfig.model_validate({"transport": {"name": "shm", "timeout": timeout}})
    return RunContext.for_run(config, run_dir, model_path=model_dir)


def _shm(folder: Path) -> ShmTransport:
    return ShmTransport(ShmTransport.Options(directory=str(folder), poll_interval=0.01), context=None)


def _generator(options: HFGenerator.Options, model_dir: Path, run_dir: Path, *, transport=None, timeout=None):
    """An hf generator built as a run builds it; tests that load no weights give it a
    transport nothing is ever sent through."""
    transport = transport if transport is not None else _shm(run_dir / "unused-shm")
    return HFGenerator(options, context=_ctx(model_dir, run_dir, timeout=timeout), transport=transport)


@pytest.fixture(scope="module")
def generator(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    gen = _generator(HFGenerator.Options(batch_size=4), model_dir, tmp_path_factory.mktemp("run"))
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    """A separately loaded copy of the model, for teacher-forced forwards."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(generator: HFGenerator) -> list[list[int]]:
    def chat(question: str) -> list[int]:
        ids = generator.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in ids]

    # Different lengths, so that batches mix left padding.
    return [chat("What is 2 + 3?"), chat("What is 17 + 25? Think briefly, then give the final answer.")]


def _generate(gen: HFGenerator, requests: list[GenerationRequest]) -> list[list[Completion]]:
    return asyncio.run(gen.generate(requests))


def _teacher_forced(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The trainer's side of the contract: log_softmax(logits / T) at each completion token."""
    t = temperature if temperature > 0 else 1.0
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / t, dim=-1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)


def _max_gap(model, prompt, completion: Completion, temperature: float) -> float:
    want = _teacher_forced(model, prompt, completion.token_ids, temperature)
    return float((torch.tensor(completion.logprobs, dtype=torch.float32) - want).abs().max())


def _tokens(completions: list[list[Completion]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in cs] for cs in completions]


def test_logprobs_equal_a_teacher_forced_forward(generator, reference, prompts):
    cases = [
        SamplingParams(max_tokens=24, temperature=1.0, seed=1),
        SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, top_k=50, seed=2),
        SamplingParams(max_tokens=24, temperature=1.3, top_k=5, seed=3),
        SamplingParams(max_tokens=24, temperature=0.0),
    ]
    # The third prompt ends in eos, which this model tends to repeat: some rows finish
    # at once while the rest of their batch goes on decoding.
    eos = generator.tokenizer.convert_tokens_to_ids("<|im_end|>")
    requests = [
        GenerationRequest(f"r{i}-{j}", prompt, 3, sampling)
        for i, sampling in enumerate(cases)
        for j, prompt in enumerate([*prompts, prompts[0] + [eos]])
    ]
    results = _generate(generator, requests)
    assert [len(cs) for cs in results] == [3] * len(requests)
    lengths = {len(c.token_ids) for cs in results for c in cs}
    assert 1 in lengths and 24 in lengths, f"expected early and full-length finishes, got {sorted(lengths)}"
    for request, completions in zip(requests, results):
        for c in completions:
            assert c.token_ids, f"{request.request_id}: empty completion"
            gap = _max_gap(reference, list(request.prompt_token_ids), c, request.sampling.temperature)
            assert gap < ATOL, (
                f"{request.request_id}: logprob gap {gap:.2e} at T={request.sampling.temperature}"
            )
            assert c.policy_version == 0


def test_finish_reasons_eos_and_length(generator, prompts):
    eos = generator.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # This random model tends to repeat its last input token: a prompt ending in eos makes
    # eos likely early, so 32 samples end both ways.
    prompt = prompts[0] + [eos]
    requests = [GenerationRequest("r", prompt, 32, SamplingParams(max_tokens=12, temperature=1.0, seed=7))]
    completions = _generate(generator, requests)[0]
    reasons = {c.finish_reason for c in completions}
    assert reasons == {"stop", "length"}, f"expected both endings in 32 samples, got {reasons}"
    for c in completions:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1], c.token_ids
            assert len(c.logprobs) == len(c.token_ids)
        else:
            assert len(c.token_ids) == 12 and eos not in c.token_ids, c.token_ids
        assert "<|im_end|>" not in c.text
        assert c.text == generator.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_same_seed_same_completions_different_seed_different(generator, prompts):
    def run(seed: int) -> list[list[Completion]]:
        sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=seed)
        return _generate(
            generator,
            [
                GenerationRequest("a", prompts[0], 4, sampling),
                GenerationRequest("b", prompts[1], 2, sampling),
            ],
        )

    first, again, other = run(123), run(123), run(124)
    assert _tokens(first) == _tokens(again)
    assert [[c.logprobs for c in cs] for cs in first] == [[c.logprobs for c in cs] for cs in again]
    assert _tokens(first) != _tokens(other)
    seqs = [tuple(c.token_ids) for c in first[0]]
    assert len(set(seqs)) > 1, f"the n sequences of one request should differ (seed + index): {seqs}"


def test_greedy_is_deterministic_and_the_argmax(generator, reference, prompts):
    requests = [
        GenerationRequest(f"g{j}", p, 2, SamplingParams(max_tokens=16, temperature=0.0))
        for j, p in enumerate(prompts)
    ]
    first, again = _generate(generator, requests), _generate(generator, requests)
    assert _tokens(first) == _tokens(again)
    for request, cs in zip(requests, first):
        assert cs[0].token_ids == cs[1].token_ids
        prompt = list(request.prompt_token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + cs[0].token_ids])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == cs[0].token_ids


def test_top_k_1_and_tiny_top_p_sample_the_greedy_tokens(generator, prompts):
    greedy = _generate(
        generator, [GenerationRequest("g", prompts[1], 1, SamplingParams(max_tokens=16, temperature=0.0))]
    )
    top_k = _generate(
        generator, [GenerationRequest("k", prompts[1], 2, SamplingParams(max_tokens=16, top_k=1, seed=5))]
    )
    top_p = _generate(
        generator, [GenerationRequest("p", prompts[1], 2, SamplingParams(max_tokens=16, top_p=1e-6, seed=5))]
    )
    want = greedy[0][0]
    for c in top_k[0] + top_p[0]:
        assert c.token_ids == want.token_ids
        # Filtering shapes the draw, not the logprob: still log_softmax(logits / 1), unfiltered.
        assert max(abs(a - b) for a, b in zip(c.logprobs, want.logprobs)) < ATOL


def test_batch_size_does_not_change_completions(model_dir, generator, prompts, tmp_path):
    single = _generator(HFGenerator.Options(batch_size=1), model_dir, tmp_path)
    try:
        for sampling in (
            SamplingParams(max_tokens=16, temperature=0.0),
            SamplingParams(max_tokens=16, seed=11),
        ):
            requests = [GenerationRequest(f"r{j}", p, 3, sampling) for j, p in enumerate(prompts)]
            assert _tokens(_generate(single, requests)) == _tokens(_generate(generator, requests)), sampling
    finally:
        single.close()


def _perturbed(reference, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """The reference weights plus noise, under their Hugging Face names (tied ones shared)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    memo: dict[int, torch.Tensor] = {}
    for name, t in reference.state_dict().items():
        key = t.data_ptr()
        if key not in memo:
            memo[key] = t + scale * torch.randn(t.shape, generator=g)
        out[name] = memo[key]
    return out


def _load_into(reference, weights: dict[str, torch.Tensor]):
    import copy

    model = copy.deepcopy(reference)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name in weights:
                t.copy_(weights[name])
    return model


def test_update_weights_serves_the_new_policy(model_dir, reference, prompts, tmp_path):
    transport = _shm(tmp_path / "shm")
    gen = _generator(HFGenerator.Options(batch_size=4), model_dir, tmp_path, transport=transport)
    sender = transport.sender()
    requests = [
        GenerationRequest(f"r{j}", p, 2, SamplingParams(max_tokens=16, seed=3)) for j, p in enumerate(prompts)
    ]
    try:
        before = _generate(gen, requests)
        # Version 1 carries lm_head.weight beside the embeddings (tied: the same tensor).
        v1 = _perturbed(reference, 0.05, seed=1)
        assert "lm_head.weight" in v1
        sender.send(WeightSet(1, v1))
        gen.update_weights(1)
        assert gen.policy_version == 1 and gen.health().policy_version == 1
        after = _generate(gen, requests)
        assert _tokens(after) != _tokens(before), "perturbed weights should sample differently"
        policy = _load_into(reference, v1)
        for request, cs in zip(requests, after):
            for c in cs:
                assert c.policy_version == 1
                gap = _max_gap(policy, list(request.prompt_token_ids), c, 1.0)
                assert gap < ATOL, f"v1: logprob gap {gap:.2e} to the perturbed model"

        # Version 2 leaves lm_head.weight out: the tied embeddings alone must update both.
        v2 = {n: t for n, t in _perturbed(reference, 0.05, seed=2).items() if n != "lm_head.weight"}
        sender.send(WeightSet(2, v2))
        gen.update_weights(2)
        policy = _load_into(reference, v2)
        assert torch.equal(policy.lm_head.weight, v2["model.embed_tokens.weight"])
        for request, cs in zip(requests, _generate(gen, requests)):
            for c in cs:
                assert c.policy_version == 2
                gap = _max_gap(policy, list(request.prompt_token_ids), c, 1.0)
                assert gap < ATOL, f"v2: logprob gap {gap:.2e} to the perturbed model"
    finally:
        sender.close()
        gen.close()


def test_failed_updates_keep_the_old_weights_and_version(model_dir, reference, prompts, tmp_path):
    transport = _shm(tmp_path / "shm")
    gen = _generator(HFGenerator.Options(batch_size=4), model_dir, tmp_path, timeout=0.3, transport=transport)
    sender = transport.sender()
    requests = [GenerationRequest("r", prompts[0], 2, SamplingParams(max_tokens=12, seed=9))]
    try:
        before = _generate(gen, requests)

        with pytest.raises(TransportTimeout, match="version 1 did not appear"):
            gen.update_weights(1)  # nothing was sent

        good = _perturbed(reference, 0.05, seed=4)
        broken = [
            (
                dict(good, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}),
                "model.layers.9.mlp.up_proj.weight",
            ),
            (
                {n: t for n, t in good.items() if n != "model.norm.weight"},
                "lacks 1 tensors: model.norm.weight",
            ),
            (dict(good, **{"model.norm.weight": torch.ones(3)}), r"wrong shapes: model.norm.weight \(3,\)"),
            (dict(good, **{"lm_head.weight": good["lm_head.weight"] + 1}), "tied tensors"),
        ]
        for version, (weights, message) in enumerate(broken, start=1):
            sender.send(WeightSet(version, weights))
            with pytest.raises(TransportError, match=message):
                gen.update_weights(version)

        assert gen.policy_version == 0
        after = _generate(gen, requests)
        assert _tokens(after) == _tokens(before)
        assert [c.logprobs for c in after[0]] == [c.logprobs for c in before[0]]
        assert all(c.policy_version == 0 for c in after[0])
    finally:
        sender.close()
        gen.close()


def _random_adapter(trainer, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's adapter set to values large enough that sampling with it, without it
    or with another version's is told apart by orders of magnitude; exported as a run does."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    exported = trainer.export_weights(seed)
    assert exported is not None
    return dict(exported.tensors)


def test_lora_adapter_versions_are_served_in_place(model_dir, reference, prompts, tmp_path):
    """With a LoRA trainer a version is the adapter alone: the generator samples with it
    on the unchanged base model, each version replacing the last; version 0 is the base."""
    pytest.importorskip("peft")
    import dataclasses

    from forgerl.adapters import LoraOptions
    from forgerl_plugins.trainers.shared.lora import adapter_off
    from tests.helpers import trainer_worker as worker

    lora = {"rank": 4, "alpha": 8}
    # The large adapters make large logits: the cached decode and the trainer's one forward
    # round differently by ~1e-5 (fp32 on both sides), as on vLLM (test_vllm_lora.py).
    tol = 1e-4
    transport = _shm(tmp_path / "shm")
    ctx = dataclasses.replace(_ctx(model_dir, tmp_path, timeout=scaled(30)), adapter=LoraOptions(**lora))
    gen = HFGenerator(HFGenerator.Options(batch_size=4), context=ctx, transport=transport)
    sender = transport.sender()
    trainer = worker.make_trainer(model_dir, tmp_path / "trainer", 2, lora=lora)
    requests = [GenerationRequest(f"r{j}", p, 2, SamplingParams(max_tokens=12, seed=5)) for j, p in enumerate(prompts)]
    base = {n: t.clone() for n, t in gen.model.state_dict().items() if "lora_" not in n}
    try:
        for request, cs in zip(requests, _generate(gen, requests)):
            for c in cs:
                assert _max_gap(reference, list(request.prompt_token_ids), c, 1.0) < ATOL, "version 0 is not the base model"
        for version in (1, 2):
            adapter = _random_adapter(trainer, version)
            assert set(adapter) == set(gen.adapter.params) and all(".lora_" in n for n in adapter)
            sender.send(WeightSet(version, adapter))
            gen.update_weights(version)
            assert sender.last_send_bytes == gen.adapter.nbytes  # the adapter moved, nothing else
            for request, cs in zip(requests, _generate(gen, requests)):
                prompt = list(request.prompt_token_ids)
                for c in cs:
                    assert c.policy_version == version
                    gap = _max_gap(trainer.model, prompt, c, 1.0)
                    assert gap < tol, f"version {version}: logprob gap {gap:.2e} to the trainer's"
                    with adapter_off(trainer.model):
                        # The check above can fail: the base model is far from these logprobs.
                        assert _max_gap(trainer.model, prompt, c, 1.0) > 100 * tol
        # Nothing merged: the base weights are as loaded.
        after = {n: t for n, t in gen.model.state_dict().items() if "lora_" not in n}
        assert all(torch.equal(after[n], t) for n, t in base.items())

        # The full model's weights, or an adapter of another rank, are refused; version 2 stays.
        full = _perturbed(reference, 0.05, seed=4)
        other = worker.make_trainer(model_dir, tmp_path / "rank8", 2, lora={"rank": 8})
        try:
            wrong_rank = _random_adapter(other, 4)
        finally:
            other.close()
        for version, (weights, message) in enumerate(
            [(full, "unknown lm_head.weight.*; missing base_model"), (wrong_rank, "wrong shapes")], start=3
        ):
            sender.send(WeightSet(version, weights))
            with pytest.raises(TransportError, match=message):
                gen.update_weights(version)
        assert gen.policy_version == 2
        c = _generate(gen, requests[:1])[0][0]
        assert c.policy_version == 2 and _max_gap(trainer.model, list(requests[0].prompt_token_ids), c, 1.0) < tol
    finally:
        trainer.close()
        sender.close()
        gen.close()


def test_empty_prompt_and_unknown_tokens_are_clear_errors(generator):
    from forgerl.errors import GeneratorError

    with pytest.raises(GeneratorError, match="empty prompt"):
        _generate(generator, [GenerationRequest("e", [], 1, SamplingParams())])
    with pytest.raises(GeneratorError, match="outside the model's vocabulary"):
        _generate(generator, [GenerationRequest("u", [1, 99999], 1, SamplingParams())])

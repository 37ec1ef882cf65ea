"""The ``reward_model`` reward with a tiny sequence-classification model built offline."""

from __future__ import annotations

import asyncio

import pytest

from forgerl.registry.plugins import build_registry
from forgerl.rewards.rewarding import NamedReward, RewardSet
from forgerl.testing import RewardContract
from forgerl.types import Problem, RewardInput

QUESTION = Problem(id="q", prompt=[{"role": "user", "content": "Say hi."}], answer="")


@pytest.fixture(scope="session")
def classifier_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model's tokenizer and config under a random 1-label classification head."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path_factory.mktemp("classifier")
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def build(folder, **options):
    return build_registry().require("reward", "reward_model").build({"model": str(folder), **options})


class TestRewardModelKit(RewardContract):
    backend = "reward_model"

    @pytest.fixture(autouse=True)
    def _model(self, classifier_dir):
        self.options = {"model": str(classifier_dir), "device": "cpu"}


def test_scores_are_the_models_logit_on_the_chat_rendering(classifier_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward = build(classifier_dir, device="cpu")
    sample = RewardInput(QUESTION, "Hi there!")
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}],
        tokenize=False,
    )
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    with torch.inference_mode():
        expected = float(model(**tokenizer(text, return_tensors="pt")).logits[0, 0])
    assert asyncio.run(reward.ascore(sample)) == pytest.approx(expected, abs=1e-5)
    assert build(classifier_dir, activation="sigmoid").model is not None


def test_samples_scored_together_are_batched_and_agree_with_alone(classifier_dir):
    reward = build(classifier_dir, device="cpu", batch_size=4)
    calls = []
    forward = reward.forward
    reward.forward = lambda texts: calls.append(len(texts)) or forward(texts)
    samples = [RewardInput(QUESTION, "hi " * i) for i in range(1, 7)]
    with RewardSet([NamedReward("rm", 1.0, reward)]) as rewards:
        together = [r.value for r in rewards.score_sync(samples)]
    assert calls == [4, 2]
    alone = [asyncio.run(reward.ascore(s)) for s in samples]
    assert together == pytest.approx(alone, abs=1e-4)
    assert len(set(alone)) > 1  # the texts score differently


def test_a_label_the_model_lacks_is_refused(classifier_dir):
    from forgerl.errors import ConfigError

    with pytest.raises(ConfigError, match="label 3"):
        build(classifier_dir, label=3)

"""Each check of the Generator kit fails on a generator that breaks its rule, with a message
naming what is wrong: a kit that passes everything proves nothing. The broken generators
(the hf generator, each breaking one rule) live in tests/helpers/kit_fake_generators.py, a
plugin loaded by import path; the kit's test methods are called directly with a site, as
pytest would call them on a subclass. (``hf`` itself passes every check:
test_generator_kit.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from forgerl.testing import GeneratorContract
from forgerl.testing.generator_support import open_site, tiny_model

pytestmark = pytest.mark.integration

FAKES = ("tests.helpers.kit_fake_generators",)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("kit-model"), {})


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "kind, check, message",
    [
        (
            "raw_logprobs",
            "test_logprobs_are_the_log_softmax_of_logits_over_temperature",
            r"T=0.7: gap .*divide by T",
        ),
        (
            "shifted",
            "test_generate_returns_n_completions_per_request_in_order",
            r"not in request order: a completion of request 0 was sampled after the prompt of request 1",
        ),
        ("too_long", "test_max_tokens_is_respected", r"longer than max_tokens .*max_tokens 1: 4 tokens"),
        ("too_long", "test_finish_reasons_are_valid", r"'length' after 15 tokens, max_tokens 12"),
        (
            "unseeded",
            "test_seeded_sampling_is_reproducible",
            r"batched in another order, sampled other tokens",
        ),
        ("one_draw", "test_the_n_completions_are_independent_draws", r"the 4 completions are equal"),
        (
            "positive_logprobs",
            "test_token_ids_and_logprobs_are_aligned_and_finite",
            r"not finite floats <= 0",
        ),
        ("no_text", "test_text_is_the_decoded_completion", r"must be the decoded tokens"),
        (
            "stuck_version",
            "test_update_weights_serves_the_new_weights_and_version",
            r"policy_version is 0 after update_weights\(1\)",
        ),
        (
            "ignores_weights",
            "test_update_weights_serves_the_new_weights_and_version",
            r"differ from the new weights'",
        ),
        (
            "leaks_thread",
            "test_close_releases_everything",
            r"threads the generator started still run after close\(\):\s+kit-fake-leak",
        ),
        (
            "leaks_process",
            "test_close_releases_everything",
            r"processes the generator started still run after close\(\): \d+: .*kit-fake-child",
        ),
    ],
)
def test_each_generator_check_fails_on_a_generator_that_breaks_it(kind, check, message, model_dir, tmp_path):
    from tests.helpers.kit_fake_generators import CHILDREN, LEAK_STOP

    backend = f"kit_gen_{kind}"
    kit = type(
        f"Kit_{kind}", (GeneratorContract,), {"backend": backend, "plugins": FAKES, "cleanup_wait_s": 1}
    )()
    LEAK_STOP.clear()
    with open_site(backend, {"batch_size": 8}, FAKES, model_dir, tmp_path / "run") as site:
        try:
            with pytest.raises(AssertionError, match=message):
                getattr(kit, check)(site)
        finally:
            LEAK_STOP.set()
            for child in CHILDREN:
                child.kill()
                child.wait()


def test_an_unknown_generator_fails_naming_the_fix(model_dir, tmp_path):
    with pytest.raises(pytest.fail.Exception, match="is the plugin installed"):
        with open_site("kit_gen_no_such_generator", {}, FAKES, model_dir, tmp_path / "run"):
            pass

"""Checks of the Trainer and Scheduler kits fail on a backend that breaks their rule, with
a message naming what is wrong: a kit that passes everything proves nothing. The broken
backends (tests/helpers/kit_fake_trainers.py, kit_fake_schedulers.py) are ``fsdp`` and
``local`` with one thing changed each; the kits' test methods are called directly, as
pytest would call them on a subclass."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgerl.testing import SchedulerContract, TrainerContract


def trainer_kit(name: str, **attrs):
    attrs = {"backend": name, "plugins": ("tests.helpers.kit_fake_trainers",), "options": {"lr": 1e-3}, **attrs}
    return type(f"Kit_{name}", (TrainerContract,), attrs)()


def scheduler_kit(name: str, **attrs):
    attrs = {"backend": name, "plugins": ("tests.helpers.kit_fake_schedulers",), "options": {"stop_timeout": 5},
             "stopped_timeout_s": 3, **attrs}
    return type(f"Kit_{name}", (SchedulerContract,), attrs)()


@pytest.mark.parametrize(
    "backend, check, message",
    [
        ("kit_prefixed_names", "test_exports_the_models_weights_under_hugging_face_names",
         r"not the Hugging Face model's state_dict\(\) keys.*unexpected \['module.lm_head.weight'"),
        ("kit_live_export", "test_exports_the_models_weights_under_hugging_face_names",
         "changed the tensors of a version already exported"),
        ("kit_ignores_temperature", "test_logprobs_match_a_plain_hugging_face_forward",
         r"away from log_softmax\(logits / T\)"),
        ("kit_reports_only_the_loss", "test_train_step_reports_the_algorithms_metrics_and_changes_the_weights",
         r"lack the algorithm's \['loss/policy'"),
        ("kit_drifts_every_step", "test_zero_advantages_leave_the_weights_alone",
         r"beyond a weight-decay shrink: \['model.norm.weight"),
        ("kit_forgets_the_optimizer", "test_checkpoint_resumes_exactly_in_a_fresh_trainer",
         r"after the resumed step .* away from the uninterrupted run's: save and load the optimiser's state"),
        ("kit_keeps_its_process_group", "test_close_releases_processes_threads_and_the_process_group",
         "left the default torch.distributed process group"),
        ("kit_sft_at_sampling_temperature", "test_sft_loss_is_transformers_cross_entropy",
         r"the sft loss is .*, transformers' cross-entropy of the same labels"),
        ("kit_advantage_per_row", "test_per_token_advantages_are_read_at_their_tokens",
         r"the gradient's norm is .* expected .*each token's own advantage"),
        ("kit_advantage_one_token_off", "test_per_token_advantages_are_read_at_their_tokens",
         r"with per-token advantages loss/policy is .* expected"),
    ],
)
def test_each_trainer_check_fails_on_a_trainer_that_breaks_it(backend, check, message, tiny_model_dir, tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(AssertionError, match=message):
        getattr(trainer_kit(backend), check)(tiny_model_dir, tmp_path)


def test_a_trainer_that_is_not_registered_fails_naming_the_fix(tiny_model_dir, tmp_path):
    with pytest.raises(pytest.fail.Exception, match="is the plugin installed"):
        trainer_kit("kit_no_such_trainer").test_builds_a_trainer_through_the_registry(tiny_model_dir, tmp_path)


def run_scheduler_check(kit, check: str, tmp_path: Path) -> None:
    jobs: list = []
    try:
        getattr(kit, check)(kit.build(), tmp_path, jobs)
    finally:
        kit.clean_up(jobs)


def test_a_cancel_that_spares_the_roles_children_fails(tmp_path):
    kit = scheduler_kit("kit_cancel_spares_children")
    with pytest.raises(AssertionError, match=r"every process of the cancelled role \(its child too\) to be stopped"):
        run_scheduler_check(kit, "test_cancel_stops_every_process_of_a_running_job", tmp_path)


def test_a_lost_exit_status_fails(tmp_path):
    kit = scheduler_kit("kit_loses_exit_code")
    with pytest.raises(AssertionError, match=r"exited with status 3, but the job ended .*exit_code=None"):
        run_scheduler_check(kit, "test_a_failing_role_fails_the_job_with_its_exit_status", tmp_path)


def test_an_unknown_job_answered_with_a_key_error_fails():
    kit = scheduler_kit("kit_unknown_job_is_key_error")
    with pytest.raises(AssertionError, match=r"raised KeyError.*raise forgerl.errors.JobNotFound"):
        kit.test_status_of_an_unknown_job_is_job_not_found(kit.build())


def test_logs_hidden_behind_supports_logs_false_fail():
    kit = scheduler_kit("kit_hides_its_logs")
    with pytest.raises(AssertionError, match="implements logs.. but supports_logs is False"):
        kit.test_supports_logs_is_honest()


def two_rank_results(tmp_path: Path, *, rank1_exports=False, loss_two=1.0, step_two=None):
    """What the two-rank check reads, made up: one rank's run, and each rank's report with
    rank 0's weights in a file, as forgerl.testing.trainer_rank writes them."""
    import torch
    from safetensors.torch import save_file

    initial = {"w": torch.zeros(64)}
    one_step = {"w": torch.full((64,), 1e-3)}
    two_step = {"w": torch.full((64,), 1e-3) if step_two is None else step_two}
    save_file(two_step, str(tmp_path / "weights.safetensors"))
    metrics = {"loss/policy": 1.0, "grad_norm": 2.0, "logprob_gap/max": 0.0}
    one = {"metrics": [metrics] * 3, "initial": initial, "weights": one_step}
    rank = {"metrics": [{**metrics, "loss/policy": loss_two}] * 3, "resume_diff": [0.0, "w"]}
    return one, [{**rank, "exported": [True] * 3}, {**rank, "exported": [rank1_exports] * 3}]


@pytest.mark.parametrize(
    "broken, message",
    [
        ({}, None),
        ({"rank1_exports": True}, "rank 1 of 2: export_weights must return None off rank 0"),
        ({"loss_two": 2.0}, r"loss/policy 1.0 on 1 rank, 2.0 on 2: normalise the loss over the whole batch"),
        ({"step_two": "half flipped"}, r"the step on 2 ranks differs from the step on 1 by 1.41 of its size"),
    ],
)
def test_the_two_rank_check_fails_when_ranks_disagree(broken, message, tmp_path):
    import torch

    if broken.get("step_two") == "half flipped":  # each rank stepped on its own rows' gradients
        broken["step_two"] = torch.cat([torch.full((32,), 1e-3), torch.full((32,), -1e-3)])
    one, two = two_rank_results(tmp_path, **broken)
    kit = trainer_kit("fsdp")
    if message is None:
        kit._compare_ranks(one, two, tmp_path)
        return
    with pytest.raises(AssertionError, match=message):
        kit._compare_ranks(one, two, tmp_path)


def test_a_kit_rank_that_fails_exits_1_and_the_check_shows_its_traceback(tmp_path):
    """A kit rank ends without interpreter finalization (forgerl.worker.exit_now), so it
    prints a failure's traceback itself; the check names the rank, its exit status and
    what the ranks wrote (a crash at exit leaves the results there)."""
    import sys

    from forgerl.testing.timing import scaled
    from forgerl.testing.trainer_support import beside_two_ranks

    command = [sys.executable, "-m", "forgerl.testing.trainer_rank", str(tmp_path / "no-spec.json")]
    with pytest.raises(AssertionError, match=r"(?s)rank 0 of 2 failed \(exit 1; .* holds \['rank0.log', 'rank1.log'\]\)"
                                             r".*Traceback.*FileNotFoundError.*no-spec.json"):
        beside_two_ranks(command, tmp_path, lambda: None, timeout=scaled(60))

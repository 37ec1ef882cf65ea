"""The sglang generator's parts that need no server: its role, the SGLang command line,
the payloads it sends under SGLang's field names and how it reads SGLang's answers, the
choice of weight sync, and what `forge plugins list` says without SGLang. (Against the
SGLang test double: tests/integration/test_sglang_double.py; real SGLang:
tests/gpu/test_sglang_cuda.py.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from forgerl.configuration.config import RunConfig
from forgerl.errors import GeneratorError, UserError
from forgerl.interfaces import RunContext, TensorSpec
from forgerl.types import GenerationRequest, SamplingParams
from forgerl_plugins.generators.common.pool import ReplicaFailed
from forgerl_plugins.generators.sglang import SGLANG_VERSION, adapter, payloads, server
from forgerl_plugins.generators.sglang.generator import SGLangGenerator, choose_weight_sync
from tests.helpers import sglang_double


def _ctx(run_dir: Path) -> RunContext:
    return RunContext.for_run(RunConfig.model_validate({"generator": {"name": "sglang"}}), run_dir)


def _request(n: int = 1, **sampling) -> GenerationRequest:
    return GenerationRequest("r-1", [5, 6, 7], n, SamplingParams(**{"max_tokens": 4, **sampling}))


def test_the_role_runs_the_launcher_per_replica_on_its_gpus(tmp_path):
    (role,) = server.roles(
        SGLangGenerator.Options(replicas=3, tensor_parallel_size=2, max_restarts=2), context=_ctx(tmp_path)
    )
    assert role.name == "sglang" and role.replicas == 3 and role.max_restarts == 2
    assert role.command[1:] == ("-m", "forgerl.server_role", "--run-dir", str(tmp_path), "--role", "sglang")
    assert role.resources.gpus == 2


def test_the_server_command_is_sglangs_launch_server_with_the_options(tmp_path):
    options = SGLangGenerator.Options(
        tensor_parallel_size=2, mem_fraction_static=0.5, context_length=512,
        server_args={"chunked_prefill_size": 4096, "enable_metrics": True, "disable_radix_cache": False},
    )  # fmt: skip
    cmd = server.server_command(options, tmp_path, "bfloat16", 4321)
    text = " ".join(cmd)
    # Under the key guard, which adds the key (from the environment) in the server's process only.
    assert cmd[:5] == [sys.executable, "-m", "forgerl_plugins.generators.sglang.guard", "-m", "sglang.launch_server"]
    assert "api-key" not in text, "a key on the command line is visible to every user through ps"
    for part in (
        f"--model-path {tmp_path}", "--host 127.0.0.1", "--port 4321", "--dtype bfloat16", "--tp-size 2",
        "--weight-version 0", "--mem-fraction-static 0.5", "--context-length 512",
        "--chunked-prefill-size 4096", "--enable-metrics",
    ):  # fmt: skip
        assert part in text, part
    assert "radix" not in text  # false: left out
    custom = server.server_command(
        SGLangGenerator.Options(launch_command=["/opt/x/python", "-m", "sglang.launch_server"]),
        tmp_path,
        "float32",
        1,
    )
    assert custom[:5] == ["/opt/x/python", "-m", "forgerl_plugins.generators.sglang.guard", "-m", "sglang.launch_server"]
    assert "--dtype float32" in " ".join(custom)


def test_the_command_is_one_the_double_accepts_and_the_double_refuses_others(tmp_path, capsys):
    """The double's command line takes SGLang's flag names only: what we pass parses."""
    cmd = server.server_command(SGLangGenerator.Options(mem_fraction_static=0.5, context_length=64), tmp_path, "float32", 1)
    # What the guard hands the program: the arguments, then the key as one word with its flag
    # (a random key may start with "-": it is still the key).
    program = [*cmd[5:], "--api-key=-k"]
    args = sglang_double.parser().parse_args(program)
    assert (args.model_path, args.port, args.api_key, args.weight_version) == (str(tmp_path), 1, "-k", "0")
    with pytest.raises(SystemExit) as refused:
        sglang_double.parser().parse_args([*program, "--no-such-flag"])
    assert refused.value.code == 2


def test_with_an_adapter_the_server_starts_with_a_lora_pool_that_holds_it(tmp_path, capsys):
    from forgerl.adapters import LoraOptions
    from forgerl.errors import ConfigError

    lora = LoraOptions(rank=24, target_modules=["q_proj", "model.layers.1.mlp.[gu]*_proj"])
    cmd = server.server_command(SGLangGenerator.Options(), tmp_path, "float32", 1, lora)
    flags = " ".join(cmd)
    assert "--enable-lora --max-lora-rank 24 --lora-target-modules gate_proj q_proj up_proj" in flags
    assert "--enable-lora" not in " ".join(server.server_command(SGLangGenerator.Options(), tmp_path, "float32", 1))
    args = sglang_double.parser().parse_args([*cmd[5:], "--api-key=k"])  # the double takes them
    assert sglang_double.lora_slots(args, sglang_double.parser()).targets == {"q_proj", "gate_proj", "up_proj"}
    with pytest.raises(SystemExit) as refused:  # as SGLang: no pool size without adapters at start
        sglang_double.lora_slots(sglang_double.parser().parse_args([*cmd[5:13], "--enable-lora"]), sglang_double.parser())
    assert refused.value.code == 2 and "--max-lora-rank and --lora-target-modules" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no module SGLang serves LoRA on"):
        adapter.server_flags(LoraOptions(target_modules=["c_attn"]))


def test_the_servers_never_return_unscaled_logprobs_nor_see_the_trainers_rendezvous(monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    env = server.server_env(SGLangGenerator.Options(env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "X": "y"}), "k3y")
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env and "MASTER_PORT" not in env and env["X"] == "y"
    assert env["FORGE_SGLANG_KEY"] == "k3y"


def test_a_generate_body_asks_for_the_completions_logprobs_only():
    body = payloads.generate_body(_request(top_k=5, seed=7, stop=("\n",)), 2, "rid-2", send_seed=True)
    assert body == {
        "rid": "rid-2",
        "input_ids": [5, 6, 7],
        "sampling_params": {
            "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 5,
            "skip_special_tokens": True, "stop": ["\n"], "sampling_seed": 7 + 2 * payloads.SEED_STRIDE,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
    }  # fmt: skip
    plain = payloads.generate_body(_request(), 0, "rid", send_seed=False)
    assert plain["sampling_params"]["top_k"] == -1 and "sampling_seed" not in plain["sampling_params"]
    with pytest.raises(GeneratorError, match="empty prompt"):
        payloads.generate_body(GenerationRequest("e", [], 1, SamplingParams()), 0, "rid", send_seed=False)


def test_every_payload_fits_the_doubles_sglang_shaped_models():
    """The double's request models carry io_struct's field names and refuse unknown ones."""
    from pydantic import ValidationError

    sglang_double.GenerateReqInput.model_validate(
        payloads.generate_body(_request(seed=1), 0, "r", send_seed=True)
    )
    sglang_double.UpdateWeightFromDiskReqInput.model_validate(payloads.update_from_disk_body("/x", 3))
    group = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank_offset": 1,
             "group_name": "g", "backend": "nccl"}  # fmt: skip
    sglang_double.InitWeightsUpdateGroupReqInput.model_validate(payloads.init_group_body(group))
    bucket = [TensorSpec("a.weight", "bfloat16", (2, 3))]
    sglang_double.UpdateWeightsFromDistributedReqInput.model_validate(
        payloads.update_distributed_body(bucket, "g")
    )
    sglang_double.UpdateWeightVersionReqInput.model_validate(payloads.weight_version_body(3))
    sglang_double.BeginWeightUpdateReqInput.model_validate(payloads.begin_update_body())
    sglang_double.EndWeightUpdateReqInput.model_validate(payloads.end_update_body())
    for policy in ("wait", "abort", "keep"):
        sglang_double.PauseGenerationReqInput.model_validate(payloads.pause_body(policy))
    sglang_double.GenerateReqInput.model_validate(
        payloads.generate_body(_request(), 0, "r", send_seed=False, lora="forge-adapter")
    )
    sglang_double.LoadLoRAAdapterReqInput.model_validate(adapter.load_body(Path("/x")))
    sglang_double.UnloadLoRAAdapterReqInput.model_validate(adapter.unload_body())
    with pytest.raises(ValidationError):
        sglang_double.UpdateWeightFromDiskReqInput.model_validate({"model_path": "/x", "version": "3"})


@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason=f"sglang is not installed (written against {SGLANG_VERSION})",
)
def test_every_payload_is_one_sglangs_own_request_classes_accept():
    pytest.importorskip("sglang.srt.managers.io_struct", reason="sglang's io_struct does not import here")
    check = sglang_double.sglang_check
    check("GenerateReqInput", payloads.generate_body(_request(seed=1), 0, "r", send_seed=True))
    check("UpdateWeightFromDiskReqInput", payloads.update_from_disk_body("/x", 3))
    check("InitWeightsUpdateGroupReqInput", payloads.init_group_body(
        {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank_offset": 1, "group_name": "g", "backend": "nccl"}))  # fmt: skip
    check(
        "UpdateWeightsFromDistributedReqInput",
        payloads.update_distributed_body([TensorSpec("a", "float32", (1,))], "g"),
    )
    check("UpdateWeightVersionReqInput", payloads.weight_version_body(3))
    for policy in ("wait", "abort", "keep"):
        check("PauseGenerationReqInput", payloads.pause_body(policy))
    check("BeginWeightUpdateReqInput", payloads.begin_update_body())
    check("EndWeightUpdateReqInput", payloads.end_update_body())
    check("ContinueGenerationReqInput", {})
    check("AbortReq", {"abort_all": True})
    check("GenerateReqInput", payloads.generate_body(_request(), 0, "r", send_seed=False, lora="forge-adapter"))
    check("LoadLoRAAdapterReqInput", adapter.load_body(Path("/x")))
    check("UnloadLoRAAdapterReqInput", adapter.unload_body())


def _answer(status: int = 200, **meta) -> httpx.Response:
    body = {
        "text": "hi",
        "output_ids": [9, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "weight_version": "3",
            "output_token_logprobs": [[-0.5, 9, None], [-0.25, 2, None]],
            **meta,
        },
    }
    return httpx.Response(status, json=body)


def test_an_answer_becomes_a_completion_of_its_version():
    c = payloads.parse_generate(_request(), _answer(), 3)
    assert (c.token_ids, c.logprobs, c.finish_reason, c.policy_version, c.text) == (
        [9, 2],
        [-0.5, -0.25],
        "stop",
        3,
        "hi",
    )
    length = payloads.parse_generate(_request(), _answer(finish_reason={"type": "length", "length": 2}), 3)
    assert length.finish_reason == "length"


def test_answers_another_replica_should_give_are_replica_failures():
    with pytest.raises(ReplicaFailed, match="weights '3'"):
        payloads.parse_generate(_request(), _answer(), 4)  # served by other weights than dispatched
    with pytest.raises(ReplicaFailed, match="aborted"):
        payloads.parse_generate(_request(), _answer(finish_reason={"type": "abort", "message": "x"}), 3)
    with pytest.raises(ReplicaFailed):
        payloads.parse_generate(_request(), httpx.Response(503, json={"error": "down"}), 3)
    with pytest.raises(GeneratorError, match="rejected"):
        payloads.parse_generate(_request(), httpx.Response(400, json={"error": "bad"}), 3)


def test_each_update_policy_pauses_in_sglangs_mode_for_it():
    # keep: retract, not in_place: an in-place pause keeps the old weights' KV under the
    # frozen requests, and SGLang refuses to flush while they hold it (docs/generators.md).
    assert {p: payloads.pause_body(p)["mode"] for p in ("wait", "abort", "keep")} == {
        "wait": "in_place", "abort": "abort", "keep": "retract",
    }  # fmt: skip


def _spans(*spans: tuple[str, int, int]) -> list[dict]:
    return [{"version": v, "start": a, "end": b} for v, a, b in spans]


def _long_answer(n: int, **meta) -> httpx.Response:
    body = {
        "text": "",
        "output_ids": list(range(10, 10 + n)),
        "meta_info": {
            "finish_reason": {"type": "length", "length": n},
            "output_token_logprobs": [[-0.5, 10 + i, None] for i in range(n)],
            **meta,
        },
    }
    return httpx.Response(200, json=body)


def test_a_sample_across_updates_is_labelled_from_sglangs_spans():
    spans = _spans(("3", 0, 4), ("4", 4, 6), ("6", 6, 9))
    c = payloads.parse_generate(_request(), _long_answer(9, weight_versions=spans, weight_version="6"), 3, crossed=[4, 6])
    assert c.versions == [3, 3, 3, 3, 4, 4, 6, 6, 6]
    assert c.policy_version == 3  # dispatched under 3: staleness counts from the oldest token
    # Queued when the replica paused: every token the new weights'.
    late = payloads.parse_generate(_request(), _long_answer(3, weight_versions=_spans(("4", 0, 3))), 3, crossed=[4])
    assert late.versions == [4, 4, 4] and late.policy_version == 3
    # Finished before the update, or never crossed one: one version, no versions list.
    done = payloads.parse_generate(_request(), _long_answer(3, weight_versions=_spans(("3", 0, 3))), 3, crossed=[4])
    plain = payloads.parse_generate(_request(), _long_answer(2, weight_versions=_spans(("3", 0, 2))), 3)
    assert done.versions is None and plain.versions is None and done.policy_version == plain.policy_version == 3
    empty = payloads.parse_generate(_request(), _long_answer(0, weight_versions=_spans(("3", 0, 0))), 3)
    assert empty.token_ids == [] and empty.versions is None


def test_spans_naming_weights_nobody_loaded_or_not_covering_the_tokens_are_refused():
    # A version neither dispatched nor loaded while it ran: someone else changed the weights.
    with pytest.raises(ReplicaFailed, match="weights '5'"):
        payloads.parse_generate(_request(), _long_answer(4, weight_versions=_spans(("3", 0, 2), ("5", 2, 4))), 3, crossed=[4])
    with pytest.raises(ReplicaFailed, match="weights 'v2'"):
        payloads.parse_generate(_request(), _long_answer(2, weight_versions=_spans(("v2", 0, 2))), 3)
    for bad in (
        _spans(("3", 0, 2), ("4", 3, 4)),  # a gap
        _spans(("3", 0, 3)),  # fewer tokens than the answer has
        _spans(("4", 0, 2), ("3", 2, 4)),  # back to an older version
        [{"version": "3", "start": 0}],
    ):
        with pytest.raises(GeneratorError, match="weight_versions"):
            payloads.parse_generate(_request(), _long_answer(4, weight_versions=bad), 3, crossed=[4])


def test_without_spans_a_sample_that_crossed_an_update_cannot_be_labelled():
    # An SGLang before per-token spans: its one label is checked as before...
    assert payloads.parse_generate(_request(), _answer(), 3).versions is None
    # ...but which token a crossing fell on is unknown: refused, not guessed.
    with pytest.raises(GeneratorError, match="needs SGLang 0.5.23"):
        payloads.parse_generate(_request(), _answer(), 3, crossed=[4])


def test_the_weight_sync_follows_the_transport():
    from forgerl_plugins.transports.nccl.transport import NcclTransport
    from forgerl_plugins.transports.shm.transport import ShmTransport

    assert choose_weight_sync("auto", ShmTransport) == "files"
    assert choose_weight_sync("auto", NcclTransport) == "broadcast"
    with pytest.raises(UserError, match="nccl for broadcast"):
        choose_weight_sync("broadcast", ShmTransport)

    class Neither:
        engine_receivers = ()

    with pytest.raises(UserError, match="neither"):
        choose_weight_sync("auto", Neither)  # type: ignore[arg-type]


def test_an_adapter_is_loaded_from_files_and_broadcast_is_refused_with_one(tmp_path):
    """SGLang takes an adapter from a folder (or CUDA IPC handles), never by broadcast."""
    import dataclasses

    from forgerl.adapters import LoraOptions
    from forgerl.errors import ConfigError
    from forgerl_plugins.transports.nccl.transport import NcclTransport

    ctx = dataclasses.replace(_ctx(tmp_path), adapter=LoraOptions(rank=8))
    transport = NcclTransport(NcclTransport.Options(), context=None)
    with pytest.raises(ConfigError, match="cannot receive one by broadcast: use --transport shm"):
        SGLangGenerator(SGLangGenerator.Options(), context=ctx, transport=transport)
    assert SGLangGenerator.serves_adapters


def test_the_backend_is_registered_and_says_how_to_install_sglang():
    from forgerl.registry.plugins import build_registry

    record = build_registry().get("generator", "sglang")
    assert record.implemented and record.roles and record.factory
    assert f"SGLang {SGLANG_VERSION}" in record.info["install"]
    if importlib.util.find_spec("sglang") is None:
        assert record.unavailable_reason() == (
            f"needs sglang: pip install 'forgerl[sglang]' (SGLang {SGLANG_VERSION}; CUDA GPUs only)"
        )

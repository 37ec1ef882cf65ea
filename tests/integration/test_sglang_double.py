"""The sglang generator, end to end on CPU, against the SGLang test double
(tests/helpers/sglang_double.py): the real role, launcher, client, weight updates and
failover; a double instead of SGLang (no CPU build exists).

What this proves: the plugin's command line, payloads and answers fit the double's
SGLang-shaped API (its request models use SGLang's field names and refuse others); the
generator passes the Generator kit against it (the double samples with the model in
transformers, so logprobs, versions and weight updates are checked for real); the
transport's engine receivers deliver whole versions (shm: a staged folder; nccl: a group
built as SGLang builds it, over gloo). What it cannot prove: that SGLang itself answers
the same way. tests/gpu/test_sglang_cuda.py runs against real SGLang servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from forgerl.testing import GeneratorContract
from forgerl.testing.generator import GeneratorSite

from ..helpers.sglang_double_plugin import DOUBLE_COMMAND
from ..helpers.timing import scaled

pytestmark = pytest.mark.integration

PLUGIN = "tests.helpers.sglang_double_plugin"


def _options(**more):
    return {
        "replicas": 1,
        "launch_command": DOUBLE_COMMAND,
        "send_seed": True,  # the double honours sampling_seed (SGLang: with sampling_backend pytorch)
        "health_interval": 0.5,
        "liveness_timeout": scaled(60),
        "startup_timeout": scaled(240),
        **more,
    }


@dataclasses.dataclass
class _SiteOver(GeneratorSite):
    """The kit's servers (one double), opened with generators of their own update policy
    over another transport: the servers take whichever transport an update names, and a
    new generator brings them back to the model folder's weights."""

    transport_name: str = "shm"

    def open(self, transport: str | None = None):  # type: ignore[override]
        return super().open(transport or self.transport_name)


@pytest.fixture(scope="module")
def kit_double(tmp_path_factory):
    """One double (a replica) for both kit classes below: starting one takes a process with
    the model in transformers, so the second class takes the first's instead of its own.
    Stopped by the last class's ``generator_site`` (below), before the two-replica cluster."""
    from forgerl.testing.generator_support import open_site, tiny_model

    model = tiny_model(tmp_path_factory.mktemp("kit-model"), {}, (PLUGIN,))
    with contextlib.ExitStack() as stack:
        run = tmp_path_factory.mktemp("kit-run")
        site = stack.enter_context(open_site("sglang_double", _options(), (PLUGIN,), model, run))
        yield site, stack


def _kit_site(kit_double, transport: str, **options) -> GeneratorSite:
    site, _ = kit_double
    return _SiteOver(site.backend, {**site.options, **options}, site.plugins, site.model_dir, site.run_dir,
                     site.config, site._serial, transport_name=transport)  # fmt: skip


class TestSGLangGeneratorOverShm(GeneratorContract):
    backend = "sglang_double"
    plugins = (PLUGIN,)
    options = _options()

    @pytest.fixture(scope="class")
    @classmethod
    def generator_site(cls, kit_double):
        yield _kit_site(kit_double, "shm")


class TestSGLangGeneratorOverNcclAbortPolicy(GeneratorContract):
    backend = "sglang_double"
    plugins = (PLUGIN,)
    options = _options(update_policy="abort")
    settings = ("transport.name=nccl", "transport.options={}")

    @pytest.fixture(scope="class")
    @classmethod
    def generator_site(cls, kit_double):
        yield _kit_site(kit_double, "nccl", update_policy="abort")
        kit_double[1].close()  # the double's last class: its server goes before the cluster's start


# ------------------------------------------------- update policies and failover, 2 replicas


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two replicas of the double behind the real launcher, started by the local scheduler."""
    from forgerl.testing.generator_support import open_site, tiny_model

    model = tiny_model(tmp_path_factory.mktemp("model"), {}, ())
    options = _options(replicas=2, max_restarts=2, request_timeout=scaled(120))
    with open_site("sglang_double", options, (PLUGIN,), model, tmp_path_factory.mktemp("run"), ()) as site:
        yield site


def _calls(generator, index: int) -> list[dict] | None:
    """The admin calls replica ``index`` received (the double's own record); None on a real
    SGLang server (tests/gpu reuses these tests), which keeps no such record."""
    return _double(generator, index, "GET", "/double/calls")


def _double(generator, index: int, method: str, path: str, **body):
    """A call to one of the double's own routes on replica ``index``; None on a real SGLang
    server, which has no such route."""
    import httpx

    info = generator.replica_info()[index]
    headers = generator._replicas[index].headers
    resp = httpx.request(method, info["url"] + path, headers=headers, json=body or None, timeout=30)
    return resp.json() if resp.status_code == 200 else None


def _in_flight_update(site, policy: str, version: int):
    """Long requests in flight while ``version`` is loaded under ``policy``: their completions,
    the version the generator serves, the admin calls each replica got, and whether the
    requests were held in flight for certain (the double's gate; a real server has none)."""
    import asyncio
    import threading

    from forgerl.testing.generator_support import push
    from forgerl.types import GenerationRequest, SamplingParams
    from tests.helpers.timing import wait_until

    site.options["update_policy"] = policy
    with site.open() as opened:
        gen = opened.generator
        for v in range(1, version):
            push(opened, v, site.new_weights(v), scaled(60))
        requests = [
            GenerationRequest(f"{policy}-{i}", site.random_prompt(i, 16), 2, SamplingParams(max_tokens=48, seed=i))
            for i in range(4)
        ]
        samples = sum(r.n for r in requests)
        # abort: every sample waits at the double's gate before its first token, so all are
        # in flight when the update comes (on a fast machine or a loaded one alike); the
        # abort opens the gate. wait drains in-flight requests first, so it is not gated.
        gated = policy == "abort" and all(_double(gen, i, "POST", "/double/gate", closed=True) for i in range(2))
        results: list = []
        running = threading.Thread(target=lambda: results.append(asyncio.run(gen.generate(requests))))
        running.start()
        try:
            if gated:
                wait_until(
                    lambda: sum(_double(gen, i, "GET", "/double/held")["held"] for i in range(2)) == samples,
                    scaled(60),
                    f"all {samples} samples held in flight",
                )
            else:  # once the replicas have work, the update comes (as the loop sends one mid-rollout)
                wait_until(lambda: any(r["outstanding"] for r in gen.replica_info()), scaled(60), "requests in flight")
            push(opened, version, site.new_weights(version), scaled(60))
        finally:
            if gated:
                for i in range(2):
                    _double(gen, i, "POST", "/double/gate", closed=False)
        running.join(scaled(120))
        assert not running.is_alive()
        calls = [_calls(gen, i) for i in range(2)]
        return results[0], gen.policy_version, calls, gated


@pytest.mark.parametrize("policy", ["wait", "abort", "keep"])
def test_requests_in_flight_during_an_update(cluster, policy):
    version = {"wait": 1, "abort": 2, "keep": 3}[policy]  # after the updates made before
    completions, served, calls, gated = _in_flight_update(cluster, policy, version)
    assert served == version
    flat = [c for cs in completions for c in cs]
    assert len(flat) == 8 and all(len(c.token_ids) == len(c.logprobs) for c in flat)
    if calls[0] is not None:  # the double: its gate held every abort-policy sample in flight
        assert gated == (policy == "abort")
    if gated:
        # All were in flight at the abort and resubmitted whole: each is the new version's.
        assert {c.policy_version for c in flat} == {version}
    elif policy == "keep":
        # Never resubmitted: each is labelled from its dispatch version, per token where it
        # ran across the update (tokens of the old weights first).
        for c in flat:
            versions = c.versions or [c.policy_version] * len(c.token_ids)
            assert c.policy_version in (version - 1, version) and versions == sorted(versions)
            assert set(versions) <= {c.policy_version, version} and len(versions) == len(c.token_ids)
    else:
        # Each completion reports the weights it was made by: old if it finished before the
        # update (drained, or done before the abort), else new.
        assert {c.policy_version for c in flat} <= {version - 1, version}
    for replica_calls in calls:
        if replica_calls is None:
            continue  # real SGLang: what it was asked is not recorded
        paths = [c["path"] for c in replica_calls]
        last = len(paths) - 1 - paths[::-1].index("/pause_generation")
        pause = replica_calls[last]
        assert pause["mode"] == {"wait": "in_place", "abort": "abort", "keep": "retract"}[policy]
        # Then the load of this version, the cache flushed, and generation resumed.
        assert paths[last + 1 :][:3] == ["/update_weights_from_disk", "/flush_cache", "/continue_generation"]
        assert replica_calls[last + 1]["weight_version"] == str(version)


def test_a_killed_replica_fails_over_restarts_and_rejoins_at_the_current_weights(cluster):
    import asyncio
    import json
    import os
    import signal

    from forgerl.testing.generator_support import push
    from forgerl.types import GenerationRequest, SamplingParams
    from forgerl_plugins.generators.sglang.server import endpoint_file
    from tests.helpers.timing import wait_until

    cluster.options["update_policy"] = "wait"
    with cluster.open() as opened:
        gen = opened.generator
        push(opened, 30, cluster.new_weights(30), scaled(60))
        before = json.loads(endpoint_file(cluster.run_dir, 1).read_text())
        os.kill(int(before["pid"]), signal.SIGKILL)
        requests = [
            GenerationRequest(f"fo-{i}", cluster.random_prompt(i, 8), 1, SamplingParams(max_tokens=8)) for i in range(6)
        ]
        results = asyncio.run(gen.generate(requests))  # served by the survivor meanwhile
        assert all(cs[0].policy_version == 30 for cs in results)
        # The scheduler restarts it; the generator brings it to version 30 before it serves.
        wait_until(
            lambda: (info := gen.replica_info()[1])["instance"] != before["instance"] and info["serving"],
            scaled(240),
            "the killed replica back in service",
        )
        assert gen.replica_info()[1]["version"] == 30
        calls = _calls(gen, 1)
        if calls is not None:
            loads = [c for c in calls if c["path"] == "/update_weights_from_disk"]
            assert loads and loads[-1]["weight_version"] == "30"
        again = asyncio.run(gen.generate(requests))
        assert all(cs[0].policy_version == 30 for cs in again)

def _open_gates(gen) -> None:
    """Open both replicas' gates (one whose server is gone has none to open)."""
    import contextlib

    import httpx

    for i in range(2):
        with contextlib.suppress(httpx.HTTPError):
            _double(gen, i, "POST", "/double/gate", closed=False)


def _held_mid_completion(gen, samples: int, after: int) -> None:
    """Close both replicas' gates at token ``after`` and wait until each of the ``samples``
    dispatched is held there (or finished sooner: a stop token), whatever the machine's speed."""
    from tests.helpers.timing import wait_until

    base = [_double(gen, i, "GET", "/double/held")["finished"] for i in range(2)]

    def all_held() -> bool:
        states = [_double(gen, i, "GET", "/double/held") for i in range(2)]
        held = sum(s["held"] for s in states)
        done = sum(s["finished"] - b for s, b in zip(states, base))
        return held + done == samples and held > 0

    wait_until(all_held, scaled(120), f"all {samples} samples held at token {after}")


def _check_per_version(cluster, prompt, comp, weights: dict[int, dict]) -> None:
    """Each token's served logprob is the one its labelled version gives it (fp32, given
    the whole prefix): the boundary is where the weights changed, to the token, and the
    tokens after it were sampled by the new weights over a prefix they computed again."""
    from forgerl.testing.generator_support import teacher_forced

    versions = comp.versions or [comp.policy_version] * len(comp.token_ids)
    for version in sorted(set(versions)):
        want = teacher_forced(cluster.reference(weights[version]), prompt, comp.token_ids, 1.0)
        gap = max(abs(a - b) for a, b, v in zip(comp.logprobs, want, versions) if v == version)
        assert gap < 1e-4, f"tokens labelled {version}: gap {gap:.1e} to that version's logprobs"


def test_keep_continues_requests_across_an_update_with_per_token_versions(cluster):
    """Update policy keep against the double: samples held at token 5 while version 41
    loads (pause by retract, load, flush, resume) go on, never resubmitted; SGLang's spans
    label each token, and every label matches the weights that gave its logprob."""
    import threading

    from forgerl.testing.generator_support import push
    from forgerl.types import GenerationRequest, SamplingParams

    weights = {v: cluster.new_weights(v) for v in (40, 41)}
    cluster.options["update_policy"] = "keep"
    try:
        with cluster.open() as opened:
            gen = opened.generator
            push(opened, 40, weights[40], scaled(60))
            requests = [
                GenerationRequest(f"keep-{i}", cluster.random_prompt(100 + i, 16), 2, SamplingParams(max_tokens=24, seed=i))
                for i in range(2)
            ]
            for i in range(2):
                _double(gen, i, "POST", "/double/gate", closed=True, after=5)
            results: list = []
            running = threading.Thread(target=lambda: results.append(asyncio.run(gen.generate(requests))))
            try:
                running.start()
                _held_mid_completion(gen, samples=4, after=5)
                push(opened, 41, weights[41], scaled(60))  # the held samples stay in flight
            finally:
                _open_gates(gen)
            running.join(scaled(120))
            assert results, "generation did not finish"
            dispatched = sum(info["dispatched"] for info in gen.replica_info())
            calls = [_calls(gen, i) for i in range(2)]
    finally:
        cluster.options["update_policy"] = "wait"
    assert dispatched == len(requests)  # continued, not resubmitted
    crossed = 0
    for request, completions in zip(requests, results[0]):
        assert len(completions) == request.n
        for comp in completions:
            assert comp.finish_reason in ("stop", "length") and comp.policy_version == 40
            if len(comp.token_ids) > 5:  # held at token 5 across the load
                assert comp.versions == [40] * 5 + [41] * (len(comp.token_ids) - 5)
                crossed += 1
            _check_per_version(cluster, request.prompt_token_ids, comp, weights)
    assert crossed, "no sample ran across the update"
    for replica_calls in calls:
        paths = [c["path"] for c in replica_calls]
        last = len(paths) - 1 - paths[::-1].index("/pause_generation")
        assert replica_calls[last]["mode"] == "retract"
        assert paths[last + 1 :][:3] == ["/update_weights_from_disk", "/flush_cache", "/continue_generation"]


def test_keep_loses_and_duplicates_nothing_when_a_replica_dies_mid_update(cluster):
    """Samples held mid-completion on both replicas; replica 1's server is killed once it
    is paused for the update. Its samples fail over to replica 0 and are sampled again
    there whole (by the new weights); replica 0's go on across the update. Every request
    comes back once, with its n samples, each labelled and checked per token; the killed
    replica comes back at the current weights."""
    import json
    import os
    import signal
    import threading

    from forgerl.testing.generator_support import _state, push
    from forgerl.types import GenerationRequest, SamplingParams
    from forgerl_plugins.generators.sglang.server import endpoint_file
    from tests.helpers.timing import wait_until

    weights = {v: cluster.new_weights(v) for v in (50, 51)}
    cluster.options["update_policy"] = "keep"
    try:
        with cluster.open() as opened:
            gen = opened.generator
            push(opened, 50, weights[50], scaled(60))
            victim = json.loads(endpoint_file(cluster.run_dir, 1).read_text())
            requests = [
                GenerationRequest(f"die-{i}", cluster.random_prompt(200 + i, 12), 1, SamplingParams(max_tokens=16, seed=i))
                for i in range(4)
            ]
            for i in range(2):
                _double(gen, i, "POST", "/double/gate", closed=True, after=3)
            admin = gen.engine.client.admin

            async def pause_then_die(r, path, params=None, json=None):
                resp = await admin(r, path, params=params, json=json)
                if path == "/pause_generation" and r.index == 1 and r.instance == victim["instance"]:
                    os.kill(int(victim["pid"]), signal.SIGKILL)
                    await asyncio.to_thread(
                        wait_until, lambda: _state(int(victim["pid"])) in (None, "Z"), scaled(30), "the server's death"
                    )
                return resp

            results: list = []
            running = threading.Thread(target=lambda: results.append(asyncio.run(gen.generate(requests))))
            gen.engine.client.admin = pause_then_die
            try:
                running.start()
                _held_mid_completion(gen, samples=4, after=3)
                before = [info["dispatched"] for info in gen.replica_info()]
                push(opened, 51, weights[51], scaled(60))
            finally:
                del gen.engine.client.admin
                _open_gates(gen)
            running.join(scaled(120))
            assert results, "generation did not finish"
            after = [info["dispatched"] for info in gen.replica_info()]
            assert gen.policy_version == 51 and gen.updater.last_update["replicas"] == [0]
            wait_until(
                lambda: (info := gen.replica_info()[1])["instance"] != victim["instance"] and info["serving"],
                scaled(240),
                "the killed replica back in service",
            )
            assert gen.replica_info()[1]["version"] == 51
    finally:
        cluster.options["update_policy"] = "wait"
    # Two on each replica at first; replica 1's two were sent again, to replica 0, once.
    assert before == [2, 2] and after == [4, 2], (before, after)
    assert len(results[0]) == len(requests)
    moved = 0
    for request, completions in zip(requests, results[0]):
        (comp,) = completions
        assert comp.finish_reason in ("stop", "length") and len(comp.token_ids) <= 16
        if comp.policy_version == 51:  # failed over: sampled again whole, after the update
            assert comp.versions is None
            moved += 1
        else:
            assert comp.policy_version == 50
            if len(comp.token_ids) > 3:
                assert comp.versions == [50] * 3 + [51] * (len(comp.token_ids) - 3)
        _check_per_version(cluster, request.prompt_token_ids, comp, weights)
    assert moved == 2


def _forge_run_on_the_double(out, *more: str) -> list[str]:
    """`forge run` with the sglang generator's code (registered as sglang_double through
    FORGE_PLUGINS, servers from the double), the tiny model, fp32 on both sides (the gap
    checks compare fp32 to fp32), and ``more`` arguments."""
    import json
    import sys

    return [
        sys.executable, "-m", "forgerl.cli", "run", "--model", "tiny", "--generator", "sglang_double",
        "--set", "loop.prompts_per_step=2", "--set", "loop.sampling.max_tokens=12", "--set", "loop.eval_size=4",
        "--set", f"generator.options.launch_command={json.dumps(DOUBLE_COMMAND)}",
        "--set", "generator.options.health_interval=0.5",
        # The role asks for a GPU per replica (tp 1); the double needs none.
        "--set", "scheduler.options.oversubscribe=true",
        "--set", "logging.progress=false", "--output", str(out),
        "--set", "trainer.options.autocast_bf16=false",
        *more,
    ]  # fmt: skip


def _double_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (this environment) with the double's plugin and the repository importable."""
    import os
    from pathlib import Path

    env = dict(os.environ if base is None else base)
    env["FORGE_PLUGINS"] = ",".join(p for p in (PLUGIN, env.get("FORGE_PLUGINS", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    return env


# shm with the wait policy (the defaults) is test_forge_run_end_to_end_survives_a_killed_replica's
# run: the same command, asserted on the same way (steps, versions, logprob gaps), and more.
@pytest.mark.parametrize(("transport", "policy"), [("nccl", "abort")])
def test_forge_run_three_steps_against_the_double(tmp_path, transport, policy):
    """`forge run` end to end with the sglang generator's code (registered as sglang_double
    through FORGE_PLUGINS, servers from the double): trained weights reach the servers each
    step, and the trainer's logprobs match the served ones."""
    import json
    import subprocess

    out = tmp_path / "run"
    command = _forge_run_on_the_double(
        out, "--transport", transport, "--trainer", "fsdp", "--steps", "3",
        "--reward", "format", "--set", "rewards.0.options.pattern=\\d", "--set", "loop.group_size=4",
        "--set", "generator.options.replicas=2", "--set", f"generator.options.update_policy={policy}",
    )  # fmt: skip
    env = _double_env()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=scaled(600))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    gaps = [r["logprob_gap/max"] for r in rows]
    assert max(gaps) < 1e-4, f"train/inference logprob gap per step: {gaps}"


def test_forge_run_end_to_end_survives_a_killed_replica(tmp_path):
    """A replica's server killed mid-run (held after step 1): the run fails its requests over
    to the other replica, the scheduler restarts the dead one, and every step trains on
    the current weights. The pool, its watcher and the loop are the vllm generator's too
    (tests/integration/test_vllm.py kills a real vLLM replica at the pool's level). This is
    also the three-step run over shm with the wait policy (the defaults): trained weights
    reach the servers each step, the trainer's logprobs match the served ones."""
    import json
    import os
    import signal
    import subprocess

    from ..helpers import hold_at_step
    from ..helpers.timing import wait_until

    out = tmp_path / "run"
    command = _forge_run_on_the_double(
        out, "--trainer", "fsdp", "--steps", "3",
        "--reward", "format", "--set", "rewards.0.options.pattern=\\d", "--set", "loop.group_size=4",
        "--set", "generator.options.replicas=2",
    )  # fmt: skip
    env = _double_env(hold_at_step.hold_env(1))  # held after step 1
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    killed = None
    try:
        wait_until(lambda: proc.poll() is not None or hold_at_step.marker(out, 1).exists(), 600,
                   "step 1 of the run (or its end)", interval=0.2)
        if proc.poll() is None:
            killed = json.loads((out / "generators" / "sglang-1.json").read_text())["pid"]
            os.kill(killed, signal.SIGKILL)  # held after step 1, before step 2
            hold_at_step.release(out, 1)
        _, stderr = proc.communicate(timeout=scaled(600))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert killed is not None, "the run ended before a replica could be killed"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    gaps = [r["logprob_gap/max"] for r in rows]
    assert max(gaps) < 1e-4, f"train/inference logprob gap per step: {gaps}"
    events = (out / "logs" / "scheduler.log").read_text()
    assert "restarting sglang-1" in events, events[-2000:]


def test_multi_turn_trajectories_through_the_sglang_generator_are_token_exact(tmp_path):
    """The sglang generator sends each turn as token ids too (the double serves them as
    SGLang does): a multi-turn run's trainer logprobs equal the served ones (fp32)."""
    import json
    import subprocess

    out = tmp_path / "run"
    command = _forge_run_on_the_double(
        out, "--environment", "guess", "--steps", "2", "--set", "loop.group_size=2",
        "--set", "loop.sampling.max_tokens=8", "--set", "loop.eval_size=2",
        "--set", "environment.max_turns=3", "--set", "environment.max_total_tokens=96",
    )  # fmt: skip
    env = _double_env()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=scaled(600))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/failed"] == 0 and row["env/observations_mean"] > 0, row
        assert row["logprob_gap/max"] < 1e-4, f"the double and the trainer disagree: {row['logprob_gap/max']}"


"""The examples of docs/plugins*.md, run as written: the tutorial's reward plugin (its
registration module must stay light, and each backend is one class), the experiment-tracker plugin, the backend
tutorials' `files` transport, `mini` generator and `mini` trainer (with the sketches of a
server-based generator), the scheduler tutorial's `procs` scheduler and the environment
tutorial's `wordle`, each checked against the contract its tutorial states (and its kit,
where forgerl.testing has one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forgerl.testing import (
    EnvironmentContract,
    GeneratorContract,
    RewardContract,
    SchedulerContract,
    TrainerContract,
    TransportContract,
)
from tests.helpers.timing import scaled

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def code_blocks(doc: str) -> dict[str, str]:
    """Python blocks of a doc whose first line is ``# path``, by that path."""
    blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", (DOCS / doc).read_text(), flags=re.S)
    return {path: body for path, body in blocks}


def test_plugin_tutorial_works_and_its_registration_module_stays_light(tmp_path: Path):
    """The tutorial's files, written out as they stand in plugins.md: the registration
    module imports neither pydantic nor the implementation (it names the class), and the
    class it names builds from an options dict and scores, as does the tutorial's own test."""
    blocks = code_blocks("plugins.md")
    for path in ("src/forgerl_brevity/plugin.py", "src/forgerl_brevity/reward.py", "tests/test_brevity.py"):
        assert path in blocks, f"docs/plugins.md has no block starting '# {path}'"
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(blocks[path])
    (tmp_path / "src/forgerl_brevity/__init__.py").write_text("")
    script = textwrap.dedent(
        """
        import sys
        from forgerl_brevity.plugin import forge_rewards
        [ref] = forge_rewards()
        heavy = [m for m in ("pydantic", "forgerl_brevity.reward") if m in sys.modules]
        assert not heavy, f"registering imported {heavy}"
        from forgerl.registry.backend_classes import record_for_class
        from forgerl.backends import RewardBackend
        backend = record_for_class(RewardBackend, ref, "forge_rewards")
        assert (backend.name, backend.description) == ("brevity", "Prefers short completions"), backend
        reward = backend.build({"target_chars": 5})
        from forgerl.types import Problem, RewardInput
        print(reward.score(RewardInput(Problem(id="1", prompt="p"), "0123456789")))
        import test_brevity
        test_brevity.test_short_beats_long()
        """
    )
    shim = REPO / ".pyshim"
    shims = [str(shim)] if shim.is_dir() else []  # a worktree's import shim, when there is one
    path = [str(tmp_path / "src"), str(tmp_path / "tests"), *shims, *sys.path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=scaled(60), env=env)
    assert done.returncode == 0, done.stderr
    assert "RewardResult(value=0.5, components={'chars': 10.0}" in done.stdout, done.stdout


def test_plugin_tutorial_reward_passes_the_reward_kit_as_its_conformance_test_says(tmp_path: Path):
    """plugins.md section 6: the tutorial's conformance test, written out as it stands,
    runs forgerl.testing's reward kit on the tutorial's reward with pytest, and passes."""
    blocks = code_blocks("plugins.md")
    for path in ("src/forgerl_brevity/plugin.py", "src/forgerl_brevity/reward.py", "tests/test_conformance.py"):
        assert path in blocks, f"docs/plugins.md has no block starting '# {path}'"
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(blocks[path])
    (tmp_path / "src/forgerl_brevity/__init__.py").write_text("")
    shim = REPO / ".pyshim"
    shims = [str(shim)] if shim.is_dir() else []  # a worktree's import shim, when there is one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), *shims, *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=kit.xml", "tests/test_conformance.py"],
        capture_output=True, text=True, timeout=scaled(120), env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert_every_check_ran(tmp_path / "kit.xml", RewardContract)


def test_tracker_example_in_plugins_md_forwards_metrics(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The W&B example registers as a plugin (hook names and arguments are checked by
    pluggy) and forwards each step's row, without None values, to the tracker."""
    import types

    from forgerl.configuration.config import RunConfig
    from forgerl.registry.plugins import build_registry

    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self, exit_code):
            calls.append(("finish", exit_code))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    plugin = types.ModuleType("forgerl_wandb_example")
    source = code_blocks("plugins.md")["src/forgerl_wandb/plugin.py"]
    exec(compile(source, "docs/plugins.md", "exec"), plugin.__dict__)

    registry = build_registry(entry_points=False, plugins=[plugin], strict=True, disabled=set())
    run_dir = tmp_path / "20261203-120000"
    registry.hooks.run_start(config=RunConfig(), run_dir=run_dir)
    row = {"step": 1, "reward/mean": 0.5, "loss/policy": None}  # None: a NaN loss, as metrics.jsonl has it
    registry.hooks.step_end(step=1, metrics=row, run_dir=run_dir)
    registry.hooks.run_end(summary={"status": "failed"}, run_dir=run_dir)

    assert [c[0] for c in calls] == ["init", "log", "finish"]
    assert calls[0][1]["id"] == run_dir.name
    assert calls[1][1:] == ({"step": 1, "reward/mean": 0.5}, 1)
    assert calls[2] == ("finish", 1)


# ------------------------------------------------- the backend tutorials' `forgerl-mini`

#: The tutorials whose blocks make up the example packages `forgerl_mini` (a transport, a
#: generator and a trainer) and `forgerl_myengine` (a server-based generator's parts).
BACKEND_TUTORIALS = ("plugins-transport.md", "plugins-generator.md", "plugins-trainer.md")
MINI_FILES = (
    "src/forgerl_mini/transport.py", "src/forgerl_mini/plugin.py",
    "src/forgerl_mini/generator.py", "src/forgerl_mini/trainer.py",
    "src/forgerl_myengine/generator.py", "src/forgerl_myengine/worker.py",
)


def assert_every_check_ran(report: Path, kit: type) -> None:
    """The tutorial's conformance test (run with ``--junitxml=REPORT``) ran every check its
    kit has, none skipped: the checks are read from the kit itself, so a check added to the
    kit is one the tutorial must pass too, and a kit class that silently collects nothing,
    or checks that skip, fail here. (Each caller first asserts that pytest exited 0.)"""
    import xml.etree.ElementTree as ET

    cases = list(ET.parse(report).getroot().iter("testcase"))
    skipped = [case.get("name") for case in cases if case.find("skipped") is not None]
    ran = {case.get("name", "").split("[")[0] for case in cases if case.find("skipped") is None}
    checks = {name for name in dir(kit) if name.startswith("test_")}
    assert checks <= ran, f"checks of {kit.__name__} that did not run: {sorted(checks - ran)}"
    assert not skipped, f"skipped: {skipped}"


@pytest.fixture(scope="module")
def mini_src(tmp_path_factory: pytest.TempPathFactory):
    """The tutorials' files written out as they stand in docs/, importable in this process
    (and in child processes given :func:`child_env`)."""
    root = tmp_path_factory.mktemp("forgerl-mini")
    blocks: dict[str, str] = {}
    for doc in BACKEND_TUTORIALS:
        blocks.update(code_blocks(doc))
    for path in MINI_FILES:
        assert path in blocks, f"no block starting '# {path}' in docs/{'|'.join(BACKEND_TUTORIALS)}"
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(blocks[path])
    for package in ("forgerl_mini", "forgerl_myengine"):
        (root / "src" / package / "__init__.py").write_text("")
    src = str(root / "src")
    sys.path.insert(0, src)
    yield root / "src"
    sys.path.remove(src)
    for name in [m for m in sys.modules if m.split(".")[0] in ("forgerl_mini", "forgerl_myengine")]:
        del sys.modules[name]


def child_env(src: Path) -> dict[str, str]:
    """A child process that imports the tutorial packages and loads `forgerl_mini.plugin`
    through FORGE_PLUGINS, as a run's processes would."""
    shim = REPO / ".pyshim"
    path = [str(src), *([str(shim)] if shim.is_dir() else []), *sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "FORGE_PLUGINS": "forgerl_mini.plugin"}


def mini_registry():
    from forgerl.registry.plugins import build_registry

    return build_registry(plugins=["forgerl_mini.plugin"], strict=True, disabled=set())


def run_context(tmp_path: Path, model: Path | None = None, **config):
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import RunContext

    return RunContext.for_run(RunConfig.model_validate(config), tmp_path, model_path=model)


def test_mini_registration_module_stays_light(mini_src: Path):
    """The registration module names the three classes and imports none of them (nor
    pydantic); the class modules, which the registry imports when it is built, import
    neither torch nor transformers at their top level."""
    script = (
        "import sys\n"
        "from forgerl_mini import plugin\n"
        "hooks = {'forge_transports': plugin.forge_transports, 'forge_generators': plugin.forge_generators,\n"
        "         'forge_trainers': plugin.forge_trainers}\n"
        "refs = {hook: f() for hook, f in hooks.items()}\n"
        "heavy = [m for m in ('pydantic', 'torch', 'transformers', 'forgerl_mini.transport',\n"
        "                     'forgerl_mini.generator', 'forgerl_mini.trainer') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from forgerl.registry.backend_classes import record_for_class\n"
        "from forgerl.backends import GeneratorBackend, TrainerBackend, TransportBackend\n"
        "kinds = {'forge_transports': TransportBackend, 'forge_generators': GeneratorBackend,\n"
        "         'forge_trainers': TrainerBackend}\n"
        "records = [record_for_class(kinds[hook], ref, hook) for hook, got in refs.items() for ref in got]\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print([b.kind for b in records])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=scaled(60), env=child_env(mini_src))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['transport', 'generator', 'trainer']"


# A receiver in another process, as a generator's worker builds it: the transport from its
# name and options with context=None, the receiver from the sender side's receiver_spec().
RECEIVER_PROCESS = """
import json, sys, time
from forgerl.errors import TransportTimeout
from forgerl.registry.plugins import build_registry

spec = json.loads(sys.argv[1])
transport = build_registry().require("transport", "files").build({}, context=None)
receiver = transport.receiver("worker-1", spec)
got = {name: (str(t.dtype), t.tolist()) for name, t in receiver.receive(2, timeout=30)}
start = time.monotonic()
try:
    receiver.receive(3, timeout=0.5)
    timed_out = None
except TransportTimeout as exc:
    timed_out = [str(exc), time.monotonic() - start]
print(json.dumps({"latest": receiver.latest_version(), "got": got, "timed_out": timed_out}))
"""


def test_transport_tutorial_delivers_whole_versions_to_another_process(mini_src: Path, tmp_path: Path):
    """The `files` transport of docs/plugins-transport.md keeps the contract it states: a
    receiver built in another process with context=None from receiver_spec() gets a
    version whole and bit-exact, versions strictly increase, a version that never comes
    is a TransportTimeout after about its timeout, and close() leaves nothing behind."""
    transport = mini_registry().require("transport", "files").build({}, context=run_context(tmp_path))
    try:
        check_files_transport(transport, mini_src)
    finally:
        transport.close()
    assert not Path(transport.receiver_spec()["directory"]).exists(), "close() left the directory"


def check_files_transport(transport, mini_src: Path) -> None:
    import json

    import torch

    from forgerl.types import WeightSet

    sender = transport.sender()
    local = transport.receiver("local")
    assert local.latest_version() is None
    v1 = {"model.embed_tokens.weight": torch.randn(4, 3).to(torch.bfloat16),
          "flags": torch.tensor([True, False])}
    v2 = {"model.embed_tokens.weight": torch.randn(4, 3).to(torch.bfloat16),
          "flags": torch.tensor([False, True])}
    sender.send(WeightSet(1, v1))
    sender.send(WeightSet(2, v2))
    with pytest.raises(ValueError, match="must increase"):
        sender.send(WeightSet(2, v1))
    assert local.latest_version() == 2

    spec = json.dumps(transport.receiver_spec())
    done = subprocess.run([sys.executable, "-c", RECEIVER_PROCESS, spec], capture_output=True, text=True,
                          timeout=scaled(90), env=child_env(mini_src))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["latest"] == 2
    assert out["got"] == {name: [str(t.dtype), t.tolist()] for name, t in v2.items()}
    message, waited = out["timed_out"]
    assert "version 3" in message and waited >= 0.5
    sender.close()


def reference_logprobs(model, prompt: list[int], completion, temperature: float):
    """log_softmax(logits / T) (T = 1 when greedy) at each completion token, from one
    plain forward pass over prompt + completion."""
    import torch

    ids = torch.tensor([prompt + list(completion.token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    scaled_logits = logits / (temperature if temperature > 0 else 1.0)
    chosen = torch.tensor(completion.token_ids).unsqueeze(-1)
    return torch.log_softmax(scaled_logits, dim=-1).gather(-1, chosen).squeeze(-1)


def train_batch(prompt: list[int], completions, advantages: list[float]):
    """A TrainBatch of one prompt's completions, laid out as the loop lays it out."""
    import torch

    from forgerl.types import TrainBatch

    width = len(prompt) + max(len(c.token_ids) for c in completions)
    shape = (len(completions), width)
    ids = torch.full(shape, -100, dtype=torch.long)
    attention, loss_mask = torch.zeros(shape, dtype=torch.long), torch.zeros(shape)
    behaviour = torch.zeros(shape)
    for row, c in enumerate(completions):
        end = len(prompt) + len(c.token_ids)
        ids[row, :end] = torch.tensor(prompt + list(c.token_ids))
        attention[row, :end] = 1
        loss_mask[row, len(prompt) : end] = 1
        behaviour[row, len(prompt) : end] = torch.tensor(c.logprobs)
    return TrainBatch(ids, attention, loss_mask, behaviour, torch.tensor(advantages),
                      torch.tensor([c.policy_version for c in completions]), num_groups=1)


def test_transport_tutorial_passes_the_transport_kits_in_process_case(mini_src: Path, tmp_path: Path):
    """The `files` transport of the tutorial, checked by forgerl.testing's transport kit as
    its "Checking it" section says (the case that needs no helper process): nothing blocks
    forever, and its close leaves nothing behind."""
    from forgerl.testing import TransportCase, TransportContract

    directory = tmp_path / "weights"
    directory.mkdir()
    case = TransportCase(
        "files", {"directory": str(directory)}, confirms_delivery=False, plugins=("forgerl_mini.plugin",)
    )
    TransportContract().test_nothing_blocks_forever(case)


@pytest.mark.integration
def test_transport_tutorial_passes_the_transport_kit_as_its_conformance_test_says(mini_src: Path, tmp_path: Path):
    """The conformance test of plugins-transport.md, written out as it stands, runs the
    whole transport kit (receivers in their own processes) on the tutorial's `files`
    transport with pytest, the plugin loaded as an installed one would be, and passes."""
    test = code_blocks("plugins-transport.md")["tests/test_conformance.py"]
    (tmp_path / "test_conformance.py").write_text(test)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=kit.xml", "test_conformance.py"],
        capture_output=True, text=True, timeout=scaled(300), env=child_env(mini_src), cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert_every_check_ran(tmp_path / "kit.xml", TransportContract)


@pytest.mark.integration
def test_generator_tutorial_passes_the_generator_kit_as_its_conformance_test_says(mini_src: Path, tmp_path: Path):
    """The conformance test of plugins-generator.md, written out as it stands, runs the
    whole Generator kit on the tutorial's `mini` generator with pytest, the plugin loaded
    as an installed one would be, and passes every check."""
    test = code_blocks("plugins-generator.md")["tests/test_conformance.py"]
    (tmp_path / "test_conformance.py").write_text(test)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=kit.xml", "test_conformance.py"],
        capture_output=True, text=True, timeout=scaled(600), env=child_env(mini_src), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert_every_check_ran(tmp_path / "kit.xml", GeneratorContract)


def test_generator_and_trainer_tutorials_keep_the_logprob_and_weight_contracts(
    mini_src: Path, tiny_model_dir: Path, tmp_path: Path
):
    """The `mini` generator and trainer of docs/plugins-{generator,trainer}.md, with the
    `files` transport, on the tiny model: the generator's logprobs are log_softmax(logits /
    T) of the sampled tokens (plain at T = 0); the trainer sees the same (logprob gap ~0);
    its exported weights carry Hugging Face names and reach the generator through the
    transport (the gap is ~0 again, completions carry the new version); a version that
    never comes times out and leaves the served one; a checkpoint restores the state."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from forgerl.errors import NotSupported, TransportTimeout
    from forgerl.types import GenerationRequest, SamplingParams

    registry = mini_registry()
    ctx = run_context(tmp_path, tiny_model_dir, transport={"name": "files", "timeout": 1})
    transport = registry.require("transport", "files").build({}, context=ctx)
    sender = transport.sender()
    generator = registry.require("generator", "mini").build({}, context=ctx, transport=transport)
    trainer = registry.require("trainer", "mini").build({"lr": 1e-3}, context=ctx)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = [5, 17, 42, 99, 7]

    def sample(temperature: float, seed: int = 3, n: int = 3):
        sampling = SamplingParams(max_tokens=6, temperature=temperature, seed=seed)
        request = GenerationRequest("r0", prompt, n, sampling)
        [completions] = asyncio.run(generator.generate([request]))
        return completions

    try:
        for temperature in (0.7, 0.0):
            completions = sample(temperature)
            assert len(completions) == 3
            for c in completions:
                assert c.policy_version == 0 and len(c.token_ids) == len(c.logprobs) > 0
                want = reference_logprobs(reference, prompt, c, temperature)
                got = torch.tensor(c.logprobs)
                assert torch.allclose(got, want, atol=1e-4), (temperature, got, want)
        assert [c.token_ids for c in sample(0.7)] == [c.token_ids for c in sample(0.7)]  # seeded

        completions = sample(1.0)
        metrics = trainer.train_step(train_batch(prompt, completions, [1.0, -1.0, 0.0]))
        assert metrics["logprob_gap/max"] < 1e-4, metrics
        assert all(map(torch.isfinite, map(torch.tensor, (metrics["loss"], metrics["grad_norm"]))))

        exported = trainer.export_weights(1)
        assert list(exported.tensors) == list(reference.state_dict()), "not the Hugging Face names"
        norm = "model.norm.weight"
        assert not torch.equal(exported.tensors[norm], reference.state_dict()[norm]), "did not train"
        sender.send(exported)
        generator.update_weights(1)
        assert generator.policy_version == 1
        completions = sample(1.0, seed=11)
        assert {c.policy_version for c in completions} == {1}
        metrics = trainer.train_step(train_batch(prompt, completions, [1.0, -1.0, 0.0]))
        assert metrics["logprob_gap/max"] < 1e-4, "the generator does not serve the trainer's weights"

        with pytest.raises(TransportTimeout):
            generator.update_weights(2)  # never sent: transport.timeout (1 s) runs out
        assert generator.policy_version == 1

        checkpoint = tmp_path / "checkpoint"
        checkpoint.mkdir()
        trainer.save(checkpoint)
        batch = train_batch(prompt, completions, [1.0, -1.0, 0.0])
        after_save = trainer.train_step(batch), trainer.export_weights(2).tensors
        trainer.load(checkpoint)
        again = trainer.train_step(batch), trainer.export_weights(2).tensors
        assert after_save[0] == again[0]
        assert all(torch.equal(after_save[1][n], again[1][n]) for n in after_save[1])

        with pytest.raises(NotSupported, match="kl_coef"):
            registry.require("trainer", "mini").build({}, context=run_context(
                tmp_path, tiny_model_dir, algorithm={"kl_coef": 0.1}))
        with pytest.raises(NotSupported, match="top_k"):
            registry.require("generator", "mini").build({}, context=run_context(
                tmp_path, tiny_model_dir, loop={"sampling": {"top_k": 5}}), transport=transport)
    finally:
        for part in (generator, trainer, sender, transport):
            part.close()


def test_server_generator_parts_of_the_generator_tutorial(mini_src: Path, tmp_path: Path):
    """The server-based sketches of docs/plugins-generator.md run: `roles` gives the
    scheduler a RoleSpec per server, and the worker-side `load_weights`, in another process,
    builds the run's transport by name with context=None and hands the engine a whole
    version."""
    import json

    import torch
    from forgerl_myengine.generator import MyEngineGenerator

    from forgerl.types import WeightSet

    ctx = run_context(tmp_path)
    options = MyEngineGenerator.Options(replicas=2, gpus_per_replica=1, max_restarts=3)
    [role] = MyEngineGenerator.roles(options, context=ctx)
    assert (role.replicas, role.resources.gpus, role.max_restarts) == (2, 1, 3)
    assert role.command[1:] == ("-m", "forgerl.server_role", "--run-dir", str(tmp_path), "--role", "myengine")
    assert callable(MyEngineGenerator.serve), "what forgerl.server_role calls for each replica"

    transport = mini_registry().require("transport", "files").build({}, context=ctx)
    sender = transport.sender()
    sender.send(WeightSet(4, {"lm_head.weight": torch.ones(2, 2)}))
    request = {"version": 4, "timeout": 30, "worker_id": "myengine-0-rank0",
               "transport": {"name": "files", "options": {}, "spec": transport.receiver_spec()}}
    script = (
        "import json, sys\n"
        "from forgerl_myengine.worker import load_weights\n"
        "class Engine:\n"
        "    def load_weights(self, weights):\n"
        "        self.got = {n: t.tolist() for n, t in weights}\n"
        "engine = Engine()\n"
        "load_weights(engine, json.loads(sys.argv[1]))\n"
        "print(json.dumps(engine.got))\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", script, json.dumps(request)], capture_output=True,
                              text=True, timeout=scaled(90), env=child_env(mini_src))
        assert done.returncode == 0, done.stderr
        loaded = json.loads(done.stdout.strip().splitlines()[-1])
        assert loaded == {"lm_head.weight": [[1.0, 1.0], [1.0, 1.0]]}
    finally:
        sender.close()
        transport.close()


@pytest.mark.integration
@pytest.mark.slow  # two trainer ranks in their own processes: 20-60 s on two busy cores
def test_trainer_tutorial_passes_the_trainer_kit_as_its_conformance_test_says(mini_src: Path, tmp_path: Path):
    """The "Run the kit" test of plugins-trainer.md, written out as it stands, runs the whole
    trainer kit (two ranks included) on the tutorial's `mini` trainer with pytest, the
    plugin loaded as an installed one would be, and passes."""
    test = code_blocks("plugins-trainer.md")["tests/test_trainer_conformance.py"]
    (tmp_path / "test_trainer_conformance.py").write_text(test)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=kit.xml", "test_trainer_conformance.py"],
        capture_output=True, text=True, timeout=scaled(400), env=child_env(mini_src), cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert_every_check_ran(tmp_path / "kit.xml", TrainerContract)


def test_a_run_on_the_three_tutorial_backends(mini_src: Path, tmp_path: Path):
    """The command the tutorials give, `forge run --model tiny --transport files --generator
    mini --trainer mini`, completes, the weights reach the generator every step, and the
    generator and trainer agree on logprobs (the gap metric ~0)."""
    import json

    args = ["--model", "tiny", "--transport", "files", "--generator", "mini", "--trainer", "mini",
            "--reward", "format", "--set", "rewards.0.options.pattern=\\d", "--steps", "2",
            "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=4",
            "--set", "loop.sampling.max_tokens=8", "--set", "loop.eval_size=2",
            "--output", str(tmp_path / "run")]
    done = subprocess.run([sys.executable, "-m", "forgerl.cli", "run", *args], capture_output=True, text=True,
                          timeout=scaled(300), env=child_env(mini_src), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["policy_version"]) == ("completed", 2)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert all(r["logprob_gap/max"] < 1e-4 for r in rows), rows


# ------------------------------------------------- the scheduler tutorial's `forgerl-procs`

PROCS_FILES = ("src/forgerl_procs/plugin.py", "src/forgerl_procs/supervisor.py",
               "src/forgerl_procs/scheduler.py", "tests/test_conformance.py")


def write_procs_package(root: Path) -> dict[str, str]:
    """The files of docs/plugins-scheduler.md written out under ``root`` as they stand; the
    environment of a process that imports them (the tutorial's package not installed)."""
    blocks = code_blocks("plugins-scheduler.md")
    for path in PROCS_FILES:
        assert path in blocks, f"docs/plugins-scheduler.md has no block starting '# {path}'"
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(blocks[path])
    (root / "src/forgerl_procs/__init__.py").write_text("")
    shim = REPO / ".pyshim"
    path = [str(root / "src"), *([str(shim)] if shim.is_dir() else []), *sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def test_scheduler_tutorial_registration_module_stays_light(tmp_path: Path):
    """plugin.py names the class and imports neither it nor pydantic; the record the
    registry makes of the class builds the scheduler from an options dict."""
    env = write_procs_package(tmp_path)
    script = (
        "import sys\n"
        "from forgerl_procs.plugin import forge_schedulers\n"
        "[ref] = forge_schedulers()\n"
        "heavy = [m for m in ('pydantic', 'forgerl_procs.scheduler') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from forgerl.registry.backend_classes import record_for_class\n"
        "from forgerl.backends import SchedulerBackend\n"
        "backend = record_for_class(SchedulerBackend, ref, 'forge_schedulers')\n"
        "assert backend.name == 'procs', backend\n"
        "scheduler = backend.build({'stop_timeout': 3})\n"
        "print(type(scheduler).__name__, scheduler.detached, scheduler.supports_logs)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled(60), env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ProcsScheduler", "True", "True"]


@pytest.mark.integration
def test_scheduler_tutorial_passes_the_scheduler_kit_as_its_conformance_test_says(tmp_path: Path):
    """docs/plugins-scheduler.md's conformance test, written out as it stands, runs the
    whole scheduler kit (real jobs of real processes) on the tutorial's `procs` scheduler
    with pytest, and passes."""
    env = write_procs_package(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=kit.xml", "tests/test_conformance.py"],
        capture_output=True, text=True, timeout=scaled(300), env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert_every_check_ran(tmp_path / "kit.xml", SchedulerContract)


# ------------------------------------------------- the environment tutorial's `wordle`

WORDLE_FILES = ("src/forgerl_wordle/plugin.py", "src/forgerl_wordle/environment.py",
                "tests/test_wordle.py", "tests/test_conformance.py")


def write_wordle_package(root: Path) -> dict[str, str]:
    """The files of docs/plugins-environment.md written out under ``root`` as they stand;
    the environment of a process that imports them (the package not installed)."""
    blocks = code_blocks("plugins-environment.md")
    for path in WORDLE_FILES:
        assert path in blocks, f"docs/plugins-environment.md has no block starting '# {path}'"
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(blocks[path])
    (root / "src/forgerl_wordle/__init__.py").write_text("")
    shim = REPO / ".pyshim"
    path = [str(root / "src"), *([str(shim)] if shim.is_dir() else []), *sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def test_environment_tutorial_registration_module_stays_light(tmp_path: Path):
    """plugin.py names the class and imports neither it nor pydantic; the record the
    registry makes of the class builds an instance per call from an options dict."""
    env = write_wordle_package(tmp_path)
    script = (
        "import sys\n"
        "from forgerl_wordle.plugin import forge_environments\n"
        "[ref] = forge_environments()\n"
        "heavy = [m for m in ('pydantic', 'forgerl_wordle.environment') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from forgerl.registry.backend_classes import record_for_class\n"
        "from forgerl.backends import EnvironmentBackend\n"
        "backend = record_for_class(EnvironmentBackend, ref, 'forge_environments')\n"
        "a, b = backend.build({'max_guesses': 3}), backend.build({'max_guesses': 3})\n"
        "print(backend.name, backend.description, type(a).__name__, a is not b, a.options.max_guesses)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled(60), env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "wordle find a five-letter word with letter-by-letter feedback WordleEnvironment True 3"


def test_environment_tutorial_passes_the_environment_kit_as_its_conformance_test_says(tmp_path: Path):
    """docs/plugins-environment.md's tests, written out as they stand, run the game's own
    tests and the whole environment kit on the tutorial's `wordle` with pytest, and pass."""
    env = write_wordle_package(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=kit.xml", "tests"],
        capture_output=True, text=True, timeout=scaled(180), env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert_every_check_ran(tmp_path / "kit.xml", EnvironmentContract)


def test_the_verifiers_config_of_environments_md_gives_the_task_and_the_environment_one_source():
    """The YAML anchor in docs/environments.md puts environment, args and pythonpath in both
    the task's options and the environment's (each backend reads its own), as the config
    loader reads it."""
    from forgerl.configuration.config import RunConfig
    from forgerl.configuration.sources import load_yaml

    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", (DOCS / "environments.md").read_text(), flags=re.S)
               if "&my-env" in b]  # fmt: skip
    data = load_yaml(block)
    source = {"environment": "my-env", "args": {"difficulty": "easy"}, "pythonpath": ["envs/my-env"]}
    assert data["task"]["options"] == source
    assert data["environment"]["options"] == {**source, "timeout": 300}
    RunConfig.model_validate(data)


def test_the_tool_less_game_of_plugins_environment_md_takes_every_turn_as_a_move():
    """The tutorial's Nim overrides ``step``: every turn is a move, a ``<tool_call>`` tag
    included (the default ``step`` would answer that with an unknown-tool error)."""
    [block] = [b for b in re.findall(r"```python\n(.*?)```", (DOCS / "plugins-environment.md").read_text(), flags=re.S)
               if "class NimEnvironment" in b]  # fmt: skip
    from forgerl.types import Problem

    namespace: dict = {}
    exec(compile(block, "docs/plugins-environment.md", "exec"), namespace)
    nim = namespace["NimEnvironment"]()
    problem = Problem(id="g", prompt="ignored")
    assert "15 stones" in nim.reset(problem)[0]["content"]
    step = nim.step("I take 3.")  # 12 left; the environment takes 12 % 4 or 1 = 1
    assert not step.done and step.messages[0]["content"] == "I take 1; 11 left. How many?"
    step = nim.step('<tool_call>{"name": "take", "arguments": {"n": "two"}}</tool_call>')
    assert step.done and step.reward == 0.0 and dict(step.components) == {"correct": 0.0, "illegal": 1.0}
    nim.reset(problem)
    for _ in range(3):  # 15 -> 12 (takes 1) -> 11 ... until the model takes the last
        step = nim.step("3")
    assert not step.done and nim.stones == 3
    step = nim.step("3")
    assert step.done and step.reward == 1.0 and dict(step.components) == {"correct": 1.0, "illegal": 0.0}

"""What the Generator kit builds around the generator under test: the model it serves, the
run it belongs to (a resolved config, a run directory, the backend's server roles started
by the local scheduler), a reference copy of the model in transformers, and a transport
per generator (shm) to send weights through.

The reference model is the trainer's side of the logprob contract: a teacher-forced
forward pass over prompt + completion gives ``log_softmax(logits / T)`` at every sampled
token, which is what the generator must have reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.configuration.sections import options_dict
from forgerl.testing.registry import backend_under_test, registry_for
from forgerl.testing.timing import scaled, wait_until

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import Generator, RunContext, Transport, TransportSender
    from forgerl.types import Completion, GenerationRequest

#: Seconds (scaled) the kit waits for the servers a generator's roles start to go away.
ROLES_STOP_S = 60.0


def tiny_model(cache_dir: Path, options: Mapping[str, Any], plugins: Sequence[str] = ()) -> Path:
    """The built-in ``tiny`` model (model backend ``tiny``, built offline) with ``options``,
    its tied embeddings rescaled to std 0.1 and saved beside it: at the builder's scale every
    position copies its input token with probability ~1, so every seed would sample the
    same tokens and the kit's sampling checks would prove nothing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = backend_under_test("model", "tiny", plugins, required=True)
    built = Path(record.build(dict(options), cache_dir=cache_dir))
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        assert isinstance(emb, torch.Tensor), f"the tiny model's input embeddings have no weight tensor: {emb!r}"
        emb.mul_(0.1 / emb.std())
    out = cache_dir / f"{built.name}-varied"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(built).save_pretrained(out)
    return out


@dataclass
class OpenGenerator:
    """A generator built as a run builds it, with the transport and sender it was given."""

    generator: Generator
    transport: Transport
    sender: TransportSender


@dataclass
class GeneratorSite:
    """The run a generator under test belongs to; one per test class (servers are slow to
    start), a new generator per test (:meth:`open`)."""

    backend: str
    options: dict[str, Any]
    plugins: tuple[str, ...]
    model_dir: Path
    run_dir: Path
    config: RunConfig
    _serial: Iterator[int] = field(default_factory=itertools.count, repr=False)
    _reference: Any = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False)
    _stop_roles: Any = field(default=None, repr=False)

    # ------------------------------------------------------------- generators

    def context(self) -> RunContext:
        """The RunContext of the site's generators: the site's config and folders."""
        from forgerl.interfaces import RunContext

        return RunContext.for_run(self.config, self.run_dir, model_path=self.model_dir)

    @contextlib.contextmanager
    def open(self, transport: str | None = None) -> Iterator[OpenGenerator]:
        """A new generator (with a new transport and its sender, as a run builds them:
        transport, sender, generator) closed with them at the end, whatever happened.
        ``transport`` names another transport than the site's (with its default options),
        for a generator whose servers take whichever its updates name (the site's servers
        then serve both)."""
        transport_dir = self.run_dir / f"weights-{next(self._serial)}"  # the shm transport's, each its own
        ctx = self.context()
        registry = registry_for(self.plugins)
        name = transport or self.config.transport.name
        options: Any = self.config.transport.options if transport is None else {}
        if name == "shm":
            options = {**options_dict(options), "directory": str(transport_dir)}
        built = registry.require("transport", name).build(options, context=ctx)
        sender = generator = None
        try:
            sender = built.sender()
            record = backend_under_test("generator", self.backend, self.plugins)
            generator = record.build(dict(self.options), context=ctx, transport=built)
            yield OpenGenerator(generator, built, sender)
        finally:
            for part in (generator, sender, built):  # the run's order (forgerl.worker)
                if part is not None:
                    part.close()

    # ------------------------------------------------------------- the model

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    def reference(self, weights: Mapping[str, Any] | None = None) -> Any:
        """The model in transformers, fp32, with ``weights`` loaded (the model folder's when None)."""
        import torch
        from transformers import AutoModelForCausalLM

        if self._reference is None:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            model.eval()  # type: ignore[no-untyped-call]  # transformers' PreTrainedModel.eval is unannotated
            self._reference = (model, {k: v.clone() for k, v in model.state_dict().items()})
        model, base = self._reference
        model.load_state_dict(base if weights is None else weights)
        return model

    def new_weights(self, version: int, scale: float = 0.02) -> dict[str, Any]:
        """The model folder's weights plus noise seeded by ``version`` (every tensor, a tied
        embedding too): what a trainer would send as ``version``."""
        import torch

        model = self.reference()
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in model.parameters():  # a tied embedding is one parameter: one noise
                p.add_(torch.randn(p.shape, generator=g) * scale)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        self.reference()  # back to the folder's weights
        return weights

    def eos_ids(self) -> set[int]:
        from transformers import GenerationConfig

        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:
            eos = None
        for value in (eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return ids

    def chat_prompt(self, question: str) -> list[int]:
        tok = self.tokenizer
        if tok.chat_template is None:
            return list(tok(question)["input_ids"])
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def random_prompt(self, seed: int, length: int) -> list[int]:
        """Ordinary tokens drawn at random: the varied tiny model samples widely after them."""
        import random

        rng = random.Random(seed)
        special = set(self.tokenizer.all_special_ids)
        ordinary = [i for i in range(len(self.tokenizer)) if i not in special]
        return [rng.choice(ordinary) for _ in range(length)]

    def close(self) -> None:
        if self._stop_roles is not None:
            self._stop_roles()
            self._stop_roles = None


@contextlib.contextmanager
def open_site(
    backend: str,
    options: Mapping[str, Any],
    plugins: Sequence[str],
    model_dir: Path,
    run_dir: Path,
    settings: Sequence[str] = (),
    transport_timeout: float = 60.0,
) -> Iterator[GeneratorSite]:
    """The run of a generator under test: a resolved config (model ``model_dir``, generator
    ``backend`` with ``options``, the shm transport, ``settings`` as ``--set`` lines) written
    to ``run_dir`` as a run writes it, and the backend's server roles started there by the
    local scheduler, as ``forge run`` starts them; stopped at the end."""
    from forgerl.configuration.config import build_config
    from forgerl.registry.resolve import resolve
    from forgerl.rundirs import runs

    record = backend_under_test("generator", backend, plugins)
    registry = registry_for(plugins)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = {
        "model": {"name": str(model_dir)},
        "generator": {"name": backend, "options": dict(options)},
        "transport": {
            "name": "shm",
            "options": {"directory": str(run_dir / "weights")},
            "timeout": scaled(transport_timeout),
        },
    }
    config = resolve(build_config(base=base, sets=settings), registry)
    runs.write_config(run_dir, config)
    site = GeneratorSite(backend, options_dict(config.generator.options), tuple(plugins), model_dir, run_dir, config)
    roles = record.server_roles(config.generator.options, context=site.context())
    try:
        if roles:
            site._stop_roles = start_roles(site, roles)
            # A first generator waits for the servers (its own start-up timeout), here in
            # the class's set-up rather than within the first check's time limit.
            with site.open():
                pass
        yield site
    finally:
        site.close()


def start_roles(site: GeneratorSite, roles: Sequence[Any]) -> Any:
    """Start ``roles`` under the local scheduler in ``site.run_dir`` and return a function
    that stops them. The scheduler's children die with the thread that started them
    (PR_SET_PDEATHSIG): one thread submits and supervises them until they are stopped."""
    from forgerl.types import JobSpec

    registry = registry_for(site.plugins)
    scheduler = registry.require("scheduler", "local").build({"stop_timeout": 10})
    # As a run's job (forgerl.rundirs.runs.build_job): the roles' processes load the plugins under
    # test too, to find the backend that serves them.
    env = {"FORGE_PLUGINS": ",".join(registry.plugin_refs)} if registry.plugin_refs else {}
    job = JobSpec(f"kit-{site.backend}", str(site.run_dir), tuple(roles), env=env)
    submitted = threading.Event()
    failed: list[BaseException] = []

    def supervise() -> None:
        try:
            handle = scheduler.submit(job)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failed.append(exc)
            return
        finally:
            submitted.set()
        scheduler.wait(handle)

    thread = threading.Thread(target=supervise, name="forge-kit-roles", daemon=True)
    thread.start()
    if not submitted.wait(scaled(60)) or failed:
        raise AssertionError(f"the local scheduler did not start the roles of {site.backend!r}: {failed}")

    def stop() -> None:
        scheduler.cancel(str(site.run_dir))
        thread.join(scaled(ROLES_STOP_S))

    return stop


# ------------------------------------------------------------------- checks


def generate(generator: Any, requests: Sequence[GenerationRequest], timeout: float) -> list[list[Completion]]:
    """``await generator.generate(requests)`` on a new event loop, as evaluation calls it,
    failing after ``timeout`` seconds instead of hanging."""

    async def go() -> list[list[Completion]]:
        return await asyncio.wait_for(generator.generate(list(requests)), timeout)

    try:
        return asyncio.run(go())
    except asyncio.TimeoutError:
        raise AssertionError(
            f"generate() of {len(requests)} request(s) did not return within {timeout:g} s"
        ) from None


def teacher_forced(
    model: Any, prompt: Sequence[int], tokens: Sequence[int], temperature: float
) -> list[float]:
    """``log_softmax(logits / T)`` at each of ``tokens`` after ``prompt`` (T = 1 when greedy)."""
    import torch

    if not tokens:
        return []
    t = temperature if temperature > 0 else 1.0
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits / t, dim=-1).gather(-1, torch.tensor(list(tokens)).unsqueeze(-1))
    return [float(x) for x in picked.squeeze(-1)]


def logprob_gap(model: Any, prompt: Sequence[int], completion: Completion, temperature: float) -> float:
    want = teacher_forced(model, prompt, completion.token_ids, temperature)
    return max((abs(a - b) for a, b in zip(completion.logprobs, want)), default=0.0)


def push(opened: OpenGenerator, version: int, weights: Mapping[str, Any], timeout: float) -> None:
    """A weight update as the loop makes one (:meth:`forgerl.runloop.loop.Loop.sync_weights`):
    ``update_weights(version)`` in a thread while the sender sends the version."""
    from forgerl.types import WeightSet

    errors: list[BaseException] = []

    def receive() -> None:
        try:
            opened.generator.update_weights(version)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    loader = threading.Thread(target=receive, name="forge-kit-weight-update", daemon=True)
    loader.start()
    opened.sender.send(WeightSet(version, dict(weights)), timeout=timeout)
    loader.join(timeout + scaled(30))
    assert not loader.is_alive(), f"update_weights({version}) did not return within {timeout:g} s of the send"
    assert not errors, f"update_weights({version}) raised {type(errors[0]).__name__}: {errors[0]}"


def child_processes() -> set[int]:
    """Live (not zombie) child processes of this process, from /proc."""
    pids: set[int] = set()
    me = os.getpid()
    try:
        tasks = os.listdir(f"/proc/{me}/task")
    except OSError:
        return pids
    for task in tasks:
        try:
            with open(f"/proc/{me}/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return {p for p in pids if _state(p) not in ("Z", "X", None)}


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def processes_left(before: set[int], wait_s: float) -> set[int]:
    """Children started since ``before`` still alive after ``wait_s`` (scaled) seconds."""
    try:
        wait_until(lambda: not (child_processes() - before), wait_s, "the generator's processes to end")
    except AssertionError:
        pass  # reported by the caller, with their command lines
    return child_processes() - before


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"

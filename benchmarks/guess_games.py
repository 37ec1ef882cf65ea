"""How a model plays the ``guess`` environment: the held-out games, greedy, move by move.

Loads the run's model (``--run DIR``: its config, and with ``--step N`` the weights of that
checkpoint; without it the base model), plays the run's held-out problems as its
evaluation does (greedy, the run's environment options and limits) through the run's
trajectory runner on the in-process hf generator, and prints what the held-out accuracy
is made of: wins, wins after the first guess, the hints answered with a number and how
many went the hinted way, and each distinct line of play (the model's guesses given the
hints, which greedy decoding makes a decision tree).

    python benchmarks/guess_games.py --run runs/learning-... [--step 18]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--step", type=int, help="a checkpoint of the run (default: the base model)")
    parser.add_argument("--lines", type=int, default=12, help="lines of play to print")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from forgerl.interfaces import RunContext
    from forgerl.models.resolve import resolve_model
    from forgerl.registry.plugins import build_registry
    from forgerl.rollouts.trajectory import Limits, TrajectoryRunner
    from forgerl.rundirs import runs
    from forgerl.types import SamplingParams
    from forgerl_plugins.environments.guess import GuessEnvironment
    from forgerl_plugins.generators.hf.generator import HFGenerator
    from forgerl_plugins.transports.shm.transport import ShmTransport

    torch.set_num_threads(1)
    registry = build_registry()
    config = runs.load_config(args.run, registry)
    if config.environment.name != "guess":
        raise SystemExit(f"{args.run} is not a guess run (environment: {config.environment.name})")
    base = resolve_model(config.model, registry)
    tmp = Path(tempfile.mkdtemp())
    model_dir = base
    if args.step is not None:
        model_dir = tmp / "model"
        export_checkpoint(args.run / "checkpoints" / f"step-{args.step:06d}" / "trainer", base, model_dir)
    env = config.environment
    options = GuessEnvironment.Options.model_validate(env.options)
    task = registry.require("task", config.task.name).build(config.task.options, seed=config.loop.seed)
    problems = task.eval_problems()[: config.loop.eval_size or None]
    turn_tokens = env.max_turn_tokens or config.loop.sampling.max_tokens
    limits = Limits(env.max_turns, env.max_total_tokens, turn_tokens, 60.0, 64)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runner = TrajectoryRunner(lambda: GuessEnvironment(options), GuessEnvironment, tokenizer, limits,
                              SamplingParams(max_tokens=turn_tokens, temperature=0.0))
    transport = ShmTransport(ShmTransport.Options(directory=str(tmp / "shm")), context=None)
    gen = HFGenerator(HFGenerator.Options(batch_size=64), context=RunContext.for_run(config, tmp, model_path=model_dir),
                      transport=transport)
    try:
        jobs = [(p, f"eval-{i}", i) for i, p in enumerate(problems)]
        trajectories, _ = asyncio.run(runner.run_many(gen, jobs))
    finally:
        gen.close()
        transport.close()
    report(trajectories, tokenizer, args.lines)


def export_checkpoint(trainer_dir: Path, base: Path, out: Path) -> None:
    """The checkpoint's model weights (DCP, as the fsdp trainer saves them) in a Hugging Face
    folder beside the base model's config and tokenizer."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forgerl_plugins.trainers.shared.checkpointing import SafePlanner, SafeReader, read_metadata_safely

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype="float32")
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=SafeReader(trainer_dir, read_metadata_safely(trainer_dir)), planner=SafePlanner())
    model.load_state_dict(state["model"])
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


def report(trajectories, tokenizer, lines: int) -> None:
    n = len(trajectories)
    comps = collections.Counter()
    for t in trajectories:
        comps.update(t.components or {})
    wins = comps["correct"]
    print(f"held-out games: {n}, won {wins:.0f} ({wins / n:.1%}); won after the first guess: "
          f"{wins - comps['first_guess']:.0f}; assistant turns per game {sum(t.turns for t in trajectories) / n:.2f}")
    print(f"hints answered with a number: {comps['hints']:.0f}, of them the hinted way: {comps['followed']:.0f} "
          f"({comps['followed'] / max(comps['hints'], 1):.1%})")
    plays = collections.Counter()
    for t in trajectories:
        text = tokenizer.decode(t.completion.token_ids)
        turns = re.split(r"<\|im_start\|>assistant\n", text)
        moves = []
        for turn in turns:
            said = turn.split("<|im_end|>")[0]
            numbers = re.findall(r"-?\d+", said)
            moves.append(numbers[-1] if numbers else "-")
        won = "won" if (t.components or {}).get("correct") else "lost"
        plays[(" ".join(moves), won)] += 1
    print("lines of play (the guesses, turn by turn; '-' = no number):")
    for (moves, won), count in plays.most_common(lines):
        print(f"  {count:3d} x  {moves:<20s} {won}")
    firsts = collections.Counter(tokenizer.decode(t.completion.token_ids).split("<|im_end|>")[0] for t in trajectories)
    print("first turns:", "; ".join(f"{c} x {s!r}" for s, c in firsts.most_common(3)))


if __name__ == "__main__":
    main()

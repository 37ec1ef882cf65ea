"""The plots of `forge report`: which metrics each panel shows, and drawing them.

Each panel is one figure with two plots side by side, the same series against step and
against wall time. Runs are told apart by colour, metrics within a panel by line style.
matplotlib is imported here only, and only its object API is used (no pyplot state), so
the module can draw from any thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from forgerl.report.data import RunData, Series, keys_present, series, wall_seconds

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes

#: The x coordinates a plot draws a series against: its steps or its wall times.
XOf: TypeAlias = Callable[[Series], list[float]]


@dataclass(frozen=True)
class Panel:
    id: str
    title: str
    ylabel: str
    keys: tuple[str, ...] = ()
    #: Keys under this prefix (``reward/``) join ``keys``, except those in ``exclude``.
    prefix: str | None = None
    exclude: tuple[str, ...] = ()
    #: Stacked areas per run (parts of one total) instead of lines.
    stacked: bool = False
    note: str = ""

    def metric_keys(self, present: set[str]) -> list[str]:
        keys = [k for k in self.keys if k in present]
        if self.prefix:
            keys += sorted(k for k in present if k.startswith(self.prefix) and k not in self.exclude and k not in keys)
        return keys


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward", "mean reward", keys=("reward/mean", "eval/reward"),
          note="reward/mean: training samples (weighted sum of the rewards); eval/reward: held-out problems"),
    Panel("reward_components", "Reward components", "mean score", prefix="reward/",
          exclude=("reward/mean", "reward/failed"), note="each reward's own score (unweighted) and its components"),
    Panel("sources", "Reward by source", "mean reward", prefix="source/",
          note="mixture tasks (docs/data.md): source/<name>/reward is the mean total reward of that source's "
               "samples, source/<name>/<reward> each of its rewards (source_samples/<name>: its samples in the step)"),
    Panel("eval_sources", "Held-out by source", "accuracy / mean reward", prefix="eval/source/",
          note="mixture tasks: eval/source/<name>/accuracy and eval/source/<name>/reward on each source's held-out rows"),
    Panel("accuracy", "Held-out accuracy", "fraction correct", keys=("eval/accuracy",),
          note="measured every loop.eval_every steps and at the last; the hollow marker at step 0 is "
               "the evaluation before training (loop.eval_at_start)"),
    Panel("completion_length", "Completion length", "tokens", keys=("completion/mean_tokens",)),
    Panel("truncation", "Truncated completions", "fraction cut at max_tokens", keys=("completion/truncated_frac",)),
    Panel("staleness", "Staleness", "policy versions behind", keys=("staleness/mean",)),
    Panel("dropped", "Dropped and failed samples", "samples per step",
          keys=("samples/dropped_stale", "reward/failed", "groups/filtered_zero_variance"),
          note="groups/filtered_zero_variance counts groups, not samples"),
    Panel("token_ages", "Trained tokens by version age", "tokens per step",
          keys=("staleness/tokens_masked",), prefix="staleness/tokens_age_",
          note="staleness/tokens_age_a: loss tokens sampled a versions before the trained policy; "
               "staleness/tokens_masked: tokens left out of the loss as too stale (loop.stale_samples: mask)"),
    Panel("logprob_gap", "Trainer vs sampler logprob gap", "nats per token",
          keys=("logprob_gap/mean", "logprob_gap/max"), prefix="logprob_gap/age_",
          note="logprob_gap/age_a: the mean over tokens sampled a versions before the trained policy"),
    Panel("entropy", "Entropy", "nats per token", keys=("entropy",)),
    Panel("grad_norm", "Gradient norm", "norm before clipping", keys=("grad_norm",)),
    Panel("loss", "Loss and KL", "value", keys=("loss/policy", "loss/kl", "kl/approx", "loss/sft"),
          note="loss/sft: a supervised run's cross-entropy (docs/sft.md)"),
    Panel("distill", "Distillation: student vs teacher", "value", keys=("distill/reverse_kl", "distill/agreement"),
          note="objective: distill. distill/reverse_kl: mean log p_student - log p_teacher of the trained tokens; "
               "distill/agreement: the fraction of them that are the teacher's most likely token"),
    Panel("time", "Where a step's time goes", "seconds", stacked=True,
          keys=("time/wait_rollouts", "time/teacher", "time/train", "time/sync", "time/other"),
          note="the loop's own time, which adds up to time/step: waiting for rollouts, the teacher's scoring "
               "(objective: distill), training, moving weights; time/other is the rest (batch preparation). "
               "Evaluation and checkpoints are not in it"),
    Panel("rollout_time", "Making a step's rollouts", "seconds", stacked=True,
          keys=("time/generate", "time/reward"),
          note="generation and scoring in the rollout thread; with loop.max_staleness > 0 they overlap "
               "earlier steps' training, so they are not part of the step time above"),
    Panel("generator_idle", "Generator idle", "fraction of the step", keys=("time/generator_idle_frac",),
          note="the share of each step's time in which the generator had no rollout request in flight "
               "(loop.overlap: versioned idles it while weights move; continuous keeps it busy)"),
)

#: Derived series: not in metrics.jsonl, computed from keys that are.
DERIVED = {"time/other"}


def panel_series(run: RunData, panel: Panel, present: set[str]) -> list[Series]:
    keys = panel.metric_keys(present | (DERIVED if "time/step" in present else set()))
    return [_other_time(run) if k == "time/other" else series(run, k) for k in keys]


def _other_time(run: RunData) -> Series:
    """``time/step`` less the parts the loop times itself, never below 0."""
    parts = ("time/wait_rollouts", "time/teacher", "time/train", "time/sync")
    step, pieces = series(run, "time/step"), [series(run, k) for k in parts]
    by_step = [dict(zip(p.steps, p.values)) for p in pieces]
    values = [max(0.0, total - sum(d.get(s, 0.0) for d in by_step)) for s, total in zip(step.steps, step.values)]
    return Series("time/other", step.steps, step.walls, values)


def all_series(runs_: list[RunData]) -> dict[str, list[list[Series]]]:
    """Panel id -> per run, the panel's series (panels no run has data for left out)."""
    present = keys_present(runs_)
    out = {}
    for panel in PANELS:
        per_run = [panel_series(run, panel, present) for run in runs_]
        if any(s.values for run_series in per_run for s in run_series):
            out[panel.id] = per_run
    return out


# --------------------------------------------------------------------------- drawing

_STYLES = ("-", "--", ":", "-.")


def draw(panel: Panel, runs_: list[RunData], per_run: list[list[Series]]) -> Any:
    """The panel's figure (a matplotlib ``Figure``, not attached to any pyplot window)."""
    from matplotlib.figure import Figure

    nrows = len(runs_) if panel.stacked else 1
    fig = Figure(figsize=(11, 3.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, 2, squeeze=False)
    colors = [f"C{i % 10}" for i in range(len(runs_))]
    for r, (run, run_series) in enumerate(zip(runs_, per_run)):
        row_axes = axes[r if panel.stacked else 0]
        wall_label = wall_seconds(run.rows)[1]
        for col, (ax, x_of, xlabel) in enumerate(
            ((row_axes[0], lambda s: s.steps, "step"), (row_axes[1], lambda s: s.walls, wall_label))
        ):
            if panel.stacked:
                _stack(ax, run_series, x_of)
                ax.set_title(f"{panel.title} — {run.label}" if len(runs_) > 1 else panel.title, fontsize=10)
            else:
                _lines(ax, run, r, colors[r], run_series, x_of, several_runs=len(runs_) > 1)
                if panel.id == "accuracy" and col == 0:
                    _start_accuracy(ax, run, colors[r])
                ax.set_title(panel.title, fontsize=10)
            ax.set_xlabel(xlabel if col == 0 else _short(xlabel), fontsize=8)
            if col == 0:
                _integer_steps(ax)
            ax.set_ylabel(panel.ylabel, fontsize=8)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    return fig


def _short(label: str) -> str:
    return "seconds since the first step began" if label.startswith("wall-clock") else "seconds (sum of time/step)"


def _lines(
    ax: Axes, run: RunData, index: int, color: str, run_series: list[Series], x_of: XOf, several_runs: bool
) -> None:
    for j, s in enumerate(run_series):
        if not s.values:
            continue
        label = f"{run.label}: {s.key}" if several_runs and len(run_series) > 1 else (
            run.label if several_runs else s.key)
        few = len(s.values) <= 40
        ax.plot(x_of(s), s.values, _STYLES[j % len(_STYLES)], color=color, label=label,
                marker="o" if few else None, markersize=3, gid=f"{index}:{s.key}")


def _start_accuracy(ax: Axes, run: RunData, color: str) -> None:
    """The evaluation before training (summary.json, not a metrics row) as a hollow marker
    at step 0, joined to the first measurement by a dotted line."""
    start = (run.summary or {}).get("eval_accuracy_start")
    if not isinstance(start, (int, float)):
        return
    ax.plot([0], [start], "o", color=color, fillstyle="none", markersize=6)
    first = series(run, "eval/accuracy")
    if first.values:
        ax.plot([0, first.steps[0]], [start, first.values[0]], ":", color=color, linewidth=1)


def _integer_steps(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _stack(ax: Axes, run_series: list[Series], x_of: XOf) -> None:
    present = [s for s in run_series if s.values]
    if not present:
        return
    # Every part on the steps of the first; a part missing on a step counts 0.
    base = present[0]
    x = x_of(base)
    ys = [[dict(zip(s.steps, s.values)).get(step, 0.0) for step in base.steps] for s in present]
    ax.stackplot(x, ys, labels=[s.key for s in present], alpha=0.85)


#: The plots of the overview picture (one grid, against step): what a first look needs.
OVERVIEW = ("reward", "accuracy", "completion_length", "entropy", "grad_norm", "time")


def overview(runs_: list[RunData], per_panel: dict[str, list[list[Series]]]) -> Any:
    """One figure with the main plots against step, runs overlaid; the step time as one
    stacked area for a single run, as a line of ``time/step`` per run for several."""
    from matplotlib.figure import Figure

    ids = [pid for pid in OVERVIEW if pid in per_panel]
    cols = 3
    rows = max(1, -(-len(ids) // cols))
    fig = Figure(figsize=(13, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    by_id = {p.id: p for p in PANELS}
    several = len(runs_) > 1
    for ax, pid in zip(axes.flat, ids):
        panel = by_id[pid]
        for r, (run, run_series) in enumerate(zip(runs_, per_panel[pid])):
            if panel.stacked and not several:
                _stack(ax, run_series, lambda s: s.steps)
            elif panel.stacked:
                _lines(ax, run, r, f"C{r % 10}", [series(run, "time/step")], lambda s: s.steps, several_runs=True)
            else:
                _lines(ax, run, r, f"C{r % 10}", run_series, lambda s: s.steps, several_runs=several)
                if pid == "accuracy":
                    _start_accuracy(ax, run, f"C{r % 10}")
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        _integer_steps(ax)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(ids):]:
        ax.set_visible(False)
    fig.suptitle("forge report: " + ", ".join(r.label for r in runs_), fontsize=11)
    return fig


def figure_png(fig: Any, dpi: int = 90) -> bytes:
    from io import BytesIO

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()

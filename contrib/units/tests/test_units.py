import json
from fractions import Fraction

import pytest

from forgerl.types import Problem
from forgerl_units.units import ConversionError, UnitsEnvironment, UnitsTask, convert_exactly, unit_of


def call(**arguments):
    return f"<tool_call>{json.dumps({'name': 'convert', 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize(
    ("value", "source", "target", "exact"),
    [
        (1, "in", "cm", Fraction(254, 100)),
        (1, "mi", "ft", Fraction(5280)),
        (1, "lb", "oz", Fraction(16)),
        (1, "gal", "cup", Fraction(16)),
        (90, "min", "h", Fraction(3, 2)),
        (Fraction(7, 2), "km", "m", Fraction(3500)),
    ],
)
def test_conversions_are_exact(value, source, target, exact):
    assert convert_exactly(Fraction(value), source, target) == exact


def test_units_are_found_by_their_names_and_aliases():
    assert [unit_of(n) for n in ("Kilometers", "foot", "feet", "US gallons", "lbs", "hour")] == [
        "km", "ft", "ft", "gal", "lb", "h",
    ]  # fmt: skip
    with pytest.raises(ConversionError, match=r"unknown unit 'furlongs'; units: mm, cm"):
        unit_of("furlongs")


def test_the_tool_answers_mistakes_with_what_is_wrong():
    env = UnitsEnvironment(UnitsEnvironment.Options())
    env.reset(Problem("p", "How many feet are in 1 mile?", "5280"))
    step = env.step(call(value=1, from_unit="mi", to_unit="kg") + call(value=1e300, from_unit="mi", to_unit="ft")
                    + call(value=1, from_unit="mi", to_unit="ft"))  # fmt: skip
    assert [m["content"] for m in step.messages] == [
        "error: cannot convert length (mi) to mass (kg)",
        "error: value must be a finite number of at most 1e+12 in size",
        "5280",
    ]
    done = env.step("It is <answer>5,280</answer> feet.")
    assert (done.reward, dict(done.components)) == (1.0, {"correct": 1.0, "used_tool": 1.0, "tagged": 1.0})


def test_a_wrong_or_missing_number_scores_zero():
    for text in ("<answer>5300</answer>", "no idea", "<answer>inf</answer>", "<answer>1e999</answer>"):
        env = UnitsEnvironment(UnitsEnvironment.Options())
        env.reset(Problem("p", "How many feet are in 1 mile?", "5280"))
        assert env.step(text).reward == 0.0, text


def test_the_task_asks_questions_its_answers_fit():
    for p in UnitsTask(UnitsTask.Options(), seed=5).next_problems(50):
        meta = p.metadata
        assert float(p.answer) == pytest.approx(float(convert_exactly(Fraction(meta["value"]), meta["from"], meta["to"])))
        assert meta["value"] in p.prompt[0]["content"]

"""Unit conversion: a task ("How many feet are in 3.5 kilometers?") and an environment whose
``convert`` tool does the arithmetic exactly, so the model's job is to call it with the
right units and report the number.

Each backend is one class: its name, description and options model live on it; the
registration module (plugin.py) names the classes as "module:Class". This module is
imported when the registry is built, so it imports nothing heavier than pydantic.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from pydantic import Field

from forgerl.environment import Environment, Message, Step, tool
from forgerl.interfaces import Task
from forgerl.options import OptionsModel
from forgerl.types import Problem

_EVAL_SEED = 7_654_321  # the held-out split is the same for every run seed
_GALLON = Fraction(3785411784, 10**9)  # US gallon, in litres (exact by definition)
_POUND = Fraction(45359237, 10**8)  # avoirdupois pound, in kilograms (exact)

#: unit -> (dimension, size in the dimension's base unit, its name in a question), exact.
UNITS: dict[str, tuple[str, Fraction, str]] = {
    "mm": ("length", Fraction(1, 1000), "millimeters"),
    "cm": ("length", Fraction(1, 100), "centimeters"),
    "m": ("length", Fraction(1), "meters"),
    "km": ("length", Fraction(1000), "kilometers"),
    "in": ("length", Fraction(254, 10000), "inches"),
    "ft": ("length", Fraction(3048, 10000), "feet"),
    "yd": ("length", Fraction(9144, 10000), "yards"),
    "mi": ("length", Fraction(1609344, 1000), "miles"),
    "g": ("mass", Fraction(1, 1000), "grams"),
    "kg": ("mass", Fraction(1), "kilograms"),
    "t": ("mass", Fraction(1000), "tonnes"),
    "oz": ("mass", _POUND / 16, "ounces"),
    "lb": ("mass", _POUND, "pounds"),
    "s": ("time", Fraction(1), "seconds"),
    "min": ("time", Fraction(60), "minutes"),
    "h": ("time", Fraction(3600), "hours"),
    "day": ("time", Fraction(86400), "days"),
    "week": ("time", Fraction(604800), "weeks"),
    "ml": ("volume", Fraction(1, 1000), "milliliters"),
    "l": ("volume", Fraction(1), "liters"),
    "cup": ("volume", _GALLON / 16, "US cups"),
    "qt": ("volume", _GALLON / 4, "US quarts"),
    "gal": ("volume", _GALLON, "US gallons"),
}
#: Other names a model may use for a unit (looked up in lower case, also without a final "s").
ALIASES = {
    **{name.lower().removeprefix("us "): unit for unit, (_, _, name) in UNITS.items()},
    "metres": "m", "metre": "m", "kilometres": "km", "litres": "l", "litre": "l", "foot": "ft",
    "inch": "in", "inches": "in", "hr": "h", "hour": "h", "sec": "s", "minute": "min", "lbs": "lb",
    "tons": "t",
}  # fmt: skip
#: The largest magnitude a question or the tool takes: results stay finite floats.
MAX_VALUE = 1e12


class ConversionError(ValueError):
    """A conversion that cannot be done (the model reads the message)."""


def unit_of(name: str) -> str:
    key = name.strip().lower().removesuffix(".").removeprefix("us ")
    key = key if key in UNITS else ALIASES.get(key) or ALIASES.get(key + "s") or ALIASES.get(key.removesuffix("s"), "")
    if not key:
        raise ConversionError(f"unknown unit {name[:40]!r}; units: {', '.join(UNITS)}")
    return key


def convert_exactly(value: Fraction, source: str, target: str) -> Fraction:
    (dim_a, size_a, _), (dim_b, size_b, _) = UNITS[unit_of(source)], UNITS[unit_of(target)]
    if dim_a != dim_b:
        raise ConversionError(f"cannot convert {dim_a} ({source[:20]}) to {dim_b} ({target[:20]})")
    return value * size_a / size_b


def format_number(x: Fraction) -> str:
    return f"{float(x):.10g}"


class UnitsTask(Task):
    """unit-conversion questions with exact answers"""

    name = "units"

    class Options(OptionsModel):
        max_value: int = Field(500, ge=1, le=10**6, description="Largest quantity a question converts.")
        eval_size: int = Field(32, ge=1, le=10_000, description="Held-out questions.")

    def __init__(self, options: Options, *, seed: int):
        self.options = options
        self.seed = seed
        self.position = 0
        self._eval = [self._problem(random.Random(_EVAL_SEED + i), f"units-eval-{i}") for i in range(options.eval_size)]
        self._eval_keys = {_key(p) for p in self._eval}

    def _problem(self, rng: random.Random, pid: str) -> Problem:
        dimension = rng.choice(sorted({d for d, _, _ in UNITS.values()}))
        source, target = rng.sample(sorted(u for u, (d, _, _) in UNITS.items() if d == dimension), 2)
        tenths = rng.randint(1, self.options.max_value * 10)
        value = Fraction(tenths, 10)
        shown = f"{float(value):g}"
        text = (
            f"How many {UNITS[target][2]} are in {shown} {UNITS[source][2]}? "
            "Give the final answer inside <answer></answer>."
        )
        return Problem(
            id=pid,
            prompt=[{"role": "user", "content": text}],
            answer=format_number(convert_exactly(value, source, target)),
            metadata={"value": shown, "from": source, "to": target},
        )

    def next_problems(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            p = self._problem(random.Random(self.seed * 1_000_003 + self.position), f"units-{self.position}")
            self.position += 1
            if _key(p) not in self._eval_keys:
                out.append(p)
        return out

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state["position"])


def _key(p: Problem) -> tuple[str, str, str]:
    return (p.metadata["value"], p.metadata["from"], p.metadata["to"])


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d{1,3})?")


class UnitsEnvironment(Environment):
    """unit conversion with a convert(value, from_unit, to_unit) tool; reward 1 for the right number"""

    name = "units"
    scores = True

    class Options(OptionsModel):
        tag: str = Field("answer", pattern=r"^[A-Za-z_][\w-]*$", description="The answer goes inside <tag></tag>.")
        tolerance: float = Field(1e-3, gt=0, le=0.5, description="Relative error an answer may have and count as right.")

    def __init__(self, options: Options):
        self.options = options
        self.problem: Problem | None = None
        self.conversions = 0

    def reset(self, problem: Problem) -> list[Message]:
        self.problem = problem
        if isinstance(problem.prompt, str):
            question = problem.prompt
        else:
            users = [m["content"] for m in problem.prompt if m.get("role") == "user"]
            question = users[-1] if users else ""
        system = (
            "You convert quantities between units. Call the convert tool to do the arithmetic, then "
            f"give the number alone inside <{self.options.tag}></{self.options.tag}>."
        )
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    @tool
    def convert(self, value: float, from_unit: str, to_unit: str) -> str:
        """Convert a quantity from one unit to another, exactly.

        Args:
            value: the quantity, e.g. 3.5
            from_unit: its unit, e.g. "km" or "kilometers"
            to_unit: the unit wanted, e.g. "ft"
        """
        if not math.isfinite(value) or abs(value) > MAX_VALUE:
            raise ConversionError(f"value must be a finite number of at most {MAX_VALUE:g} in size")
        self.conversions += 1
        return format_number(convert_exactly(Fraction(value), from_unit, to_unit))

    def answer(self, assistant_text: str) -> Step:
        assert self.problem is not None, "answer before reset"
        tag = self.options.tag
        tagged = re.findall(rf"<{tag}>(.*?)</{tag}>", assistant_text, re.S)
        text = (tagged[-1] if tagged else assistant_text).replace(",", "")
        numbers = _NUMBER.findall(text)
        correct = bool(numbers) and _close(numbers[-1], self.problem.answer, self.options.tolerance)
        return Step.finish(
            float(correct), correct=float(correct), used_tool=float(self.conversions > 0), tagged=float(bool(tagged))
        )


def _close(given: str, expected: str, tolerance: float) -> bool:
    try:
        a, b = float(given), float(expected)
    except ValueError:
        return False
    return math.isfinite(a) and abs(a - b) <= tolerance * abs(b)

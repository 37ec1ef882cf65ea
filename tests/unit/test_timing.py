"""FORGE_TEST_TIMEOUT_SCALE (tests/helpers/timing.py, forgerl.testing.timing): a factor from 1
up stretches every deadline; anything else is refused by name. A NaN, 0 or -5 used to
become 1 without a word, and inf passed until ``hard_limit`` overflowed inside a test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scale, scaled

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("raw", ["nan", "NaN", "0", "-5", "inf", "-inf", "1e400", "0.5", "1e9", "three", "3s"])
def test_a_value_that_is_no_factor_is_refused_by_name(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_TEST_TIMEOUT_SCALE", raw)
    with pytest.raises(ValueError, match=r"^FORGE_TEST_TIMEOUT_SCALE=.*give a number from 1") as caught:
        scaled(10)
    assert repr(raw) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("raw", "factor"), [("1", 1.0), ("3", 3.0), (" 2.5 ", 2.5), ("", 1.0), (None, 1.0)])
def test_a_factor_stretches_deadlines(raw: str | None, factor: float, monkeypatch: pytest.MonkeyPatch) -> None:
    if raw is None:
        monkeypatch.delenv("FORGE_TEST_TIMEOUT_SCALE", raising=False)
    else:
        monkeypatch.setenv("FORGE_TEST_TIMEOUT_SCALE", raw)
    assert scale() == factor and scaled(10) == 10 * factor


@pytest.mark.parametrize("raw", ["nan", "inf", "0"])
def test_pytest_stops_before_the_first_test_with_one_line(raw: str) -> None:
    env = {**os.environ, "FORGE_TEST_TIMEOUT_SCALE": raw}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_timing.py",
         "-k", "a_factor_stretches"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(120),
    )
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "FORGE_TEST_TIMEOUT_SCALE" in lines[0], proc.stderr[-2000:]
    assert "passed" not in proc.stdout, proc.stdout[-2000:]

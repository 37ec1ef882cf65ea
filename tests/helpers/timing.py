"""Deadlines for tests, scaled by one documented factor.

Tests synchronise on events and conditions, never on how fast something runs: a test
waits *until* something holds, bounded by a deadline that only says when to give up.
Every such deadline goes through :func:`scaled`, so one variable stretches them all on a
slow or loaded machine:

    FORGE_TEST_TIMEOUT_SCALE=3 make test      # what `make test-stress` sets

The default is 1. A deadline that passes on an idle machine but not under load means the
test measured speed, not behaviour: fix the test, do not raise the deadline.

The functions are the conformance kits' own (forgerl/testing/timing.py), so that the kits
and forgerl's tests stretch alike.
"""

from forgerl.testing.timing import scale, scaled, wait_until

__all__ = ["scale", "scaled", "wait_until"]

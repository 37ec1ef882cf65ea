"""What the test environment's rubric computes, importable on both sides (plain Python)."""

from __future__ import annotations


def reward_of(text: str) -> float:
    """The rubric's reward of a last reply: any fixed function of the text serves, one
    whose values differ within a group so that advantages are not all zero."""
    return (sum(map(ord, text)) % 7) / 6

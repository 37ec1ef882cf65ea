"""Requests that run across a weight update (update policy ``keep``) and the per-token
versions of what they return.

Under ``keep`` a replica is paused with our requests in flight, loads the new version and
resumes them: a completion's first tokens come from the old weights, the rest from the
new. Which token is the first new one is known exactly only by the engine: while it is
paused nothing is sampled, so the number of tokens each request has sampled then is the
boundary. The engine adapter asks its paused server for those counts
(:meth:`.engine.Engine.sampled_so_far`); the updater records them on every request in
flight there (a :class:`Crossing` on its :class:`Flight`) once the load succeeded; the
adapter labels the completions with them (:func:`label`).

An engine that reports the boundary itself, in each answer, needs no counts at the pause:
SGLang records how many tokens each request had sampled when its weight version changed
and returns per-token version spans (``meta_info.weight_versions``). Its adapter then
labels from those (:func:`set_versions`), and the crossings only say which versions a
request may name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from forgerl.types import Completion


@dataclass
class Crossing:
    """A weight update a request ran across: ``counts[choice]`` tokens of completion
    ``choice`` were sampled before it (absent: none, the request had not started), the rest
    by ``version`` (or a later crossing's)."""

    counts: dict[int, int]
    version: int


@dataclass
class Flight:
    """One request in flight on a replica, dispatched under weights ``version``; ``key``:
    the id the engine knows it by."""

    key: str
    version: int
    crossings: list[Crossing] = field(default_factory=list)


def label(completions: list[Completion], flight: Flight, *, choices: list[int] | None = None) -> None:
    """Give each completion of ``flight`` its per-token ``versions`` where an update fell
    inside it, from the counts the engine reported at the pause (:class:`Crossing`);
    ``choices[i]``: the engine's choice index completion ``i`` came from (default ``i``; a
    greedy request's copies all come from choice 0)."""
    if not flight.crossings:
        return
    for i, c in enumerate(completions):
        choice = i if choices is None else choices[i]
        n = len(c.token_ids)
        versions = [flight.version] * n
        for crossing in flight.crossings:  # in the order the updates happened
            start = min(max(crossing.counts.get(choice, 0), 0), n)
            versions[start:] = [crossing.version] * (n - start)
        set_versions(c, flight.version, versions)


def set_versions(c: Completion, dispatched: int, versions: list[int]) -> None:
    """Label ``c``, dispatched under weights ``dispatched``, with the version that sampled
    each of its tokens. Its ``policy_version`` stays the dispatch version: the oldest
    token's, from which staleness counts. A completion sampled wholly by the dispatch
    version keeps ``versions`` None, exactly as without ``keep``."""
    c.policy_version = dispatched
    if any(v != dispatched for v in versions):
        c.versions = list(versions)

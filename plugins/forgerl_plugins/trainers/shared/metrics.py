"""Combine per-micro-batch loss metrics into one set for the whole batch, over all ranks.

``policy_loss`` reports, per micro-batch, means over that micro-batch's loss tokens. The
batch value of such a mean is the token-weighted mean over every micro-batch of every
rank. Loss terms are already scaled by the global normaliser, so they add up; maxima
take the maximum. Padding micro-batches carry zero tokens and so weigh nothing. A mean
over some of the tokens only (the logprob gap of one version age) comes with its own
weight, the number of tokens it is a mean over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Parts of the loss: each micro-batch's value is its share of the batch loss.
SUM_KEYS = frozenset({"loss/policy", "loss/kl", "loss/sft"})
#: Maxima over tokens.
MAX_KEYS = frozenset({"ratio/max", "logprob_gap/max"})


class MetricAccumulator:
    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self.tokens = 0.0
        #: Summed weights of the means that carry their own (``add``'s ``weights``).
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, float], tokens: int, weights: Mapping[str, float] | None = None) -> None:
        """One micro-batch's metrics over its ``tokens`` loss tokens; ``weights[key]``: the
        number of tokens the mean ``key`` is over, where that is not all of them."""
        self.tokens += tokens
        weights = weights or {}
        for key, value in metrics.items():
            if key in MAX_KEYS:
                self.maxes[key] = max(self.maxes.get(key, float("-inf")), value)
            elif key in SUM_KEYS:
                self.sums[key] = self.sums.get(key, 0.0) + value
            else:
                weight = weights.get(key, tokens)
                self.sums[key] = self.sums.get(key, 0.0) + value * weight
                if key in weights:
                    self.weights[key] = self.weights.get(key, 0.0) + weight

    def reduce(self, device: torch.device, group: Any = None) -> dict[str, float]:
        """All-reduce over ``group`` (default: the default process group; with tensor
        parallelism, the ranks that train on different rows). Every rank must call, with
        the same keys (they depend only on the config). The same result on every rank."""
        import torch
        import torch.distributed as dist

        sum_keys, max_keys, weight_keys = sorted(self.sums), sorted(self.maxes), sorted(self.weights)
        sums = torch.tensor(
            [self.sums[k] for k in sum_keys] + [self.weights[k] for k in weight_keys] + [self.tokens],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        out: dict[str, float] = {}
        *numbers, tokens = sums.tolist()
        values, weights = numbers[: len(sum_keys)], dict(zip(weight_keys, numbers[len(sum_keys):]))
        for key, value in zip(sum_keys, values):
            out[key] = value if key in SUM_KEYS else value / max(weights.get(key, tokens), 1.0)
        if max_keys:
            maxes = torch.tensor([self.maxes[k] for k in max_keys], dtype=torch.float64, device=device)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
            out.update(zip(max_keys, maxes.tolist()))
        return out

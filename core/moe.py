"""Mixture-of-experts arithmetic shared by the engine, the live prediction and the lessons (torch-free)."""

from __future__ import annotations

import math


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, experts: int) -> int:
    """The token copies one expert accepts from a group of `tokens` tokens (GShard, Lepikhin et al. 2020, sec. 3.2:
    expert capacity = ceil(C * tokens per group * k / E)); the rest are dropped."""
    return math.ceil(capacity_factor * tokens * top_k / experts)


def kept_share(capacity_factor: float | None, tokens: int, top_k: int, experts: int) -> float:
    """The share of a group's token copies its experts keep when routing is balanced: all of them without a
    capacity factor, else at most `experts` x `expert_capacity` of its `tokens` x `top_k` (an unbalanced routing
    drops more)."""
    if capacity_factor is None:
        return 1.0
    return min(1.0, experts * expert_capacity(capacity_factor, tokens, top_k, experts) / (tokens * top_k))

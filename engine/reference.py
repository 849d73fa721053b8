"""The single-process ground truth: the whole global batch in one forward, backward and AdamW step.

Every strategy is checked against `reference_run`, step by step: loss, gradients, parameters and
both AdamW moments, by parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import RunConfig
from engine.model import build_model, global_batch, loss_fn, mixed_precision
from engine.optim import AdamW, adamw_


@dataclass
class StepState:
    """Everything a strategy must reproduce after one optimizer step, keyed by parameter name."""

    loss: float
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]


def hyper(cfg: RunConfig) -> AdamW:
    return AdamW(lr=cfg.lr, weight_decay=cfg.weight_decay)


def reference_run(cfg: RunConfig) -> list[StepState]:
    model = build_model(cfg.model, cfg.seed)
    h = hyper(cfg)
    params = dict(model.named_parameters())
    exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
    exp_avg_sq = {n: torch.zeros_like(p) for n, p in params.items()}
    states = []
    for step in range(cfg.steps):
        tokens, targets = global_batch(cfg.model, cfg.seed, step, cfg.global_batch)
        model.zero_grad(set_to_none=True)
        with mixed_precision(cfg.dtype, "cpu"):
            logits = model(tokens)
        loss = loss_fn(logits, targets)
        loss.backward()
        for n, p in params.items():
            adamw_(p, p.grad, exp_avg[n], exp_avg_sq[n], step + 1, h)
        states.append(StepState(
            loss=loss.item(),
            grads={n: p.grad.detach().clone() for n, p in params.items()},
            params={n: p.detach().clone() for n, p in params.items()},
            exp_avg={n: t.clone() for n, t in exp_avg.items()},
            exp_avg_sq={n: t.clone() for n, t in exp_avg_sq.items()},
        ))
    return states

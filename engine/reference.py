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


def reproduces_reference(cfg: RunConfig) -> bool:
    """Whether a run repeats the reference's arithmetic exactly, so is checked bit for bit (engine.verify): on the
    CPU the reference runs on, no mesh axis but pp splits the batch or a tensor. A pipeline stage boundary only
    detaches a tensor and sends it unchanged, the loss is scaled in one place the same way, and every schedule
    runs each stage's backwards in micro-batch order; given the run's own micro-batches (`reference_run`), the
    reference then does the same additions in the same order."""
    return cfg.device == "cpu" and all(d == 1 for axis, d in cfg.mesh.axes if axis != "pp")


def reference_run(cfg: RunConfig) -> list[StepState]:
    """The reference's steps: the whole global batch in one backward, or, where the run repeats the reference's
    arithmetic (`reproduces_reference`), its own micro-batches, each loss / m backwarded in turn and the losses
    summed as the run sums them, one process's gradient accumulation."""
    model = build_model(cfg.model, cfg.seed)
    h = hyper(cfg)
    params = dict(model.named_parameters())
    exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
    exp_avg_sq = {n: torch.zeros_like(p) for n, p in params.items()}
    m = cfg.micro_batches if reproduces_reference(cfg) else 1
    states = []
    for step in range(cfg.steps):
        tokens, targets = global_batch(cfg.model, cfg.seed, step, cfg.global_batch)
        model.zero_grad(set_to_none=True)
        rows, step_loss = len(tokens) // m, 0.0
        for k in range(m):
            with mixed_precision(cfg.dtype, "cpu"):
                logits = model(tokens[k * rows:(k + 1) * rows])
            loss = loss_fn(logits, targets[k * rows:(k + 1) * rows])
            (loss / m).backward()
            step_loss += loss.item() / m
        for n, p in params.items():
            adamw_(p, p.grad, exp_avg[n], exp_avg_sq[n], step + 1, h)
        states.append(StepState(
            loss=step_loss,
            grads={n: p.grad.detach().clone() for n, p in params.items()},
            params={n: p.detach().clone() for n, p in params.items()},
            exp_avg={n: t.clone() for n, t in exp_avg.items()},
            exp_avg_sq={n: t.clone() for n, t in exp_avg_sq.items()},
        ))
    return states

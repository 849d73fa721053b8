"""AdamW as one elementwise function, so a sharded optimizer step equals the unsharded one bit for bit.

Every strategy (and the reference) calls `adamw_` on whatever it owns: whole parameters for data
parallel, flat shards for ZeRO. Because each element's update only reads that element, how the
parameters are cut into shards cannot change the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamW:
    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


@torch.no_grad()
def adamw_(param, grad, exp_avg, exp_avg_sq, step: int, h: AdamW) -> None:
    """One AdamW update in place (Loshchilov & Hutter 2019, Algorithm 2; the same operation order as
    torch.optim.AdamW's single-tensor path, which the tests check against)."""
    param.mul_(1 - h.lr * h.weight_decay)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    bias_correction1 = 1 - h.beta1**step
    bias_correction2_sqrt = math.sqrt(1 - h.beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-h.lr / bias_correction1)

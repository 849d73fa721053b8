"""The data-parallel / ZeRO lesson's arithmetic for the live run: what the formulas expect of the engine.

The engine trains in fp32 with AdamW and no separate master copy: 4 bytes of weight, 4 of gradient and
8 of optimizer state (two moments) per parameter, so the ZeRO formulas (Rajbhandari et al. 2019, Fig. 1)
read (4 + 4 + 8) Psi with the same sharding per stage as the mixed-precision (2 + 2 + 12) Psi.
"""

from __future__ import annotations

# label -> (engine strategy, zero stage, dp gradient communication)
LIVE_STRATEGIES = {
    "DDP, all-reduce after backward": ("dp", 0, "naive"),
    "DDP, bucketed all-reduce overlapped with backward": ("dp", 0, "bucketed"),
    "ZeRO-1 (optimizer state sharded)": ("dp", 1, "bucketed"),
    "ZeRO-2 (+ gradients sharded)": ("dp", 2, "bucketed"),
    "ZeRO-3 / FSDP (+ weights sharded, prefetched)": ("fsdp", 3, "bucketed"),
}
FP32_WEIGHT_BYTES, FP32_GRAD_BYTES, ADAM_STATE_BYTES = 4, 4, 8


def expected_memory(psi: int, stage: int, world: int) -> dict[str, float]:
    """Bytes of params, grads and optimizer state per rank under ZeRO `stage` over `world` ranks."""
    return {
        "params": FP32_WEIGHT_BYTES * psi / (world if stage >= 3 else 1),
        "grads": FP32_GRAD_BYTES * psi / (world if stage >= 2 else 1),
        "optimizer": ADAM_STATE_BYTES * psi / (world if stage >= 1 else 1),
    }


def expected_comm_bytes_per_step(psi: int, stage: int, world: int) -> float:
    """Bytes one rank sends per optimizer step (one micro-batch), ring collectives of fp32 values:
    all-reduce (or reduce-scatter + all-gather) = 2 (N-1)/N x 4 Psi; ZeRO-3 adds a second all-gather of
    the weights for backward: 3 (N-1)/N x 4 Psi (ZeRO paper sec. 7: 1.5x the data-parallel volume)."""
    collectives = 3 if stage >= 3 else 2
    return collectives * (world - 1) / world * FP32_WEIGHT_BYTES * psi

"""The data-parallel / ZeRO lesson's arithmetic for the live run: what the formulas expect of the engine.

The engine trains in fp32 with AdamW and no separate master copy: 4 bytes of weight, 4 of gradient and
8 of optimizer state (two moments) per parameter, so the ZeRO formulas (Rajbhandari et al. 2019, Fig. 1)
read (4 + 4 + 8) Psi with the same sharding per stage as the mixed-precision (2 + 2 + 12) Psi.
"""

from __future__ import annotations

from engine.config import ADAM_STATE_BYTES, FP32_GRAD_BYTES, FP32_WEIGHT_BYTES

# label -> (engine strategy, zero stage, dp gradient communication)
LIVE_STRATEGIES = {
    "DDP, all-reduce after backward": ("dp", 0, "naive"),
    "DDP, bucketed, overlapped with backward": ("dp", 0, "bucketed"),
    "ZeRO-1 (optimizer state sharded)": ("dp", 1, "bucketed"),
    "ZeRO-2 (+ gradients sharded)": ("dp", 2, "bucketed"),
    "ZeRO-3 / FSDP (+ weights, prefetched)": ("fsdp", 3, "bucketed"),
}


def expected_memory(psi: int, stage: int, world: int) -> dict[str, float]:
    """Bytes of params, grads and optimizer state per rank under ZeRO `stage` over `world` ranks."""
    return {
        "params": FP32_WEIGHT_BYTES * psi / (world if stage >= 3 else 1),
        "grads": FP32_GRAD_BYTES * psi / (world if stage >= 2 else 1),
        "optimizer": ADAM_STATE_BYTES * psi / (world if stage >= 1 else 1),
    }


def expected_comm_bytes_per_step(psi: int, stage: int, world: int, micro_batches: int = 1,
                                  last_unit_params: int = 0) -> float:
    """Bytes one rank sends per optimizer step, ring collectives of fp32 values, x = (N-1)/N x 4 bytes:

    * ZeRO-0 and 1: one all-reduce (ZeRO-1: reduce-scatter + all-gather) after the last micro-batch, the
      others accumulate locally: 2 x Psi.
    * ZeRO-2: each micro-batch's gradients are reduce-scattered (a rank keeps only its shard), then the
      updated weights all-gathered once: (micro_batches + 1) x Psi.
    * ZeRO-3: each micro-batch all-gathers every unit's weights for forward and again for backward and
      reduce-scatters its gradients (ZeRO paper sec. 7: 1.5x the data-parallel volume), except the last
      unit, kept gathered from its forward straight into its backward: micro_batches x (3 Psi - last).
    """
    x = (world - 1) / world * FP32_WEIGHT_BYTES
    if stage >= 3:
        return micro_batches * (3 * psi - last_unit_params) * x
    if stage == 2:
        return (micro_batches + 1) * psi * x
    return 2 * psi * x


def comm_formula_text(stage: int) -> str:
    """The formula above for `stage`, as the page writes it (x = (N-1)/N x 4 bytes)."""
    return {3: "m(3Ψ - Ψ_last) x", 2: "(m + 1)Ψ x"}.get(stage, "2Ψ x")

"""What one compute kernel costs on a chip: a GEMM of a given shape, an attention kernel, a memory-bound op.

Every efficiency comes from op-level measurements recorded per chip in ``chips.toml`` (its header says
which benchmark each field is read from); nothing here is fitted to end-to-end training runs.

* GEMM ``In[M, K] . W[K, N]``: the roofline's compute side at the rate a large GEMM sustains on the chip
  (its MSMF: at the power limit, every GPU of the node busy; else a rate measured at 8192^3, else its
  MAMF burst), scaled by the shape curve ``g(M, N, K) / g(8192, 8192, 8192)`` with ``g = MN / (MN +
  matmul_half_area) * K / (K + matmul_half_k)``, fitted per GPU generation to OpenXLA's measured GEMM
  tables: a small output leaves SMs idle (tile and wave quantization), a short K cannot hide the tile
  pipeline's prologue and epilogue. The memory side reads both operands and writes the output once
  ([SB] Part 1).
* FlashAttention kernels: forward + backward FLOP/s at ``attention_efficiency`` (FlashAttention-2) or
  ``flash3_efficiency`` (the chip's newer kernels: FA3 / cuDNN on Hopper, FA4 on Blackwell) of peak
  for long sequences, ``s / (s + 530)`` of that at s keys (both FlashAttention-2 curves, A100 and H100,
  halve at ~530 tokens). The backward does 2.5x the forward's FLOPs (five matmuls to two; Dao 2023
  sec. 4.1). FlashAttention written in Triton (2022-23) takes 1.4x FlashAttention-2's forward time and 2x
  its backward (Dao 2023 sec. 4.1). At head dim 64 a kernel reaches ``attention_head_dim_64`` or
  ``flash3_head_dim_64`` of its head-dim-128 rate (on Hopper 0.91 and 0.82, [FA3]'s H100 figures;
  ``head_dim_factor``).
* memory-bound ops: bytes through HBM at ``hbm_efficiency`` (pointwise kernels, copy-like) or
  ``norm_efficiency`` / ``norm_bwd_efficiency`` (kernels with row reductions: norms, softmax).
* eager PyTorch modules (an RMSNorm or a rotary embedding written as a chain of elementwise ops through
  fp32, each op its own kernel): the seconds Liger-Kernel's published benchmarks measured for the Hugging
  Face modules, as bytes moved at the chip's peak HBM bandwidth per element of the op (``EAGER_BYTES``).

Every rate is multiplied by ``chip.pace``: 1 for one chip; in a cluster, the share of the table's (one
chip's) rates its slowest chip reaches, since a synchronous step waits for it (planner.costs.cluster_chip).
"""

from __future__ import annotations

from hardware.chips import DTYPE_BYTES, Chip

_REFERENCE_DIM = 8192  # the MSMF / MAMF tables' large shapes: g is normalised to 1 here
ATTENTION_HALF_SEQ = 530  # FlashAttention-2 benchmark: A100 and H100 reach half their plateau at ~530 tokens
FLASH_BWD_FLOP_RATIO = 2.5  # backward FLOPs over forward FLOPs of a FlashAttention kernel (Dao 2023, sec. 4.1)


def matmul_shape_factor(chip: Chip, m: float, n: float, k: float) -> float:
    """g(M, N, K) / g(8192, 8192, 8192): 1 for large GEMMs, below 1 for small outputs or short K."""
    def g(mm, nn, kk):
        area = mm * nn
        return area / (area + chip.matmul_half_area) * kk / (kk + chip.matmul_half_k)

    return g(m, n, k) / g(_REFERENCE_DIM, _REFERENCE_DIM, _REFERENCE_DIM)


def matmul_rate(chip: Chip, dtype: str, m: float, n: float, k: float) -> float:
    """FLOP/s a GEMM of this shape reaches on `chip` in `dtype` (fp8 at the fp8 rate and its own measured share,
    `Chip.peak_flops_per_s(..., achievable=True)`)."""
    return (chip.peak_flops_per_s(dtype, achievable=True) * min(1.0, matmul_shape_factor(chip, m, n, k))
            * chip.pace)


def matmul_s(chip: Chip, dtype: str, m: float, k: float, n: float, batch: float = 1.0) -> float:
    """Seconds of `batch` GEMMs In[M, K] . W[K, N]: the slower of compute and memory (roofline)."""
    if min(m, k, n, batch) <= 0:
        return 0.0
    flops = 2.0 * m * k * n * batch
    compute_s = flops / matmul_rate(chip, dtype, m, n, k)
    width = DTYPE_BYTES["bf16" if dtype == "fp8" else dtype] if dtype in DTYPE_BYTES else 2
    memory_s = batch * width * (m * k + k * n + m * n) / (chip.hbm_bw(achievable=True) * chip.pace)
    return max(compute_s, memory_s)


# FlashAttention written in Triton (the flash-attention repository's flash_attn_triton.py, 2022-23, which
# llm-foundry copied for its default attn_impl 'triton' on the pre-MLIR Triton): "FlashAttention-2 is around
# 1.3-1.5x faster than FlashAttention in Triton in the forward pass and around 2x faster in the backward
# pass" (Dao 2023, sec. 4.1, A100 80GB). Its time is FlashAttention-2's times these factors (the middle of
# the forward's range), on every GPU: neither kernel uses Hopper's wgmma (FlashAttention-2 runs its Ampere
# kernels on H100, and the pre-MLIR Triton emits Ampere's mma), so the ratio is taken to carry over.
TRITON_FLASH_SLOWDOWN = (1.4, 2.0)  # (forward, backward) time over FlashAttention-2's
FLASH_KERNELS = ("flash", "flash3", "flash-triton")


def best_flash_kernel(chip: Chip) -> str:
    """The attention kernel a current framework runs on `chip`: the newer generation where it exists."""
    return "flash3" if chip.flash3_efficiency is not None else "flash"


# The head dimension. Every attention efficiency in chips.toml is measured at head dim 128. At 64 the same
# kernels do half the matmul work per K/V tile they load against the same softmax and bookkeeping, and run
# slower per FLOP: chips.toml's attention_head_dim_64 and flash3_head_dim_64 give the share of the head-dim-128
# rate reached at 64, from the FlashAttention-3 paper's H100 figures (FlashAttention-2 0.91, cuDNN and
# FlashAttention-3 0.82). "flash-triton" takes FlashAttention-2's: its slowdown (TRITON_FLASH_SLOWDOWN) is
# stated against FlashAttention-2 at the same head dim, over the FA2 paper's head-dim-64 and -128 figures.
# Linear in the head dim between 64 and 128; below 64 held at 64's (not measured); from 128 up none (the
# forward runs faster at 256, the backward was not measured there).
_MEASURED_HEAD_DIM = 128


def head_dim_factor(chip: Chip, kernel: str, head_dim: float) -> float:
    """The share of its head-dim-128 FLOP/s a FlashAttention kernel reaches at `head_dim` (1 where the chip
    table has no measurement by head dim)."""
    at_64 = chip.flash3_head_dim_64 if kernel == "flash3" else chip.attention_head_dim_64
    if at_64 is None or head_dim >= _MEASURED_HEAD_DIM:
        return 1.0
    between = (max(head_dim, 64) - 64) / (_MEASURED_HEAD_DIM - 64)
    return at_64 + (1.0 - at_64) * between


def flash_plateau_flops_per_s(chip: Chip, kernel: str = "flash", head_dim: float = _MEASURED_HEAD_DIM) -> float:
    """Forward + backward FLOP/s a FlashAttention kernel ("flash": FlashAttention-2; "flash3": the chip's
    newer kernels; "flash-triton" FlashAttention-2's, before TRITON_FLASH_SLOWDOWN) reaches at long
    sequences over heads of `head_dim` (head_dim_factor)."""
    if kernel == "flash3":
        if chip.flash3_efficiency is None:
            raise ValueError(f"{chip.name} has no FlashAttention-3-class kernel; use attention \"flash\"")
        efficiency = chip.flash3_efficiency
    else:
        efficiency = chip.attention_efficiency
    return chip.bf16_flops_per_s * efficiency * head_dim_factor(chip, kernel, head_dim) * chip.pace


def flash_attention_s(chip: Chip, fwd_flops: float, keys: float, kernel: str = "flash",
                      head_dim: float = _MEASURED_HEAD_DIM) -> tuple[float, float]:
    """(forward, backward) seconds of a FlashAttention kernel (`flash_plateau_flops_per_s`; "flash-triton":
    the Triton one, TRITON_FLASH_SLOWDOWN) doing `fwd_flops` of forward work (the causal mask's skipped half
    already left out) with `keys` keys per query, over heads of `head_dim`."""
    if fwd_flops <= 0:
        return 0.0, 0.0
    rate = flash_plateau_flops_per_s(chip, kernel, head_dim) * keys / (keys + ATTENTION_HALF_SEQ)
    fwd_s, bwd_s = fwd_flops / rate, FLASH_BWD_FLOP_RATIO * fwd_flops / rate
    if kernel == "flash-triton":
        return fwd_s * TRITON_FLASH_SLOWDOWN[0], bwd_s * TRITON_FLASH_SLOWDOWN[1]
    return fwd_s, bwd_s


# Effective bytes per element at peak HBM bandwidth of PyTorch eager modules: time x peak bandwidth /
# elements, from Liger-Kernel's benchmark tables (github.com/linkedin/Liger-Kernel, benchmark/data:
# h100_all_benchmark_data.csv, H100 NVL 3.9 TB/s, and all_benchmark_data.csv, A100-SXM4-80GB 2.04 TB/s;
# provider "huggingface", bf16, the largest shapes, where every provider is bandwidth-bound), the mean of
# the two chips (they differ by 10-20 %):
#   RMSNorm (LlamaRMSNorm: fp32 cast, pow, mean, rsqrt, two multiplies), M = 2048 rows of H = 32768:
#     forward 1.219 ms on H100 NVL (70.9 B), 1.919 ms on A100 (58.3 B); backward 3.029 ms (176 B),
#     5.015 ms (152 B). Liger's fused kernel: 0.111 ms forward (6.4 B), torch.compile 0.156 ms (9.1 B).
#   rotary (apply_rotary_pos_emb: rotate_half, cos/sin products), q and k of 16384 tokens, hidden 8192,
#     32 query and 8 KV heads: forward 2.567 ms (59.7 B), 3.817 ms (46.4 B); backward 3.113 ms (72.4 B),
#     4.557 ms (55.4 B). Liger's fused kernel: 0.200 ms (4.7 B) both ways.
#   cross-entropy (torch.nn.CrossEntropyLoss: log_softmax then nll_loss) over fp32 logits, provider "huggingface"
#     / "torch", the benchmark's own fp32 input: forward on A100 at B x T = 16384, V = 32768, 65536, 131072:
#     5.317, 10.615, 20.726 ms (20.2, 20.2, 19.7 B), on B200 (all_benchmark_data_cutile.csv, 8 TB/s) at V =
#     128256, B x T = 4096, 8192: 1.347, 2.643 ms (20.5, 20.1 B): mean 20.1. Backward on B200: 1.619, 3.161 ms
#     (24.7, 24.1 B; A100's 2024 run, full minus forward, 38 B, an older PyTorch).
EAGER_BYTES = {"norm_fwd": 65.0, "norm_bwd": 164.0, "rope_fwd": 53.0, "rope_bwd": 64.0, "ce_fwd": 20.1,
               "ce_bwd": 24.4}


def eager_s(chip: Chip, effective_bytes: float) -> float:
    """Eager PyTorch modules whose cost is given as effective bytes at peak HBM bandwidth (EAGER_BYTES)."""
    return effective_bytes / (chip.hbm_bytes_per_s * chip.pace)


def pointwise_s(chip: Chip, nbytes: float) -> float:
    """A pointwise kernel (bias, activation, residual add, dropout, rotary): copy-like over HBM."""
    return nbytes / (chip.hbm_bw(achievable=True) * chip.pace)


def norm_s(chip: Chip, nbytes: float, backward: bool = False) -> float:
    """A kernel with row reductions (LayerNorm, RMSNorm, softmax) moving `nbytes` through HBM."""
    efficiency = chip.norm_bwd_efficiency if backward else chip.norm_efficiency
    return nbytes / (chip.hbm_bytes_per_s * efficiency * chip.pace)

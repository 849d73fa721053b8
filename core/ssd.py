"""The work of one Mamba-2 block (Dao & Gu 2024, "Transformers are SSMs"), counted once for the live engine
(engine/config.py counts a run's FLOPs with it) and this machine's calibration (hardware/this_machine.py
fits the block's time against it, at one rank's shape)."""

from __future__ import annotations

# The largest Mamba-2 expansion (d_inner = ssm_expand x hidden) the planner and the engine take: published Mamba
# models expand 2x, so a larger one is a typo (10^200 had overflowed the planner's FLOP counts)
MAX_SSM_EXPAND = 64


def mamba_block_flops(sequences: int, seq_len: int, hidden: int, inner: int, heads: int, head_dim: int,
                      groups: int, state: int, chunk: int, conv_width: int) -> float:
    """Forward FLOPs of one Mamba-2 block as engine/mamba.py computes it: the five input projections and
    out_proj, the conv (2 w per channel and token), and the chunked SSD (sec. 6) per head and token, with
    chunk length Q, head width P, state N: C.B^T scores over the token's chunk (2 Q N), those scores times
    x (2 Q P), the chunk's state B^T x (2 N P), the state's output C.h (2 N P), and the state recurrence
    between chunks (2 N P per chunk). Linear in the sequence length: attention's scores are quadratic."""
    tokens = sequences * seq_len
    gn = groups * state
    projections = 2.0 * tokens * (hidden * (2 * inner + 2 * gn + heads) + inner * hidden)
    conv = 2.0 * tokens * (inner + 2 * gn) * conv_width
    q, p, n = chunk, head_dim, state
    ssd = tokens * heads * (2 * q * n + 2 * q * p + 4 * n * p) + sequences * (seq_len // q) * heads * 2 * n * p
    return projections + conv + ssd


def state_correction_flops(tokens: float, heads: int, head_dim: int, state: int) -> float:
    """What context parallel by state passing adds: each held position's output gains C_t . h_in, the
    incoming state read out, 2 N P FLOPs per head."""
    return 2.0 * tokens * heads * state * head_dim

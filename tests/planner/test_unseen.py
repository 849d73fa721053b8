"""Runs the planner was never calibrated on: Llama 3 405B on 8K-16K H100s (Dubey et al. 2024 Table 4).

GQA, H100s and FlashAttention are all outside the 18 A100 runs the global curves were chosen on. The
bound is loose on purpose (20 % of the published MFU): this checks that the model transfers, not that
it was fitted. The 128K-context row is printed by bench/bench_planner.py but not asserted: there
attention is over half the model FLOPs, and whether the paper counts the causal square whole or half
(unstated) moves the MFU by 1.4x.
"""

import pytest

from planner.api import estimate
from planner.validation import llama3_table4_cases

CASES = [(c, mfu) for c, mfu in llama3_table4_cases() if c["model"]["seq_len"] <= 8192]


@pytest.mark.parametrize("case, published_mfu", CASES, ids=[c["name"] for c, _ in CASES])
def test_llama3_405b_mfu_within_20_percent(case, published_mfu):
    assert estimate(case).mfu == pytest.approx(published_mfu, rel=0.20)

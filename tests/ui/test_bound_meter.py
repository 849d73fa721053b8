"""The bound meter (ui/bound_meter.py): the rule in readable units, and each meter's communication in its
collective's colour, as the planner's breakdown and the step timelines draw it."""

import re

import pytest

from hardware.chips import CHIPS
from planner.bounds import cross_pod_bound, data_parallel_bound, expert_parallel_bound, tensor_parallel_bound
from planner.models import MODEL_PRESETS
from ui.bound_meter import bound_figure, verdict_text
from ui.tables import format_bytes_per_s, format_flops, format_flops_per_s
from ui.timeline import KIND_COLORS

SCIENTIFIC = re.compile(r"\de[+-]\d")  # 9.89e+14: not for students


def test_the_formatters_write_the_units_datasheets_quote():
    assert format_flops_per_s(989e12) == "989 TFLOP/s" and format_flops_per_s(2.25e15) == "2,250 TFLOP/s"
    assert format_bytes_per_s(450e9) == "450 GB/s" and format_bytes_per_s(3.35e12) == "3.35 TB/s"
    assert format_bytes_per_s(6.25e9) == "6.25 GB/s"
    assert format_flops(4.29e9) == "4.29 GFLOP" and format_flops(1.573e8) == "157 MFLOP"


def test_the_rule_says_c_over_w_in_tflops_and_gbs():
    llama = MODEL_PRESETS["Llama 3 8B"]
    dp = data_parallel_bound(llama, CHIPS["h100"], 4096, 8)
    # H100: 989 TFLOP/s bf16 over 450 GB/s of NVLink = 2,198 (the scaling book's rule)
    assert "C / W = 989 TFLOP/s / 450 GB/s = 2,198; here 4,096" in verdict_text(dp)
    pod = cross_pod_bound(llama, CHIPS["tpu-v5p"], 2**22).rule  # planner.bounds writes it in units
    assert "C / W_network = 459 TFLOP/s / 6.25 GB/s = 73,440" in pod
    assert not SCIENTIFIC.search(verdict_text(dp) + pod)


@pytest.mark.parametrize("chip", ["h100", "tpu-v5p"])
def test_every_meter_draws_its_communication_in_its_collectives_colour(chip):
    """The data-parallel page had drawn its meter's gradient all-reduce yellow beside a live timeline that draws
    all-reduces purple."""
    c, llama, mixtral = CHIPS[chip], MODEL_PRESETS["Llama 3 8B"], MODEL_PRESETS["Mixtral 8x7B"]
    bounds = {"all_reduce": data_parallel_bound(llama, c, 4096, 8),
              "all_gather": data_parallel_bound(llama, c, 4096, 8, fsdp=True),
              "reduce_scatter": tensor_parallel_bound(llama, c, 4096, 4),  # as the planner's breakdown draws TP's
              "all_to_all": expert_parallel_bound(mixtral, c, 4096, 8)}
    for kind, bound in bounds.items():
        colours = [bar.marker.color for bar in bound_figure(bound, "x").data]
        assert colours == [KIND_COLORS["forward"], KIND_COLORS[kind]]


def test_the_meter_fits_half_a_narrow_page():
    """Data parallel draws two meters side by side: on one line each, the verdict and the axis title's basis ran
    past the edges of a meter half of a page 1,024 px wide."""
    fsdp = bound_figure(data_parallel_bound(MODEL_PRESETS["Llama 3 8B"], CHIPS["h100"], 256, 8, fsdp=True),
                        "FSDP / ZeRO-3")
    assert fsdp.layout.title.text == "FSDP / ZeRO-3:<br>communication-bound"
    assert fsdp.layout.xaxis.title.text == "µs per layer<br>(peak FLOP/s, link bandwidth)"

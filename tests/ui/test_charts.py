"""Chart builders return figures whose data match the formulas they draw."""

import math

import pytest

from ui.charts import OperatingPoint, RooflineSeries, log_axis, roofline_figure


def test_roofline_is_min_of_peak_and_bandwidth_line():
    h100 = RooflineSeries("H100", 989e12, 3.35e12, highlight=True)
    fig = roofline_figure([h100], [OperatingPoint("B=128", 120.0, 120.0 * 3.35e12)])
    line = fig.data[0]
    for x, y in zip(line.x, line.y, strict=True):
        assert y == pytest.approx(min(989e12, x * 3.35e12) / 1e12)
    ridge = fig.data[1]
    assert ridge.x[0] == pytest.approx(989e12 / 3.35e12)  # ~295 FLOP/B
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    star = fig.data[-1]
    assert star.name == "B=128" and star.y[0] == pytest.approx(120 * 3.35)


def test_axis_range_covers_every_ridge_and_point():
    low = RooflineSeries("cpu", 1e11, 1e10)  # ridge 10
    high = RooflineSeries("tpu", 4.59e14, 2.765e12)  # ridge ~166
    fig = roofline_figure([low, high], [OperatingPoint("tiny", 0.5, 5e9)])
    xs = fig.data[0].x
    assert xs[0] <= 0.5 and xs[-1] >= 166


def test_the_breakdown_colours_a_zero_sync_as_the_timeline_does():
    from ui.charts import breakdown_figure
    from ui.timeline import KIND_COLORS

    parts = {"compute": 1.0, "dp_comm": 0.1}
    plain, zero = breakdown_figure(parts, 1.1), breakdown_figure(parts, 1.1, zero_stage=1)
    assert list(plain.data[0].marker.color)[1] == KIND_COLORS["all_reduce"]
    assert list(zero.data[0].marker.color)[1] == KIND_COLORS["reduce_scatter"]
    assert "reduce-scatter" in list(zero.data[0].y)[1]


def test_counts_and_long_times_read_as_a_student_reads_them():
    from ui.tables import count, format_seconds, format_step

    assert (count(1, "chip"), count(8, "chip"), count(2, "process")) == ("1 chip", "8 chips", "2 processes")
    assert (format_seconds(57162.19), format_seconds(300), format_seconds(2.5)) == ("15.9 h", "5 min", "2.5 s")
    assert format_step(1.234) == "1.23 s" and format_step(57162.19) == "15.9 h"
    # the unit is chosen after rounding to three figures: no "1e+03 ms", no "120 s" where minutes start
    assert [format_seconds(s) for s in (0.99996, 119.96, 7199.99, 0.00099996, 1e9)] == [
        "1 s", "2 min", "2 h", "1 ms", "277,778 h"]
    assert (format_step(119.996), format_step(119.99)) == ("2 min", "119.99 s")
    assert (format_seconds(1e-8), format_seconds(0.0)) == ("10 ns", "0 µs")  # a tiny matmul had read 0.00 µs
    assert (format_seconds(999.6 * 3600), format_seconds(999.4 * 3600)) == ("1,000 h", "999 h")  # not "1e+03 h"


def test_a_log_axis_is_labelled_at_both_ends():
    # the expert-parallel cost chart's values, 2.3 to 42 ms: Plotly's own range had stopped at the data, so the
    # ticks above 20 fell outside it and the top third of the chart carried no label
    axis = log_axis([2.3, 13.0, 42.0], title="ms")
    assert axis["tickvals"] == [2, 5, 10, 20, 50] and axis["ticktext"] == ["2", "5", "10", "20", "50"]
    assert axis["range"] == pytest.approx([math.log10(2), math.log10(50)]) and axis["title"] == "ms"
    one = log_axis([3.0])  # a single value still gets a range with a tick at each end
    assert one["tickvals"] == [2, 5] and one["ticktext"] == ["2", "5"]
    assert log_axis([0.004, 0.03])["ticktext"] == ["0.002", "0.005", "0.01", "0.02", "0.05"]
    # six decades (the context-parallel chart, 50 µs to 700 ms): powers of ten only, the range still snapped
    wide = log_axis([60.0, 7e5])
    assert wide["ticktext"] == ["10", "100", "1,000", "10,000", "100,000", "1,000,000"]
    assert wide["range"] == pytest.approx([1, 6])  # a label at each end still


def test_a_command_breaks_between_arguments_and_reads_the_same_to_the_shell():
    import shlex

    from ui.tables import COMMAND_LINE_CHARS, CONTINUATION, shell_lines

    command = (".venv/bin/python -m engine run --strategy tp [--sequence-parallel] --world 2 --heads 4 --kv-heads 2 "
               "--pattern 'MA;A=ECHO;${A,,} X;#' --steps 2 --check")
    shown = shell_lines(command)
    lines = shown.split("\n")
    assert len(lines) > 1 and all(len(line) <= COMMAND_LINE_CHARS for line in lines)
    # a flag keeps its value ("--kv-heads 2" on one line), the quoted pattern stays one argument, and once its
    # continuations are read the shell gets the same words
    assert any("--kv-heads 2" in line for line in lines) and "--pattern 'MA;A=ECHO;${A,,} X;#'" in shown
    assert shlex.split(shown.replace(CONTINUATION, " ")) == shlex.split(command)
    assert shell_lines("a --x 1\nb --y 2") == "a --x 1\nb --y 2"  # short commands, a line each, as written
    # a continuation already written (torchrun's) is read as one line and broken again where it fits
    written = "torchrun --nnodes 2 \\\n    -m engine.worker --check"
    assert shell_lines(written) == "torchrun --nnodes 2 -m engine.worker --check"

"""The hardware lesson's own fixes: the chips table, the matmul's numbers in words, the roofline's star and the
chips to compare with (the rest of the page: tests/ui/test_app.py)."""

import json
import re

from hardware.chips import CHIPS
from tests.ui.apptest_util import open_app
from ui.tables import NO_VALUE, chip_table_rows

PAGE = "app_pages/hardware.py"
SCIENTIFIC = re.compile(r"\de[+-]\d")


def test_a_chip_without_fp8_shows_a_dash_not_none():
    rows = {r["Chip"]: r["fp8 TFLOP/s"] for r in chip_table_rows(CHIPS.values())}
    assert rows["A100 80GB SXM"] == rows["TPU v5e"] == NO_VALUE
    assert rows["H100 SXM"] == "1979" and None not in rows.values()


def test_the_page_writes_units_and_shows_every_chip_to_compare():
    at = open_app(PAGE, chip="h100")
    assert not at.exception, [e.value for e in at.exception]
    text = next(m.value for m in at.markdown if "this matmul does" in m.value)
    # B = 128, D = F = 4096 in bf16: 2 B D F = 4.29 GFLOP; 2 (B D + D F + B F) bytes = 34 MiB
    assert "4.29 GFLOP and moves 34 MiB" in text and not SCIENTIFIC.search(text)
    table = at.dataframe[0].value
    assert "None" not in set(table["fp8 TFLOP/s"].astype(str))
    # the chip's name stays in view while the table scrolls sideways (its last column at 1,280 px)
    assert json.loads(at.dataframe[0].proto.columns)["Chip"] == {"pinned": True}
    (compare,) = at.multiselect  # in its column, on as many rows as its chips need: none hidden
    assert compare.value == ["a100-80gb", "b200", "tpu-v5e"] and compare.proto.wrap


def test_the_star_is_named_in_the_legend_not_on_the_lines():
    at = open_app(PAGE, chip="h100")
    chart = next(c for c in at.get("plotly_chart") if "Roofline" in c.proto.spec)
    assert '"mode":"markers+text"' not in chart.proto.spec.replace(" ", "")
    # In two thirds of a page 1,024 px wide a legend beside the chart squeezed the plot to a strip and its axis
    # title past both edges; in the narrow column the toggle's label was cut to "Achievable instea...".
    layout = json.loads(chart.proto.spec)["layout"]
    assert layout["legend"]["orientation"] == "h" and layout["legend"]["yanchor"] == "top"
    assert layout["xaxis"]["title"]["text"] == "arithmetic intensity<br>(FLOPs per byte of HBM traffic)"
    assert at.toggle(key="achievable").proto.wrap


def test_a_chip_keeps_its_colour_whatever_else_is_compared():
    """The colours had gone by place in "Compare with": B200's line changed colour when A100 was taken out."""
    def colours(at):
        chart = next(c for c in at.get("plotly_chart") if "Roofline" in c.proto.spec)
        return {t["name"]: t["line"]["color"] for t in json.loads(chart.proto.spec)["data"] if t.get("mode") == "lines"}

    at = open_app(PAGE, chip="h100")
    before = colours(at)
    at.multiselect[0].unselect("a100-80gb").run()
    after = colours(at)
    assert "A100 80GB SXM" in before and "A100 80GB SXM" not in after
    assert after["B200 (HGX)"] == before["B200 (HGX)"] and after["TPU v5e"] == before["TPU v5e"]
    assert len(set(before.values())) == len(before)

"""How fast each lesson redraws when a student moves one of its analytic widgets (sliders, boxes), in
Streamlit's AppTest: the page script's own time, without the browser (which adds drawing the charts).

    .venv/bin/python bench/bench_lessons.py            # every lesson, each widget moved twice

Prints, per lesson, the median and the slowest rerun over its widgets (live-run widgets excluded: they
only configure a run). Measured, never pass/fail.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _moves(widget):
    """Up to two changes for a widget: ("index", i) for boxes and radios, ("value", v) otherwise; none
    where the widget's raw options cannot be read back (a select slider with a format function)."""
    kind = type(widget).__name__
    if kind == "Selectbox":
        return [("index", i) for i in range(len(widget.options)) if i != widget.index][:2]
    if kind == "Radio":
        return [("value", o) for o in widget.options if o != widget.value][:2]
    if kind == "SelectSlider":
        current = widget.value
        moves = []
        for option in widget.options:
            try:
                raw = type(current)(option)
            except (TypeError, ValueError):
                return []
            if raw != current:
                moves.append(("value", raw))
        return moves[:2]
    if kind == "Slider":
        return [("value", v) for v in (widget.min, widget.max) if v != widget.value][:2]
    if kind == "Toggle":
        return [("value", not widget.value)]
    return []


def bench_page(path: str) -> list[float]:
    """Seconds of each rerun after one widget move; a widget AppTest cannot set (a radio with a format
    function, say) is skipped and the page opened afresh."""
    from tests.ui.apptest_util import open_app

    at = open_app(path)
    times = []
    widgets = [(getter, w.key) for getter in ("select_slider", "slider", "selectbox", "radio", "toggle")
               for w in getattr(at, getter) if w.key and not w.disabled
               and not w.key.startswith(("live", "tp_live", "cp_live", "ep_live", "pp_live"))
               and w.key not in ("model", "chip")]  # live-run settings and the sidebar's shared choices
    for getter, key in widgets:
        for how, value in _moves(getattr(at, getter)(key=key)):
            try:
                target = getattr(at, getter)(key=key)
                target.select_index(value) if how == "index" else target.set_value(value)
                start = time.perf_counter()
                at.run()
                elapsed = time.perf_counter() - start
            except Exception:  # noqa: BLE001 - AppTest could not set it: skip, start clean
                at = open_app(path)
                continue
            if at.exception:
                raise RuntimeError(f"{path}: {key}={value!r}: {at.exception[0].value}")
            times.append(elapsed)
    return times


def main() -> int:
    from ui.lessons import LESSONS

    print(f"{'lesson':32s} {'widgets moved':>13s} {'median ms':>10s} {'slowest ms':>11s}")
    medians = []
    for lesson in LESSONS:
        times = bench_page(lesson.path)
        if not times:
            print(f"{lesson.title:32s} {0:>13d} {'-':>10s} {'-':>11s}")
            continue
        medians.append(statistics.median(times))
        print(f"{lesson.title:32s} {len(times):>13d} {statistics.median(times) * 1e3:>10.0f} "
              f"{max(times) * 1e3:>11.0f}")
    print(f"median of the lessons' medians: {statistics.median(medians) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

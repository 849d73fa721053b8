"""A lesson's small table of words and numbers, the one way the lessons show one; and a planner search's table."""

import re

import streamlit as st

# a number and its unit (ui.tables' bytes and times): kept on one line when a cell wraps ("1.56" above "ms")
_NUMBER_UNIT = re.compile(r"(\d) ((?:[kKMGTP]i?)?B|[mµn]?s)\b")


def _cell(value) -> str:
    """A transposed table's cell: a count with its thousands marked, anything else as it reads."""
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def text_table(rows: list[dict], columns_from: str | None = None) -> None:
    """`rows` as a static table whose cells wrap, not a data grid: in a window 800 px wide (the lesson
    466 px beside the sidebar) a grid's columns keep their text's width and the last ones ran out of sight,
    behind a sideways scroll ("collectives per step", ring attention's rank 2 and 3, the pipeline's "held,
    last rank"). A grid stays for the long tables a reader sorts or scrolls (the chips, the calibration).

    `columns_from`: a few rows of many quantities (a live panel's runs) turned on their side, a column per row
    headed by its `columns_from` value and a row per quantity: eight columns had not fitted even wrapped. Its
    cells are written as text (`_cell`): a column then holds counts and percentages alike, which a
    column of numbers cannot."""
    if columns_from is not None:
        rows = [{"": key, **{str(row[columns_from]): _cell(row[key]) for row in rows}}
                for key in rows[0] if key != columns_from] if rows else []
    st.table([{key: _NUMBER_UNIT.sub("\\1\u00a0\\2", value) if isinstance(value, str) else value
               for key, value in row.items()} for row in rows], hide_index=True)


def search_table(report, by_axis: bool = False) -> None:
    """A planner search's ranked layouts (ui.meshes.search_rows) as a grid, each number with its decimals: the
    planner's page (`by_axis`, a column per degree) and the meshes page (the sidebar's mesh) show one table."""
    from ui.meshes import SEARCH_FORMATS, search_rows

    st.dataframe(search_rows(report, by_axis), hide_index=True, width="stretch",
                 column_config={k: st.column_config.NumberColumn(format=f) for k, f in SEARCH_FORMATS.items()})

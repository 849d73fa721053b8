"""Open the app (and one of its pages) in Streamlit's AppTest, with query parameters as a shared link."""

from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "app.py")
TIMEOUT_S = 120  # generous: the suite runs on 2 loaded cores


def open_app(page: str | None = None, **params) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    if page is not None:
        at.switch_page(page)
        at.run()
    return at


def runs_table(at, quantity: str):
    """The table of `at` turned on its side by app_pages.text_table's `columns_from` (a column per run, a row per
    quantity) that has a row `quantity`, read back as a row per run (runs in the index)."""
    return next(t.value for t in at.table if quantity in list(t.value.get("", []))).set_index("").T

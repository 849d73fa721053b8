"""Shared sidebar choices read from a link: good values kept, every bad one reported with its default."""

from ui.state import DEFAULT_MESH, parse_choices

CHIPS = ["h100", "a100-80gb", "tpu-v5p"]
MODELS = ["Llama 3 8B", "GPT-3 175B"]


def _parse(params, page_params=()):
    return parse_choices(params, CHIPS, MODELS, "h100", "Llama 3 8B", page_params)


def test_empty_link_gives_defaults_and_no_messages():
    choices, problems = _parse({})
    assert (choices.chip, choices.model, choices.mesh) == ("h100", "Llama 3 8B", DEFAULT_MESH)
    assert problems == []
    assert choices.num_chips == 8


def test_good_link_is_kept():
    choices, problems = _parse({"chip": "tpu-v5p", "model": "GPT-3 175B", "dp": "15", "tp": "8", "pp": "16"})
    assert problems == []
    assert choices.chip == "tpu-v5p" and choices.model == "GPT-3 175B"
    assert choices.num_chips == 15 * 8 * 16
    assert choices.mesh_label() == "dp=15 x tp=8 x pp=16"


def test_unknown_chip_names_the_known_ones():
    choices, problems = _parse({"chip": "h900"})
    assert choices.chip == "h100"
    assert len(problems) == 1 and "h900" in problems[0] and "tpu-v5p" in problems[0]


def test_zero_negative_and_nonsense_sizes_fall_back():
    choices, problems = _parse({"dp": "0", "tp": "-4", "pp": "abc", "cp": "1e9", "ep": "2"})
    assert choices.mesh == {**DEFAULT_MESH, "ep": 2}
    assert len(problems) == 4
    assert all("using" in p for p in problems)


def test_unknown_parameters_are_reported_but_page_parameters_are_not():
    _, problems = _parse({"chp": "h100", "tokens": "64"}, page_params={"tokens"})
    assert len(problems) == 1 and "`chp` (did you mean `chip`?)" in problems[0]


def test_many_unknown_parameters_are_counted_not_listed():
    from ui.state import UNKNOWN_LISTED

    junk = {f"zz{i:03d}": "1" for i in range(40)}
    _, problems = _parse({**junk, "lab_mbb": "2"}, page_params={"lab_mb", "lab_pp"})
    message = problems[-1]
    assert message.count("`") == 2 * (UNKNOWN_LISTED + 1)  # five names and the one suggestion
    assert "`lab_mbb` (did you mean `lab_mb`?)" in message and f"and {41 - UNKNOWN_LISTED} more" in message


def test_non_finite_link_values_are_found():
    from ui.state import non_finite_params

    assert non_finite_params({"dp": "INF", "tp": "2", "stages": "nan", "chip": "h100", "t_b": "1e999",
                              "x": "-Infinity", "y": "abc"}) == ["dp", "stages", "t_b", "x"]


def test_a_link_with_infinity_opens_with_a_message():
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/pipeline.py", dp="INF", stages="inf")
    assert not at.exception
    warnings = " ".join(w.value for w in at.sidebar.warning)
    assert "dp=`INF`" in warnings and "`stages`=`inf`" in warnings
    assert warnings.count("`INF`") == 1  # the sidebar's own check says it; the finite check does not again


def test_the_sidebar_uses_the_mesh_size_its_link_message_names():
    # the mesh widgets start from what parse_choices made of the link (not Streamlit's own reading of a bound
    # widget's parameter, which took 2.5 as 2 and 1e3 as 1000 while the message said "using dp=8")
    from tests.ui.apptest_util import open_app

    at = open_app(None, dp="1e3", tp="2")
    assert not at.exception
    assert at.sidebar.number_input(key="dp").value == 8 and at.sidebar.number_input(key="tp").value == 2
    assert "using dp=8" in " ".join(w.value for w in at.sidebar.warning)
    assert at.query_params["tp"] == "2" and "dp" not in at.query_params  # the link keeps what it uses
    at.sidebar.number_input(key="dp").set_value(16).run()
    assert at.query_params["dp"] == "16"


def test_typed_text_in_a_message_stays_as_typed():
    from ui.state import inert_markdown

    # a pattern typed as "MA *x* [l](http://e.com)" had shown x in italics
    assert inert_markdown("pattern='MA *x* _y_ ~~z~~ [l](h) `c` $m$'") == (
        "pattern='MA \\*x\\* \\_y\\_ \\~\\~z\\~\\~ \\[l\\](h) \\`c\\` \\$m\\$'")


def test_an_empty_link_value_is_said_in_words():
    """An empty code span renders as two backticks: "Unknown chip `` in the link"."""
    _, problems = _parse({"chip": "", "model": " "})
    assert "Unknown chip (empty) in the link" in problems[0]
    assert "Unknown model preset (blank) in the link" in problems[1]
    assert not any("``" in p or "` `" in p for p in problems)


def test_a_pages_bound_choices_are_checked_against_their_options():
    from ui.state import choice_link_problems, ignored_link_message

    options = {"batch_tokens": ["0.5M", "1M", "4M"], "search_top": [3, 5, 10], "layout_mode": ["a", "b"]}
    params = {"batch_tokens": "123", "search_top": "7", "layout_mode": "a", "chip": "h100", "other": "1e999"}
    bad = choice_link_problems(params, options)
    assert bad == {"batch_tokens": "one of 0.5M, 1M, 4M", "search_top": "one of 3, 5, 10"}
    assert ignored_link_message(bad, params) == (
        "Ignored from the link: batch_tokens=`123` (it takes one of 0.5M, 1M, 4M); search_top=`7` (it takes one of "
        "3, 5, 10). The page's own values are used instead.")
    # a value that is not a finite number is the app's own message ("not a finite number"), said once
    assert choice_link_problems({"search_top": "inf"}, options) == {}
    assert choice_link_problems({"search_top": ["5", "8"]}, options) == {"search_top": "one value, one of 3, 5, 10"}
    # a single choice takes one value: a repeated key of valid values had put the widget back to its default silently
    assert choice_link_problems({"search_top": ["5", "10"]}, options) == {"search_top": "one value, one of 3, 5, 10"}
    assert choice_link_problems({"search_top": ["5"]}, options) == {}

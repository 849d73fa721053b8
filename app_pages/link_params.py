"""Taking a bad value out of the link (query parameters) before a widget reads it, for the app shell and the
pages that check their own parameters."""

import streamlit as st


def drop_from_link(key: str) -> None:
    """Remove `key` from the link. A widget already bound to it this session (its page seen before, the bad
    link back by the browser's Back) cannot have it deleted, so its value is set again instead: the widget
    keeps what it showed and writes the link back from it."""
    if key in st.session_state:
        st.session_state[key] = st.session_state[key]
    else:
        del st.query_params[key]


def link_values() -> dict[str, str]:
    """The link's values as it has them, for a message about them (ui.state.ignored_link_message): a repeated key's
    all of them, joined ("2, 4"), where the link's dict keeps only the last."""
    return {k: ", ".join(st.query_params.get_all(k)) for k in st.query_params}


def drop_link_values_not_taken(options: dict, ranges: dict | None = None) -> dict[str, str]:
    """Take out of the link each value a page's bound widget would drop without a word, before the widgets read
    it, and return them with what each takes, for the page to say (ui.state.ignored_link_message): of `options`'s
    keys (bound choice widgets: key -> their options as the link writes them), a value that is none of them
    (ui.state.choice_link_problems); of `ranges`'s (bound number sliders: key -> (lowest, highest)), one out of
    range or no number (ui.state.slider_link_problems)."""
    from ui.state import choice_link_problems, slider_link_problems

    present = {k: st.query_params.get_all(k) for k in [*options, *(ranges or {})] if k in st.query_params}
    bad = choice_link_problems(present, options) | slider_link_problems(present, ranges or {})
    for key in bad:
        drop_from_link(key)
    return bad


def follow_sidebar(key: str, start) -> None:
    """A lesson's own slider `key`, whose value starts at the sidebar's (`start`, derived from the sidebar's mesh
    and model), starts there again when the sidebar changes: a student who moved the sidebar's tp from 1 to 2
    had kept the lesson's t = 8 from before, where a link opened fresh with tp=2 showed t = 2 (the same sidebar,
    two pages). Between sidebar changes the slider keeps what the student set; the first run leaves it to the
    link."""
    seen = f"_sidebar_start_{key}"
    if seen in st.session_state and st.session_state[seen] != start:
        st.session_state[key] = start
    st.session_state[seen] = start

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


def drop_choices_not_offered(options: dict) -> dict[str, str]:
    """Take out of the link each of `options`'s keys (a page's bound choice widgets: key -> their options as the
    link writes them) whose value is none of them, before the widgets read it, and return them with what each
    takes (ui.state.choice_link_problems), for the page to say (ui.state.ignored_link_message): a bound widget
    drops such a value without a word."""
    from ui.state import choice_link_problems

    bad = choice_link_problems({k: st.query_params.get_all(k) for k in options if k in st.query_params}, options)
    for key in bad:
        drop_from_link(key)
    return bad

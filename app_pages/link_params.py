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

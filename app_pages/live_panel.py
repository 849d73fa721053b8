"""What every live panel shows when the engine fails: one sentence, and the workers' words folded away."""

import streamlit as st

from ui.engine_errors import engine_error_message


def show_engine_failure(exc: BaseException, hint: str, what: str = "run") -> None:
    message, details = engine_error_message(exc, what=what, hint=hint)
    st.error(message, icon=":material/error:")
    if details:
        with st.expander("What the workers said"):
            st.code(details, language=None)

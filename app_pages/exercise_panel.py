"""Exercises on a lesson page: each question, and its worked answer behind a click (built in ui/exercises.py
from the page's current settings, so moving a slider changes the question and the answer)."""

import streamlit as st


def show_exercises(exercises) -> None:
    if not exercises:  # no heading over nothing: a page whose settings leave no question shows none
        return
    st.subheader("Try it yourself")
    st.caption("Each answer follows the page's current settings: change a slider or the sidebar and the "
               "question changes with it. Work it out, then open the answer.")
    for number, exercise in enumerate(exercises, start=1):
        st.markdown(f"**{number}.** {exercise.question}")
        with st.expander("Show the worked answer"):
            st.markdown("\n\n".join(exercise.worked))

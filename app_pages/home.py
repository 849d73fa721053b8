"""Home: what ShardLab is and the route through the lessons."""

import streamlit as st

from ui.lessons import LESSONS, PLANNED

st.title("ShardLab")
st.markdown(
    """
Training a large Transformer means splitting one model and one batch over hundreds or thousands of
chips. Each way of splitting (**parallelism strategy**) trades memory for communication, and the
best layouts combine several. ShardLab lets you *see* and *try* them:

- an **analytic model** predicts memory, step time and utilisation of real models on real chips
  (H100, B200, TPU v5p, ...), from the chips' specifications;
- a **live engine** runs real sharded training steps of small models on several processes of the
  machine you are using, checks every result against a single-process run, and records what every
  rank computed and communicated.

The sidebar holds your setup (model, chip, mesh shape). Every lesson reads it (the Lab has its own model
and mesh, on its page), and the page's link keeps it: copy the URL to share exactly what you see.
"""
)

st.subheader("The route")
st.markdown("Start with the hardware: every strategy is judged by what chips compute and what links carry.")
for number, lesson in enumerate(LESSONS, start=1):
    with st.container(border=True):
        st.page_link(lesson.path, label=f"{number}. {lesson.title}", icon=lesson.icon)
        st.markdown(lesson.summary)

st.subheader("Then experiment")
with st.container(border=True):
    st.page_link("app_pages/lab.py", label="The Lab", icon=":material/science:")
    st.markdown("Any layout the engine runs, on this machine's processes: your model size, mesh, schedule and "
                "batch, each run verified and beside its prediction, collected in a table where two runs can "
                "be compared step against step, with the command lines that repeat it elsewhere.")

if PLANNED:
    st.markdown("**Next on the route** (being built; each appears above when it is ready):")
    for number, (title, summary) in enumerate(PLANNED, start=len(LESSONS) + 1):
        st.markdown(f"{number}. **{title}**: {summary}")

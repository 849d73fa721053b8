"""ShardLab entry point: `streamlit run app.py`.

Runs before every page: sets up the navigation and the sidebar whose choices (model preset, chip,
mesh shape) the lessons share (the Lab has its own model and mesh, and says so in the sidebar). The
choices live in the URL query parameters, so a shared link opens the same view.
"""

# Import these fully before any page: Plotly looks them up in sys.modules without taking the import lock,
# so a second session starting while the first is still importing pandas could see a half-made module.
import numpy  # noqa: F401
import pandas  # noqa: F401
import streamlit as st

from app_pages.link_params import drop_from_link
from hardware.chips import CHIPS
from planner.models import DEFAULT_MODEL, MODEL_PRESETS
from ui.lab import LAB_PARAMS
from ui.lessons import LESSONS, page_params
from ui.state import (
    DEFAULT_MESH,
    MAX_AXIS_DEGREE,
    MESH_AXES,
    MESH_AXIS_HELP,
    Choices,
    link_value,
    non_finite_params,
    parse_choices,
)
from ui.tables import count

DEFAULT_CHIP = "h100"

st.set_page_config(page_title="ShardLab", page_icon=":material/grid_view:", layout="wide")

# Check what the link carries once per session, before the bound widgets silently drop bad values. The mesh
# sizes start from what the check made of the link: their widgets are not bound to it (a bound number widget
# reads the link itself, 2.5 as 2, 1e3 as 1000, "inf" as an error, before anything could say what it used)
# and write it back below.
if "link_problems" not in st.session_state:
    _from_link, st.session_state["link_problems"] = parse_choices(
        dict(st.query_params), CHIPS, MODEL_PRESETS, DEFAULT_CHIP, DEFAULT_MODEL, page_params() | LAB_PARAMS)
    for _axis in MESH_AXES:
        st.session_state[_axis] = _from_link.mesh[_axis]
# A value like "inf" would stop a bound number widget with an error (Streamlit catches only ValueError):
# take it out of the link before any widget reads it, and say so.
for _key in non_finite_params(st.query_params.to_dict()):
    _value = link_value(st.query_params[_key])
    _said = f"Ignored {link_value(_key)}={_value} from the link: not a finite number; "
    # said once: not again on a rerun, nor where the sidebar's check has said it ("Mesh size dp=`inf` ...")
    if not any(problem.startswith(_said) or problem.startswith(f"Mesh size {_key}={_value}")
               for problem in st.session_state["link_problems"]):
        st.session_state["link_problems"].append(_said + "using the default.")
    drop_from_link(_key)

# the default page is served at "/" (Streamlit serves no other path for it, so it is given none)
home = st.Page("app_pages/home.py", title="Start here", icon=":material/home:", default=True)
lesson_pages = [st.Page(lesson.path, title=lesson.title, icon=lesson.icon, url_path=lesson.url_path)
                for lesson in LESSONS]
lab = st.Page("app_pages/lab.py", title="The Lab", icon=":material/science:", url_path="lab")
nav = st.navigation({"ShardLab": [home], "Lessons": lesson_pages, "Experiment": [lab]})

with st.sidebar:
    st.markdown("### Your setup")
    if nav.url_path == lab.url_path:  # shown on every page, read by the lessons only: said where it is not
        st.caption(":material/info: **The Lab does not use this setup**: it runs its own small model and mesh, set "
                   "on the page. The lessons use it.")
    st.caption("Shared by the lessons and kept in the link: copy the URL to share this view.")
    model = st.selectbox("Model", list(MODEL_PRESETS), index=list(MODEL_PRESETS).index(DEFAULT_MODEL),
                         key="model", bind="query-params")
    # Options are the table keys, not display names: a bound widget puts its option text in the link.
    chip = st.selectbox("Chip", list(CHIPS), index=list(CHIPS).index(DEFAULT_CHIP), key="chip",
                        bind="query-params", help="Keys of hardware/chips.toml; the full name is shown below.")
    st.markdown("**Mesh shape**")
    # three boxes a row: five in one cut a degree of 1,024 to "10" in the sidebar's width
    cols = [col for row in range(0, len(MESH_AXES), 3) for col in st.columns(3)][:len(MESH_AXES)]
    mesh = {}
    for col, axis in zip(cols, MESH_AXES, strict=True):
        mesh[axis] = col.number_input(axis, min_value=1, max_value=MAX_AXIS_DEGREE, step=1, key=axis,
                                      help=MESH_AXIS_HELP[axis])
        if mesh[axis] == DEFAULT_MESH[axis]:  # the link keeps what differs from the defaults
            if axis in st.query_params:
                del st.query_params[axis]
        else:
            st.query_params[axis] = str(int(mesh[axis]))
    choices = Choices(model, chip, {axis: int(d) for axis, d in mesh.items()})
    if choices.num_chips == 1:  # "1 chip = **1 chip**" had said it twice
        st.caption(f"**One chip** of {CHIPS[chip].name}, nothing split: raise a degree above to share the work.")
    else:
        st.caption(f"{choices.mesh_label()} = **{count(choices.num_chips, 'chip')}** of {CHIPS[chip].name}")
    for problem in st.session_state["link_problems"]:
        st.warning(problem, icon=":material/link_off:")
    if st.session_state["link_problems"] and st.button("Dismiss link messages"):
        st.session_state["link_problems"] = []
        st.rerun()

st.session_state["choices"] = choices
nav.run()

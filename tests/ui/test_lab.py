"""The Lab page: refused layouts before running, runs collected in a table, compare, downloads, the command
line that reproduces the run."""

import json

import pytest
from streamlit.testing.v1.element_tree import Column

from engine.cli import config_from_args, run_parser
from tests.ui.apptest_util import open_app
from ui.tables import CONTINUATION

LAB = "app_pages/lab.py"


def _lab(**widgets):
    at = open_app(LAB)
    if "lab_preset" in widgets:  # the preset first: it enables the widgets of its architecture
        at.selectbox(key="lab_preset").set_value(widgets.pop("lab_preset")).run()
    for key, value in widgets.items():
        at.number_input(key=key).set_value(value) if key in _NUMBERS else at.selectbox(key=key).set_value(value)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


_NUMBERS = {"lab_pp", "lab_dp", "lab_fsdp", "lab_cp", "lab_ep", "lab_tp", "lab_heads", "lab_kv_heads",
            "lab_layers", "lab_mb", "lab_steps", "lab_hidden", "lab_ssm_groups", "lab_ssm_chunk"}


def test_the_page_opens_with_a_runnable_default():
    at = _lab()
    assert not at.error
    run = next(b for b in at.button if b.label == "Run this experiment")
    assert not run.disabled
    assert any("dp=2 on 2 processes" in m.value.replace("*", "") for m in at.markdown)


@pytest.mark.parametrize("widgets, says", [
    ({"lab_tp": 3}, "heads=4"),  # tp must divide the heads
    ({"lab_ep": 2}, "moe"),  # expert parallel needs experts
    ({"lab_pp": 4, "lab_layers": 2}, "layers"),  # whole layers per stage
    ({"lab_preset": "Mamba-2 (2 layers, width 64)", "lab_dp": 1, "lab_tp": 2, "lab_ssm_groups": 1},
     "ssm_groups=1 is not divisible by tp=2"),  # whole groups of Mamba-2 heads per tp rank
])
def test_a_layout_that_cannot_run_is_refused_before_running(widgets, says):
    at = _lab(**widgets)
    shown = at.error[0].value.replace("\\", "") if at.error else ""  # as rendered: Markdown's escapes gone
    assert says in shown.lower(), [e.value for e in at.error]
    assert next(b for b in at.button if b.label == "Run this experiment").disabled


def test_a_refusal_names_the_labs_controls_not_the_command_lines_flags():
    # the engine's messages are shared with `python -m engine run`; the Lab says its own controls' titles
    from ui.lab import LAB_FLAGS, LAB_TITLES, lab_words

    at = _lab(lab_ep=2)
    shown = at.error[0].value.replace("\\", "")
    assert "use **MLP** moe" in shown and "--mlp" not in shown
    assert lab_words("use --micro-batches 2 or 4") == "use **Micro-batches** 2 or 4"
    assert lab_words("(--strategy tp, or --mesh ...,tp=N)") == "(--strategy tp, or --mesh ...,tp=N)"  # no control
    assert set(LAB_FLAGS.values()) <= set(LAB_TITLES)
    # every flag the Lab translates is one the engine's command line has
    from engine.cli import run_parser

    options = {o for a in run_parser("x")._actions for o in a.option_strings}
    assert set(LAB_FLAGS) <= options


def test_the_command_lines_rebuild_the_same_config():
    at = _lab(lab_tp=2, lab_dp=1, lab_steps=2)
    commands = [c.value.replace(CONTINUATION, " ") for c in at.code]  # as the shell reads it
    engine_line = next(c for c in commands if c.startswith(".venv/bin/python -m engine run"))
    argv = engine_line.split()[4:]  # after ".venv/bin/python -m engine run"
    cfg = config_from_args(run_parser("x").parse_args([a for a in argv if a not in ("--check", "--predict")]))
    assert cfg.parallel.axes(cfg.world) == (("tp", 2),) and cfg.steps == 2
    # with the server's time limit, as its run gets it (the panel's "run it again" had it, this one had not)
    assert cfg.timeout_s == 120
    torchrun = next(c for c in commands if c.startswith("torchrun --nnodes"))
    assert "-m engine.worker" in torchrun and "--timeout-s 120" in torchrun


def test_bf16_is_on_the_command_line_and_refused_with_moe():
    at = _lab(lab_dtype="bfloat16")
    assert not at.error
    line = next(c.value for c in at.code if c.value.startswith(".venv/bin/python -m engine run")).replace(
        CONTINUATION, " ")
    assert "--dtype bfloat16" in line
    at = _lab(lab_preset="MoE (2 layers, 4 experts, top-2)", lab_dtype="bfloat16")
    assert at.error and "routing tie" in at.error[0].value


def _columns_in_row(node, columns: int = 1) -> dict[str, int]:
    """Each widget under `node` by key, and how many columns share its row (1: a line of its own)."""
    kids = list(getattr(node, "children", {}).values())
    row = sum(isinstance(kid, Column) for kid in kids) or columns
    found = {}
    for kid in kids:
        if getattr(kid, "key", None):
            found[kid.key] = columns
        found |= _columns_in_row(kid, row)
    return found


def test_no_control_is_too_narrow_for_its_words_in_a_1024_px_window():
    # A fifth of the page (a 1,024-px window with the sidebar) cut "transformer" and "bf16 mixed precision",
    # a quarter "interleaved-1f1b", and a toggle's title is cut, never wrapped: "Sequence pa..."
    row = _columns_in_row(_lab().main)
    assert row["lab_arch"] == row["lab_sp"] == 1
    assert row["lab_schedule"] <= 3 and row["lab_dtype"] <= 3 and row["lab_pattern"] <= 4


def test_a_preset_loads_every_model_field():
    at = _lab(lab_preset="small (4 layers, width 128)")
    assert (at.number_input(key="lab_layers").value, at.number_input(key="lab_hidden").value,
            at.number_input(key="lab_heads").value) == (4, 128, 8)
    at.selectbox(key="lab_preset").set_value("hybrid (4 layers: Mamba-2, attention, Mamba-2, attention)").run()
    assert at.radio(key="lab_arch").value == "hybrid" and at.number_input(key="lab_hidden").value == 64


def test_a_mamba_experiment_has_the_command_line_that_rebuilds_it():
    at = _lab(lab_preset="Mamba-2 (2 layers, width 64)", lab_dp=1, lab_cp=2)
    at.radio(key="lab_ssm_cp").set_value("alltoall").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    line = next(c.value for c in at.code if c.value.startswith(".venv/bin/python -m engine run")).replace(
        CONTINUATION, " ")
    assert "--arch mamba2" in line and "--ssm-cp alltoall" in line
    cfg = config_from_args(run_parser("x").parse_args([a for a in line.split()[4:]
                                                        if a not in ("--check", "--predict")]))
    assert cfg.model.arch == "mamba2" and cfg.parallel.ssm_cp == "alltoall" and cfg.world == 2


@pytest.mark.multiprocess
def test_runs_are_collected_compared_and_exported():
    at = _lab(lab_steps=2)
    next(b for b in at.button if b.label == "Run this experiment").click().run(timeout=240)
    assert not at.exception and at.success, [e.value for e in at.error]
    # its command once, under the run; the section below points to it (it had shown the same one again)
    assert sum(c.value.startswith(".venv/bin/python -m engine run") for c in at.code) == 1
    assert any("the command under the run above" in m.value for m in at.markdown)
    at.number_input(key="lab_dp").set_value(1).run()
    assert sum(c.value.startswith(".venv/bin/python -m engine run") for c in at.code) == 2  # new settings
    at.number_input(key="lab_tp").set_value(2).run()
    next(b for b in at.button if b.label == "Run this experiment").click().run(timeout=240)
    assert not at.exception and at.success, [e.value for e in at.error]
    table = at.dataframe[-1].value
    assert list(table["run"]) == ["run 1", "run 2"] and list(table["mesh"]) == ["dp=2", "tp=2"]
    assert set(table["check"]) == {"passed"}
    charts = at.get("plotly_chart")
    assert len(charts) >= 4  # the live panel's predicted and measured steps, then the two compared runs
    # a third run: the comparison moves to the latest two (it had stayed on runs 1 and 2)
    at.number_input(key="lab_steps").set_value(3).run()
    next(b for b in at.button if b.label == "Run this experiment").click().run(timeout=240)
    assert not at.exception and at.success, [e.value for e in at.error]
    assert (at.selectbox(key="lab_cmp_a").value, at.selectbox(key="lab_cmp_b").value) == ("run 2", "run 3")


def test_results_json_carries_every_run():
    from core.timeline import Timeline
    from engine.config import RunConfig
    from engine.run import RunSummary
    from ui.lab import results_json
    from ui.live import LiveRun

    summary = RunSummary(ok=True, check=None, world=2, strategy="dp", zero_stage=0, mesh={"dp": 2}, steps=3,
                         micro_batches=1, device="cpu", loss=[5.5] * 3, step_time_s=0.01, step_times_s=[0.01] * 3,
                         memory_bytes=[], comm_bytes=[], stats={}, config={})
    run = LiveRun("run 1", RunConfig(), summary, Timeline([]))
    from engine.cli import command_line

    out = json.loads(results_json([run], [command_line(run.cfg)]))
    assert out[0]["label"] == "run 1" and out[0]["command"].startswith(".venv/bin/python -m engine run")


@pytest.mark.multiprocess
def test_the_command_line_shown_reproduces_the_pages_run():
    import subprocess
    import sys
    from pathlib import Path

    from tests.ui.apptest_util import APP

    at = _lab(lab_steps=2, lab_dp=1, lab_tp=2)
    next(b for b in at.button if b.label == "Run this experiment").click().run(timeout=240)
    assert not at.exception and at.success
    page_run = at.session_state["lab_runs"][-1]
    line = next(c.value for c in at.code if c.value.startswith(".venv/bin/python -m engine run")).replace(
        CONTINUATION, " ")
    argv = line.split()[1:] + ["--json"]
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                         cwd=Path(APP).parent)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["check"]["passed"] and reply["mesh"] == page_run.summary.mesh
    assert reply["loss"] == page_run.summary.loss  # the same seed, data and layout: the same numbers


def test_a_schedule_left_from_a_pipeline_is_dropped_when_the_mesh_has_none():
    """The schedule box keeps its value when pp goes back to 1 (disabled, not reset): the run and its command
    line take the engine's default then, which the CLI accepts (a schedule without a pp axis exits 2)."""
    from engine.cli import command_line, main
    from engine.config import ModelConfig, ParallelConfig
    from ui.lab import lab_config

    cfg = lab_config(ModelConfig(), {"dp": 2}, 0, "gpipe", 2, 1, 2, 3, "cpu")
    assert cfg.parallel.schedule == ParallelConfig.schedule and cfg.parallel.virtual_stages == 1
    assert "gpipe" not in command_line(cfg)
    assert main(["run", "--schedule", "gpipe", "--world", "2"]) == 2


def test_a_greyed_out_control_does_not_block_the_run():
    # a reviewer's: virtual stages set to 2 under the interleaved schedule, then the schedule put back to 1F1B: the
    # greyed-out box still made "1f1b runs one stage per rank" and Run stayed disabled
    at = _lab(lab_pp=2, lab_dp=1)
    at.selectbox(key="lab_schedule").set_value("interleaved-1f1b").run()
    at.number_input(key="lab_virtual").set_value(2).run()
    at.selectbox(key="lab_schedule").set_value("1f1b").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert not next(b for b in at.button if b.label == "Run this experiment").disabled
    assert "--virtual-stages" not in next(c.value for c in at.code if c.value.startswith(".venv/bin/python"))


def test_a_second_run_while_the_first_is_in_flight_does_not_drop_it(monkeypatch):
    # a reviewer's: Run pressed again mid-run replaced the pending job, so the first run never reached the table
    import streamlit as st

    import app_pages.live_panel as panel

    class Going:
        def wait(self, timeout):
            return False

    class Done:
        def wait(self, timeout):
            return True

    monkeypatch.setattr(panel, "_submit", lambda *a: pytest.fail("submitted a second run over the first"))
    monkeypatch.setattr(panel, "_follow", lambda key: "following the first")
    # going, or finished while the second press's rerun interrupted its panel (a reviewer's race): collected first
    for first in (Going(), Done()):
        st.session_state.clear()
        st.session_state[panel._pending_key("k")] = (first, "hint", "run")
        assert panel.run_live("k", [("run 2", None)], hint="") == "following the first"
    st.session_state.clear()


def test_greyed_out_model_fields_stay_out_of_the_run():
    # a reviewer's: a dense transformer carried --experts, --top-k and the SSM fields it cannot use into its command,
    # its JSON and the queue's cache key
    at = open_app(LAB)
    at.session_state["lab_experts"] = 8
    at.session_state["lab_ssm_state"] = 32
    at.run()
    assert not at.exception
    line = next(c.value for c in at.code if c.value.startswith(".venv/bin/python"))
    assert "--experts" not in line and "--ssm-state" not in line


def test_the_servers_caps_are_said_before_run(monkeypatch):
    # a reviewer's: 16 processes or a 569M-parameter model looked runnable until Run was pressed
    import server.queue
    from server.queue import RunQueue
    from server.settings import Settings

    q = RunQueue(Settings(max_concurrent=1, max_world=2))
    monkeypatch.setattr(server.queue, "_queue", q)
    try:
        at = _lab(lab_dp=4)
        assert at.error and "more than this server allows (2)" in at.error[0].value
        assert next(b for b in at.button if b.label == "Run this experiment").disabled
    finally:
        q.shutdown()


def test_a_shared_link_opens_the_same_experiment_and_says_what_it_could_not_take():
    at = open_app(LAB, lab_layers="4", lab_hidden="128", lab_dp="1", lab_tp="2", lab_sp="true",
                  lab_dtype="bf16 mixed precision", lab_zero="9", lab_steps="999", lab_device="cuda")
    assert not at.exception, [e.value for e in at.exception]
    assert (at.number_input(key="lab_layers").value, at.number_input(key="lab_hidden").value) == (4, 128)
    assert at.toggle(key="lab_sp").value and at.selectbox(key="lab_dtype").value == "bfloat16"
    said = at.info[0].value
    assert "lab_zero=`9` (it takes one of 0, 1, 2, 3)" in said and "lab_steps=`999`" in said
    assert "this server has no GPU" in said or "cuda" not in said
    assert at.selectbox(key="lab_zero").value == 0 and at.number_input(key="lab_steps").value == 3
    assert "lab_zero" not in at.query_params and "lab_steps" not in at.query_params  # taken out of the link
    assert any("**tp=2** on **2 processes**" in m.value for m in at.markdown)


def test_link_problems_name_the_range_or_the_options():
    from ui.lab import LAB_PARAMS, lab_link_problems

    bad = lab_link_problems({"lab_layers": "x", "lab_hidden": "4", "lab_mlp": "sparse", "lab_sp": "yes",
                             "lab_pattern": "<b>", "lab_ssm_cp": "all-to-all to heads", "lab_device": "cuda"},
                            devices=["cpu", "cuda"])
    assert bad == {"lab_layers": "a whole number from 1 to 32", "lab_hidden": "a whole number from 8 to 1024",
                   "lab_mlp": "one of dense, moe", "lab_sp": "true or false"}
    assert {"lab_layers", "lab_pp", "lab_tp", "lab_device", "lab_pattern"} <= LAB_PARAMS


def test_a_link_keeps_the_smallest_values_and_a_bad_value_coming_back_is_said_again():
    # a box at its default is left out of the link: the defaults are the first preset's, so 1s stay in it
    at = open_app(LAB, lab_mlp="moe", lab_top_k="1", lab_kv_heads="1", lab_layers="1")
    assert not at.exception, [e.value for e in at.exception]
    assert (at.number_input(key="lab_top_k").value, at.number_input(key="lab_kv_heads").value,
            at.number_input(key="lab_layers").value) == (1, 1, 1)
    assert not at.info
    # the browser's Back brings a bad link back into a session whose boxes are bound: said, not a crash
    at.query_params["lab_zero"] = "9"
    at.query_params["lab_layers"] = "²"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert "lab_zero=`9`" in at.info[0].value and "lab_layers=`²`" in at.info[0].value
    assert at.number_input(key="lab_layers").value == 1


def test_typed_text_from_a_link_cannot_make_a_link_or_markup():
    at = open_app(LAB, lab_arch="hybrid", lab_pattern="[CLICK](HTTPS://EVIL.EXAMPLE)")
    assert not at.exception, [e.value for e in at.exception]
    said = at.error[0].value
    assert "\\[CLICK\\]" in said and "](HTTPS" not in said.replace("\\]", "")


def test_the_link_check_reads_a_number_as_streamlit_does_and_the_command_is_quoted():
    from ui.lab import bound_number

    # what the message calls ignored is what the box does not take: Streamlit reads a float and cuts it
    assert [bound_number(t) for t in ("2.5", "1e3", "٣", " 4 ", "²", "inf", "x")] == [2, 1000, 3, 4, None, None, None]
    at = open_app(LAB, lab_layers="4.9", lab_heads="٣", lab_vocab="1e3", lab_mb="x")
    assert not at.exception, [e.value for e in at.exception]
    assert (at.number_input(key="lab_layers").value, at.number_input(key="lab_vocab").value) == (4, 1000)
    said = at.info[0].value
    assert "lab_mb=`x`" in said and "lab_layers" not in said and "lab_vocab" not in said
    # a pattern is one shell argument, never shell syntax, whatever a link typed into it
    at = open_app(LAB, lab_arch="hybrid", lab_pattern="MA;A=ECHO;${A,,} X;#")
    shown = next(c.value for c in at.code if "engine run" in c.value)
    assert "--pattern 'MA;A=ECHO;${A,,} X;#'" in shown


def test_the_micro_batches_default_does_not_follow_the_mesh():
    at = open_app(LAB, lab_pp="2", lab_dp="1")
    assert not at.exception, [e.value for e in at.exception]
    assert at.number_input(key="lab_mb").value == 1  # as on the page that made the link, whatever its pp


def test_a_hand_written_preset_link_loads_the_preset_and_a_long_pattern_is_said():
    at = open_app(LAB, lab_preset="Mamba-2 (2 layers, width 64)")
    assert not at.exception, [e.value for e in at.exception]
    assert at.radio(key="lab_arch").value == "mamba2"  # as choosing it on the page would
    at = open_app(LAB, lab_arch="hybrid", lab_pattern="MA" * 100)
    # the box keeps the first 32 letters, whatever the page does: said as such, not "ignored"
    said = at.warning[0].value
    assert "lab_pattern=" in said and "at most 32 letters, one per layer" in said and "keeps its first 32" in said
    assert not at.info or "lab_pattern" not in at.info[0].value
    at = open_app(LAB, lab_pp="2", lab_dp="1")
    assert any("each stage waits for the others" in c.value for c in at.caption)  # 1 micro-batch, 2 stages


@pytest.mark.parametrize("most", [50, 2])
def test_the_steps_box_goes_as_far_as_the_servers_limit(monkeypatch, most):
    """SHARDLAB_MAX_STEPS raised above 20 had done nothing in the Lab, whose box stopped at 20; a link is checked
    against the server's limit, not 20."""
    import server.queue
    from server.queue import RunQueue
    from server.settings import Settings

    q = RunQueue(Settings(max_concurrent=1, max_steps=most))
    monkeypatch.setattr(server.queue, "_queue", q)
    try:
        at = open_app(LAB, lab_steps=str(most))
        assert not at.exception and not at.info, [i.value for i in at.info]
        box = at.number_input(key="lab_steps")
        assert box.value == most and box.proto.max == most
        assert f"at most {most}" in box.help
        at = open_app(LAB, lab_steps=str(most + 1))
        assert not at.exception
        assert f"lab_steps=`{most + 1}` (it takes a whole number from 1 to {most})" in at.info[0].value
        assert at.number_input(key="lab_steps").value == min(3, most)  # the page's default, within the limit
    finally:
        q.shutdown()


def test_a_repeated_link_key_is_said_with_the_value_the_control_took():
    from ui.lab import repeated_link_message

    # Streamlit's bound controls take the last value of a repeated key, without a word: the page says which
    at = open_app(LAB, lab_layers=["3", "4"], lab_sp=["true", "false"])
    assert not at.exception, [e.value for e in at.exception]
    said = " ".join(i.value for i in at.info)
    assert "lab_layers 2 values (`3, 4`)" in said and "lab_layers=`4`" in said and "lab_sp=`false`" in said
    assert at.number_input(key="lab_layers").value == 4 and at.toggle(key="lab_sp").value is False
    # a repeated key whose last value no control takes is ignored, quoted with all its values
    at = open_app(LAB, lab_zero=["1", "9"])
    assert "lab_zero=`1, 9` (it takes one value, one of 0, 1, 2, 3)" in at.info[0].value
    assert at.selectbox(key="lab_zero").value == 0
    assert repeated_link_message({"lab_steps": ["5"]}) == ""
    # a key no control reads is not said to be taken; a repeated pattern cut to the box's length is said as both
    at = open_app(LAB, lab_foo=["a", "b"], lab_arch="hybrid", lab_pattern=["MA", "A" * 40])
    said = " ".join(i.value for i in at.info)
    assert "lab_foo" not in said and "lab_pattern 2 values" in said
    assert any("longer than the box takes" in w.value for w in at.warning)

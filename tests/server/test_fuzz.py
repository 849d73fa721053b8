"""Bad input, fuzzed with hypothesis: the links (query parameters) of every page, the engine's run
configuration, planner case files. Every invalid input gets a message naming what to change: never a
traceback, a hang or a half-written file."""

import copy
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cli import config_from_args, run_parser
from engine.config import ConfigError, RunConfig
from hardware.chips import CHIPS
from planner.api import estimate
from planner.models import DEFAULT_MODEL, MODEL_PRESETS, SpecError
from tests.ui.apptest_util import open_app
from ui.lessons import LESSONS, page_params
from ui.state import MAX_AXIS_DEGREE, MESH_AXES, parse_choices

ROOT = Path(__file__).resolve().parents[2]

# Values a link or a form may carry: numbers of every kind, words, empty, markup, very long.
junk = st.one_of(
    st.integers(-10**12, 10**12).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.text(max_size=40), st.sampled_from(["", " ", "0", "-1", "1e9", "nan", "inf", "h100", "<script>", "%00",
                                          "../../etc/passwd", "x" * 5000, "1,2", "None", "true", "²", "٣",
                                          "[a](http://x)"]),
)
shared_keys = ["chip", "model", *MESH_AXES]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(shared_keys + sorted(page_params()) + ["chp", "zzz", ""]), junk, max_size=8))
def test_any_link_gives_valid_choices_and_says_what_was_wrong(params):
    choices, problems = parse_choices(params, CHIPS, MODEL_PRESETS, "h100", DEFAULT_MODEL, page_params())
    assert choices.chip in CHIPS and choices.model in MODEL_PRESETS
    assert all(1 <= d <= MAX_AXIS_DEGREE for d in choices.mesh.values())
    assert all(isinstance(p, str) and p for p in problems)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda lesson: lesson.url_path)
def test_every_page_opens_with_a_mangled_link(lesson):
    keys = shared_keys + list(lesson.params)

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.dictionaries(st.sampled_from(keys), junk, min_size=1, max_size=5))
    def opens(params):
        at = open_app(lesson.path, **params)
        assert not at.exception, (params, [e.value for e in at.exception])
        assert at.sidebar.selectbox  # the page rendered, sidebar and all

    opens()


def test_the_lab_opens_with_a_mangled_link():
    from ui.lab import LAB_PARAMS

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.dictionaries(st.sampled_from(sorted(LAB_PARAMS)), junk, min_size=1, max_size=6))
    def opens(params):
        at = open_app("app_pages/lab.py", **params)
        assert not at.exception, (params, [e.value for e in at.exception])
        warned = " ".join(w.value for w in at.sidebar.warning)
        assert "unknown link parameter" not in warned, warned  # the Lab's keys are known to the app
        assert at.button  # the page rendered down to its Run button

    opens()


# -- the engine's configuration ------------------------------------------------------------------------

FLAGS = {
    "--strategy": st.sampled_from(["dp", "fsdp", "cp", "ep", "tp", "pp", "zz"]),
    "--zero-stage": st.integers(-1, 4).map(str),
    "--world": st.integers(-2, 80).map(str),
    "--steps": st.integers(-2, 50).map(str),
    "--micro-batches": st.integers(-1, 17).map(str),
    "--micro-batch-size": st.integers(-1, 9).map(str),
    "--mesh": st.one_of(st.text(max_size=20), st.lists(st.tuples(
        st.sampled_from(["pp", "dp", "fsdp", "cp", "ep", "tp", "xx"]), st.integers(-1, 9)), max_size=4).map(
        lambda axes: ",".join(f"{a}={d}" for a, d in axes))),
    "--experts": st.integers(-1, 17).map(str),
    "--top-k": st.integers(-1, 9).map(str),
    "--capacity-factor": st.one_of(st.floats(-2, 5), st.sampled_from([float("nan"), float("inf")])).map(str),
    "--seq-len": st.integers(-1, 300).map(str),
    "--heads": st.integers(-1, 17).map(str),
    "--kv-heads": st.integers(-1, 17).map(str),
    "--ffn": st.integers(-1, 300).map(str),
    "--layers": st.integers(-1, 17).map(str),
    "--schedule": st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "nope"]),
    "--virtual-stages": st.integers(-1, 5).map(str),
    "--timeout-s": st.one_of(st.floats(-1, 100), st.sampled_from([float("nan"), float("inf")])).map(str),
    "--mlp": st.sampled_from(["dense", "moe", "dence"]),
    "--cp-variant": st.sampled_from(["ring", "allgather", "tree"]),
}


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None), max_size=7).flatmap(
    lambda keys: st.fixed_dictionaries({k: FLAGS[k] for k in keys})),
    st.lists(st.sampled_from(["--sequence-parallel", "--no-prefetch", "--check"]), max_size=2))
def test_any_engine_flags_give_a_config_or_a_message(flags, switches):
    argv = [x for k, v in flags.items() for x in (k, v)] + switches
    parser = run_parser("python -m engine run")
    try:
        args = parser.parse_args(argv)
    except ConfigError as e:  # argparse's complaint ("argument --world: invalid int value"), raised for exit 2
        assert "argument" in str(e) and "-h)" in str(e)
        return
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        assert str(e)  # says what to change
        return
    assert isinstance(cfg, RunConfig) and cfg.world >= 1 and cfg.steps >= 1


# -- planner case files ------------------------------------------------------------------------------------

# two example cases (the search fills their null fields) and two published runs with every layout field set;
# the Mixtral example is left out only because its search takes seconds per example
CASES = [json.loads((ROOT / "planner" / "cases" / f).read_text()) for f in
         ("llama3-405b-16k-h100.json", "llama3-8b-v5p-64.json")]
CASES += [r for r in json.loads((ROOT / "planner" / "data" / "heldout-runs.json").read_text())
          if r["name"] in ("megatron-h100-weak-gpt70b", "nemo2502-mixtral-8x7b-ep8-fp8-b200")]
json_junk = st.one_of(st.none(), st.booleans(), st.integers(-10**15, 10**15), st.floats(allow_nan=True),
                      st.text(max_size=12), st.lists(st.integers(), max_size=3), st.just({}))


def _paths(d, prefix=()):
    for k, v in d.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from _paths(v, (*prefix, k))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(CASES))), st.data())
def test_a_mangled_case_file_is_estimated_or_refused_with_the_field_named(which, data):
    case = copy.deepcopy(CASES[which])
    paths = list(_paths(case))
    for where in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3, unique=True)):
        node = case
        for k in where[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict):
            if data.draw(st.booleans()):
                node[where[-1]] = data.draw(json_junk)
            else:
                node.pop(where[-1], None)
    try:
        result = estimate(case)
    except SpecError as e:
        assert e.field and str(e)
        return
    assert result.result.step_time_s > 0


def test_the_planner_cli_refuses_a_malformed_file_without_writing_anything(tmp_path, capsys):
    from planner.__main__ import main

    bad = tmp_path / "case.json"
    bad.write_text('{"model": {"layers": 2,')
    out = tmp_path / "timeline.json"
    assert main(["estimate", str(bad), "--timeline", str(out)]) == 2
    assert "malformed JSON" in capsys.readouterr().err and not out.exists()


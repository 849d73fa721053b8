"""`python -m planner estimate|search`: output keys, and exit 2 with the field named on bad input."""

import json
import os
import subprocess
import sys

import pytest

from planner.__main__ import main
from planner.validation import load_published_runs

RUN = load_published_runs()[12]  # korthikanti2022-175B-full: every layout field fixed


def _write(tmp_path, obj, name="case.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def test_estimate_prints_the_documented_keys(tmp_path, capsys):
    assert main(["estimate", _write(tmp_path, RUN)]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "mfu", "tflops_per_chip", "memory_bytes_per_chip", "fits", "chosen"):
        assert key in out
    assert set(out["memory_bytes_per_chip"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert out["fits"] is True
    assert out["step_time_s"] == pytest.approx(RUN["published"]["step_time_s"], rel=0.15)


def test_estimate_reports_what_it_chose_for_null_fields(tmp_path, capsys):
    case = json.loads(json.dumps(RUN))
    case["training"]["micro_batch"] = None
    case["parallel"]["virtual_stages"] = None
    assert main(["estimate", _write(tmp_path, case)]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert set(chosen["training"]) >= {"micro_batch"} and "virtual_stages" in chosen["parallel"]


def test_search_ranks_layouts_with_explanations(tmp_path, capsys):
    case = json.loads(json.dumps(RUN))
    for k in ("dp", "tp", "pp", "pp_schedule", "virtual_stages"):
        case["parallel"][k] = None
    case["training"]["recompute"] = None
    assert main(["search", _write(tmp_path, case), "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = out["layouts"]
    assert 1 <= len(layouts) <= 3
    times = [x["step_time_s"] for x in layouts]
    assert times == sorted(times)
    assert all(x["explanation"] and all(isinstance(s, str) for s in x["explanation"]) for x in layouts)


def _bad(**edits):
    case = json.loads(json.dumps(RUN))
    for path, value in edits.items():
        block, key = path.split("__")
        if value is KeyError:
            del case[block][key]
        else:
            case[block][key] = value
    return case


@pytest.mark.parametrize("case, field", [
    (_bad(cluster__chip="a100-40gb-typo"), "cluster.chip"),
    (_bad(parallel__tp=3), "parallel"),  # 3 * 8 * 1 * 1 != 64
    (_bad(parallel__tp=64, parallel__pp=1), "parallel.tp"),  # 64 does not divide 96 heads
    (_bad(model__hidden=KeyError), "model.hidden"),
    (_bad(training__global_batch=KeyError), "training.global_batch"),
    (_bad(training__recompute="sometimes"), "training.recompute"),
    (_bad(parallel__cp=2, parallel__pp=4, model__seq_len=2047), "parallel.cp"),
    (_bad(model__heads=7, model__kv_heads=7), "model.heads"),  # 7 does not divide hidden
    (_bad(model__sliding_window=-1), "model.sliding_window"),
    (_bad(model__sliding_window=128, model__sliding_window_layers=500), "model.sliding_window_layers"),
    (_bad(model__sliding_window_layers=4), "model.sliding_window_layers"),  # layers of a window not given
    (_bad(model__sliding_window=128, model__causal=False), "model.sliding_window"),
    (_bad(model__layer_pattern="MMMM", model__layers=4, model__mlp="swiglu", model__sliding_window_layers=2),
     "model.sliding_window_layers"),  # a pure Mamba model has no attention layer to window
    (_bad(parallel__etp=2), "parallel.etp"),  # a dense model has no experts to split
    (_bad(parallel__etp="half"), "parallel.etp"),
    ("{not json", "malformed JSON"),
    ([1, 2], "case"),
    ("[" * 100_000 + "]" * 100_000, "too deeply"),
    (_bad(training__zero_stage=True), "training.zero_stage"),  # bool is an int to Python: 1
    (_bad(training__zero_stage=1.0), "training.zero_stage"),
    (_bad(training__global_batch=10**15), "training.global_batch"),  # its pipeline would never finish
    (_bad(cluster__network_bytes_per_s=1e-300), "cluster.network_bytes_per_s"),  # overflowed to a NaN sync
    (_bad(model__hidden=10**200), "model.hidden"),
    (_bad(model__rope_head_dim=64), "model.rope_head_dim"),  # no MLA: it was added to attention's FLOPs
    (_bad(model__ssm_state=16), "model.ssm_state"),  # no Mamba-2 layer
    (_bad(training__ssm_cp="alltoall"), "training.ssm_cp"),
    (_bad(training__micro_batch=5), "training.micro_batch"),  # named, not "no layout divides"
    (_bad(cluster__chips_per_node=7), "cluster.chips_per_node"),  # 7 does not divide 64: no whole nodes
    (_bad(cluster__num_chips=10**15), "cluster.num_chips"),  # refused, not searched
    (_bad(parallel__pp_layout="E|t*99999999999|L"), "parallel.pp_layout"),  # refused before it is written out
    (_bad(parallel__pp_layout="E(((t|)*100000)*100000)L"), "parallel.pp_layout"),
    (_bad(parallel__pp=10**9, parallel__pp_layout="E|t*99999999999|L"), "parallel.pp_layout"),  # pp is unchecked yet
    # a count int() refuses to read had told the user to call sys.set_int_max_str_digits()
    (_bad(parallel__pp_layout="E|t*" + "9" * 5000 + "|L"), "a count of 5,000 digits"),
    ({**_bad(), "paralel": {"tp": 3}}, "case.paralel"),  # a misspelt block was dropped, the layout chosen instead
    (json.dumps(RUN)[:-1] + ', "cluster": {"chip": "h100", "num_chips": 8}}', "'cluster' twice"),
    (json.dumps(RUN).replace('"global_batch": 64', '"global_batch": ' + "9" * 5000),
     "an integer of thousands of digits"),
    (_bad(model__dense_ffn=1001), "model.dense_ffn"),  # a dense model's MLP is ffn: it replaced it unchecked
    (_bad(model__dense_layers=2), "model.dense_layers"),
    (_bad(model__mtp_layers=9999), "model.mtp_layers"),
    (_bad(training__ep_comm_overlap=True), "training.ep_comm_overlap"),  # no experts to route to
    (_bad(training__ep_dispatch="deepep"), "training.ep_dispatch"),
    (_bad(training__logit_metrics=10**9), "training.logit_metrics"),
    # sizes no model has, each named: they had given NaN MFU and 1e298-second steps with exit 0
    (_bad(model__experts=10**300), "model.experts"),
    (_bad(model__kv_lora_rank=10**300), "model.kv_lora_rank"),
    (_bad(model__layer_pattern="MMMM", model__layers=4, model__mlp="swiglu", model__ssm_expand=2**40),
     "model.ssm_expand"),
    (_bad(model__layer_pattern="MMMM", model__layers=4, model__mlp="swiglu", model__ssm_conv=10**300),
     "model.ssm_conv"),
])
def test_bad_input_exits_2_naming_the_field(tmp_path, capsys, case, field):
    assert main(["estimate", _write(tmp_path, case)]) == 2
    err = capsys.readouterr().err
    assert field in err


def test_what_is_not_a_case_file_is_refused_before_it_is_read(tmp_path, capsys, monkeypatch):
    # /dev/zero had been read until the kernel killed the process at 24 GB; a pipe nobody writes to had hung
    import planner.case

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for path in ("/dev/zero", str(pipe)):
        assert main(["estimate", path]) == 2
        assert "is not a regular file" in capsys.readouterr().err
    monkeypatch.setattr(planner.case, "MAX_CASE_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(" " * 1001 + json.dumps(RUN))
    assert main(["estimate", str(big)]) == 2
    assert "is larger than" in capsys.readouterr().err


def test_module_entry_point_exit_code(tmp_path):
    path = _write(tmp_path, _bad(cluster__chip="nope"))
    proc = subprocess.run([sys.executable, "-m", "planner", "estimate", path], capture_output=True, text=True)
    assert proc.returncode == 2 and "cluster.chip" in proc.stderr


def test_layout_that_does_not_fit_is_reported_not_rejected(tmp_path, capsys):
    case = json.loads(json.dumps(RUN))
    # 175B on one pipeline stage: ~350 GB of weights per chip (one stage: no interleaving)
    case["parallel"].update(tp=8, pp=1, dp=8, virtual_stages=1, pp_schedule="1f1b")
    case["training"]["recompute"] = "none"
    assert main(["estimate", _write(tmp_path, case)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["memory_bytes_per_chip"]["total"] > out["hbm_bytes"]
    assert "a100-80gb" not in out["fits_on"]


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback(tmp_path):
    """`python -m planner estimate case.json | head -1`: the reader goes before the JSON is written; the CLI stops
    quietly with its own status."""
    from pathlib import Path

    case = tmp_path / "case.json"
    case.write_text(json.dumps({"model": {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn": 4096,
                                          "vocab": 32000, "seq_len": 1024},
                                "training": {"global_batch": 8}, "parallel": {"dp": 8},
                                "cluster": {"chip": "h100", "num_chips": 8}}))
    proc = subprocess.Popen([sys.executable, "-m", "planner", "estimate", str(case)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    proc.stdout.close()  # before the child, still importing, writes anything
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()


def test_a_file_that_is_not_utf8_exits_2(tmp_path, capsys):
    path = tmp_path / "case.json"
    path.write_bytes(b"\xff\xfe{")
    assert main(["estimate", str(path)]) == 2
    assert "UTF-8" in capsys.readouterr().err


def test_infinite_network_exits_2(tmp_path, capsys):
    text = json.dumps(RUN).replace('"num_chips"', '"network_bytes_per_s": Infinity, "num_chips"')
    assert main(["estimate", _write(tmp_path, text)]) == 2
    assert "cluster.network_bytes_per_s" in capsys.readouterr().err


def test_an_unwritable_timeline_path_exits_2(tmp_path, capsys):
    out = tmp_path / "no-such-folder" / "t.json"
    assert main(["estimate", _write(tmp_path, RUN), "--timeline", str(out)]) == 2
    assert "--timeline" in capsys.readouterr().err and not out.parent.exists()


@pytest.mark.parametrize("case, says", [
    (_bad(training__sequence_parallel="yes"), 'must be true, false or null, got "yes"'),
    (_bad(training__fusion="compiled"), 'must be one of "fused", "eager" or null, got "compiled"'),
    (_bad(parallel__tp=True), "must be an integer >= 1, got true"),
    ({**_bad(), "cluster": None}, "cluster: must be a JSON object, got null"),  # had said "got NoneType"
])
def test_messages_quote_the_case_file_as_json(tmp_path, capsys, case, says):
    """Python's spellings (None, True, 'yes', NoneType) are not what the user wrote in the file."""
    assert main(["estimate", _write(tmp_path, case)]) == 2
    assert says in capsys.readouterr().err


def test_a_timeline_path_that_is_the_case_or_stdout_exits_2_before_estimating(tmp_path, monkeypatch):
    """The trace had replaced the case file it was estimated from; written to /dev/stdout with stdout in a file, it
    had replaced the result printed there, exit 0."""
    case = _write(tmp_path, RUN)
    out = subprocess.run([sys.executable, "-m", "planner", "estimate", case, "--timeline", case],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "which this command reads" in out.stderr
    assert json.loads(open(case).read()) == RUN
    printed = tmp_path / "out.json"
    with open(printed, "w") as stdout:
        out = subprocess.run([sys.executable, "-m", "planner", "estimate", case, "--timeline", "/dev/stdout"],
                             stdout=stdout, stderr=subprocess.PIPE, text=True)
    assert out.returncode == 2 and "where this command prints its result" in out.stderr
    assert printed.read_text() == ""


def test_a_timeline_path_that_is_a_folder_exits_2_before_estimating(tmp_path, capsys, monkeypatch):
    import planner.__main__ as cli

    monkeypatch.setattr(cli, "estimate", lambda case: pytest.fail("estimated a case whose output cannot be written"))
    assert main(["estimate", _write(tmp_path, RUN), "--timeline", str(tmp_path)]) == 2
    assert f"--timeline: {tmp_path}: it is a folder" in capsys.readouterr().err


def test_a_node_larger_than_the_chips_scale_up_domain_exits_2(tmp_path, capsys):
    """An HGX A100's NVSwitch joins 8 GPUs: a 1,000-GPU node would cost every collective as NVLink; 8 is taken (and
    fewer, a node partly used, where they divide the chips)."""
    big = json.loads(json.dumps(RUN))
    big["cluster"]["chips_per_node"] = 1000
    assert main(["estimate", _write(tmp_path, big)]) == 2
    assert "cluster.chips_per_node: 1000 is more than" in capsys.readouterr().err
    big["cluster"]["chips_per_node"] = 8
    assert main(["estimate", _write(tmp_path, big)]) == 0


def test_search_that_ranks_nothing_exits_2_and_says_why(tmp_path, capsys):
    free = json.loads(json.dumps(RUN))
    for k in ("dp", "tp", "pp", "pp_schedule", "virtual_stages"):
        free["parallel"][k] = None
    free["training"]["micro_batch"] = 5  # divides no replica's share of the batch
    assert main(["search", _write(tmp_path, free)]) == 2
    captured = capsys.readouterr()
    assert "training.micro_batch" in captured.err and not captured.out
    free["training"]["micro_batch"] = None
    free["cluster"]["num_chips"] = 8  # 175B in 8 chips: layouts divide, none fits
    free["parallel"]["dp"] = None
    assert main(["search", _write(tmp_path, free)]) == 2
    assert "none of the" in capsys.readouterr().err


def test_search_ranks_at_most_a_hundred_layouts(tmp_path, capsys):
    # each ranked layout is simulated pass by pass: --top 10^9 ran for minutes
    assert main(["search", _write(tmp_path, RUN), "--top", "101"]) == 2
    assert "--top: must be 1 to 100" in capsys.readouterr().err


def test_a_case_saved_with_a_byte_order_mark_reads(tmp_path, capsys):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RUN).encode())  # as Windows editors save UTF-8
    assert main(["estimate", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_an_unwritable_stdout_is_said_not_a_traceback(tmp_path):
    path = _write(tmp_path, RUN)
    trace = tmp_path / "t.json"
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "planner", "estimate", path, "--timeline", str(trace)],
                              stdout=full, stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 2 and "cannot write the result" in proc.stderr and "Traceback" not in proc.stderr
    assert not trace.exists()  # had been written: the trace of a result nobody got

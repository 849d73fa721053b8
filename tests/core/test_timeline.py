"""The shared Timeline format: busy time, normalisation, JSON round trip, Chrome trace schema."""

import json

import pytest

from core.timeline import Span, Timeline


def _tl():
    return Timeline([
        Span(0, "compute", "fwd L0", 10.0, 10.5, flops=1e9, step=0, micro_batch=0),
        Span(0, "comm", "all_gather", 10.2, 10.4, bytes=4096, group="dp", is_async=True),
        Span(0, "compute", "bwd L0", 10.5, 11.0),
        Span(1, "compute", "fwd L0", 10.1, 10.6),
        Span(1, "idle", "bubble", 10.6, 11.0),
    ])


def test_busy_seconds_counts_overlap_once():
    tl = Timeline([Span(0, "comm", "a", 0.0, 1.0), Span(0, "comm", "b", 0.5, 2.0), Span(0, "comm", "c", 3.0, 4.0)])
    assert tl.busy_seconds(0, "comm") == pytest.approx(3.0)  # [0,2] + [3,4]


def test_normalized_starts_at_zero_and_keeps_durations():
    tl = _tl().normalized()
    assert tl.start_s == 0.0
    assert tl.duration_s == pytest.approx(1.0)
    assert tl.comm_bytes(0) == 4096


def test_dict_round_trip():
    tl = _tl()
    again = Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))
    assert again.spans == tl.spans


def test_chrome_trace_schema(tmp_path):
    path = tmp_path / "t.json"
    _tl().write_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 5
    for e in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert e["dur"] >= 0 and e["ts"] >= 0
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    # compute and comm on separate tracks of the same process
    assert {e["tid"] for e in complete if e["pid"] == 0} == {0, 1}


def test_bad_span_is_rejected():
    with pytest.raises(ValueError, match="lane"):
        Span(0, "gpu", "x", 0, 1)
    with pytest.raises(ValueError, match="ends before"):
        Span(0, "comm", "x", 2, 1)


def test_overlap_counts_each_second_once():
    # the numbers the lessons issue found wrong: nested compute spans (a layer around its ring steps)
    # and concurrent collectives used to be summed pairwise, reading more hidden than there was comm
    tl = Timeline([
        Span(0, "compute", "fwd L0", 0.0, 4.0),
        Span(0, "compute", "attn L0 ring 0", 1.0, 2.0),  # nested in fwd L0
        Span(0, "comm", "all_gather a", 3.0, 6.0, is_async=True),
        Span(0, "comm", "all_gather b", 3.0, 6.0, is_async=True),  # concurrent with a
        Span(0, "compute", "bwd L0", 5.0, 5.5),
        Span(1, "comm", "all_reduce", 0.0, 1.0),
    ])
    comm_s, hidden_s = tl.overlap(0)
    assert comm_s == 3.0 and hidden_s == 1.5  # 3-4 under fwd, 5-5.5 under bwd
    assert tl.overlap(1) == (1.0, 0.0)
    only_ring = tl.overlap(0, compute=lambda s: s.name.startswith("attn"))
    assert only_ring == (3.0, 0.0)


def test_a_wait_inside_a_compute_span_hides_nothing():
    # a tensor-parallel layer's blocking all-reduce lies inside the layer's span: the rank waits there, so none
    # of it is under compute (the live panel's table had read TP's all-reduces 100 % hidden); nor is an
    # asynchronous transfer during an idle span inside a layer (a ring step waiting for its block)
    tl = Timeline([
        Span(0, "compute", "fwd L0", 0.0, 10.0),
        Span(0, "comm", "all_reduce", 2.0, 3.0),
        Span(0, "comm", "send kv", 5.0, 9.0, is_async=True),
        Span(0, "idle", "wait kv", 8.0, 9.0),
    ])
    assert tl.overlap(0) == (5.0, 3.0)  # the transfer's 5-8 under compute; 8-9 and the all-reduce not


def test_difference_of_interval_unions():
    from core.timeline import difference

    assert difference([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert difference([(0, 2), (1, 4)], []) == [(0, 4)]
    assert difference([(0, 1)], [(0, 1)]) == []


def test_union_and_intersection():
    from core.timeline import intersection_seconds, union_seconds

    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_seconds([]) == 0
    assert intersection_seconds([(0, 2), (4, 8)], [(1, 5), (7, 9)]) == 1 + 1 + 1


def test_a_trace_is_written_through_a_link_and_into_a_pipe_never_over_them(tmp_path):
    import os
    import threading

    from core.timeline import unwritable_reason

    real, link = tmp_path / "real.json", tmp_path / "link.json"
    link.symlink_to(real)
    assert unwritable_reason(str(link)) is None
    _tl().write_chrome_trace(str(link))
    assert link.is_symlink() and json.loads(real.read_text())["traceEvents"]  # the link still names the file
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert unwritable_reason(str(fifo)) is None
    _tl().write_chrome_trace(str(fifo))
    reader.join(timeout=10)
    assert json.loads(got[0])["traceEvents"] and not os.path.isfile(fifo)  # still a pipe
    assert unwritable_reason(os.devnull) is None  # written into, as any program writes /dev/null


def test_a_pipe_nobody_reads_is_said_not_waited_on_for_ever(tmp_path, monkeypatch):
    import errno
    import os

    import core.timeline

    monkeypatch.setattr(core.timeline, "PIPE_READER_WAIT_S", 0.2)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as e:
        _tl().write_chrome_trace(str(fifo))
    assert e.value.errno == errno.ENXIO and "no program opened the pipe" in e.value.strerror


def test_the_result_s_own_stdout_and_the_input_are_refused(tmp_path, monkeypatch):
    import sys

    from core.timeline import unwritable_reason

    printed, case = tmp_path / "out.json", tmp_path / "case.json"
    case.write_text("{}")
    with open(printed, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert "where this command prints its result" in unwritable_reason(str(printed))
        assert unwritable_reason(str(printed), result_on_stdout=False) is None  # torchrun's --out: the result
    assert "which this command reads" in unwritable_reason(str(case), inputs=(str(case),))
    assert unwritable_reason(str(tmp_path / "other.json"), inputs=(str(case),)) is None


def test_a_path_that_names_a_folder_or_too_long_a_name_is_refused_before_the_run(tmp_path):
    from core.timeline import unwritable_reason

    assert "it ends in '/', so it names a folder" in unwritable_reason(str(tmp_path / "not-made-yet") + "/")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert unwritable_reason(str(afile / "x.json")).endswith(f"{afile} is a file, not a folder")
    assert "longer than the" in unwritable_reason(str(tmp_path / ("a" * 300 + ".json")))
    assert unwritable_reason(str(tmp_path / "fine.json")) is None


def test_a_pipeline_bubble_is_not_drawn_under_the_ranks_other_compute():
    # rank 1 finishes its F/B at 4 ms and runs its optimizer step 4.5-5 ms while rank 0 works on to 6 ms: its
    # bubble is 4-4.5 and 5-6, not 4-6 under the optimizer (the Lab's pp = 2 chart had drawn that)
    from core.timeline import bubble_spans

    spans = [Span(0, "compute", "F s0", 0.0, 1.0), Span(0, "compute", "B s0", 3.0, 6.0),
             Span(1, "compute", "F s1", 1.0, 2.0), Span(1, "compute", "B s1", 2.0, 4.0),
             Span(1, "compute", "optimizer", 4.5, 5.0)]
    idle = sorted((s.rank, s.start_s, s.end_s) for s in bubble_spans(Timeline(spans)))
    assert idle == [(0, 1.0, 3.0), (1, 0.0, 1.0), (1, 4.0, 4.5), (1, 5.0, 6.0)]

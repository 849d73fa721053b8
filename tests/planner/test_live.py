"""The planner's prediction of live runs (planner/live.py), on a calibration measured on a 2-core machine
(tests/planner/data): every strategy and mesh the engine runs gets a prediction in the engine's span
format, consistent with the calibration's own measurement of the engine; and the comparison with a
measured timeline names what differs most."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from core.mesh import Mesh
from core.timeline import Span, Timeline
from engine.cli import config_from_args, run_parser
from hardware.collectives import ring_sent_bytes
from hardware.this_machine import (
    ALONE_MODE,
    BACK_TO_BACK_MODE,
    BLOCKING_MODES,
    GLOO_THREADS,
    PAIR_MODE,
    Calibration,
    CalibrationError,
    CommFit,
    Fit,
    comm_key,
    early_mode,
    late_mode,
    work,
)
from planner.eventsim import Compute, Send
from planner.live import RING_STEP_OPS, WAITING, _Costs, _params, _Rank, _Shape, compare, per_step_by_kind, predict

# A 2-core machine's calibration (engine/predict.ensure_calibration at worlds 2 and 4), every fit in it
CAL = Calibration.from_dict(json.loads((Path(__file__).parent / "data" / "calibration-2core.json").read_text()))


def _cfg(flags: str):
    return config_from_args(run_parser("test").parse_args(flags.split()))


RUNS = [
    "--strategy dp --world 2", "--strategy dp --world 2 --dp-comm naive", "--strategy dp --world 2 --micro-batches 2",
    "--strategy dp --zero-stage 1 --world 2", "--strategy dp --zero-stage 2 --world 4",
    "--strategy fsdp --world 2", "--strategy fsdp --world 4 --no-prefetch",
    "--strategy tp --world 2", "--strategy tp --sequence-parallel --world 4",
    "--strategy tp --mesh dp=2,tp=2 --world 4",
    "--strategy pp --schedule 1f1b --micro-batches 4 --world 2", "--strategy pp --mesh pp=2,dp=2 --world 4",
    "--strategy pp --schedule interleaved-1f1b --virtual-stages 2 --micro-batches 4 --world 2",
    "--strategy pp --schedule zb-h1 --micro-batches 4 --world 2", "--strategy pp --mesh tp=2,pp=2 --world 4",
    "--strategy cp --world 2", "--strategy cp --cp-variant allgather --world 2",
    "--strategy cp --mesh dp=2,cp=2 --world 4",
    "--strategy ep --world 2", "--strategy ep --mesh dp=2,ep=2 --world 4",
]


@pytest.mark.parametrize("flags", RUNS)
def test_every_live_run_has_a_prediction(flags):
    cfg = _cfg(flags)
    pred = predict(cfg, CAL)
    assert pred.step_time_s > 0
    assert sum(pred.breakdown_s.values()) == pytest.approx(pred.step_time_s)
    assert pred.timeline.ranks == list(range(cfg.world)) and pred.timeline.source == "predicted"
    names = {s.name for s in pred.timeline.spans if s.lane == "compute"}
    assert "optimizer step" in names
    d = pred.as_dict()
    assert json.loads(json.dumps(d))["step_time_s"] == pytest.approx(pred.step_time_s)


def test_each_rank_computes_at_its_own_pace():
    # the speed check found one rank's core 1.5x faster (Calibration.rank_pace): its compute is that much
    # shorter, and a pipeline, whose stages do not wait at every step for each other, ends sooner
    flags = "--strategy pp --schedule 1f1b --micro-batches 4 --world 2"
    even = predict(_cfg(flags), CAL)
    assert predict(_cfg(flags), dataclasses.replace(CAL, rank_pace=(1.0, 1.0))).step_time_s == even.step_time_s
    paced = predict(_cfg(flags), dataclasses.replace(CAL, rank_pace=(1 / 1.5, 1.0)))
    assert paced.step_time_s < 0.97 * even.step_time_s

    def compute_s(pred, rank):
        return sum(s.end_s - s.start_s for s in pred.timeline.spans if s.lane == "compute" and s.rank == rank)

    assert compute_s(paced, 0) == pytest.approx(compute_s(even, 0) / 1.5, rel=1e-6)
    assert compute_s(paced, 1) == pytest.approx(compute_s(even, 1), rel=1e-6)
    # a pace that is not one per rank (another world's check) is not used
    assert predict(_cfg(flags), dataclasses.replace(CAL, rank_pace=(0.5,))).step_time_s == even.step_time_s


def test_idle_spans_as_the_engine_draws_them():
    # as the engine marks a pipeline's bubbles (core/timeline.py); the prediction's other waits are gaps (the
    # engine's ring attention marks its own, which per_step_by_kind reads as waiting all the same)
    assert not any(s.lane == "idle" for s in predict(_cfg("--strategy fsdp --world 2"), CAL).timeline.spans)
    pp = predict(_cfg("--strategy pp --schedule 1f1b --micro-batches 4 --world 2"), CAL).timeline
    assert {s.name for s in pp.spans if s.lane == "idle"} == {"bubble"}


def test_one_rank_agrees_with_the_calibrations_own_engine_step():
    # the calibration times the engine's data-parallel step at world 1; the prediction, built from the
    # modules' fits and the driver's overhead per unit, should land near it (not fitted to it: the
    # modules are timed separately, at other shapes)
    pred = predict(_cfg("--world 1"), CAL)
    assert pred.step_time_s == pytest.approx(CAL.engine_units["step"], rel=0.15)


def test_dp_spans_are_named_as_the_engine_names_them():
    pred = predict(_cfg("--strategy dp --world 2"), CAL)
    compute = {s.name for s in pred.timeline.spans if s.lane == "compute"}
    assert {"fwd embed", "fwd L0", "fwd L1", "fwd head", "bwd head", "bwd L0", "optimizer step"} <= compute
    comm = [s for s in pred.timeline.spans if s.lane == "comm"]
    assert comm and all(s.group == "dp" and s.is_async and "all_reduce" in s.name for s in comm)


def test_the_costs_follow_the_strategy():
    # bucketed all-reduces hide under backward; the naive sync after backward does not
    bucketed = predict(_cfg("--strategy dp --world 2"), CAL)
    naive = predict(_cfg("--strategy dp --world 2 --dp-comm naive"), CAL)
    assert naive.step_time_s > bucketed.step_time_s
    # tensor parallel waits for its all-reduces: its breakdown has tp communication
    assert predict(_cfg("--strategy tp --world 2"), CAL).breakdown_s.get("tp_comm", 0) > 0


def _tl(spans, source="measured"):
    return Timeline(spans, source=source)


def test_per_step_counts_nested_spans_once_and_measures_waiting():
    spans = []
    for step in (0, 1, 2):
        t = 10.0 * step
        spans += [Span(0, "compute", "fwd L0", t, t + 4.0, step=step),
                  Span(0, "compute", "attn L0 ring 0", t + 1.0, t + 2.0, step=step),  # nested in fwd L0
                  Span(0, "comm", "all_reduce grads", t + 4.0, t + 5.0, group="dp", step=step),
                  Span(0, "comm", "all_gather L0", t + 4.0, t + 9.0, group="dp", is_async=True, step=step),
                  Span(0, "compute", "optimizer step", t + 6.0, t + 7.0, step=step)]
    kinds = per_step_by_kind(_tl(spans))  # step 0 (warm-up) left out
    assert kinds["forward compute"] == pytest.approx(3.0)
    assert kinds["other compute"] == pytest.approx(1.0)
    assert kinds["gloo all-reduce (dp)"] == pytest.approx(1.0)
    assert kinds["optimizer compute"] == pytest.approx(1.0)
    assert kinds[WAITING] == pytest.approx(9.0 - 6.0)  # the window is 9 s, blocking spans cover 6 s
    assert not any("all_gather" in k for k in kinds)  # asynchronous: runs beside the step


def test_a_wait_inside_a_layer_is_waiting_not_compute():
    # the engine's ring attention marks the time it blocks on its transfers (idle "wait" spans) and posts
    # them (a blocking comm span), both inside the layer's span: neither is the layer's compute
    spans = []
    for step in (0, 1):
        t = 10.0 * step
        spans += [Span(0, "compute", "bwd L0", t, t + 6.0, step=step),
                  Span(0, "comm", "post kv L0", t + 1.0, t + 2.0, group="cp", step=step),
                  Span(0, "comm", "send kv L0", t + 2.0, t + 5.0, group="cp", is_async=True, step=step),
                  Span(0, "compute", "attn bwd L0 ring 0", t + 2.0, t + 3.0, step=step),
                  Span(0, "idle", "wait kv L0", t + 3.0, t + 5.0, step=step),
                  Span(0, "compute", "optimizer step", t + 7.0, t + 8.0, step=step)]
    kinds = per_step_by_kind(_tl(spans))
    assert kinds["backward compute"] == pytest.approx(6.0 - 1.0 - 1.0 - 2.0)
    assert kinds["gloo other comm (cp)"] == pytest.approx(1.0)
    assert kinds["other compute"] == pytest.approx(1.0)
    assert kinds[WAITING] == pytest.approx(2.0 + 1.0)  # the wait in the layer, the gap before the optimizer


def test_compare_names_the_span_that_differs_most():
    pred = _tl([Span(0, "compute", "fwd L0", 0.0, 1e-3), Span(0, "comm", "all_reduce", 1e-3, 2e-3, group="dp")],
               source="predicted")
    meas = _tl([Span(0, "compute", "fwd L0", 0.0, 1.05e-3, step=s) for s in (0, 1)]
               + [Span(0, "comm", "all_reduce", 1.05e-3, 3.15e-3, group="dp", step=s) for s in (0, 1)])
    rows = compare(pred, meas)
    assert [r["what"] for r in rows] == ["gloo all-reduce (dp)"]  # forward differs by only 5 %
    assert rows[0]["ratio"] == pytest.approx(2.1)
    assert rows[0]["text"].startswith("gloo all-reduce (dp) took 2.1x its predicted time")


def test_compare_calls_a_few_predicted_microseconds_none():
    # the event simulation can leave a wait of a few picoseconds: "2593067742.6x its predicted time" was printed
    pred = _tl([Span(0, "compute", "fwd L0", 0.0, 1e-3), Span(0, "comm", "all_reduce", 1e-3, 1e-3 + 3e-12, group="dp")],
               source="predicted")
    meas = _tl([Span(0, "compute", "fwd L0", 0.0, 1e-3, step=s) for s in (0, 1)]
               + [Span(0, "comm", "all_reduce", 1e-3, 3e-3, group="dp", step=s) for s in (0, 1)])
    rows = compare(pred, meas)
    assert rows and all("x its predicted" not in r["text"] for r in rows)
    assert rows[0]["text"].endswith("the prediction has none")


def test_compare_says_a_kind_of_work_the_run_did_not_measure():
    # the data-parallel page had read "other compute took 0.0x its predicted time (0.00 ms against 0.18 ms ...)"
    pred = _tl([Span(0, "compute", "fwd L0", 0.0, 1e-3), Span(0, "comm", "all_reduce", 1e-3, 3e-3, group="dp")],
               source="predicted")
    meas = _tl([Span(0, "compute", "fwd L0", 0.0, 1e-3, step=s) for s in (0, 1)])
    rows = compare(pred, meas)
    assert [r["text"] for r in rows] == ["gloo all-reduce (dp): the prediction has 2.00 ms per rank per step; the "
                                         "run measured none"]


def test_the_planner_never_imports_the_engine_package():
    # the torch-free core (mesh, timeline, schedules) is below both; the planner reads a RunConfig by attribute
    code = ("import sys, planner.api, planner.live, planner.layout_search, planner.timeline, planner.simulate; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'engine'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


def test_the_planner_side_never_imports_torch():
    code = ("import sys, planner.live, planner.eventsim, hardware.this_machine, engine.predict, engine.run; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"


# -- Mamba-2 and hybrid runs -------------------------------------------------------------------------------

MAMBA_RUNS = [
    "--arch mamba2 --strategy dp --world 2", "--arch mamba2 --strategy fsdp --world 2",
    "--arch mamba2 --strategy dp --zero-stage 1 --world 2",
    "--arch mamba2 --strategy tp --world 2", "--arch mamba2 --strategy tp --sequence-parallel --world 2",
    "--arch mamba2 --strategy cp --world 2", "--arch mamba2 --strategy cp --world 4",
    "--arch mamba2 --strategy cp --world 4 --ssm-cp alltoall", "--arch mamba2 --mesh pp=2 --world 2",
    "--arch mamba2 --mesh pp=2,cp=2 --world 4", "--arch hybrid --strategy cp --world 2",
    "--arch hybrid --strategy tp --world 2", "--arch hybrid --mesh dp=2,tp=2 --world 4",
]


@pytest.mark.parametrize("flags", MAMBA_RUNS)
def test_every_mamba_run_has_a_prediction(flags):
    cfg = _cfg(flags)
    pred = predict(cfg, CAL)
    assert pred.step_time_s > 0
    assert sum(pred.breakdown_s.values()) == pytest.approx(pred.step_time_s)
    assert pred.timeline.ranks == list(range(cfg.world))


def test_a_calibration_without_the_mamba_fit_says_so():
    older = dataclasses.replace(CAL, compute={k: v for k, v in CAL.compute.items() if k != "mamba"})
    with pytest.raises(CalibrationError, match="no timing of mamba"):
        predict(_cfg("--arch mamba2 --strategy dp --world 2"), older)


@pytest.mark.parametrize("flags", ["--arch mamba2", "--arch hybrid", "--arch hybrid --pattern MMA --layers 3"])
def test_the_gradient_sync_covers_every_mamba_parameter(flags):
    # the data-parallel sync's buckets are cut from this list: it must hold the model's every parameter
    m = _cfg(flags).model
    assert sum(n for unit in _params(m) for _, n in unit) == m.params
    # tp = 2: the Mamba layer's norm whole, the rest split by heads and groups (engine/tp.py)
    local = _params(m, tp=2)[1 + m.kinds.index("M")]
    assert sum(n for _, n in local) == m.hidden + (m.mamba_params - m.hidden) // 2


def _spans(pred, name, rank=None):
    return [s for s in pred.timeline.spans if s.name == name and (rank is None or s.rank == rank)]


def test_tp_has_one_all_reduce_per_mamba_layer_each_way():
    cfg = _cfg("--arch mamba2 --strategy tp --world 2")
    pred = predict(cfg, CAL)
    act = cfg.micro_batch_size * cfg.model.seq_len * cfg.model.hidden * 4
    for rank in (0, 1):
        for layer in ("L0", "L1"):
            for name in (f"all_reduce {layer} mamba", f"all_reduce {layer} mamba grad"):
                spans = _spans(pred, name, rank)
                assert len(spans) == 1 and spans[0].group == "tp" and spans[0].bytes == act
    tp_comm = {s.name for s in pred.timeline.spans if s.group == "tp"}
    assert not any("L0" in n and "mamba" not in n for n in tp_comm)  # nothing else in the layer
    sp = predict(_cfg("--arch mamba2 --strategy tp --sequence-parallel --world 2"), CAL)
    for name in ("all_gather L0 mamba", "reduce_scatter L0 mamba", "all_gather L0 mamba grad",
                 "reduce_scatter L0 mamba grad", "all_reduce L0 mamba norm grad"):
        assert len(_spans(sp, name, 0)) == 1, name


def test_state_passing_writes_the_engines_chain():
    # cp = 4, contiguous slices: rank r receives the state from r - 1 and sends it to r + 1 (B x H x P x N
    # fp32, engine/ssm_cp.py), so the ranks' corrections follow each other; backward the other way
    cfg = _cfg("--arch mamba2 --strategy cp --world 4")
    m, b = cfg.model, cfg.micro_batch_size
    state_bytes = b * m.ssm_heads * m.ssm_head_dim * m.ssm_state * 4
    halo_bytes = b * (m.conv_width - 1) * (m.ssm_inner + 2 * m.ssm_groups * m.ssm_state) * 4
    pred = predict(cfg, CAL)
    for name, senders in (("send state L0", [0, 1, 2]), ("send dstate L0", [1, 2, 3]),
                          ("send conv halo L0", [0, 1, 2]), ("send dhalo L0", [1, 2, 3])):
        spans = _spans(pred, name)
        assert sorted(s.rank for s in spans) == senders, name
        assert {s.bytes for s in spans} == {halo_bytes if "halo" in name else state_bytes}
    # a receive is drawn where its rank waited: rank 1's message may have arrived while it still scanned
    assert {s.rank for s in _spans(pred, "recv state L0")} <= {1, 2, 3}
    assert {s.rank for s in _spans(pred, "recv dstate L0")} <= {0, 1, 2}
    # the chain serialises the ranks: each corrects its outputs only once its predecessor's state arrived
    sent = {s.rank: s.end_s for s in _spans(pred, "send state L0")}
    corrected = [_spans(pred, "scan L0 correct with incoming state", r)[0].start_s for r in range(4)]
    assert all(corrected[r] >= sent[r - 1] for r in (1, 2, 3))
    assert corrected == sorted(corrected)
    assert not any(s.group == "cp" and "all_to_all" in s.name for s in pred.timeline.spans)
    # and each sender waits for its state to be received before it computes on (engine/ssm_cp waits its sends)
    for send in _spans(pred, "send state L0"):
        after = [c.start_s for c in pred.timeline.spans if c.rank == send.rank and c.lane == "compute"
                 and c.start_s >= send.start_s]
        assert min(after) >= send.end_s - 1e-12


@pytest.fixture
def programs(monkeypatch):
    """The rank programs each `predict` hands the event simulation, newest last."""
    import planner.live as live

    recorded = []
    simulate = live.simulate

    def recording(progs, *args, **kwargs):
        recorded.append(progs)
        return simulate(progs, *args, **kwargs)

    monkeypatch.setattr(live, "simulate", recording)
    return recorded


def test_state_passing_charges_its_own_measured_work_over_the_mixer(programs):
    # "mamba_state" (engine/calibrate._state_passing_sample): what StatePassing adds to the plain mixer, half
    # before the chain and half after (the correction); a rank of the hybrid model holds two zig-zag slices,
    # and the one past the first runs a conv and scan of its own
    cfg = _cfg("--arch hybrid --strategy cp --world 2")

    def correction_s(fit) -> list[float]:
        """Rank 0's corrections, forward, in one core's seconds."""
        predict(cfg, dataclasses.replace(CAL, compute={**CAL.compute, "mamba_state": fit}))
        ops = [op for op in programs[-1][0]
               if isinstance(op, Compute) and op.name.endswith("correct with incoming state")]
        assert ops
        return [op.seconds for op in ops]

    fixed = correction_s(Fit(2e-3, 0.0, 0.0, 0.0))
    twice = correction_s(Fit(4e-3, 0.0, 0.0, 0.0))
    assert [b - a for a, b in zip(fixed, twice, strict=True)] == pytest.approx([1e-3] * len(fixed))
    per_slice = correction_s(Fit(0.0, 0.0, 0.0, 0.0, 2e-3, 0.0))
    assert per_slice == pytest.approx(fixed)  # one slice past the first


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "gpipe"])
def test_a_pipeline_message_holds_its_sender_as_long_as_posting_took_in_that_pipeline(programs, schedule):
    # hardware.this_machine.POSTING_SCHEDULES: interleaved's postings are timed in its own pipeline (its chunks
    # send back while the previous rank sends on: 0.47 ms on average at 2 ranks here, 1F1B's 0.19); GPipe's
    # one stage a rank posts as 1F1B's
    flags = f"--strategy pp --schedule {schedule} --micro-batches 4 --world 2"
    cfg = _cfg(flags + (" --virtual-stages 2" if schedule == "interleaved-1f1b" else ""))
    predict(cfg, CAL)
    held = {op.post_s for ops in programs[-1].values() for op in ops if isinstance(op, Send)}
    assert held == {CAL.send_post_fit(2, schedule).alpha_s}
    assert CAL.send_post_fit(2, "interleaved-1f1b").alpha_s > CAL.send_post_fit(2, "gpipe").alpha_s


def test_a_receive_posted_after_its_send_waits_the_late_transfer():
    # gloo's point-to-point is a rendezvous: GPipe's stage 1 posts each RECV when it needs the activation,
    # long after stage 0 sent it, and waits the calibrated late receive from there (engine/calibrate.
    # _pipeline_messages); the executor waits for its isends before the optimizer step
    cfg = _cfg("--strategy pp --schedule gpipe --micro-batches 4 --world 2")
    base = dataclasses.replace(CAL, comm={k: v for k, v in CAL.comm.items() if "/late" not in k})
    # (without late0: a receive posted while nothing computes takes late1 too)
    late = dataclasses.replace(CAL, comm={**base.comm,
                                          comm_key(2, "send_recv", 2, late_mode(1)): CommFit(5e-3, 0.0, 0.5)})
    base, pred = predict(cfg, base), predict(cfg, late)
    waits = [s.duration_s for s in _spans(pred, "recv act s1") if s.micro_batch > 0]
    assert len(waits) == 3 and min(waits) >= 5e-3 - 1e-12
    # each of those receives waits 5 ms where it waited what it did without the late transfer
    before = sum(s.duration_s for s in _spans(base, "recv act s1") if s.micro_batch > 0)
    assert pred.step_time_s > base.step_time_s + 3 * 5e-3 - before - 1e-9
    finish = _spans(pred, "optimizer step", 0)[0].start_s
    assert finish >= max(s.end_s for s in _spans(pred, "send act s0")) - 1e-12


def test_posting_a_pipeline_message_holds_its_sender_for_the_calibrated_posting():
    # gloo writes the message from the calling thread: every isend of a pipeline holds its sender for the
    # posting the calibration timed in the engine's own pipeline (a blocking "post send ..." span, as the
    # engine records it); a calibration without it holds it for none
    cfg = _cfg("--strategy pp --schedule 1f1b --micro-batches 4 --world 2")
    without = dataclasses.replace(CAL, comm={k: v for k, v in CAL.comm.items() if not k.endswith("/send_recv/n2/post")})
    held = dataclasses.replace(CAL, comm={**without.comm, comm_key(2, "send_recv", 2, "post"): CommFit(2e-3, 0.0, 0.0)})
    base, pred = predict(cfg, without), predict(cfg, held)
    posts = [s for s in pred.timeline.spans if s.name.startswith("post send")]
    assert len(posts) == 8 and all(s.duration_s == pytest.approx(2e-3) and not s.is_async for s in posts)
    assert {s.name for s in posts} == {"post send act s0", "post send grad s1"}
    assert not any(s.name.startswith("post ") for s in base.timeline.spans)
    assert pred.step_time_s > base.step_time_s + 4e-3


def test_two_asynchronous_operations_at_once_get_through_the_calibrated_pair():
    # dp at world 4 drains its gradient buckets over one group of 4: they run two at a time at the calibrated
    # speedup (2 x alone / pair, clamped to 1..GLOO_THREADS); without the pair timing, each at full speed
    cfg = _cfg("--strategy dp --world 4")
    def with_pair(alone_s, pair_s):
        comm = {k: v for k, v in CAL.comm.items() if not k.endswith(("/alone", "/pair"))}
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            for n in (2, 4):
                comm[comm_key(4, kind, n, ALONE_MODE)] = CommFit(alone_s, 0.0, 0.5)
                comm[comm_key(4, kind, n, PAIR_MODE)] = CommFit(pair_s, 0.0, 0.5)
        return dataclasses.replace(CAL, comm=comm)
    assert _Costs(with_pair(2e-3, 4e-3), cfg).concurrency("all_reduce", 4, 65536) == pytest.approx(1.0)
    assert _Costs(with_pair(2e-3, 3e-3), cfg).concurrency("all_reduce", 4, 65536) == pytest.approx(4 / 3)
    assert _Costs(with_pair(2e-3, 1e-3), cfg).concurrency("all_reduce", 4, 65536) == GLOO_THREADS  # at most
    assert _Costs(with_pair(2e-3, 9e-3), cfg).concurrency("all_reduce", 4, 65536) == 1.0  # at least
    bare = dataclasses.replace(CAL, comm={k: v for k, v in CAL.comm.items() if not k.endswith(("/alone", "/pair"))})
    assert _Costs(bare, cfg).concurrency("all_reduce", 4, 65536) == GLOO_THREADS
    assert _Costs(CAL, cfg).concurrency("all_reduce", 1, 65536) == GLOO_THREADS  # a group of one
    serial, full = predict(cfg, with_pair(2e-3, 4e-3)), predict(cfg, bare)
    assert serial.step_time_s > full.step_time_s + 5e-3  # 14 buckets: two at once no faster than one by one


def test_a_late_receive_while_nothing_computes_takes_the_blocked_sender_time():
    # GPipe's stage 0 sends its last activation and blocks waiting for the first gradient; stage 1 posts that
    # receive later, with nothing computing: the calibrated late receive with the sender blocked (late0)
    cfg = _cfg("--strategy pp --schedule gpipe --micro-batches 4 --world 2")
    base = dataclasses.replace(CAL, comm={k: v for k, v in CAL.comm.items() if not k.endswith("/late0")})
    idle = dataclasses.replace(CAL, comm={**base.comm,
                                          comm_key(2, "send_recv", 2, late_mode(0)): CommFit(5e-3, 0.0, 0.5)})
    base, pred = predict(cfg, base), predict(cfg, idle)
    assert max(s.duration_s for s in _spans(pred, "recv act s1")) >= 5e-3 - 1e-12
    assert max(s.duration_s for s in _spans(base, "recv act s1")) < 5e-3
    assert pred.step_time_s > base.step_time_s


def test_a_message_to_a_waiting_receive_takes_the_calibrated_early_message():
    # 1F1B's stage 1 waits for its first activation from the start: it arrives the calibrated early message
    # (engine/calibrate._pipeline_messages: one way, the sender computing on) after stage 0's isend; a
    # calibration without early messages gives the group's ring shift instead
    cfg = _cfg("--strategy pp --schedule 1f1b --micro-batches 4 --world 2")
    for early in (2e-4, 4e-3):
        cal = dataclasses.replace(CAL, comm={**CAL.comm,
                                             comm_key(2, "send_recv", 2, early_mode(1)): CommFit(early, 0.0, 0.5)})
        pred = predict(cfg, cal)
        first = min(_spans(pred, "recv act s1"), key=lambda s: s.start_s)
        sent = min(s.start_s for s in _spans(pred, "send act s0"))
        assert first.start_s < sent and first.end_s == pytest.approx(sent + early)
    shift = CAL.comm[comm_key(2, "ring_shift", 2, "sync")]
    pred = predict(cfg, dataclasses.replace(CAL, comm={k: v for k, v in CAL.comm.items() if "/early" not in k}))
    first = min(_spans(pred, "recv act s1"), key=lambda s: s.start_s)
    sent = min(s.start_s for s in _spans(pred, "send act s0"))
    assert first.end_s >= sent + shift.alpha_s - 1e-12


def test_alltoall_switches_shards_twice_each_way():
    cfg = _cfg("--arch mamba2 --strategy cp --world 4 --ssm-cp alltoall")
    m, b = cfg.model, cfg.micro_batch_size
    tokens = b * m.seq_len // 4
    inputs = tokens * (m.ssm_inner + 2 * m.ssm_groups * m.ssm_state + m.ssm_heads) * 4
    outputs = tokens * m.ssm_inner * 4
    pred = predict(cfg, CAL)
    for name, nbytes in (("all_to_all scan inputs L0", inputs), ("all_to_all scan outputs L0", outputs),
                         ("all_to_all scan outputs L0 bwd", outputs), ("all_to_all scan inputs L0 bwd", inputs)):
        spans = _spans(pred, name)
        # a span's bytes are what the rank sends, as the engine records them: all but its own quarter
        assert sorted(s.rank for s in spans) == [0, 1, 2, 3] and {s.bytes for s in spans} == {nbytes * 3 // 4}, name
    assert not any("state" in s.name for s in pred.timeline.spans if s.lane == "comm")


def test_a_hybrid_mixes_both_kinds():
    # zig-zag slices beside attention: rank 0 holds slices 0 and 3, rank 1 slices 1 and 2; the state
    # goes 0 -> 1, stays on rank 1, then 1 -> 0; the attention layer passes K/V around the ring
    pred = predict(_cfg("--arch hybrid --strategy cp --world 2"), CAL)
    assert [s.rank for s in _spans(pred, "send state L0")] == [0, 1]
    assert _spans(pred, "send/recv kv L1") and not _spans(pred, "send state L1")


# -- context parallel's ring and DP's buckets as the engine runs them --------------------------------------

# A calibration from before the ring shift's posting was measured
CAL_NO_POST = dataclasses.replace(CAL, comm={k: v for k, v in CAL.comm.items() if not k.endswith("/post")})


def _ops(pred, rank, names):
    return sorted((s for s in pred.timeline.spans if s.rank == rank and s.name in names), key=lambda s: s.start_s)


def test_the_ring_posts_each_hop_and_sends_dkv_on_after_each_block():
    cfg = _cfg("--strategy cp --world 2")
    pred = predict(cfg, CAL)
    for rank in (0, 1):
        # per layer: forward 1 K/V hop, backward 1 K/V and 2 dK/dV hops, each posted (blocking) then in flight
        for layer in ("L0", "L1"):
            posts = [s for s in pred.timeline.spans if s.rank == rank and s.name.startswith("post")
                     and s.name.endswith(layer)]
            assert sorted(s.name.split()[1] for s in posts) == ["dkv", "dkv", "kv", "kv"]
            assert all(s.lane == "comm" and not s.is_async and s.group == "cp" for s in posts)
            shifts = _spans(pred, f"send/recv dkv {layer}", rank)
            assert len(shifts) == 2 and all(s.is_async for s in shifts)
            # the first dK/dV hop is still in flight while the second block computes
            second = _spans(pred, f"attn bwd {layer} ring 1", rank)[0]
            first_dkv = min(shifts, key=lambda s: s.start_s)
            assert first_dkv.start_s < second.end_s
    assert not pred.notes
    assert "calibrate again" in predict(cfg, CAL_NO_POST).notes[0]
    assert not any(s.name.startswith("post") for s in predict(cfg, CAL_NO_POST).timeline.spans)


def test_dp_buckets_leave_as_their_gradients_exist():
    # engine/dp.py's hooks: a bucket is all-reduced as soon as its last gradient is accumulated, so the
    # MLP's buckets of the last layer leave before that layer's attention backward has run
    pred = predict(_cfg("--strategy dp --world 2"), CAL)
    for rank in (0, 1):
        buckets = sorted((s for s in pred.timeline.spans if s.rank == rank and "bucket" in s.name),
                         key=lambda s: s.start_s)
        assert [s.name for s in buckets] == [f"all_reduce bucket {k}" for k in range(len(buckets))]
        last_layer = _spans(pred, "bwd L1", rank)
        issued_in_layer = [b for b in buckets if min(s.start_s for s in last_layer) < b.start_s
                           < max(s.end_s for s in last_layer)]
        assert issued_in_layer, "no bucket leaves during the last layer's backward"
    # every parameter in exactly one bucket
    m = _cfg("--strategy dp --world 2").model
    assert sum(s.bytes for s in buckets) == m.params * 4


@pytest.mark.parametrize("flags, expert_reduced", [("--strategy ep --world 2", False),
                                                    ("--strategy ep --world 4", False),
                                                    ("--strategy ep --mesh dp=2,ep=2 --world 4", True)])
def test_experts_gradients_skip_ep_as_the_engine_sums_them(flags, expert_reduced):
    # engine/dp.py: an expert's gradient already holds every ep rank's tokens, so it is summed over the data
    # axes but ep, in buckets of its own; with ep the only data axis it is summed over nothing. The dense
    # weights' buckets go over every data axis, named as the engine names the group.
    cfg = _cfg(flags)
    pred = predict(cfg, CAL)
    m, ep = cfg.model, Mesh(cfg.parallel.axes(cfg.world)).degree("ep")
    local = _params(m, ep=ep)
    expert = sum(n for unit in local for name, n in unit[next((k for k, (nm, _) in enumerate(unit)
                                                               if nm == "router"), len(unit)) + 1:])
    dense = sum(n for unit in local for _, n in unit) - expert
    buckets = [s for s in pred.timeline.spans if s.rank == 0 and "bucket" in s.name]
    # a span's bytes are what the rank sends (engine/comm.py): a ring all-reduce over n sends 2 (n - 1) / n
    dense_n = Mesh(cfg.parallel.axes(cfg.world)).batch_shards
    expected = ring_sent_bytes("all_reduce", 4 * dense, dense_n)
    if expert_reduced:
        expected += ring_sent_bytes("all_reduce", 4 * expert, dense_n // ep)
    assert sum(s.bytes for s in buckets) == expected
    assert {s.group for s in buckets if s.bytes} >= ({"dp+ep", "dp"} if expert_reduced else {"ep"})


def test_the_predicted_buckets_are_the_engines():
    # the engine's bucketing (engine/dp.py over the model's named parameters) and the prediction's (over
    # planner.live._params) must cut the same buckets: an MoE model at ep = 1, experts and dense weights in one
    # reduction group, is where they once differed
    pytest.importorskip("torch")
    from core.buckets import plan_buckets
    from engine.model import LanguageModel

    cfg = _cfg("--strategy dp --mlp moe --world 2")
    model = LanguageModel(cfg.model)
    engine = plan_buckets(((n, p.numel() * 4, "dp") for n, p in model.named_parameters()),
                          cfg.parallel.bucket_bytes)
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    pred = predict(cfg, CAL)
    predicted = sorted((s for s in pred.timeline.spans if s.rank == 0 and "bucket" in s.name),
                       key=lambda s: int(s.name.split()[-1]))
    assert [s.bytes for s in predicted] == [sum(sizes[n] for n in names) for _, names in engine]


# -- what a blocking operation does to the rank around it (engine/calibrate: resume_task, SYNC_GAPS_S) -----

def test_compute_right_after_waiting_on_communication_resumes_slower():
    costs = _Costs(CAL, _cfg("--strategy tp --world 2"))
    # calibrated with every rank computing at once; the programs count one core's seconds
    assert costs.resume_s == pytest.approx(CAL.resume_s[2] / CAL.share(2)) and costs.resume_s > 0
    r = _Rank(0, costs)
    r.compute("first", 1e-3)
    r.coll("blocking", (0, 1), "tp", "all_reduce", 1024)
    r.compute("after a blocking all-reduce", 1e-3)
    h = r.coll("async", (0, 1), "tp", "all_reduce", 1024, asyn=True)
    r.compute("beside an asynchronous one", 1e-3)
    r.wait(h)
    r.comm_op(Send("a send does not block", 1, ("k",), 1e-4))
    r.compute("after its wait and a send", 1e-3)
    r.compute_scale = 0.5  # half a unit's compute (ZB-H1's backward halves): the penalty is whole
    r.coll("blocking again", (0, 1), "tp", "all_reduce", 1024)
    r.compute("half a unit after a blocking all-reduce", 2e-3)
    seconds = {op.name: op.seconds for op in r.ops if isinstance(op, Compute)}
    assert seconds["first"] == seconds["beside an asynchronous one"] == 1e-3
    for name in ("after a blocking all-reduce", "after its wait and a send", "half a unit after a blocking all-reduce"):
        assert seconds[name] == pytest.approx(1e-3 + costs.resume_s)


def test_a_layer_that_already_pays_for_cold_caches_pays_its_resumes_only_beyond_that():
    # a wide layer's extra in a run (_Costs.extra_fwd: the caches it finds emptied) covers its segments' resumes
    # after communication, which find the same caches emptied, up to that much: max(extra, resumes), not both
    costs = _Costs(CAL, _cfg("--strategy tp --world 2"))
    r = _Rank(0, costs)
    r.cold_credit = 1.5 * costs.resume_s
    for i in range(3):
        r.coll(f"blocking {i}", (0, 1), "tp", "all_reduce", 1024)
        r.compute(f"after {i}", 1e-3)
    seconds = [op.seconds for op in r.ops if isinstance(op, Compute)]
    assert seconds == pytest.approx([1e-3, 1e-3 + 0.5 * costs.resume_s, 1e-3 + costs.resume_s])
    # the program sets it at each layer from the run's size: none for the default model
    assert costs.extra_fwd == 0.0
    wide = _Costs(CAL, _cfg("--strategy tp --world 2 --hidden 256 --ffn 1024"))
    assert wide.extra_fwd > 0 and wide.driver_fwd == pytest.approx(costs.driver_fwd + wide.extra_fwd)


def test_zb_h1_halves_cost_what_the_calibration_measured_of_the_split():
    # BI + BW cost more than the fused backward on a small model (engine/calibrate.measure_zb_split)
    def seconds(flags, prefix):
        tl = predict(_cfg(flags + " --micro-batches 4 --world 2"), CAL).timeline
        return sum(s.end_s - s.start_s for s in tl.spans if s.lane == "compute" and s.name.startswith(prefix))

    zb = CAL.compute["zb_split"]
    split = zb.fwd(1.0) + zb.bwd(1.0)
    assert split > 1.5  # the fixture's calibration: 0.90 + 0.80
    plain = seconds("--strategy pp --schedule 1f1b", "B ")
    bi, bw = seconds("--strategy pp --schedule zb-h1", "BI "), seconds("--strategy pp --schedule zb-h1", "BW ")
    # the resume penalty after each receive (on B and on BI alike) blurs the ratios by a few per cent
    assert (bi + bw) / plain == pytest.approx(split, rel=0.1)
    assert bi / bw == pytest.approx(zb.fwd(1.0) / zb.bwd(1.0), rel=0.15)


def test_zb_h1_forward_costs_what_recording_for_the_split_was_measured_at():
    def forward_s(schedule, cal):
        tl = predict(_cfg(f"--strategy pp --schedule {schedule} --micro-batches 4 --world 2"), cal).timeline
        return sum(s.duration_s for s in tl.spans if s.lane == "compute" and s.name.startswith("F ") and s.step == 0)

    ratio = CAL.compute["zb_record"].fwd(1.0)
    assert ratio > 1.05  # the fixture's calibration: 1.16
    plain = forward_s("1f1b", CAL)
    # the resume penalty after each receive is added whole, not scaled: a few per cent of blur
    assert forward_s("zb-h1", CAL) / plain == pytest.approx(ratio, rel=0.05)
    unit = dataclasses.replace(CAL, compute={**CAL.compute, "zb_record": dataclasses.replace(
        CAL.compute["zb_record"], fwd_per_unit_s=1.0)})
    assert forward_s("zb-h1", unit) == pytest.approx(plain, rel=0.02)


def test_a_blocking_operation_costs_what_it_was_measured_at_after_as_much_compute():
    costs = _Costs(CAL, _cfg("--strategy ep --world 2"))
    fits = {mode: CAL.comm[comm_key(2, "all_to_all", 2, mode)] for mode in BLOCKING_MODES}
    assert fits["sync_short"].gap_s < fits["sync"].gap_s < fits["sync_long"].gap_s
    nbytes, share = 18432, CAL.share(2)

    def after(gap_s):  # a gap of wall-clock compute with every rank computing: one core's seconds / share
        return costs.comm("all_to_all", 2, nbytes, gap_s=gap_s / share)

    for mode, fit in fits.items():
        assert after(fit.gap_s) == pytest.approx(fit.seconds(nbytes))
    # beyond the measured gaps: the nearest; between two: linear in log(gap)
    assert after(1.0) == pytest.approx(fits["sync_long"].seconds(nbytes))
    assert after(0.0) == pytest.approx(fits["sync_short"].seconds(nbytes))
    middle = math.sqrt(fits["sync"].gap_s * fits["sync_long"].gap_s)
    assert after(middle) == pytest.approx((fits["sync"].seconds(nbytes) + fits["sync_long"].seconds(nbytes)) / 2)
    # the rank's program reads each blocking operation at the compute since its last communication
    r = _Rank(0, costs)
    r.compute("long compute", 5e-3)
    r.coll("a2a", (0, 1), "ep", "all_to_all", nbytes)
    assert r.ops[-1].seconds == pytest.approx(fits["sync_long"].seconds(nbytes))
    assert r.since_comm == 0.0


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_a_pipelines_dp_buckets_are_its_stages_and_leave_in_the_last_micro_batch(schedule):
    # engine/dp.py plans the buckets over a pipeline rank's own stage and counts only the last micro-batch's
    # gradients: every stage parameter in one bucket, none all-reduced before that micro-batch's backward;
    # ZB-H1's weight half makes the gradients in forward order, so its buckets leave last-numbered first
    from core.schedules.build import stage_units

    cfg = _cfg(f"--mesh pp=2,dp=2 --schedule {schedule} --micro-batches 4 --world 4")
    pred = predict(cfg, CAL)
    params = _params(cfg.model)
    for rank in range(4):
        stage = Mesh(cfg.parallel.axes(4)).coord(rank, "pp")
        spans = sorted(pred.timeline.for_rank(rank), key=lambda s: s.start_s)
        buckets = [s for s in spans if "bucket" in s.name]
        numbers = [int(s.name.rsplit(" ", 1)[1]) for s in buckets]
        assert sorted(numbers) == list(range(len(buckets)))
        assert numbers == sorted(numbers, reverse=schedule == "zb-h1")
        assert sum(s.bytes for s in buckets) == 4 * sum(n for u in stage_units(cfg.model, 2, stage)
                                                         for _, n in params[u])
        last_backward = min(s.start_s for s in spans if s.lane == "compute" and s.micro_batch == 3
                            and s.name.split()[0] in ("B", "BW"))
        assert all(s.start_s >= last_backward for s in buckets)
        # a bucket's launch runs inside its pass (the engine times the pass as one span), not as a bubble
        assert not [s.name for s in spans if s.lane == "compute" and s.name.startswith("bwd ")]


def test_an_asynchronous_operation_takes_no_less_than_the_blocking_one():
    # a burst whose compute alone accounts for its measured time (4 ranks on 2 cores) says nothing about its
    # operations: one of them then takes the blocking operation's time, not the bisection's floor of 0
    cfg = _cfg("--mesh pp=2,dp=2 --micro-batches 4 --world 4")
    sync = CAL.comm[comm_key(4, "all_reduce", 2, "sync")]
    burst = CommFit(1e-4, 0.0, 0.5, burst=6, compute_s=2e-3)
    cal = dataclasses.replace(CAL, comm={**CAL.comm, comm_key(4, "all_reduce", 2, "async"): burst})
    assert _Costs(cal, cfg).comm("all_reduce", 2, 32768, "async") == pytest.approx(sync.seconds(32768))
    # a burst that takes longer than its compute and its operations back to back: longer than blocking
    slow = CommFit(0.2, 0.0, 0.5, burst=6, compute_s=1e-4)
    cal = dataclasses.replace(CAL, comm={**CAL.comm, comm_key(4, "all_reduce", 2, "async"): slow})
    assert _Costs(cal, cfg).comm("all_reduce", 2, 32768, "async") > 2 * sync.seconds(32768)


def test_a_bursts_compute_is_simulated_at_its_cpu_time_where_the_calibration_has_it():
    # the same measured burst: compute read as 2 ms of shared wall time, or recorded as 0.2 ms of CPU (its
    # solo time). With less of the burst's time the ranks' compute, its operations took more of it
    cfg = _cfg("--mesh pp=2,dp=2 --micro-batches 4 --world 4")
    wall_only = CommFit(20e-3, 0.0, 0.5, burst=6, compute_s=2e-3)
    with_cpu = dataclasses.replace(wall_only, compute_cpu_s=0.2e-3)
    seconds = []
    for fit in (wall_only, with_cpu):
        cal = dataclasses.replace(CAL, comm={**CAL.comm, comm_key(4, "all_reduce", 2, "async"): fit})
        seconds.append(_Costs(cal, cfg).comm("all_reduce", 2, 32768, "async"))
    assert seconds[1] > seconds[0]


def _units(**changes):
    """CAL with some of its engine units (world 1, default model) replaced."""
    return dataclasses.replace(CAL, engine_units={**CAL.engine_units, **changes})


def test_the_drivers_overhead_is_read_per_unit_at_the_calibrations_own_shape():
    u = CAL.engine_units
    default = _Costs(CAL, _cfg("--strategy dp --world 2"))
    # the first layer of a pass over the next: fwd L0 (after the embedding) against fwd L1 (after L0);
    # backward the last layer (after the head) against the others
    assert default.cold_fwd == pytest.approx(max(0.0, u["fwd L0"] - u["fwd L1"]))
    assert default.cold_bwd == pytest.approx(max(0.0, u["bwd L1"] - u["bwd L0"]))
    # a forward layer's driver is its warm time less the modules alone at the default shape
    shape = _Shape(2, 32, 64, 4, 2, 128)
    assert default.driver_fwd == pytest.approx(max(0.0, u["fwd L1"] - default._block(shape, True)))
    # the embedding and the head have their own, from their own units
    assert default.ends_fwd["embed"] == pytest.approx(
        u["fwd embed"] - default.fit("embed", {"b": 1, "t": 64, "d": 64}, True))
    # without the wide model's step, a model of another size reads the same overhead: the units were timed on
    # the default model (the code before took the modules at the run's own shape, and a wider model's driver read 0)
    default_only = dataclasses.replace(CAL, engine_units={k: v for k, v in u.items() if not k.startswith("wide ")})
    wider = "--strategy dp --world 2 --hidden 256 --ffn 512 --heads 8 --kv-heads 4"
    wide = _Costs(default_only, _cfg(wider))
    assert (wide.driver_fwd, wide.cold_fwd, wide.ends_fwd) == (default.driver_fwd, default.cold_fwd, default.ends_fwd)
    assert wide.driver_fwd > 0
    assert _Costs(default_only, _cfg("--strategy dp --world 2")).driver_fwd == default.driver_fwd


def test_a_layer_between_the_default_and_the_wide_model_takes_a_driver_between_theirs():
    # the wide model's own step (hardware.this_machine.WIDE_UNITS: width 256, ffn 1024) gives its layers' driver;
    # a run's layer takes it by where its weights lie, in log size, from the default layer's (36 Ki elements)
    # to the wide one's (0.94 Mi); cold and the ends stay the default model's
    default = _Costs(CAL, _cfg("--strategy dp --world 2"))
    wide = _Costs(CAL, _cfg("--strategy dp --world 2 --hidden 256 --ffn 1024"))
    wide_shape = _Shape(2, 32, 256, 4, 2, 1024)
    assert wide.driver_fwd == pytest.approx(CAL.engine_units["wide fwd L1"] - wide._block(wide_shape, True))
    assert wide.cold_fwd == default.cold_fwd and wide.ends_fwd == default.ends_fwd
    half = _Costs(CAL, _cfg("--strategy dp --world 2 --hidden 128 --ffn 256"))
    # a layer: q and o d x d, k and v d x d / 2 (2 of 4 heads), the MLP 3 x d x ffn, two norms
    layer = {d: 3 * d * d + 3 * d * f + 2 * d for d, f in ((64, 128), (128, 256), (256, 1024))}
    t = math.log(layer[128] / layer[64]) / math.log(layer[256] / layer[64])
    assert half.driver_fwd == pytest.approx(default.driver_fwd + (wide.driver_fwd - default.driver_fwd) * t)
    # larger than the wide model: held at its driver; tp's shard of a layer is what the rank holds
    assert _Costs(CAL, _cfg("--strategy dp --world 2 --hidden 512 --ffn 2048 --heads 8 --kv-heads 4")
                  ).driver_fwd == pytest.approx(wide.driver_fwd)
    assert _Costs(CAL, _cfg("--strategy tp --world 2 --hidden 256 --ffn 1024")).driver_fwd < wide.driver_fwd


def test_the_wide_models_step_at_world_1_is_predicted_as_it_was_timed():
    # its layers' spans and its optimizer step are the calibration's own timings of them, at its speed
    cfg = _cfg("--strategy dp --world 1 --hidden 256 --ffn 1024")
    spans = predict(cfg, CAL).timeline.spans
    u = CAL.engine_units

    def seconds(name: str) -> float:
        return sum(s.duration_s for s in spans if s.name == name and s.step == 0)

    assert seconds("fwd L1") == pytest.approx(u["wide fwd L1"], rel=1e-6)
    assert seconds("optimizer step") == pytest.approx(u["wide optimizer step"], rel=1e-6)
    # and the default model's optimizer is unchanged by it
    default = _cfg("--strategy dp --world 1")
    without = dataclasses.replace(CAL, engine_units={k: v for k, v in u.items() if not k.startswith("wide ")})
    assert _Costs(CAL, default).adamw([4096, 65536]) == _Costs(without, default).adamw([4096, 65536])


def test_a_hand_worked_cold_layer():
    # fwd L0 2 ms after the embedding, fwd L1 1.5 ms after L0: the first layer of every pass costs 0.5 ms more
    costs = _Costs(_units(**{"fwd L0": 2e-3, "fwd L1": 1.5e-3}), _cfg("--strategy dp --world 2"))
    assert costs.cold_fwd == pytest.approx(0.5e-3)
    assert costs.driver_fwd == pytest.approx(1.5e-3 - costs._block(_Shape(2, 32, 64, 4, 2, 128), True))


def test_a_calibration_without_per_layer_units_takes_a_layers_mean():
    # an older file: the layers' mean, half of it around the embedding and the head, no cold layer
    units = {k.replace(" L", " block "): v for k, v in CAL.engine_units.items()}
    costs = _Costs(dataclasses.replace(CAL, engine_units={**units, "fwd Lx": CAL.engine_units["fwd L0"]}),
                   _cfg("--strategy dp --world 2"))
    shape = _Shape(2, 32, 64, 4, 2, 128)
    assert costs.cold_fwd == 0.0
    assert costs.driver_fwd == pytest.approx(max(0.0, CAL.engine_units["fwd L0"] - costs._block(shape, True)))
    assert costs.ends_fwd == {"embed": costs.driver_fwd / 2, "head": costs.driver_fwd / 2}


def test_the_first_layer_of_each_pass_runs_cold():
    cal = _units(**{"fwd L0": 2e-3, "fwd L1": 1.5e-3})

    def fwd_s(flags):
        spans = predict(_cfg(flags), cal).timeline.spans
        return {s.name: s.duration_s for s in spans if s.rank == 0 and s.step == 0 and s.lane == "compute"
                and s.name.startswith(("fwd L", "F s"))}

    # data parallel at world 2: L0 follows the embedding (cold), L1 follows L0 (warm); one rank per core
    dp = fwd_s("--strategy dp --world 2 --layers 3")
    assert dp["fwd L0"] == pytest.approx(dp["fwd L1"] + 0.5e-3, rel=1e-6)
    assert dp["fwd L2"] == pytest.approx(dp["fwd L1"], rel=1e-6)
    # a pipeline stage's forward begins with a cold layer each micro-batch, as the engine's first layer after
    # the embedding does: with one layer per stage, stage 1's every F holds one
    with_cold = predict(_cfg("--strategy pp --schedule gpipe --micro-batches 2 --world 2"), cal).timeline
    without = predict(_cfg("--strategy pp --schedule gpipe --micro-batches 2 --world 2"),
                      _units(**{"fwd L0": 1.5e-3, "fwd L1": 1.5e-3})).timeline

    def per_micro_batch(tl):
        out: dict[int, float] = {}
        for s in tl.spans:
            if s.rank == 1 and s.name == "F s1" and s.step == 0:
                out[s.micro_batch] = out.get(s.micro_batch, 0.0) + s.duration_s
        return out

    f1, f0 = per_micro_batch(with_cold), per_micro_batch(without)
    assert sorted(f1) == sorted(f0) == [0, 1]
    assert all(f1[mb] - f0[mb] == pytest.approx(0.5e-3, rel=1e-3) for mb in f1)


def test_a_blocking_operation_right_after_another_costs_what_back_to_back_ones_did():
    """A naive data-parallel sync all-reduces one parameter after another: gloo's threads stay awake, and
    each costs what the calibration timed back to back (BACK_TO_BACK_MODE), not what it costs after 50 us of
    compute (3-4x more here); between no compute and the shortest measured gap, linear."""
    short = CAL.comm[comm_key(2, "all_reduce", 2, "sync_short")]
    b2b = dataclasses.replace(short, alpha_s=short.alpha_s / 4, gap_s=0.0)
    cal = dataclasses.replace(CAL, comm={**CAL.comm, comm_key(2, "all_reduce", 2, BACK_TO_BACK_MODE): b2b})
    costs, nbytes = _Costs(cal, _cfg("--strategy dp --dp-comm naive --world 2")), 4096
    assert costs.comm("all_reduce", 2, nbytes, gap_s=0.0, after_collective=True) == pytest.approx(b2b.seconds(nbytes))
    half = short.gap_s / 2 / cal.share(2)  # half the shortest gap, in one core's seconds
    assert costs.comm("all_reduce", 2, nbytes, gap_s=half, after_collective=True) == pytest.approx(
        (b2b.seconds(nbytes) + short.seconds(nbytes)) / 2)
    # after a wait or a message (not what the calibration timed back to back), and from a calibration without
    # it (older files): the shortest gap, as before
    assert costs.comm("all_reduce", 2, nbytes, gap_s=0.0) == pytest.approx(short.seconds(nbytes))
    assert _Costs(CAL, _cfg("--strategy dp --world 2")).comm("all_reduce", 2, nbytes, gap_s=0.0,
                                                             after_collective=True) == \
        pytest.approx(short.seconds(nbytes))
    r = _Rank(0, costs)
    r.coll("first", (0, 1), "dp", "all_reduce", nbytes)
    r.coll("second", (0, 1), "dp", "all_reduce", nbytes)
    assert r.ops[-1].seconds == pytest.approx(b2b.seconds(nbytes))
    r.wait(r.coll("async", (0, 1), "dp", "all_reduce", nbytes, asyn=True))
    r.coll("after a wait", (0, 1), "dp", "all_reduce", nbytes)
    assert r.ops[-1].seconds == pytest.approx(short.seconds(nbytes))
    naive = predict(_cfg("--strategy dp --dp-comm naive --world 2"), cal).step_time_s
    assert naive < predict(_cfg("--strategy dp --dp-comm naive --world 2"), CAL).step_time_s


def _comm(flags: str, rank: int = 0) -> list[Span]:
    return [s for s in predict(_cfg(flags), CAL).timeline.spans if s.lane == "comm" and s.rank == rank]


def test_an_moe_layer_under_tensor_parallel_is_no_tp_region():
    # engine/tp.py: the MoE stays whole on every tp rank, its norm enters no region; without sequence parallel it
    # moves nothing over tp, with it each weight's gradient is summed over tp (SequenceShardLinear) and the
    # experts run on the rank's S/tp positions. The prediction had entered and left a region around it
    cfg = _cfg("--strategy tp --mlp moe --world 2")
    plain = _comm("--strategy tp --mlp moe --world 2")
    assert not [s for s in plain if "mlp" in s.name]
    assert len([s for s in plain if " attn" in s.name]) == 2 * cfg.model.layers  # attention's all-reduce each way
    sp = _comm("--strategy tp --mlp moe --sequence-parallel --world 2")
    assert not [s for s in sp if s.name.endswith(("mlp", "mlp grad"))]
    m = cfg.model
    expert_grads = [s for s in sp if " expert " in s.name]
    assert len(expert_grads) == 3 * m.experts * m.layers
    assert {s.bytes for s in expert_grads} == {ring_sent_bytes("all_reduce", m.hidden * m.ffn * 4, 2)}
    assert len([s for s in sp if "router grad" in s.name]) == m.layers


def test_context_parallel_under_tensor_parallel_rings_this_ranks_kv_heads():
    # each tp rank passes its kv_heads / tp heads' K and V (engine/cp.py): the ring had carried all of them
    cfg = _cfg("--mesh cp=2,tp=2 --world 4")
    m = cfg.model
    kv = [s for s in _comm("--mesh cp=2,tp=2 --world 4") if s.name.startswith("send/recv kv")]
    per_rank = 2 * cfg.micro_batch_size * (m.kv_heads // 2) * (m.seq_len // 2) * (m.hidden // m.heads) * 4
    assert kv and {s.bytes for s in kv} == {per_rank}


def test_zero_collectives_go_by_the_shard_axis_name():
    # engine/flat.py records them on its shard axis: fsdp where the mesh has one (the prediction had said dp)
    spans = _comm("--mesh fsdp=2,tp=2 --world 4")
    sharded = [s for s in spans if "all_gather" in s.name or "reduce_scatter" in s.name]
    assert sharded and {s.group for s in sharded if s.group != "tp"} == {"fsdp"}


def test_zero_with_expert_parallel_keeps_the_experts_in_a_flat_buffer_of_their_own():
    # engine/flat.py: one flat buffer per gradient group, so an MoE unit has the dense weights' and the experts'
    # (which skip ep); only the dense shard is summed over ep, the experts' over nothing here
    spans = _comm("--mesh fsdp=2,ep=2 --mlp moe --world 4")
    cfg = _cfg("--mesh fsdp=2,ep=2 --mlp moe --world 4")
    gathers = [s for s in spans if s.name.startswith("all_gather L")]
    assert len(gathers) == 2 * 2 * cfg.model.layers  # forward and backward, two buffers per layer
    replicas = [s for s in spans if s.name == "all_reduce grad shards"]
    units = cfg.model.layers + 2
    assert len(replicas) == units and all(s.group == "ep" for s in replicas)


def test_a_capacity_factor_keeps_the_share_of_token_copies_it_allows():
    from core.moe import expert_capacity, kept_share

    full = [s for s in _comm("--strategy ep --mlp moe --world 2") if "dispatch" in s.name]
    half = [s for s in _comm("--strategy ep --mlp moe --capacity-factor 0.5 --world 2") if "dispatch" in s.name]
    m = _cfg("--strategy ep --mlp moe --capacity-factor 0.5 --world 2").model
    share = kept_share(0.5, m.seq_len, m.top_k, m.experts)
    assert share == m.experts * expert_capacity(0.5, m.seq_len, m.top_k, m.experts) / (m.seq_len * m.top_k)
    assert share < 1 and [h.bytes for h in half] == [round(f.bytes * share) for f in full]
    assert kept_share(None, 64, 2, 8) == 1.0 and kept_share(4.0, 64, 2, 8) == 1.0


def test_finishing_dp_gradients_divides_once_per_bucket_with_no_copy_into_it():
    # engine/dp.py: the gradients are views of the bucket's flat buffer (no cat), one division per bucket
    pred = predict(_cfg("--strategy dp --world 2"), CAL)
    naive = predict(_cfg("--strategy dp --world 2 --dp-comm naive"), CAL)

    def finish(p):
        return sum(s.end_s - s.start_s for s in p.timeline.spans if s.name == "finish grads" and s.rank == 0)

    assert finish(pred) < finish(naive)  # a few buckets against every parameter


def test_a_group_size_the_calibration_never_timed_is_not_priced_as_another():
    # a world-w calibration had timed groups of 2 and w only, and a world-8 run's groups of 4 were priced as
    # groups of 8, silently; engine.predict now measures every size a run uses, and a size still missing is said
    only_whole = dataclasses.replace(CAL, comm={k: v for k, v in CAL.comm.items() if not k.startswith("w4/")
                                                or "/n4/" in k}, group_sizes={4: [4]})
    assert only_whole.measured_sizes(4) == [4]
    with pytest.raises(CalibrationError, match="no timing of groups of 2 at world 4"):
        predict(_cfg("--mesh dp=2,tp=2 --world 4"), only_whole)
    assert predict(_cfg("--strategy dp --world 4"), only_whole).step_time_s > 0  # its one group of 4 was timed


def test_an_expert_shard_is_summed_over_its_own_replica_axes():
    # engine/flat.py sums each flat buffer's shard over its gradient axes but the shard axis
    # (core.mesh.shard_replica_axes): at cp=2 x ep=2 under ZeRO-1 the dense buffer over cp+ep, the experts' over cp
    # (the prediction had left the experts' out)
    spans = _comm("--mesh cp=2,ep=2 --mlp moe --zero-stage 1 --world 4")
    groups = [s.group for s in spans if s.name == "all_reduce grad shards"]
    units = _cfg("--mesh cp=2,ep=2 --mlp moe --zero-stage 1 --world 4").model.layers + 2
    assert groups.count("cp+ep") == units and groups.count("cp") == _cfg("--mlp moe").model.layers


def test_the_optimizer_step_runs_each_element_at_the_pace_of_the_steps_whole_state():
    # AdamW 20 us a tensor + 1 ns an element while its state stays in the caches, 2x per element over 4 Mi
    # elements; the driver 10 us a tensor. 64 tensors of 64 Ki elements (4 Mi, 64 MiB of state): 64 x (20 + 10)
    # us + 4 Mi x 2 ns; one of them alone stays in the caches
    # (a calibration without the wide model's step: its pace in a run is test_the_wide_models_step_at_world_1_...)
    cal = dataclasses.replace(CAL, compute={**CAL.compute, "adamw": Fit(20e-6, 1e-9),
                                            "optimizer_driver": Fit(10e-6, 0.0)},
                              adamw_state={65536: 1.0, 4194304: 2.0},
                              engine_units={k: v for k, v in CAL.engine_units.items() if not k.startswith("wide ")})
    costs = _Costs(cal, _cfg("--strategy dp --world 2"))
    assert costs.adamw([65536] * 64) == pytest.approx(64 * 30e-6 + 4194304 * 2e-9)
    assert costs.adamw([65536]) == pytest.approx(30e-6 + 65536e-9)
    # a calibration from before it was measured: every element at the one tensor's pace
    assert _Costs(dataclasses.replace(cal, adamw_state={}), _cfg("--strategy dp --world 2")).adamw(
        [65536] * 64) == pytest.approx(64 * 30e-6 + 4194304e-9)


def test_the_first_ring_step_is_the_masked_diagonal_block():
    # engine/cp.py: step 0 is the rank's own keys under the causal mask (its own fit, "ring_diag"), the others
    # unmasked and merged ("ring_block"): a diagonal fit 1 ms dearer lengthens step 0's forward span by that
    # (backward, by at least that: the K/V shifts' gloo threads share the cores with it for longer)
    cfg = _cfg("--strategy cp --world 2")
    base = predict(cfg, CAL)
    diag = CAL.compute["ring_diag"]
    dearer = dataclasses.replace(CAL, compute={**CAL.compute, "ring_diag": dataclasses.replace(
        diag, fwd_fixed_s=diag.fwd_fixed_s + 1e-3, bwd_fixed_s=diag.bwd_fixed_s + 1e-3)})
    pred = predict(cfg, dearer)

    def length(p, name):
        span = _spans(p, name, 0)[0]
        return span.end_s - span.start_s

    assert length(pred, "attn L0 ring 0") == pytest.approx(length(base, "attn L0 ring 0") + 1e-3, abs=1e-9)
    assert length(pred, "attn L0 ring 1") == pytest.approx(length(base, "attn L0 ring 1"), abs=1e-9)
    assert length(pred, "attn bwd L0 ring 0") >= length(base, "attn bwd L0 ring 0") + 1e-3 - 1e-9
    costs, shape = _Costs(dearer, cfg), {"b": 2, "heads": 4, "rows": 16, "cols": 16, "head_dim": 16}
    for op, diagonal in (("ring_diag", True), ("ring_block", False)):
        f = dearer.compute[op]
        assert costs.ring_block(2, 4, 16, 16, True, diagonal=diagonal) == pytest.approx(
            f.fwd(work(op, shape), 2 * 4 * 16 * 16) + RING_STEP_OPS * costs.tiny)


def test_an_expert_parallel_moe_is_priced_as_the_engines_dispatch_over_every_routed_row():
    # engine/ep.py's layer, timed as such ("moe_ep"), at the rank's E / ep local experts and the FLOPs of every
    # token's top_k rows (balanced, the rank's experts take as many as it sends): 8 experts over ep 2 at width
    # 128 and 4 x 32 tokens; without ep the module's own fit over all 8
    cfg = _cfg("--strategy ep --world 2 --experts 8 --hidden 128 --ffn 256 --micro-batch-size 4")
    costs, f = _Costs(CAL, cfg), CAL.compute["moe_ep"]
    flops = 2.0 * 128 * 128 * 8 + 6.0 * 128 * 2 * 128 * 256
    assert costs.moe(4, 32, 2, True) == pytest.approx(f.fwd_fixed_s + 4 * f.fwd_per_item_s + flops * f.fwd_per_unit_s)
    assert costs.moe(4, 32, 2, False) == pytest.approx(f.bwd_fixed_s + 4 * f.bwd_per_item_s + flops * f.bwd_per_unit_s)
    alone = CAL.compute["moe"]
    assert costs.moe(4, 32, 1, True) == pytest.approx(alone.fwd(flops, 8))
    # a dearer dispatch lengthens each MoE layer's forward by that: the expert-parallel runs price it
    dearer = dataclasses.replace(CAL, compute={**CAL.compute, "moe_ep": dataclasses.replace(
        f, fwd_fixed_s=f.fwd_fixed_s + 1e-3)})
    base, pred = predict(cfg, CAL), predict(cfg, dearer)
    assert pred.breakdown_s["compute"] > base.breakdown_s["compute"] + 2e-3 - 1e-6  # 2 layers


@pytest.mark.parametrize("flags, says", [
    ("--strategy cp --world 2 --seq-len 1024", "ring-attention blocks are up to 512 x 512 scores a head"),
    ("--strategy dp --world 2 --seq-len 512", "attention runs over 512 tokens, longer than the 256"),
    ("--strategy cp --world 2 --cp-variant allgather --seq-len 512", "attention runs over 512 tokens"),
])
def test_a_run_beyond_the_calibrated_attention_says_the_prediction_extrapolates(flags, says):
    notes = predict(_cfg(flags), CAL).notes
    assert len(notes) == 1 and says in notes[0] and "extrapolates" in notes[0]


@pytest.mark.parametrize("flags", ["--strategy cp --world 2 --seq-len 512", "--strategy dp --world 2 --seq-len 256",
                                   "--strategy dp --world 2", "--arch mamba2 --strategy dp --world 2 --seq-len 512"])
def test_a_run_within_the_calibrated_attention_has_no_such_note(flags):
    # cp = 2 at 512 tokens: blocks of 256 x 256, the largest timed; a Mamba-2 model has no attention
    assert predict(_cfg(flags), CAL).notes == []

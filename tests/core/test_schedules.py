"""Pipeline schedules as data and their simulator: no processes, pure arithmetic.

Times are small multiples of 0.5 s, exact in binary floating point, so equalities below are exact up to
pytest.approx's default 1e-6 relative tolerance (no rounding can accumulate).
"""

import itertools

import pytest

import core.schedules.build as sch
from core.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    RECV,
    SEND,
    Action,
    OpTimes,
    Schedule,
    ScheduleError,
    formula_bubble_fraction,
    make_schedule,
    render_ascii,
    simulate,
)


def _valid_cases():
    for name, p, m in itertools.product(sch.SCHEDULE_NAMES, (1, 2, 4), range(1, 9)):
        for v in ((1, 2, 3) if name == "interleaved-1f1b" else (1,)):
            if name == "interleaved-1f1b" and m % p:
                continue
            yield name, p, m, v


CASES = list(_valid_cases())


def _check_dependencies(sim):
    """Re-derive every dependency from the simulated intervals, independently of the simulator."""
    sched, comm_s = sim.schedule, sim.times.comm_s
    p, last_stage = sched.num_ranks, sched.num_stages - 1
    end, start = {}, {}
    for rank, (actions, intervals) in enumerate(zip(sched.actions, sim.intervals_s, strict=True)):
        previous_end = 0.0
        for a, (s, e) in zip(actions, intervals, strict=True):
            assert s >= previous_end - 1e-12 and e >= s, f"rank {rank} overlaps or reorders at {a}"
            previous_end = e
            if a.is_compute:
                start[(a.kind, a.micro_batch, a.stage)] = s
                end[(a.kind, a.micro_batch, a.stage)] = e
    grad = BACKWARD_INPUT if sched.split_backward else BACKWARD

    def after(key, dep, remote):
        assert start[key] >= end[dep] + (comm_s if remote else 0.0) - 1e-12, f"{key} starts before {dep}"

    for (kind, mb, s) in list(start):
        if kind == FORWARD and s > 0:
            after((kind, mb, s), (FORWARD, mb, s - 1), p > 1)
        if kind in (BACKWARD, BACKWARD_INPUT):
            after((kind, mb, s), (FORWARD, mb, s), False)
            if s < last_stage:
                after((kind, mb, s), (grad, mb, s + 1), p > 1)
        if kind == BACKWARD_WEIGHT:
            after((kind, mb, s), (BACKWARD_INPUT, mb, s), False)


@pytest.mark.parametrize("times", [OpTimes(), OpTimes(1.0, 1.5, 0.5, comm_s=0.5)], ids=["equal", "comm"])
def test_every_dependency_is_respected(times):
    for name, p, m, v in CASES:
        _check_dependencies(simulate(make_schedule(name, p, m, v), times))


def test_each_stage_runs_forward_and_backward_of_each_micro_batch_once_on_its_rank():
    for name, p, m, v in CASES:
        sched = make_schedule(name, p, m, v)
        backward = (BACKWARD_INPUT, BACKWARD_WEIGHT) if name == "zb-h1" else (BACKWARD,)
        for rank in range(p):
            got = sorted((a.kind, a.micro_batch, a.chunk) for a in sched.compute_order(rank))
            want = sorted(itertools.product((FORWARD, *backward), range(m), range(v)))
            assert got == want, (name, p, m, v, rank)
            assert all(a.stage == a.chunk * p + rank for a in sched.actions[rank])


def test_sends_and_recvs_pair_up_in_the_same_order_on_both_ends():
    """Plain FIFO point-to-point matching needs each rank pair to agree on the message order."""
    for name, p, m, v in CASES:
        sched = make_schedule(name, p, m, v)
        for src, dst in itertools.permutations(range(p), 2):
            sent = [a.message for a in sched.actions[src] if a.kind == SEND and a.peer == dst]
            received = [a.message for a in sched.actions[dst] if a.kind == RECV and a.peer == src]
            assert sent == received, (name, p, m, v, src, dst)
        if p == 1:
            assert all(a.is_compute for a in sched.actions[0])


@pytest.mark.parametrize("times", [OpTimes(), OpTimes(1.0, 1.0, 2.0), OpTimes(2.0, 0.5, 0.5)],
                         ids=["tB=2tF", "tB=3tF", "tB=tF/2"])
def test_gpipe_1f1b_and_interleaved_bubble_equals_the_formula(times):
    # Narayanan et al. 2021 eq. 1: (p - 1) / m; §2.2: (p - 1) / (v m); no communication time.
    for name, p, m, v in CASES:
        if name == "zb-h1":
            continue
        sim = simulate(make_schedule(name, p, m, v), times)
        assert sim.ideal_s == pytest.approx(m * (times.forward_s + times.backward_s))
        assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m)), (name, p, m, v)
        assert sim.bubble_fraction == pytest.approx(formula_bubble_fraction(name, p, m, v, times))


def test_one_f_one_b_hand_worked_p2_m2():
    """p = 2, m = 2, t_F = 1, t_B = 2. Rank 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]; rank 0: F0 [0,1]
    F1 [1,2], waits for B0's gradient, B0 [4,6], waits, B1 [7,9]. Makespan 9, ideal m (t_F + t_B) = 6,
    bubble 3 / 6 = 0.5 = (p - 1) / m."""
    sim = simulate(make_schedule("1f1b", 2, 2))
    compute = [[iv for a, iv in zip(acts, ivs) if a.is_compute]
               for acts, ivs in zip(sim.schedule.actions, sim.intervals_s)]
    assert [str(a) for a in sim.schedule.compute_order(0)] == ["F mb0 s0", "F mb1 s0", "B mb0 s0", "B mb1 s0"]
    assert compute[0] == [(0, 1), (1, 2), (4, 6), (7, 9)]
    assert compute[1] == [(1, 2), (2, 4), (4, 5), (5, 7)]
    assert (sim.makespan_s, sim.ideal_s, sim.bubble_fraction) == (9, 6, 0.5)


def test_interleaved_hand_worked_p2_m2_v2():
    """p = 2, m = 2, v = 2: stages s0, s2 on rank 0, s1, s3 on rank 1; a chunk's F takes 0.5, B 1.
    Rank 0 warms up with all 4 chunk-forwards, rank 1 with 2 (Megatron-Core's (p - r - 1) 2 + (v - 1) p, since
    core_r0.10.0 also when m = p), then F mb0 s3 [1.5,2], B mb0 s3 [2,3], F mb1 s3 [3,3.5], B mb1 s3 [3.5,4.5];
    rank 0's s2 backwards follow each s3 one, [3,4] and [4.5,5.5], then s1 [4.5,5.5], [5.5,6.5] and s0 [5.5,6.5],
    [6.5,7.5]: makespan 7.5 = ideal 6 plus a bubble of 1.5, fraction 0.25 = (p - 1) / (v m)."""
    sim = simulate(make_schedule("interleaved-1f1b", 2, 2, 2))
    rank0 = [(str(a), iv) for a, iv in zip(sim.schedule.actions[0], sim.intervals_s[0]) if a.is_compute]
    assert rank0 == [("F mb0 s0", (0, 0.5)), ("F mb1 s0", (0.5, 1)), ("F mb0 s2", (1, 1.5)),
                     ("F mb1 s2", (1.5, 2)), ("B mb0 s2", (3, 4)), ("B mb1 s2", (4.5, 5.5)),
                     ("B mb0 s0", (5.5, 6.5)), ("B mb1 s0", (6.5, 7.5))]
    assert (sim.makespan_s, sim.ideal_s, sim.bubble_fraction) == (7.5, 6, 0.25)


def test_zb_h1_hand_worked_p2_m2():
    """Unit t_F = t_BI = t_BW. Rank 1: F0 BI0 F1 BI1 W0 W1 back to back from t = 1 (ends 7); rank 0:
    F0 F1, waits for BI0's gradient until 3, then BI0 W0, waits until 5, BI1 W1 (ends 7). Bubble 1 / 6,
    a third of 1F1B's 3 / 6."""
    sim = simulate(make_schedule("zb-h1", 2, 2))
    kinds = [[f"{a.kind}{a.micro_batch}" for a in sim.schedule.compute_order(r)] for r in range(2)]
    assert kinds == [["F0", "F1", "BI0", "BW0", "BI1", "BW1"], ["F0", "BI0", "F1", "BI1", "BW0", "BW1"]]
    assert (sim.makespan_s, sim.ideal_s) == (7, 6)
    assert sim.bubble_fraction == pytest.approx(1 / 6)


def test_zb_h1_bubble_is_below_1f1b_and_a_third_of_it_for_equal_op_times():
    for p, m in itertools.product((2, 3, 4), range(1, 9)):
        zb = simulate(make_schedule("zb-h1", p, m)).bubble_fraction
        one_f_one_b = simulate(make_schedule("1f1b", p, m)).bubble_fraction
        assert zb < one_f_one_b, (p, m)
        if m >= p:
            # Qi et al. 2023 §2.1: (p - 1)(t_F + t_B - t_W) against 1F1B's (p - 1)(t_F + t_B + t_W).
            assert zb == pytest.approx(one_f_one_b / 3), (p, m)
            assert zb == pytest.approx(formula_bubble_fraction("zb-h1", p, m)), (p, m)


def test_zb_h1_formula_holds_when_the_weight_gradient_outlasts_the_forward():
    # t_B = 3 t_F split evenly, BW = 1.5 t_F > t_F: Qi et al.'s (p - 1)(t_F + t_BI - t_BW) had said 0.094 at
    # p = 4, m = 8; rank 0 idles (p - 1) t_BI before its first BW can run: 4.5 / 32 = 0.141
    # and uneven splits of the backward, either way (a short BI beside a long BW leaves (p - 1) t_F)
    cases = [OpTimes(1.0, r / 2, r / 2) for r in (1.0, 2.0, 3.0, 4.0)] + [
        OpTimes(1.0, 0.5, 2.0), OpTimes(1.0, 0.8, 1.0), OpTimes(1.0, 2.0, 0.5), OpTimes(1.0, 0.3, 0.3)]
    for times in cases:
        for p, m in itertools.product((2, 4, 8), (8, 16)):
            zb = simulate(make_schedule("zb-h1", p, m), times).bubble_fraction
            assert zb == pytest.approx(formula_bubble_fraction("zb-h1", p, m, times=times)), (times, p, m)
    assert formula_bubble_fraction("zb-h1", 4, 8, times=OpTimes(1.0, 1.5, 1.5)) == pytest.approx(4.5 / 32)


def test_peak_in_flight_activations():
    assert simulate(make_schedule("1f1b", 4, 8)).peak_in_flight == (4, 3, 2, 1)
    assert simulate(make_schedule("gpipe", 4, 8)).peak_in_flight == (8, 8, 8, 8)
    zb = simulate(make_schedule("zb-h1", 4, 8))
    assert zb.peak_in_flight == (4, 3, 2, 1)  # activations until BI: the same as 1F1B
    assert zb.peak_weight_grads_pending == (1, 2, 3, 4)  # rank r defers r BWs (+1 between BI and BW)
    # Megatron-LM's warm-up 2 (p - 1 - r) + (v - 1) p, plus the first steady forward.
    assert simulate(make_schedule("interleaved-1f1b", 4, 8, 2)).peak_in_flight == (11, 9, 7, 5)
    assert simulate(make_schedule("1f1b", 4, 2)).peak_in_flight == (2, 2, 2, 1)
    # one chunk is not interleaved: 1F1B's order and memory (Megatron-LM runs v = 1 as 1F1B)
    assert simulate(make_schedule("interleaved-1f1b", 4, 8, 1)).peak_in_flight == (4, 3, 2, 1)


def test_communication_time_delays_the_consumer():
    """p = 2, m = 1, t_F = 1, t_B = 2, 0.5 s per transfer: F [0,1], arrives 1.5, F [1.5,2.5], B
    [2.5,4.5], arrives 5, B [5,7]."""
    sim = simulate(make_schedule("1f1b", 2, 1), OpTimes(comm_s=0.5))
    assert sim.makespan_s == 7
    tl = sim.timeline()
    comm = sorted((s.rank, s.name, s.start_s, s.end_s, s.is_async) for s in tl.spans if s.lane == "comm")
    assert comm == [(0, "recv grad s0", 4.5, 5.0, False), (0, "send act s0", 1.0, 1.5, True),
                    (1, "recv act s1", 1.0, 1.5, False), (1, "send grad s1", 4.5, 5.0, True)]


def test_timeline_lanes_add_up():
    sim = simulate(make_schedule("interleaved-1f1b", 4, 8, 2))
    tl = sim.timeline(step=3)
    assert tl.source == "predicted" and tl.meta["schedule"] == "interleaved-1f1b"
    for rank in range(4):
        compute = tl.busy_seconds(rank, "compute")
        assert compute == pytest.approx(sim.ideal_s)
        assert tl.busy_seconds(rank, "idle") == pytest.approx(sim.makespan_s - compute)
    assert not [s for s in tl.spans if s.lane == "comm"]  # comm_s = 0: nothing to draw
    assert {s.step for s in tl.spans} == {3}
    assert len(tl.to_chrome_trace()["traceEvents"]) > len(tl.spans)


def test_module_docstring_pictures_are_current():
    for name, v, wrap in (("gpipe", 1, None), ("1f1b", 1, None), ("interleaved-1f1b", 2, 29), ("zb-h1", 1, None)):
        picture = render_ascii(simulate(make_schedule(name, 4, 8, v)), wrap_cells=wrap)
        indented = "\n".join(("    " + line).rstrip() for line in picture.splitlines())
        assert indented in sch.__doc__, name


@pytest.mark.parametrize("call, fragment", [
    (lambda: make_schedule("1f1b", 0, 4), "num_ranks (p) must be an integer >= 1"),
    (lambda: make_schedule("gpipe", 2, 0), "num_micro_batches (m) must be an integer >= 1"),
    (lambda: make_schedule("interleaved-1f1b", 2, 4, 0), "virtual_stages (v) must be an integer >= 1"),
    (lambda: make_schedule("interleaved-1f1b", 2, 4, 1.5), "virtual_stages (v) must be an integer >= 1"),
    (lambda: make_schedule("interleaved-1f1b", 4, 6, 2), "use 4 or 8 micro-batches"),
    (lambda: make_schedule("interleaved-1f1b", 4, 2, 2), "multiple of num_ranks (4), got 2: use 4 micro"),
    (lambda: make_schedule("1f1b", 2, 4, 2), "set virtual_stages to 1"),
    (lambda: make_schedule("pipedream", 2, 4), "choose one of"),
    (lambda: OpTimes(forward_s=0), "forward_s must be > 0"),
    (lambda: OpTimes(comm_s=-1), "comm_s must be >= 0"),
])
def test_invalid_requests_say_what_to_change(call, fragment):
    with pytest.raises(ScheduleError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call()


def _edited(sched, rank, actions):
    ranks = list(sched.actions)
    ranks[rank] = tuple(actions)
    return Schedule(sched.name, sched.num_ranks, sched.num_micro_batches, sched.virtual_stages, tuple(ranks))


def test_simulator_rejects_a_deadlock():
    sched = make_schedule("gpipe", 2, 1)
    f, send, recv, b = sched.actions[0]
    assert (f.kind, send.kind, recv.kind, b.kind) == (FORWARD, SEND, RECV, BACKWARD)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(_edited(sched, 0, [recv, f, send, b]))  # rank 0 waits for a gradient before sending


def test_simulator_rejects_missing_or_misordered_actions():
    sched = make_schedule("gpipe", 2, 1)
    f, send, recv, b = sched.actions[0]
    with pytest.raises(ScheduleError, match="received 0 times"):
        simulate(_edited(sched, 0, [f, send, b]))
    with pytest.raises(ScheduleError, match="before it RECVs"):
        simulate(_edited(sched, 0, [f, send, b, recv]))
    with pytest.raises(ScheduleError, match="before its input"):
        simulate(_edited(sched, 0, [b, f, send, recv]))
    with pytest.raises(ScheduleError, match="runs 2 times"):
        simulate(_edited(sched, 0, [f, send, recv, b, b]))
    with pytest.raises(ScheduleError, match="whose peer is wrong"):
        simulate(_edited(sched, 0, [f, Action(SEND, 0, 0, 0, peer=0, tensor="act"), recv, b]))

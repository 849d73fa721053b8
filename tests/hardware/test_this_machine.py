"""This machine as a chip: the calibration's fits on hand-made samples, and its cache file (missing,
corrupt, from another version or machine, stale: each gives a message and is measured again)."""

import dataclasses
import json
import os

import pytest

from hardware import this_machine as tm


def _fill(cal: tm.Calibration) -> tm.Calibration:
    """Every operation engine/calibrate.comm_task times (tm.comm_modes) on each group size of each world `cal`
    measured, where it has none, and its core sharing and resuming (a sound file has them all: tm.load checks)."""
    for w in cal.worlds:
        cal.compute_share.setdefault(w, 1.5)
        cal.resume_s.setdefault(w, 1e-4)
        for schedule in tm.POSTING_SCHEDULES:  # fit_posting
            cal.comm.setdefault(tm.comm_key(w, "send_recv", 2, tm.posting_mode(schedule)), tm.CommFit(3e-4, 0.0, 0.0))
        for n in sorted(set(cal.measured_sizes(w)) | set(tm.default_group_sizes(w))):
            for kind, mode in tm.comm_modes(w, n):
                if mode not in tm.OPTIONAL_MODES:
                    cal.comm.setdefault(tm.comm_key(w, kind, n, mode), tm.CommFit(5e-4, 1e-9, 0.5))
    return cal


def _cal(key="abc", created_s=1000.0, without=(), fill=True, **kw) -> tm.Calibration:
    fits = {op: tm.Fit(1e-5, 1e-10, 2e-5, 2e-10) for op in tm.COMPUTE_FITS if op not in without}
    cal = tm.Calibration(key=key, created_s=created_s, cpus=2, torch="2.13.0",
                          compute=fits, engine_units={"step": 0.01, "wide step": 0.04},
                          compute_share={1: 1.0, 2: 1.1}, resume_s={2: 1.5e-4},
                          adamw_state={65536: 1.0, 1048576: 1.4, 4194304: 2.1},
                          comm={tm.comm_key(2, "all_reduce", 2, "sync"): tm.CommFit(4e-4, 2e-9, 0.6, gap_s=3e-4),
                                tm.comm_key(2, "send_recv", 2, tm.late_mode(1)): tm.CommFit(8e-4, 2e-9, 0.5),
                                tm.comm_key(2, "send_recv", 2, tm.late_mode(0)): tm.CommFit(9e-4, 2e-9, 0.4),
                                tm.comm_key(2, "send_recv", 2, tm.early_mode(1)): tm.CommFit(2e-4, 2e-9, 0.5),
                                tm.comm_key(2, "send_recv", 2, tm.POST_MODE): tm.CommFit(3e-4, 0.0, 0.0),
                                tm.comm_key(2, "send_recv", 2, tm.posting_mode("interleaved-1f1b")):
                                    tm.CommFit(5e-4, 0.0, 0.0),
                                tm.comm_key(2, "all_reduce", 2, tm.ALONE_MODE): tm.CommFit(1e-3, 0.0, 0.6),
                                tm.comm_key(2, "all_reduce", 2, tm.PAIR_MODE): tm.CommFit(1.6e-3, 0.0, 0.7)},
                          probe={"matmul_flops_per_s": 5e10, "memory_bytes_per_s": 1e10, "threads": 1,
                                 "bf16_matmul_flops_per_s": 2e10}, worlds=[2], **{"reference_s": 1.5e-3, **kw})
    return _fill(cal) if fill else cal


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_round_trip(cache):
    cal = _cal(created_s=1e9)
    path = tm.save(cal)
    assert path.parent == cache and os.listdir(cache) == [path.name]  # no temporary file left behind
    loaded, why = tm.load("abc", now_s=1e9 + 10)
    assert why == "" and loaded == cal


def test_missing_file(cache):
    cal, why = tm.load("abc")
    assert cal is None and why == "no calibration of this machine yet"


@pytest.mark.parametrize("content, says", [
    ("{not json", "unreadable"),
    (json.dumps({"format": 1, "key": "abc"}), "another version of ShardLab"),
    (json.dumps({"format": tm.FORMAT, "key": "abc"}), "malformed"),
    (json.dumps({**_cal().to_dict(), "compute": {"linear": {"nope": 1}}}), "malformed"),
])
def test_corrupt_file_says_why_and_is_measured_again(cache, content, says):
    tm.cache_path("abc").write_text(content)
    cal, why = tm.load("abc")
    assert cal is None and says in why and "measuring again" in why


@pytest.mark.parametrize("content, says", [
    (b"\xff\xfe not utf-8", "unreadable"),
    (b"[" * 100_000, "unreadable"),  # nested past Python's recursion limit
    (b"[1, 2]", "another version"),
    (json.dumps({**_cal().to_dict(), "comm": None}).encode(), "malformed"),
    (json.dumps({**_cal().to_dict(), "compute": [1]}).encode(), "malformed"),
    # loaded once, then a TypeError or OverflowError wherever the value was used: refused when read
    (json.dumps({**_cal().to_dict(), "cpus": 1e400}).replace("Infinity", "1e400").encode(), "malformed"),
    (json.dumps({**_cal().to_dict(), "compute": {"linear": {"fwd_fixed_s": "1", "fwd_per_unit_s": 1}}}).encode(),
     "malformed"),
    (json.dumps({**_cal().to_dict(), "probe": [1, 2]}).encode(), "malformed"),
    # a NaN passes every comparison that guards it: "ran its reference Block nanx faster", a prediction
    # without compute; refused wherever a number is read
    (json.dumps({**_cal().to_dict(), "reference_s": float("nan")}).encode(), "malformed"),
    (json.dumps({**_cal().to_dict(), "created_s": float("inf")}).encode(), "malformed"),
    (json.dumps({**_cal().to_dict(), "compute_share": {"2": float("nan")}}).encode(), "malformed"),
    (json.dumps({**_cal().to_dict(), "engine_units": {"step": float("nan")}}).encode(), "malformed"),
    (json.dumps({**_cal().to_dict(), "probe": {**_cal().probe, "matmul_flops_per_s": float("nan")}}).encode(),
     "malformed"),
])
def test_a_file_of_any_other_shape_is_measured_again_not_a_traceback(cache, content, says):
    tm.cache_path("abc").write_bytes(content)
    cal, why = tm.load("abc")
    assert cal is None and says in why and "measuring again" in why


def test_other_machine_and_stale(cache):
    tm.save(_cal(key="abc", created_s=1000.0))
    os.replace(tm.cache_path("abc"), tm.cache_path("xyz"))
    assert "another machine" in tm.load("xyz", now_s=1001.0)[1]
    tm.save(_cal(key="abc", created_s=1000.0))
    cal, why = tm.load("abc", now_s=1000.0 + tm.STALE_AFTER_S + 86400)
    assert cal is None and "31 days old" in why


def test_a_calibration_without_the_mamba_fit_is_measured_again_once(cache):
    # a file from before the Mamba-2 mixer was timed: every fit but that one
    tm.save(_cal(created_s=1000.0, without=("mamba",)))
    cal, why = tm.load("abc", now_s=1001.0)
    assert cal is None and "no timing of mamba" in why and "measuring again" in why
    tm.save(_cal(created_s=1000.0))  # what the measurement then writes: sound from now on
    cal, why = tm.load("abc", now_s=1001.0)
    assert why == "" and "mamba" in cal.compute
    # and one from before receives posted after their send were timed
    old = _cal(created_s=1000.0)
    del old.comm[tm.comm_key(2, "send_recv", 2, tm.late_mode(1))]
    tm.save(old)
    cal, why = tm.load("abc", now_s=1001.0)
    assert cal is None and "a receive posted after its send" in why and "measuring again" in why
    # or before a late receive with its sender blocked was
    old = _cal(created_s=1000.0)
    del old.comm[tm.comm_key(2, "send_recv", 2, tm.late_mode(0))]
    tm.save(old)
    cal, why = tm.load("abc", now_s=1001.0)
    assert cal is None and "with the sender blocked" in why and "measuring again" in why
    assert _cal().idle_late_fit(2, 2).alpha_s == 9e-4 and old.idle_late_fit(2, 2) is None
    # or before messages sent to a waiting receive were
    old = _cal(created_s=1000.0)
    del old.comm[tm.comm_key(2, "send_recv", 2, tm.early_mode(1))]
    tm.save(old)
    cal, why = tm.load("abc", now_s=1001.0)
    assert cal is None and "a message sent to a waiting receive" in why and "measuring again" in why
    # or before the posting of a pipeline message's isend was
    old = _cal(created_s=1000.0)
    del old.comm[tm.comm_key(2, "send_recv", 2, tm.POST_MODE)]
    tm.save(old)
    cal, why = tm.load("abc", now_s=1001.0)
    assert cal is None and "the posting of a pipeline message" in why and "measuring again" in why
    assert _cal().send_post_fit(2).alpha_s == 3e-4 and old.send_post_fit(2) is None
    # each pipeline the calibration times posts as timed there; the others as the first (1F1B, one stage a rank)
    assert [_cal().send_post_fit(2, s).alpha_s for s in ("1f1b", "interleaved-1f1b", "gpipe", "zb-h1")] == \
        [3e-4, 5e-4, 3e-4, 3e-4]
    old = _cal(created_s=1000.0)
    del old.comm[tm.comm_key(2, "send_recv", 2, tm.posting_mode("interleaved-1f1b"))]
    tm.save(old)
    cal, why = tm.load("abc", now_s=1001.0)
    assert cal is None and "the posting of a pipeline message" in why and "measuring again" in why
    # or before two asynchronous operations at once were
    old = _cal(created_s=1000.0)
    del old.comm[tm.comm_key(2, "all_reduce", 2, tm.PAIR_MODE)]
    tm.save(old)
    cal, why = tm.load("abc", now_s=1001.0)
    assert cal is None and "two asynchronous operations at once" in why and "measuring again" in why
    assert old.pair_speedup(2, "all_reduce", 2, 1024) is None
    # or with one pair at a time only, at a world where two pairs can exchange at once
    four = _cal(created_s=1000.0)
    four.worlds = [2, 4]
    four.comm[tm.comm_key(4, "send_recv", 2, tm.POST_MODE)] = tm.CommFit(8e-4, 0.0, 0.0)
    for mode in (tm.late_mode, tm.early_mode):
        four.comm[tm.comm_key(4, "send_recv", 2, mode(1))] = tm.CommFit(8e-4, 2e-9, 0.5)
    four.comm[tm.comm_key(4, "send_recv", 2, tm.late_mode(0))] = tm.CommFit(9e-4, 2e-9, 0.4)
    for mode in (tm.ALONE_MODE, tm.PAIR_MODE):
        four.comm[tm.comm_key(4, "all_reduce", 4, mode)] = tm.CommFit(3e-3, 0.0, 0.4)
    _fill(four)  # every other operation at world 4
    for mode in (tm.late_mode, tm.early_mode):
        del four.comm[tm.comm_key(4, "send_recv", 2, mode(2))]
    tm.save(four)
    assert tm.load("abc", now_s=1001.0)[0] is None
    four.comm[tm.comm_key(4, "send_recv", 2, tm.late_mode(2))] = tm.CommFit(5e-3, 2e-9, 0.5)
    tm.save(four)
    assert tm.load("abc", now_s=1001.0)[0] is None
    four.comm[tm.comm_key(4, "send_recv", 2, tm.early_mode(2))] = tm.CommFit(3e-3, 2e-9, 0.5)
    tm.save(four)
    assert tm.load("abc", now_s=1001.0)[0] == four
    assert [f.alpha_s for f in four.early_fits(4, 2)] == [8e-4, 3e-3]


def test_a_calibration_without_its_speed_reference_is_measured_again(cache):
    tm.save(_cal(reference_s=0.0))
    cal, why = tm.load("abc", now_s=1001.0)
    assert cal is None and "reference Block" in why and "measuring again" in why


def test_at_speed_scales_the_compute_by_the_reference_block_timed_now():
    cal = _cal(reference_s=2e-3)
    cal.compute["zb_split"] = tm.Fit(0.0, 0.6, 0.0, 0.5)  # a ratio of two timings, not seconds
    cal.compute["zb_record"] = tm.Fit(0.0, 1.15, 0.0, 0.0)  # as is ZB-H1's recording forward
    slow, factor = cal.at_speed(3e-3)
    assert factor == pytest.approx(1.5)
    assert slow.compute["linear"].fwd(1e6) == pytest.approx(1.5 * cal.compute["linear"].fwd(1e6))
    assert slow.compute["linear"].bwd(1e6, 2) == pytest.approx(1.5 * cal.compute["linear"].bwd(1e6, 2))
    assert slow.engine_units["step"] == pytest.approx(0.015)
    assert all(slow.compute[op] == cal.compute[op] for op in tm.RATIO_FITS)
    assert slow.comm == cal.comm and slow.compute_share == cal.compute_share  # measured as they are
    assert slow.resume_s == cal.resume_s
    # the live bench's alternative: a gloo operation's CPU share at the new speed, the rest as measured
    ar = tm.comm_key(2, "all_reduce", 2, "sync")  # 60 % CPU busy: 0.6 x 1.5 + 0.4 = 1.3x
    assert cal.comm[ar].at_speed(1.5).alpha_s == pytest.approx(1.3 * cal.comm[ar].alpha_s)
    assert cal.comm[ar].at_speed(1.5).seconds(1e6) == pytest.approx(1.3 * cal.comm[ar].seconds(1e6))
    post = tm.comm_key(2, "send_recv", 2, tm.POST_MODE)  # no CPU time recorded: as measured
    assert cal.comm[post].at_speed(1.5) == cal.comm[post]
    burst = tm.CommFit(1e-3, 1e-9, 1.4, burst=6, compute_s=2e-4, compute_cpu_s=1.5e-4).at_speed(0.5)
    assert burst.alpha_s == pytest.approx(0.5e-3) and burst.compute_s == pytest.approx(1e-4)  # busy over 1: all
    assert burst.compute_cpu_s == pytest.approx(0.75e-4)
    assert cal.compute["linear"] == _cal().compute["linear"]  # the calibration itself is left alone
    assert "1.50x slower" in tm.speed_words(factor) and "2.00x faster" in tm.speed_words(0.5)
    # far from the calibration's speed, the prediction says it is rough (BUSY_SPEED_FACTOR)
    assert tm.busy_words(1.5) is None and tm.busy_words(0.5) is None
    assert "was busy" in tm.busy_words(tm.BUSY_SPEED_FACTOR) and "made on a busy machine" in tm.busy_words(0.3)
    # no reference (an older file) or no timing now: as calibrated
    assert _cal(reference_s=0.0).at_speed(3e-3)[1] == 1.0 and cal.at_speed(0.0) == (cal, 1.0)


def test_mamba_work_is_the_engines_flop_count():
    # the count is engine/config.mamba_forward_flops, at the whole model's shape or one rank's
    from engine.config import ModelConfig, mamba_forward_flops

    m = ModelConfig(arch="mamba2", seq_len=64, ssm_chunk=16)
    shape = {"b": 3, "t": m.seq_len, "d": m.hidden, "inner": m.ssm_inner, "heads": m.ssm_heads,
             "head_dim": m.ssm_head_dim, "groups": m.ssm_groups, "state": m.ssm_state, "conv": m.conv_width,
             "chunk": m.ssm_chunk}
    assert tm.work("mamba", shape) == mamba_forward_flops(m, 3)
    # tp = 2 splits heads, groups and the inner width; cp = 2 halves the tokens: exactly a quarter each way
    local = {**shape, "t": 32, "inner": m.ssm_inner // 2, "heads": m.ssm_heads // 2, "groups": m.ssm_groups // 2}
    assert tm.work("mamba", local) == pytest.approx(mamba_forward_flops(m, 3) / 4)
    assert tm.scan_steps(shape) == 4 and tm.scan_steps({**shape, "t": 8}) == 1


def _mamba_rows(seconds):
    rows = []
    for t, inner, groups in [(32, 128, 4), (16, 64, 2), (8, 128, 4), (64, 128, 4), (32, 256, 4)]:
        shape = {"b": 2, "t": t, "d": inner // 2, "inner": inner, "heads": inner // 16, "head_dim": 16,
                 "groups": groups, "state": 16, "conv": 4, "chunk": 8}
        rows.append({"op": "mamba", "shape": shape, **seconds(tm.work("mamba", shape), tm.scan_steps(shape))})
    return rows


def test_mamba_fit_separates_per_scan_step_and_per_flop_costs():
    rows = _mamba_rows(lambda w, k: {"fwd_s": 900e-6 + 25e-6 * k + w * 8e-11, "bwd_s": 1.4e-3 + 140e-6 * k + w * 4e-11})
    f = tm.fit_compute(rows)[0]["mamba"]
    assert f.fwd_fixed_s == pytest.approx(900e-6) and f.fwd_per_item_s == pytest.approx(25e-6)
    assert f.fwd_per_unit_s == pytest.approx(8e-11) and f.bwd_per_item_s == pytest.approx(140e-6)


def test_mamba_fit_is_refitted_when_noise_makes_a_term_negative():
    # one slow backward at the longest sequence: three terms would fit it with negative ones
    def seconds(w, k):
        return {"fwd_s": 1e-3 + w * 8e-11, "bwd_s": 2e-3 + w * 4e-11 + (30e-3 if k == 8 else 0.0)}

    f = tm.fit_compute(_mamba_rows(seconds))[0]["mamba"]
    assert f.bwd_per_item_s == 0.0 and f.bwd_fixed_s > 0 and f.bwd_per_unit_s >= 0
    assert f.fwd_fixed_s == pytest.approx(1e-3) and f.fwd_per_unit_s == pytest.approx(8e-11)


def test_state_passing_fit_separates_its_fixed_work_from_each_further_slice():
    # engine.calibrate.SSM_STATE_SHAPES: one slice of 16, 8 and 64 positions, two zig-zag slices of 8; each
    # slice past the first runs a conv and scan of its own (1.2 ms forward here), the correction grows with FLOPs
    rows = []
    for t, slices in ((16, 1), (16, 1), (8, 1), (16, 2), (64, 1)):
        shape = {"b": 2, "t": t, "d": 64, "inner": 128, "heads": 8, "head_dim": 16, "groups": 4, "state": 16,
                 "conv": 4, "chunk": 8, "slices": slices}
        w = tm.work("mamba_state", shape)
        assert w == 2.0 * 2 * t * 8 * 16 * 16  # C_t . h0: 2 N P per head and position
        rows.append({"op": "mamba_state", "shape": shape, "fwd_s": 4e-4 + 1.2e-3 * (slices - 1) + 2e-10 * w,
                     "bwd_s": 5e-4 + 1.6e-3 * (slices - 1)})
    f = tm.fit_compute(rows)[0]["mamba_state"]
    assert (f.fwd_fixed_s, f.fwd_per_item_s, f.fwd_per_unit_s) == pytest.approx((4e-4, 1.2e-3, 2e-10))
    assert (f.bwd_fixed_s, f.bwd_per_item_s) == pytest.approx((5e-4, 1.6e-3))
    assert f.bwd_per_unit_s == pytest.approx(0.0, abs=1e-15)


def test_posting_is_fitted_per_pipeline_schedule():
    per_rank = [[2e-4, 4e-4], [3e-4]]  # each rank's postings: their mean over every message, 0.3 ms
    assert tm.fit_posting(2, per_rank) == {"w2/send_recv/n2/post": tm.CommFit(3e-4, 0.0, 0.0)}
    assert tm.fit_posting(4, per_rank, "interleaved-1f1b") == {
        "w4/send_recv/n2/post-interleaved-1f1b": tm.CommFit(3e-4, 0.0, 0.0)}


def test_machine_key_depends_on_torch():
    assert tm.machine_key("2.13.0") == tm.machine_key("2.13.0") != tm.machine_key("2.12.0")


def test_fit_line_recovers_a_line_and_never_goes_negative():
    a, b = tm._fit_line([(0.0, 1.0), (10.0, 21.0), (20.0, 41.0)])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
    assert tm._fit_line([(1.0, 5.0), (2.0, 3.0)]) == (4.0, 0.0)  # a falling cost: only noise, its mean
    a, b = tm._fit_line([(1.0, 0.0), (2.0, 3.0)])  # a negative intercept: through the origin instead
    assert a == 0.0 and b == pytest.approx(6 / 5)


def test_fit_compute_on_synthetic_linear_samples():
    # t = 20 us + FLOPs / 10 GFLOP/s forward, twice that backward
    samples = []
    for m, k, n in [(8, 64, 64), (64, 128, 256), (256, 256, 512)]:
        flops = 2.0 * m * k * n
        samples.append({"op": "linear", "shape": {"m": m, "k": k, "n": n}, "fwd_s": 20e-6 + flops / 1e10,
                        "bwd_s": 40e-6 + 2 * flops / 1e10})
    samples.append({"op": "probe", "shape": {}, "fwd_s": 0.0, "bwd_s": 0.0,
                    "probe": {"matmul_flops_per_s": 4e10, "memory_bytes_per_s": 1e10, "threads": 1}})
    fits, units, probe = tm.fit_compute(samples)
    f = fits["linear"]
    assert f.fwd_fixed_s == pytest.approx(20e-6) and f.fwd_per_unit_s == pytest.approx(1e-10)
    assert f.bwd_fixed_s == pytest.approx(40e-6) and f.bwd_per_unit_s == pytest.approx(2e-10)
    assert probe["matmul_flops_per_s"] == 4e10 and units == {}


def test_the_ranks_pace_is_of_one_moment_and_not_kept_in_the_file():
    cal = dataclasses.replace(_cal(), rank_pace=(0.6, 1.0))
    assert "rank_pace" not in cal.to_dict()
    assert tm.Calibration.from_dict(cal.to_dict()) == dataclasses.replace(cal, rank_pace=())


def test_fit_compute_puts_anchored_samples_at_one_speed():
    # the same linear samples as above, the middle group timed during a spell that ran everything 1.8x
    # slower (its anchor, the reference Block timed around it, read 1.8x too): the fit is the steady one's
    samples = []
    for (m, k, n), anchor in zip([(8, 64, 64), (64, 128, 256), (256, 256, 512)], [2e-3, 3.6e-3, 2e-3],
                                 strict=True):
        flops = 2.0 * m * k * n
        slow = anchor / 2e-3
        samples.append({"op": "linear", "shape": {"m": m, "k": k, "n": n}, "fwd_s": slow * (20e-6 + flops / 1e10),
                        "bwd_s": slow * (40e-6 + 2 * flops / 1e10), "anchor_s": anchor})
    assert tm.anchor_reference_s(samples) == pytest.approx(2e-3)
    f = tm.fit_compute(samples)[0]["linear"]
    assert f.fwd_fixed_s == pytest.approx(20e-6) and f.fwd_per_unit_s == pytest.approx(1e-10)
    assert f.bwd_fixed_s == pytest.approx(40e-6) and f.bwd_per_unit_s == pytest.approx(2e-10)
    # unanchored samples (an older measurement) are fitted as they read; no anchor, no reference
    bare = [{k: v for k, v in smp.items() if k != "anchor_s"} for smp in samples]
    assert tm.anchor_reference_s(bare) == 0.0 and tm.at_anchor_speed(bare) == bare
    middle = 2.0 * 64 * 128 * 256
    assert tm.fit_compute(bare)[0]["linear"].fwd(middle) > 1.2 * (20e-6 + middle / 1e10)


def test_zb_split_fit_is_each_half_per_second_of_the_plain_backward():
    sample = {"op": "zb_split", "shape": {"b": 2, "t": 32, "d": 64, "plain_bwd_s": 0.8e-3},
              "fwd_s": 0.72e-3, "bwd_s": 0.56e-3}
    zb = tm.fit_compute([sample])[0]["zb_split"]
    assert zb.fwd(1.0) == pytest.approx(0.9) and zb.bwd(1.0) == pytest.approx(0.7)
    assert zb.fwd(2e-3) == pytest.approx(1.8e-3)  # work: the plain backward's seconds
    assert "zb_record" not in tm.fit_compute([sample])[0]  # timed by an older ShardLab: measured again


def test_zb_record_fit_is_the_recording_forward_per_second_of_the_plain_one():
    # ZB-H1's forward keeps every parameter module's output for the split (a hook each): 1.15 ms against 1.0
    sample = {"op": "zb_split", "shape": {"b": 2, "t": 32, "d": 64, "plain_bwd_s": 0.8e-3, "plain_fwd_s": 1.0e-3,
                                          "record_fwd_s": 1.15e-3}, "fwd_s": 0.72e-3, "bwd_s": 0.56e-3}
    fits = tm.fit_compute([sample])[0]
    assert fits["zb_record"].fwd(1.0) == pytest.approx(1.15) and fits["zb_record"].fwd(2e-3) == pytest.approx(2.3e-3)
    assert fits["zb_split"].fwd(1.0) == pytest.approx(0.9)
    assert "zb_record" in tm.COMPUTE_FITS  # a cached calibration without it is measured again (load)


def test_optimizer_driver_is_the_engines_step_less_the_adamw_kernel_per_tensor():
    # AdamW: 20 us + 1 ns per element; the engine's step over 10 tensors of 1000 elements took 0.31 ms
    samples = [{"op": "adamw", "shape": {"numel": n}, "fwd_s": 20e-6 + 1e-9 * n, "bwd_s": 0.0} for n in (64, 4096)]
    samples.append({"op": "engine_optimizer", "shape": {"tensors": 10, "numel": 10_000}, "fwd_s": 0.31e-3,
                    "bwd_s": 0.0})
    driver = tm.fit_compute(samples)[0]["optimizer_driver"]
    assert driver.fwd(0) == pytest.approx((0.31e-3 - 10 * 20e-6 - 10_000e-9) / 10)


def _state_samples(ns_per_element: dict[int, float]) -> list[dict]:
    return [{"op": "adamw_state", "shape": {"numel": n}, "fwd_s": n * ns * 1e-9, "bwd_s": 0.0}
            for n, ns in ns_per_element.items()]


def test_adamw_state_is_each_sizes_time_per_element_over_the_smallest_sizes():
    # this machine: 1.37 ns an element over 64 Ki elements, 1.90 over 1 Mi, 2.93 over 4 Mi (ADAMW_STATE_SIZES)
    state = tm.fit_adamw_state(_state_samples({65536: 1.37, 1048576: 1.90, 4194304: 2.93}))
    assert state == pytest.approx({65536: 1.0, 1048576: 1.90 / 1.37, 4194304: 2.93 / 1.37})
    assert tm.fit_adamw_state([]) == {}  # not measured: no slowdown (state_slowdown)
    assert "adamw_state" not in tm.fit_compute(_state_samples({65536: 1.37}))[0]  # not a module fit


def test_state_slowdown_interpolates_in_log_size_and_holds_beyond_the_ends():
    state = {65536: 1.0, 1048576: 1.4, 4194304: 2.2}
    assert tm.state_slowdown(state, 1000) == 1.0 and tm.state_slowdown(state, 65536) == 1.0  # in the caches
    assert tm.state_slowdown(state, 1048576) == pytest.approx(1.4)
    assert tm.state_slowdown(state, 2097152) == pytest.approx(1.8)  # half way from 1 Mi to 4 Mi in log size
    assert tm.state_slowdown(state, 262144) == pytest.approx(1.2)  # 64 Ki -> 256 Ki is half of 64 Ki -> 1 Mi
    assert tm.state_slowdown(state, 1e9) == pytest.approx(2.2)  # streamed from memory: the largest's pace
    assert tm.state_slowdown({}, 1e9) == 1.0
    assert _cal().adamw_slowdown(2097152) == pytest.approx(1.75)


def test_optimizer_driver_takes_the_kernel_at_the_default_models_state_size():
    # the engine's step over 2 Mi elements (10 tensors) took 10.4 ms; AdamW 20 us + 1 ns per element in the
    # caches, 1.8x that per element over 2 Mi: the kernel's part 10 x 20 us + 2 Mi x 1.8 ns
    samples = [{"op": "adamw", "shape": {"numel": n}, "fwd_s": 20e-6 + 1e-9 * n, "bwd_s": 0.0} for n in (64, 4096)]
    samples += _state_samples({65536: 1.0, 2097152: 1.8})
    samples.append({"op": "engine_optimizer", "shape": {"tensors": 10, "numel": 2097152}, "fwd_s": 10.4e-3,
                    "bwd_s": 0.0})
    driver = tm.fit_compute(samples)[0]["optimizer_driver"]
    assert driver.fwd(0) == pytest.approx((10.4e-3 - 10 * 20e-6 - 2097152 * 1.8e-9) / 10)


def test_a_file_without_the_optimizer_over_large_state_is_measured_again(cache):
    cal = _cal()
    cal.adamw_state = {}  # a file from before it was measured
    tm.save(cal)
    loaded, why = tm.load("abc", now_s=1001.0)
    assert loaded is None and "the optimizer over more state than the caches hold" in why and "measuring again" in why


def test_a_file_without_the_engines_step_on_a_wider_model_is_measured_again(cache):
    cal = _cal()
    del cal.engine_units["wide step"]  # a file from before the wide model's step was timed
    tm.save(cal)
    loaded, why = tm.load("abc", now_s=1001.0)
    assert loaded is None and "the engine's own step on a wider model" in why and "measuring again" in why


def test_fit_moe_separates_per_expert_and_per_flop_costs():
    rows = []
    for experts, top_k, ffn in [(2, 1, 32), (4, 2, 64), (8, 2, 32), (4, 1, 128)]:
        shape = {"b": 2, "t": 16, "d": 32, "experts": experts, "top_k": top_k, "ffn": ffn}
        w = tm.work("moe", shape)
        rows.append({"op": "moe", "shape": shape, "fwd_s": 30e-6 + 15e-6 * experts + w * 2e-10,
                     "bwd_s": 60e-6 + 25e-6 * experts + w * 4e-10})
    f = tm._fit_moe(rows)
    assert f.fwd_fixed_s == pytest.approx(30e-6) and f.fwd_per_item_s == pytest.approx(15e-6)
    assert f.fwd_per_unit_s == pytest.approx(2e-10) and f.bwd_per_item_s == pytest.approx(25e-6)


def test_three_term_fits_do_not_hang_on_the_units_of_their_columns():
    # an expert-parallel MoE's local experts (2-4) beside its FLOPs (1e6-1e8): the normal equations in raw units
    # had been judged singular and fitted a constant
    rows = []
    for b, t, d, experts, ep in [(2, 32, 64, 4, 2), (2, 32, 64, 8, 4), (2, 32, 64, 8, 2), (2, 32, 128, 4, 2),
                                 (2, 64, 128, 8, 2)]:
        shape = {"b": b, "t": t, "d": d, "ffn": 2 * d, "experts": experts, "top_k": 2, "ep": ep}
        w = tm.work("moe_ep", shape)
        rows.append({"op": "moe_ep", "shape": shape, "fwd_s": 300e-6 + 80e-6 * (experts // ep) + w * 2e-11,
                     "bwd_s": 400e-6 + 50e-6 * (experts // ep) + w * 3e-11})
    f = tm.fit_compute(rows)[0]["moe_ep"]
    assert f.fwd_fixed_s == pytest.approx(300e-6) and f.fwd_per_item_s == pytest.approx(80e-6)
    assert f.fwd_per_unit_s == pytest.approx(2e-11) and f.bwd_per_unit_s == pytest.approx(3e-11)


def test_expert_parallel_moe_work_takes_every_tokens_rows_whatever_the_ep_size():
    # balanced routing brings back to the rank's E / ep experts as many rows as it sent: the whole module's FLOPs
    shape = {"b": 2, "t": 32, "d": 64, "ffn": 128, "experts": 8, "top_k": 2}
    assert tm.work("moe_ep", dict(shape, ep=4)) == tm.work("moe_ep", dict(shape, ep=2)) == tm.work("moe", shape)
    assert tm.work("moe", shape) == 2.0 * 64 * 64 * 8 + 6.0 * 64 * 2 * 64 * 128


def test_share_is_against_the_per_core_timings_around_the_shared_one():
    def block(seconds):
        return {"fwd_s": seconds / 2, "bwd_s": seconds / 2}
    # 4 ranks at 8 ms each; one rank per core (2 cores) at 3 and 4 ms before, 5 and 4 ms after: 8 / 4 = 2.0x
    assert tm.fit_share([[block(8e-3)]] * 4, [block(3e-3), block(4e-3), block(5e-3), block(4e-3)]) == pytest.approx(2.0)
    assert tm.fit_share([[block(2e-3)]] * 4, [block(3e-3)]) == 1.0  # never faster than one rank per core


def test_no_more_ranks_than_cores_share_nothing():
    # 2 cores; world 2 as a format-4 file had it
    cal = dataclasses.replace(_cal(), compute_share={1: 1.0, 2: 1.3, 4: 2.2})
    assert cal.share(2) == 1.0 and cal.cores(2) == 2.0
    assert cal.share(4) == 2.2 and cal.cores(4) == pytest.approx(4 / 2.2)
    assert cal.share(8) == pytest.approx(4.4)  # more ranks than measured: the cores divide evenly


def test_fit_comm_takes_the_slowest_rank_and_the_cpu_share():
    def row(rank_slowdown, nbytes):
        seconds = (100e-6 + 1e-9 * nbytes) * rank_slowdown
        return {"kind": "all_gather", "n": 2, "world": 2, "bytes": nbytes, "mode": "sync", "seconds": seconds,
                "cpu_s": 0.5 * seconds}
    fits = tm.fit_comm(2, [[row(1.0, 1024), row(1.0, 131072)], [row(1.5, 1024), row(1.5, 131072)]])
    f = fits[tm.comm_key(2, "all_gather", 2, "sync")]
    assert f.alpha_s == pytest.approx(150e-6) and f.beta_s_per_byte == pytest.approx(1.5e-9)
    assert f.cpu_fraction == pytest.approx(0.5) and f.seconds(0) == pytest.approx(150e-6)


def test_an_async_bursts_cpu_share_leaves_out_its_own_compute():
    # a burst of 6 operations, each posted after 0.2 ms of compute, in 5 ms with 3 ms of process CPU: the
    # operations' threads took 3 - 6 x 0.2 = 1.8 ms of it, 0.36 of a core (the whole 0.6 had counted the
    # rank's compute a second time in planner.eventsim, beside the rank computing)
    row = {"kind": "all_gather", "n": 2, "world": 2, "bytes": 1024, "mode": "async", "seconds": 5e-3,
           "cpu_s": 3e-3, "burst": 6, "compute_s": 0.2e-3}
    fit = tm.fit_comm(2, [[row], [row]])[tm.comm_key(2, "all_gather", 2, "async")]
    assert fit.cpu_fraction == pytest.approx(0.36) and fit.burst == 6 and fit.compute_s == pytest.approx(0.2e-3)
    busier = dict(row, cpu_s=1e-3)  # less CPU than its compute (timer resolution): none, never negative
    assert tm.fit_comm(2, [[busier]])[tm.comm_key(2, "all_gather", 2, "async")].cpu_fraction == 0.0


def test_an_async_bursts_own_compute_is_its_cpu_time_not_its_wall_time():
    # 4 ranks on 2 cores: each compute of 0.2 ms of CPU read 0.4 ms of wall while every rank timed its own.
    # Taking 6 x 0.4 ms out of 3 ms of CPU in 5 ms left 0.12 of a core; the CPU it used leaves 0.36
    row = {"kind": "all_gather", "n": 4, "world": 4, "bytes": 1024, "mode": "async", "seconds": 5e-3,
           "cpu_s": 3e-3, "burst": 6, "compute_s": 0.4e-3, "compute_cpu_s": 0.2e-3}
    slower = dict(row, compute_s=0.3e-3, compute_cpu_s=0.25e-3)  # another rank: more work, less waiting
    fit = tm.fit_comm(4, [[row], [row], [row], [slower]])[tm.comm_key(4, "all_gather", 4, "async")]
    assert fit.cpu_fraction == pytest.approx((3 * 1.8 + 1.5) / 20)
    # the slowest rank's compute, each way (planner.live simulates the burst with it)
    assert fit.compute_s == pytest.approx(0.4e-3) and fit.compute_cpu_s == pytest.approx(0.25e-3)
    # a file's fit from before the CPU time was recorded reads 0 there
    assert tm.CommFit(1e-4, 0.0, 0.5, burst=6, compute_s=2e-3).compute_cpu_s == 0.0


def test_missing_world_names_what_to_measure():
    with pytest.raises(tm.CalibrationError, match="measure world 4"):
        _cal().comm_fit(4, "all_reduce", 4)
    assert _cal().share(1) == 1.0 and _cal().share(4) == pytest.approx(2.2)  # beyond measured: cores divide


def test_cores_are_what_the_world_was_measured_to_get():
    # 4 ranks each 2.5x slower than alone together got 4 / 2.5 = 1.6 of the 2 cores; up to one rank a core,
    # or a world not measured, the machine's cores
    cal = _cal()
    cal.compute_share[4] = 2.5
    assert cal.cores(4) == pytest.approx(1.6)
    assert cal.cores(2) == 2.0 and cal.cores(1) == 2.0 and cal.cores(8) == 2.0
    cal.compute_share[4] = 1.86  # faster than the cores allow: the machine drifted between the two timings
    assert cal.cores(4) == 2.0


def test_summary_lines_are_words():
    lines = tm.summary_lines(_cal())
    assert any("50.0 GFLOP/s fp32, 20.0 GFLOP/s bf16 (1 thread)" in line for line in lines)
    assert any("2 ranks" in line for line in lines)
    assert any("0.90 ms after the receive with its sender blocked, 0.80 ms with 1 sender computing" in line
               for line in lines)
    assert any("reference Block" in line and "1.50 ms" in line for line in lines)
    assert ("an AdamW step over 4 M elements (64 MiB of weights, gradients and moments) takes 2.10x as long per "
            "element as over 64 Ki, whose state stays in the caches") in lines
    assert any("posting a pipeline message (its isend) holds the sender 0.30 ms on average" in line
               for line in lines)
    wide = _cal()
    wide.engine_units.update({"wide fwd L1": 2e-3, "wide bwd L0": 3.5e-3, "wide optimizer step": 9.5e-3})
    assert ("the engine's own step on one rank took 10.0 ms on the default model and 40.0 ms at width 256 (a layer "
            "2.00 ms forward, 3.50 ms backward, the optimizer step 9.5 ms), where each layer and the optimizer find "
            "the caches emptied by what ran before them") in tm.summary_lines(wide)
    assert not any("width 256" in line for line in lines)  # not all of the wide step's spans: no line
    assert any("two asynchronous all-reduces of 128 KB posted at once get through 1.25 operations' worth in the "
               "time of one alone" in line for line in lines)
    assert _cal().probe_result().ridge_point() == pytest.approx(5.0)
    assert any("2 ranks: a gloo all-reduce costs 400 us + 2.00 ns/byte;" in line for line in lines)
    flat = _cal()
    flat.comm[tm.comm_key(2, "all_reduce", 2, "sync")] = tm.CommFit(4.5e-3, 0.0, 0.6, gap_s=3e-4)
    assert any("costs 4,500 us at every size swept (its per-byte cost was below the timing noise)" in line
               and "0.00 ns/byte" not in line for line in tm.summary_lines(flat))


def test_two_operations_at_once_get_through_twice_one_alone_over_the_pair():
    # one alone 1 ms, two posted at once 1.6 ms: 2 x 1 / 1.6 = 1.25 operations' worth in one's time
    assert _cal().pair_speedup(2, "all_reduce", 2, 4096) == pytest.approx(1.25)
    assert _cal(fill=False).pair_speedup(2, "all_gather", 2, 4096) is None  # not timed


def test_an_operation_that_never_completes_under_compute_stalls():
    def row(seconds, nbytes):
        return {"kind": "reduce_scatter", "n": 2, "world": 2, "bytes": nbytes, "mode": "contended",
                "seconds": seconds, "cpu_s": 0.5 * seconds}
    stalled = tm.fit_comm(2, [[row(tm.CONTENDED_CAP_S * 1.01, 1024), row(tm.CONTENDED_CAP_S * 1.02, 131072)]])
    assert stalled[tm.comm_key(2, "reduce_scatter", 2, "contended")].stalls
    moving = tm.fit_comm(2, [[row(1e-3, 1024), row(2e-3, 131072)]])
    assert not moving[tm.comm_key(2, "reduce_scatter", 2, "contended")].stalls


def test_resuming_after_communication_is_the_extra_over_resuming_after_compute():
    rows = [[{"after_comm_s": 5e-4, "after_compute_s": 3e-4}], [{"after_comm_s": 4e-4, "after_compute_s": 3e-4}]]
    assert tm.fit_resume(rows) == pytest.approx(1.5e-4)
    assert tm.fit_resume([[{"after_comm_s": 2e-4, "after_compute_s": 3e-4}]]) == 0.0  # never below 0


def test_the_posting_of_a_pipeline_message_is_the_mean_over_every_ranks_messages():
    fits = tm.fit_posting(4, [[1e-4, 3e-4], [2e-4], [], [6e-4]])  # pooled: (1 + 3 + 2 + 6) / 4 x 1e-4
    fit = fits[tm.comm_key(4, "send_recv", 2, tm.POST_MODE)]
    assert fit.seconds(16384) == pytest.approx(3e-4) and fit.beta_s_per_byte == 0.0
    with pytest.raises(ValueError, match="posted no message"):
        tm.fit_posting(2, [[], []])


def test_blocking_fits_keep_the_compute_gap_they_were_measured_after():
    rows = [[{"kind": "all_to_all", "n": 2, "world": 2, "bytes": b, "mode": "sync_long", "seconds": 1e-3 + b * 1e-9,
              "cpu_s": 1e-4, "gap_s": 2e-3} for b in (1024, 131072)]]
    fit = tm.fit_comm(2, rows)[tm.comm_key(2, "all_to_all", 2, "sync_long")]
    assert fit.gap_s == 2e-3 and fit.alpha_s == pytest.approx(1e-3) and fit.beta_s_per_byte == pytest.approx(1e-9)


def test_message_modes_read_back():
    assert tm.message_mode(tm.late_mode(0)) == ("late", 0)
    assert tm.message_mode(tm.early_mode(2)) == ("early", 2)
    assert tm.message_mode("sync_long") is None and tm.message_mode("late") is None


# -- a file that parses but holds what no measurement makes: measured again, never a crash later ----------

def _with(**changes) -> bytes:
    d = _cal().to_dict()
    for path, value in changes.items():
        *outer, last = path.split("__")
        node = d
        for part in outer:
            node = node[part]
        node[last] = value
    return json.dumps(d).encode()


def _comm(key: str, **fields) -> dict:
    return {**tm.asdict(_cal().comm[key]), **fields}


@pytest.mark.parametrize("content, says", [
    # share() took max() of nothing: ValueError in the prediction
    (_with(compute_share={}), "compute_share has no world 1"),
    (_with(compute_share={"1": 1.0}), "world 2 has no core sharing"),
    (_with(cpus=0), "cpus is 0"),  # ZeroDivisionError in share()
    (_with(resume_s={"2": -1}), "resume_s[2] is -1"),  # negative compute: the simulation deadlocked
    (_with(compute_share={"1": 1.0, "2": 0.0}), "compute_share[2] is 0.0"),  # cores(): world / 0
    # a silently absurd prediction (2 s a step)
    (_with(compute__linear={"fwd_fixed_s": -1, "fwd_per_unit_s": 1e-10}), "compute linear fwd_fixed_s is -1"),
    (_with(compute__mamba={"fwd_fixed_s": 0, "fwd_per_unit_s": 0, "bwd_per_item_s": -1e-3}),
     "compute mamba bwd_per_item_s is -0.001"),
    (_with(engine_units={"step": -0.01}), "engine unit 'step' is -0.01 s"),
    (_with(comm={**_cal().to_dict()["comm"], "w2/all_reduce/n2/sync": _comm("w2/all_reduce/n2/sync", alpha_s=-1e-3)}),
     "w2/all_reduce/n2/sync alpha_s is -0.001"),
    (_with(comm={**_cal().to_dict()["comm"], "w2/all_gather/n2/async": _comm("w2/all_gather/n2/async",
                                                                               beta_s_per_byte=-1e-9)}),
     "beta_s_per_byte is -1e-09"),
    (_with(comm={**_cal().to_dict()["comm"], "w2/all_reduce/n2/pair": _comm("w2/all_reduce/n2/pair",
                                                                              cpu_fraction=1.5)}),
     "cpu_fraction is 1.5"),
    (_with(comm={**_cal().to_dict()["comm"], "w2/all_reduce/n2/async": _comm("w2/all_reduce/n2/async", burst=-6)}),
     "burst is -6"),
    (_with(comm={**_cal().to_dict()["comm"], "nonsense": _comm("w2/all_reduce/n2/sync")}), "malformed"),
    (_with(reference_s=-1.5e-3), "reference_s is -0.0015"),
    (_with(adamw_state={"65536": 1.0, "1048576": 0.0}), "adamw_state[1048576] is 0.0"),  # a free optimizer step
    (_with(worlds=[1, 2]), "world 1 has no communication"),
    (_with(group_sizes={"2": [3]}), "world 2 lists groups of [3]"),
    (_with(group_sizes={"2": [2], "4": [2, 4]}), "group sizes of world 4, which was not measured"),
    (_with(probe__memory_bytes_per_s=0), "probe memory_bytes_per_s is 0"),
])
def test_a_file_of_impossible_values_is_measured_again_with_a_message(cache, content, says):
    tm.cache_path("abc").write_bytes(content)
    cal, why = tm.load("abc", now_s=1001.0)
    assert cal is None and says in why and "measuring again" in why, why
    with pytest.raises(tm.CalibrationError):
        tm.Calibration.from_dict(json.loads(content))


def test_a_sound_file_is_not_impossible():
    # what the measurement writes passes, the suite's recorded 2-core machine too (tests/conftest.py)
    from tests.conftest import _recorded

    assert tm.Calibration.from_dict(json.loads(_with())) == _cal()
    recorded = _recorded()
    assert tm._impossible(recorded) == [] and recorded.missing_comm() == []


def test_share_without_any_measured_world_divides_the_cores():
    cal = _cal(fill=False)
    cal.compute_share = {}
    assert cal.share(4) == 2.0  # the cores divided, not max() of nothing


# -- every operation the measurement times, on every group size it measured --------------------------------

def test_a_file_missing_any_operation_comm_task_times_is_measured_again(cache):
    cal = _cal()
    for key in [k for k in cal.comm if k.startswith("w2/all_gather/")]:
        del cal.comm[key]  # the reviewer's cut: the prediction refused every run needing one, nothing re-measured
    tm.save(cal)
    loaded, why = tm.load("abc", now_s=1001.0)
    assert loaded is None and "no timing of w2/all_gather/n2/sync" in why and "measuring again" in why
    for mode in ("contended", "sync_long", "async"):
        cal = _cal()
        del cal.comm[tm.comm_key(2, "reduce_scatter", 2, mode)]
        tm.save(cal)
        loaded, why = tm.load("abc", now_s=1001.0)
        assert loaded is None and f"w2/reduce_scatter/n2/{mode}" in why
    # and a size the file says it measured: its every operation
    cal = _cal()
    cal.group_sizes = {2: [2]}
    cal.worlds, cal.compute_share[6], cal.resume_s[6] = [2, 6], 1.5, 1e-4
    cal.group_sizes[6] = [2, 3, 6]
    _fill(cal)
    del cal.comm[tm.comm_key(6, "ring_shift", 3, tm.POST_MODE)]
    tm.save(cal)
    loaded, why = tm.load("abc", now_s=1001.0)
    assert loaded is None and "w6/ring_shift/n3/post" in why
    _fill(cal)  # comm_modes on groups of 3: no pair messages to time
    cal.comm[tm.comm_key(6, "ring_shift", 3, tm.POST_MODE)] = tm.CommFit(1e-4, 0.0, 0.0)
    tm.save(cal)
    assert tm.load("abc", now_s=1001.0)[0] == cal
    assert not any(k.startswith("w6/send_recv/n3/") for k in cal.comm)


def test_comm_modes_are_what_the_measurement_made():
    # the recorded 2-core calibration is comm_task's own output (worlds 2 and 4, groups of 2 and 4): its keys
    # are comm_modes' (the optional back-to-back timing and world 2's messages at a second load, which it
    # predates, aside) and a pipeline's posting in each pipeline timed (tm.fit_posting)
    from tests.conftest import _recorded

    recorded = _recorded()
    postings = {tm.comm_key(w, "send_recv", 2, tm.posting_mode(s)) for w in (2, 4) for s in tm.POSTING_SCHEDULES}
    made = {k for k in recorded.comm if k not in postings}
    expected = {tm.comm_key(w, kind, n, mode) for w in (2, 4) for n in tm.default_group_sizes(w)
                for kind, mode in tm.comm_modes(w, n) if mode not in tm.OPTIONAL_MODES
                and not tm._optional_load(w, mode)}
    assert made == expected
    assert postings <= set(recorded.comm)


# -- the group sizes measured at each world --------------------------------------------------------------

def test_the_group_sizes_of_each_world_are_kept_and_read_from_older_files(cache):
    cal = _cal()
    assert cal.measured_sizes(2) == [2] and cal.measured_sizes(4) == []  # from its keys: an older file
    cal.worlds, cal.group_sizes = [2, 6], {2: [2], 6: [2, 3, 6]}
    _fill(cal)
    tm.save(cal)
    loaded, why = tm.load("abc", now_s=1001.0)
    assert why == "" and loaded == cal and loaded.measured_sizes(6) == [2, 3, 6]
    assert json.loads(tm.cache_path("abc").read_text())["group_sizes"] == {"2": [2], "6": [2, 3, 6]}
    older = cal.to_dict()
    del older["group_sizes"]
    assert tm.Calibration.from_dict(older).measured_sizes(6) == [2, 3, 6]


# -- the cache folder's hygiene ------------------------------------------------------------------------------

def test_a_calibration_dated_in_the_future_is_stale(cache):
    tm.save(_cal(created_s=1000.0 + 86400))
    cal, why = tm.load("abc", now_s=1000.0)
    assert cal is None and "24.0 hours in the future" in why and "measuring again" in why
    assert tm.load("abc", now_s=1000.0 + 86400 - 60)[0] is not None  # a minute's skew is not the future


def test_temporary_files_a_killed_save_left_are_removed(cache):
    import time

    old = time.time() - 2 * tm.STALE_TMP_S
    killed = [cache / "tmpab_c1234.tmp", cache / "this-machine-x8y.tmp"]  # an older ShardLab's, and this one's
    writing = cache / "this-machine-live.tmp"  # another process's save, under way
    others = [cache / "tmp-notes.tmp", cache / "mine.tmp", cache / "tmpab_c1234.txt"]
    for path in [*killed, writing, *others]:
        path.write_text("{")
    for path in [*killed, *others]:
        os.utime(path, (old, old))
    tm.save(_cal(created_s=1e9))
    assert not any(p.exists() for p in killed)
    assert writing.exists() and all(p.exists() for p in others)
    # load too: a file killed mid-save is never followed by another save while its calibration stays sound
    os.utime(writing, (old, old))
    assert tm.load("abc", now_s=1e9 + 10)[1] == ""
    assert not writing.exists()
    assert sorted(os.listdir(cache)) == sorted([tm.cache_path("abc").name, *(p.name for p in others)])


def test_save_writes_through_a_temporary_file_of_its_own_name(cache, monkeypatch):
    import tempfile

    seen = []
    real = tempfile.mkstemp

    def mkstemp(**kw):
        fd, name = real(**kw)
        seen.append(os.path.basename(name))
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    tm.save(_cal(created_s=1e9))
    assert len(seen) == 1 and seen[0].startswith(tm.TMP_PREFIX) and seen[0].endswith(".tmp")


def test_the_group_sizes_a_kind_was_timed_on_by_mode():
    cal = _cal(fill=False)
    fit = tm.CommFit(5e-4, 1e-9, 0.5)
    cal.comm[tm.comm_key(4, "send_recv", 4, tm.late_mode(1))] = fit
    cal.comm[tm.comm_key(4, "send_recv", 2, tm.late_mode(1))] = fit
    cal.comm[tm.comm_key(4, "send_recv", 2, "sync")] = fit
    assert cal.kind_sizes(4, "send_recv", tm.late_mode(1)) == [2, 4]
    assert cal.kind_sizes(4, "send_recv", "sync") == [2]
    assert cal.kind_sizes(4, "send_recv", tm.early_mode(3)) == [2, 4]  # none in that mode: any mode's
    assert cal.kind_sizes(2, "all_gather", "sync") == [] and cal.kind_sizes(8, "send_recv", "sync") == []


def test_world_2_times_its_messages_at_a_second_load_and_older_files_price_them_at_the_first():
    # one pair is all a 2-rank world has: its second load is that pair beside a busy thread (message_loads); a
    # Mamba-2 cp run's messages took 2-6 ms under its bucket all-reduces, where one pair alone timed 0.3 ms
    assert list(tm.message_loads(2)) == [1, 2] and [tm.message_spinners(2, k) for k in (1, 2)] == [0, 1]
    assert list(tm.message_loads(4)) == [1, 2] and tm.message_spinners(4, 2) == 0
    assert list(tm.message_loads(8)) == [1, 2, 3, 4]
    assert ("send_recv", tm.late_mode(2)) in tm.comm_modes(2, 2)
    cal = _cal()
    for mode in (tm.late_mode(2), tm.early_mode(2)):  # as an older file has it
        del cal.comm[tm.comm_key(2, "send_recv", 2, mode)]
    assert len(cal.late_fits(2, 2)) == 1 and len(cal.early_fits(2, 2)) == 1 and not cal.missing_comm()
    loaded = tm.CommFit(5e-3, 0.0, 0.5)
    cal.comm[tm.comm_key(2, "send_recv", 2, tm.late_mode(2))] = loaded
    assert cal.late_fits(2, 2)[-1] is loaded and len(cal.late_fits(2, 2)) == 2
    del cal.comm[tm.comm_key(2, "send_recv", 2, tm.late_mode(1))]
    assert cal.late_fits(2, 2) is None  # a required load missing: none


# -- attention: the scores' own cost beside their FLOPs -------------------------------------------------------

def test_sdpa_scores_counts_the_cpu_kernels_causal_blocks():
    # up to 512 tokens one key block holds every key: all t x t computed, the mask applied inside
    assert tm.sdpa_scores(32) == 32 * 32 and tm.sdpa_scores(512) == 512 * 512
    # 1,024 tokens: query blocks of 256 need 1, 1, 2, 2 key blocks of 512 (FlashAttentionKernel.cpp)
    assert tm.sdpa_scores(1024) == 256 * (512 + 512 + 1024 + 1024) == 3 * 1024 * 1024 // 4
    # 513 tokens: blocks of 64; the last, one row, reaches past the first key block into a second (of 1 key)
    assert tm.sdpa_scores(513) == 512 * 512 + 513


def test_score_elements_of_attention_and_of_a_ring_block():
    assert tm.score_elements("attention", {"b": 2, "heads": 4, "t": 1024}) == 2 * 4 * 786432
    assert tm.score_elements("ring_block", {"b": 2, "heads": 4, "rows": 16, "cols": 32}) == 2 * 4 * 16 * 32
    assert tm.score_elements("swiglu", {"b": 2, "t": 32, "d": 64, "ffn": 128}) == 0.0
    # attention's work counts QK^T and PV over the computed scores only
    s = {"b": 1, "t": 1024, "d": 64, "heads": 4, "kv_heads": 2, "head_dim": 16}
    assert tm.work("attention", s) == pytest.approx(2.0 * 1024 * 64 * 12 * 16 + 4.0 * 16 * 4 * 786432)


def _attention_samples(a: float, e: float, c: float) -> list[dict]:
    rows = []
    for b, t, d, h, kv in ((2, 32, 64, 4, 2), (2, 16, 64, 4, 2), (2, 128, 64, 4, 2), (2, 256, 64, 4, 2),
                           (2, 128, 128, 2, 2)):
        s = {"b": b, "t": t, "d": d, "heads": h, "kv_heads": kv, "head_dim": d // h}
        y = a + e * tm.score_elements("attention", s) + c * tm.work("attention", s)
        rows.append({"op": "attention", "shape": s, "fwd_s": y, "bwd_s": 2 * y})
    return rows


def test_attention_fit_separates_fixed_per_score_and_per_flop_costs():
    fit = tm.fit_compute(_attention_samples(1.5e-4, 6e-10, 1.2e-11))[0]["attention"]
    assert (fit.fwd_fixed_s, fit.fwd_per_item_s, fit.fwd_per_unit_s) == pytest.approx((1.5e-4, 6e-10, 1.2e-11))
    assert (fit.bwd_fixed_s, fit.bwd_per_item_s, fit.bwd_per_unit_s) == pytest.approx((3e-4, 1.2e-9, 2.4e-11))


def test_relative_fit_keeps_every_term_nonnegative():
    # times that fall with the scores: a negative per-score term would only fit noise; the best two-term fit
    # with that term at zero is kept
    xs = [(1.0, 1e3, 1e6), (1.0, 1e5, 2e6), (1.0, 1e4, 4e6)]
    ys = [2e-4, 2.5e-4, 5e-4]
    coef = tm._relative_nonnegative(xs, ys)
    assert min(coef) >= 0 and coef[1] == 0.0
    assert tm._relative_nonnegative([(1.0, 0.0, 0.0)], [0.0]) == (0.0, 0.0, 0.0)  # nothing timed: no weight

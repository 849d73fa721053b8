"""The predicted Timeline of one step: every pipeline stage's compute, exposed communication and bubbles.

One representative chip per pipeline stage is drawn (global rank stage * dp * cp * tp, the tp/cp/dp
rank 0 of the stage): within a stage all chips run the same ops at the same times. The order of
forward and backward passes is the engine's own schedule (`engine.schedules`, torch-free), so a
predicted and a measured pipeline line up; the durations come from the step simulator. A pass is
split into its layers (compute, then that layer's exposed TP / CP / EP / ZeRO-3 communication) while
the span count stays under `max_spans`; beyond that each pass is one compute span and one comm span,
and if even that is over the budget, back-to-back work is merged into "busy" spans between bubbles.
"""

from __future__ import annotations

from engine.schedules import make_schedule
from engine.trace import Span, Timeline
from planner.simulate import ChunkCost, StepResult


def _pass_spans(rank: int, chunk: ChunkCost, kind: str, start: float, mb: int, recompute: str,
                detailed: bool, label: str, deferred_s: float = 0.0) -> list[Span]:
    """Spans of one forward ("F") or backward ("B") of one micro-batch through one chunk; a ZB-H1
    backward-input pass leaves out the `deferred_s` of weight-gradient work."""
    spans: list[Span] = []
    t = start

    def add(lane, name, dur, group="", flops=0.0, nbytes=0):
        nonlocal t
        if dur > 0:
            spans.append(Span(rank, lane, name, t, t + dur, bytes=int(nbytes), flops=flops, micro_batch=mb,
                              group=group))
            t += dur

    total = chunk.fwd_s if kind == "F" else chunk.bwd_s - deferred_s
    if detailed:
        idx = 0
        for lc, n in chunk.layer_costs:
            for _ in range(n):
                if kind == "F":
                    add("compute", f"fwd {label} L{idx}", lc.fwd_compute_s, flops=lc.fwd_flops)
                    add("comm", "tp collectives", lc.tp_fwd_s, "tp", nbytes=2 * lc.tp_bytes)
                    add("comm", "cp k/v ring", lc.cp_fwd_s, "cp")
                    add("comm", "ep all-to-all", lc.ep_fwd_s, "ep")
                    add("comm", "zero-3 all-gather", lc.zero3_fwd_s, "dp")
                else:
                    if recompute == "full":
                        add("compute", f"recompute {label} L{idx}", lc.recompute_s, flops=lc.fwd_flops)
                        add("comm", "tp collectives", lc.tp_fwd_s, "tp", nbytes=2 * lc.tp_bytes)
                    elif lc.recompute_s:
                        add("compute", f"recompute attn {label} L{idx}", lc.recompute_s)
                    add("compute", f"bwd {label} L{idx}", lc.bwd_compute_s, flops=2 * lc.fwd_flops)
                    add("comm", "tp collectives", lc.tp_bwd_s, "tp", nbytes=2 * lc.tp_bytes)
                    add("comm", "cp k/v ring", lc.cp_bwd_s, "cp")
                    add("comm", "ep all-to-all", lc.ep_bwd_s, "ep")
                    add("comm", "zero-3 gather/scatter", lc.zero3_bwd_s, "dp")
                idx += 1
        if kind != "F":
            add("comm", "zero-2 reduce-scatter", chunk.parts["dp_comm"], "dp")
        add("compute", f"{'fwd' if kind == 'F' else 'bwd'} {label} extra", start + total - chunk.p2p_s - t)
    else:
        comm = sum(chunk.parts[k] for k in ("tp_comm", "cp_comm", "ep_comm", "zero3_comm", "dp_comm"))
        passes_s = max(1e-30, chunk.fwd_s + chunk.bwd_s - 2 * chunk.p2p_s)
        comm_share = comm * (chunk.fwd_s - chunk.p2p_s) / passes_s
        share = comm_share if kind == "F" else comm - comm_share
        name = "fwd" if kind == "F" else "bwd-input" if deferred_s else "bwd"
        add("compute", f"{name} {label}", total - chunk.p2p_s - share)
        add("comm", "layer collectives", share, "tp")
    return spans


BUSY = "busy (passes, collectives, short waits)"


def _merge_busy(spans: list[Span], min_idle_s: float) -> list[Span]:
    """Over the span budget: fold each rank's back-to-back passes, their exposed collectives and idle gaps
    shorter than `min_idle_s` into "busy" compute spans, keeping the longer bubbles and the data-parallel
    sync, so the picture stays drawable."""
    out: list[Span] = []
    by_rank: dict[int, list[Span]] = {}
    for s in spans:
        by_rank.setdefault(s.rank, []).append(s)
    for rank, rank_spans in by_rank.items():
        run: Span | None = None
        for s in sorted(rank_spans, key=lambda s: (s.start_s, s.end_s)):
            short_gap = s.lane == "idle" and s.duration_s < min_idle_s
            if (s.lane == "idle" and not short_gap) or s.group == "dp" or s.name == "optimizer step":
                out.append(s)
                continue
            if (short_gap or s.group == "pp") and run is None:
                continue
            if run is not None and s.start_s <= run.end_s + 1e-12:
                run = Span(rank, "compute", BUSY, run.start_s, max(run.end_s, s.end_s),
                           flops=run.flops + s.flops)
                continue
            if run is not None:
                out.append(run)
            run = Span(rank, "compute", BUSY, s.start_s, s.end_s, flops=s.flops)
        if run is not None:
            out.append(run)
    return out


def predicted_timeline(res: StepResult, max_spans: int = 20000) -> Timeline:
    lay, m = res.layout, res.micro_batches
    p, v = lay.pp, lay.virtual_stages
    sched = make_schedule(lay.pp_schedule, p, m, v)
    layers_per_pass = max(sum(c.layers for c in s.chunks) for s in res.stages) / v
    detailed = 2 * p * m * v * layers_per_pass * 3 <= max_spans
    rank_of = [i * lay.dp * lay.cp * lay.tp for i in range(p)]
    clock = [0.0] * p
    done: dict[tuple[str, int, int], float] = {}
    order = [list(sched.compute_order(r)) for r in range(p)]
    cursor = [0] * p
    spans: list[Span] = []
    num_stages = p * v
    while any(cursor[r] < len(order[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while cursor[r] < len(order[r]):
                a = order[r][cursor[r]]
                chunk = res.stages[r].chunks[a.stage // p]
                if a.kind == "F":
                    deps = [("F", a.micro_batch, a.stage - 1)] if a.stage > 0 else []
                elif a.kind == "BW":
                    deps = [("B", a.micro_batch, a.stage)]
                else:  # B, or BI: the input gradient, which the previous stage waits for
                    deps = [("F", a.micro_batch, a.stage)]
                    if a.stage < num_stages - 1:
                        deps.append(("B", a.micro_batch, a.stage + 1))
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                if start > clock[r]:
                    spans.append(Span(rank_of[r], "idle", "bubble", clock[r], start))
                if a.kind == "BW":
                    end = start + chunk.wgrad_s
                    spans.append(Span(rank_of[r], "compute", f"wgrad s{a.stage}", start, end,
                                      micro_batch=a.micro_batch))
                    done[("BW", a.micro_batch, a.stage)] = end
                else:
                    kind = "F" if a.kind == "F" else "B"
                    deferred = chunk.wgrad_s if a.kind == "BI" else 0.0
                    spans.extend(_pass_spans(rank_of[r], chunk, kind, start, a.micro_batch, lay.recompute,
                                             detailed and not deferred, f"s{a.stage}", deferred))
                    end = start + (chunk.fwd_s if kind == "F" else chunk.bwd_s - deferred)
                    if chunk.p2p_s > 0:
                        spans.append(Span(rank_of[r], "comm", "send act" if kind == "F" else "send grad",
                                          end - chunk.p2p_s, end, micro_batch=a.micro_batch, group="pp"))
                    done[(kind, a.micro_batch, a.stage)] = end
                clock[r] = end
                cursor[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {sched.name} deadlocked in the planner's timeline")
    pipe_end = max(clock)
    for r, stage in enumerate(res.stages):
        t = clock[r]
        if stage.dp_total_s > 0:
            hidden = stage.dp_total_s - stage.dp_exposed_s
            spans.append(Span(rank_of[r], "comm", "dp gradient sync", t - hidden,
                              t - hidden + stage.dp_total_s,
                              group="dp", is_async=hidden > 0))
            t += stage.dp_exposed_s
        spans.append(Span(rank_of[r], "compute", "optimizer step", t, t + stage.optimizer_s))
        t += stage.optimizer_s
        if t < pipe_end:
            spans.append(Span(rank_of[r], "idle", "wait", t, pipe_end))
    coarse = len(spans) > max_spans
    if coarse:
        spans = _merge_busy(spans, min_idle_s=res.step_time_s * p / max_spans)
    tl = Timeline(spans, source="predicted", meta={
        "case": res.case.name, "chip": res.chip.key, "schedule": lay.pp_schedule, "pp": p,
        "virtual_stages": v,
        "micro_batches": m, "ranks": "one chip per pipeline stage (tp/cp/dp rank 0)",
        "analytic_step_s": res.step_time_s, "detailed": detailed, "merged": coarse,
    })
    tl.meta["simulated_step_s"] = tl.end_s
    return tl

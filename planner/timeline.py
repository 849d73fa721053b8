"""The predicted Timeline of one step: every pipeline stage's compute, all its communication (hidden and
exposed, each on the lane of its mesh axis), and bubbles.

One representative chip per pipeline stage is drawn (global rank stage * dp * cp * tp, the tp/cp/dp
rank 0 of the stage): within a stage all chips run the same ops at the same times. The order of
forward and backward passes is the engine's own schedule (`core.schedules`, torch-free), so a
predicted and a measured pipeline line up; the durations come from the step simulator.

Where communication sits (planner.costs says how much of it hides):
* a pass is split into its layers while the span count stays under `max_spans` and each rank's layers stay
  wide enough to tell apart on a chart (`MAX_LAYER_PASSES`): each layer's compute,
  then its collectives, each as one comm span on its group ("tp", "cp", "ep", "dp"): the part that
  hides runs under the layer's compute, the part the pass waits for extends past it; the embedding's and
  the output heads' work and their collectives close the pass as one block (the lookup, which opens a
  forward, is drawn there too);
* beyond that each pass is one compute span and one comm span per group and collective, and if even that is
  over the budget, back-to-back work is merged into "busy" spans between bubbles;
* the data-parallel gradient sync runs under the last backward (is_async) with its exposed tail after
  it, then a shared embedding's gradient sync between stages, the gradient buffer's passes (which the
  step runs before and during its backward: drawn together there) and the optimizer step; pipeline
  sends end each pass;
* expert all-to-alls overlapped with another micro-batch (`ep_comm_overlap`) show whole in the passes
  that have none beside them, each run's warm-up forwards and draining backwards
  (planner.simulate.unpaired_ep_s).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from core.timeline import Span, Timeline, kind_label, span_kind
from planner import passes
from planner.costs import CommOp
from planner.simulate import ChunkCost, StepResult, comm_group_sizes


class _Pass:
    """Spans of one pass on one rank, laid out from `start`: compute blocks advance the clock; each
    block's collectives hide under it (from its start, one after another per group) and whatever of
    them is exposed runs after it, in order."""

    def __init__(self, rank: int, start: float, mb: int, sizes: dict[str, int]):
        self.rank, self.t, self.mb, self.sizes = rank, start, mb, sizes
        self.spans: list[Span] = []
        self.group_free: dict[str, float] = defaultdict(float)

    def block(self, name: str, compute_s: float, comms: tuple[CommOp, ...] | list[CommOp],
              flops: float = 0.0) -> None:
        t0 = self.t
        if compute_s > 0:
            self.spans.append(Span(self.rank, "compute", name, t0, t0 + compute_s, flops=flops,
                                   micro_batch=self.mb))
        t1 = t0 + compute_s
        tail = t1
        for c in comms:
            if c.time_s <= 0:
                continue
            if c.exposed_s > 0:
                tail += c.exposed_s  # the pass waits for this part, after the compute
                start = max(t0, tail - c.time_s, self.group_free[c.group])
            else:
                start = max(t0, self.group_free[c.group])
            end = start + c.time_s
            name = _drawn_name(c)
            # what this rank sends in the span's time_s (all `count` ops of it), as a span's bytes are counted
            self.spans.append(Span(self.rank, "comm", name, start, end, bytes=int(c.sent_bytes(self.sizes[c.group])),
                                   micro_batch=self.mb, group=c.group, is_async=c.exposed_s < c.time_s))
            self.group_free[c.group] = end
        self.t = tail


def _drawn_name(c: CommOp) -> str:
    """A collective's span name with its kind in it, so that it is drawn in its kind's row and colour
    (core.timeline.span_kind reads the kind from the name), as the engine's spans of the same work are: a
    point-to-point op (the K/V ring, a state chain) as a send, "ep dispatch + combine" as an all-to-all (it had
    been drawn as "other comm", where the step's breakdown coloured it as an all-to-all)."""
    if c.kind == "p2p":
        return f"{c.name} (send/recv)"
    if c.kind and span_kind(Span(0, "comm", c.name, 0.0, 0.0)) != c.kind:
        return f"{c.name} ({kind_label(c.kind)})"
    return c.name


def _pass_spans(rank: int, chunk: ChunkCost, kind: str, start: float, mb: int, detailed: bool, label: str,
                sizes: dict[str, int], deferred_s: float = 0.0) -> list[Span]:
    """Spans of one forward ("F") or backward ("B") of one micro-batch through one chunk; a ZB-H1
    backward-input pass leaves out the `deferred_s` of weight-gradient work. A comm span's bytes are those this
    rank sends (core.timeline.Span; CommOp.sent_bytes over the group's `sizes`)."""
    p = _Pass(rank, start, mb, sizes)
    total = chunk.fwd_s if kind == "F" else chunk.bwd_s - deferred_s
    if detailed:
        layers = list(enumerate(lc for lc, n in chunk.layer_costs for _ in range(n)))
        for idx, lc in (layers if kind == "F" else reversed(layers)):  # the backward runs the layers last first
            if kind == "F":
                p.block(f"fwd {label} L{idx}", lc.fwd_compute_s, lc.fwd_comms, lc.fwd_flops)
            else:
                if lc.recompute == "full":
                    p.block(f"recompute {label} L{idx}", lc.recompute_s, lc.recompute_comms,
                            lc.full_recompute_flops)
                elif lc.recompute_s:
                    p.block(f"recompute {label} L{idx}", lc.recompute_s, lc.recompute_comms)
                p.block(f"bwd {label} L{idx}", lc.bwd_compute_s, lc.bwd_comms, 2 * lc.fwd_flops)
        if kind != "F" and chunk.parts["dp_comm"] > 0:
            p.block("", 0.0, [CommOp("dp", "zero-2 reduce-scatter", "reduce_scatter", 0.0,
                                     chunk.parts["dp_comm"], chunk.parts["dp_comm"])])
        ends = chunk.end_comms[0 if kind == "F" else 1]  # the embedding's and the head's TP collectives
        extra = start + total - chunk.p2p_s - p.t - sum(c.exposed_s for c in ends)
        p.block(f"{'fwd' if kind == 'F' else 'bwd'} {label} embed/logits", extra, ends)
    else:
        # one compute span, one comm span per group and collective: totals of the chunk's layers for this
        # direction, named by the collective (so drawn in its colour, as the layer-by-layer spans are)
        comms: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        compute = 0.0
        for lc, n in chunk.layer_costs:
            ops = lc.fwd_comms if kind == "F" else lc.bwd_comms + lc.recompute_comms
            compute += n * (lc.fwd_compute_s if kind == "F" else lc.bwd_compute_s + lc.recompute_s)
            for c in ops:
                total_of = comms[c.group, c.kind]
                total_of[0] += n * c.time_s
                total_of[1] += n * c.exposed_s
                total_of[2] += n * c.sent_bytes(sizes[c.group])
        for c in chunk.end_comms[0 if kind == "F" else 1]:
            total_of = comms[c.group, c.kind]
            total_of[0] += c.time_s
            total_of[1] += c.exposed_s
            total_of[2] += c.sent_bytes(sizes[c.group])
        if kind != "F":
            comms["dp", "reduce_scatter"][0] += chunk.parts["dp_comm"]
            comms["dp", "reduce_scatter"][1] += chunk.parts["dp_comm"]
        exposed = sum(e for _, e, _ in comms.values())
        compute = max(0.0, total - chunk.p2p_s - exposed)
        name = "fwd" if kind == "F" else "bwd-input" if deferred_s else "bwd"
        # recomputation drawn apart, before the backward it serves, in its own colour (the breakdown has it)
        recompute = 0.0 if kind == "F" else min(compute, sum(n * lc.recompute_s for lc, n in chunk.layer_costs))
        if recompute > 0:
            p.block(f"recompute {label}", recompute, [])
            compute -= recompute
        # one window per group, as its collectives queue on its links; inside it, each kind back to back
        groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for (g, _), (t, e, _) in comms.items():
            groups[g][0] += t
            groups[g][1] += e
        p.block(f"{name} {label}", compute, [CommOp(g, g, "", 0.0, t, e) for g, (t, e) in groups.items() if t > 0])
        spans = []
        for sp in p.spans:
            if sp.lane != "comm" or sp.name not in groups:
                spans.append(sp)
                continue
            t0 = sp.start_s
            for (g, k), (t, _, b) in comms.items():
                if g == sp.name and t > 0:
                    what = "ring send/recv" if k == "p2p" else k
                    spans.append(replace(sp, name=f"{g} {what}", start_s=t0, end_s=t0 + t, bytes=int(b)))
                    t0 += t
        return _within(spans, start, start + total)
    return _within(p.spans, start, start + total)


def _within(spans: list[Span], start: float, end: float) -> list[Span]:
    """A pass's spans with its collectives inside it: one queued behind the others on its links past the pass's
    end (the output head's, behind the last layer's) is drawn ending there, where the planner's pass, which
    counts what of it shows, ends."""
    out = []
    for sp in spans:
        if sp.lane == "comm" and sp.end_s > end:
            sp = replace(sp, start_s=max(start, end - sp.duration_s), end_s=end)
        out.append(sp)
    return out


BUSY = "busy (passes, collectives, short waits)"
# Layer passes (forward and backward) on one rank above which the timeline draws passes, not layers: on a
# chart ~900 px wide each layer would get under ~2 px, and its collectives, each a sliver, would merge into a
# band that looks busy the whole step (TPU v5p, Llama 3 8B, dp 16 tp 4: 512 layer passes, the all-gather
# row solid though busy 16 % of it)
MAX_LAYER_PASSES = 400


# How much a predicted timeline draws (its meta "drawn"), finest first: every layer and its collectives; each
# pass as one compute span with one span per collective kind; each pass alone, its collectives left out (over
# the span budget); every rank's passes folded into busy spans (far over it)
DRAWN = {"layers": "each layer's forward and backward and each of its collectives",
         "passes": "each pass (a micro-batch through a pipeline chunk) whole, its collectives as one block per kind",
         "passes only": "each pass (a micro-batch through a pipeline chunk) as one bar, what its collectives add "
                        "to it drawn inside it: too many to draw one by one",
         "busy": "each stage's back-to-back passes as grey busy blocks between its bubbles: far too many passes "
                 "to draw one by one"}
# the collectives of the step's end, around the passes (drawn at every level of detail)
STEP_SYNCS = ("dp gradient", "dp weight", "tied embedding")


def _passes_only(spans: list[Span]) -> list[Span]:
    """Over the span budget, first: each pass as one span of its kind (forward, recomputation, backward), the
    collectives inside the passes left out (what of them shows is drawn as part of its pass), the bubbles, the
    data-parallel sync and the optimizer kept."""
    out: list[Span] = []
    last: dict[int, Span] = {}
    for s in sorted(spans, key=lambda s: (s.rank, s.start_s, s.end_s)):
        prev = last.get(s.rank)
        if s.lane == "comm" and not s.name.startswith(STEP_SYNCS):
            # what of it runs past the pass's compute is exposed (a collective partly hidden too, and the pass's
            # pipeline send): its pass waits for it, so the bar runs to its end
            if prev is not None and prev.lane == "compute" and prev.micro_batch == s.micro_batch \
                    and s.start_s <= prev.end_s + 1e-12:
                out[-1] = last[s.rank] = replace(prev, end_s=max(prev.end_s, s.end_s))
            continue
        if (prev is not None and s.lane == "compute" and prev.lane == "compute" and s.micro_batch == prev.micro_batch
                and span_kind(s) == span_kind(prev) and s.start_s <= prev.end_s + 1e-12):
            out[-1] = last[s.rank] = replace(prev, end_s=max(prev.end_s, s.end_s), flops=prev.flops + s.flops)
            continue
        out.append(s)
        last[s.rank] = s
    return out


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
            if (s.lane == "idle" and not short_gap) or s.name.startswith("dp gradient") or s.name == "optimizer step":
                out.append(s)
                continue
            if s.lane == "comm" and s.is_async:
                continue  # hidden communication: its time is inside the busy span it ran under
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


def predicted_timeline(res: StepResult, max_spans: int = 20000, max_layer_passes: int | None = None) -> Timeline:
    lay, m = res.layout, res.micro_batches
    p, v = lay.pp, lay.virtual_stages
    comms_per_layer = max((len(lc.fwd_comms) + len(lc.bwd_comms) for s in res.stages for c in s.chunks
                           for lc, _ in c.layer_costs), default=0)
    layers_per_pass = max(sum(c.layers for c in s.chunks) for s in res.stages) / v
    # layer by layer while the spans stay under the budget and a rank's layers stay wide enough to tell apart
    # on a chart (`MAX_LAYER_PASSES`); else a pass's work and collectives as a few blocks
    detailed = (p * m * v * layers_per_pass * (3 + comms_per_layer) <= max_spans
                and 2 * m * v * layers_per_pass <= (max_layer_passes or MAX_LAYER_PASSES))
    rank_of = [i * lay.dp * lay.cp * lay.tp for i in range(p)]
    sizes = comm_group_sizes(lay)
    # every pass's start and end: the same run of the schedule the step time comes from (planner.passes)
    sched = passes.run(res.stages, lay, m)
    pl = sched.plan
    clock = [0.0] * p
    spans: list[Span] = []
    kinds = pl.kinds
    # a pass's spans depend on its rank, chunk and kind only: laid out once from 0, then moved to each start
    shapes: dict[tuple, list[Span]] = {}
    # more passes than the span budget (thousands of micro-batches): each rank's passes are folded into busy
    # spans as they come, its idle gaps under half a span's share of the step with them (`_merge_busy`)
    min_idle_s = res.step_time_s * p / (2 * max_spans)
    folding = len(pl.ranks) > max_spans
    busy: list[list[float] | None] = [None] * p
    for i, r in enumerate(pl.ranks):
        start, end = sched.starts[i], sched.ends[i]
        if folding:
            run = busy[r]
            if run is not None and start <= run[1] + min_idle_s:
                run[1] = clock[r] = end
                continue
            if run is not None:
                spans.append(Span(rank_of[r], "compute", BUSY, run[0], run[1]))
            if start > clock[r]:
                spans.append(Span(rank_of[r], "idle", "bubble", clock[r], start))
            busy[r], clock[r] = [start, end], end
            continue
        if start > clock[r]:
            spans.append(Span(rank_of[r], "idle", "bubble", clock[r], start))
        clock[r] = end
        kind, mb, stage = kinds[i], pl.micro_batches[i], pl.stages[i]
        if kind == passes.GAP:
            if end > start:  # between runs: this stage's gradients reduce-scattered and its weights gathered again
                spans.append(Span(rank_of[r], "comm", "dp gradient reduce-scatter (and weight gather)", start, end,
                                  group="dp"))
            continue
        chunk = res.stages[r].chunks[pl.chunks[i]]
        if pl.showing[i]:
            chunk = chunk.showing_ep()
        if kind == "BW":
            spans.append(Span(rank_of[r], "compute", f"BW s{stage}", start, end,  # as the engine names it
                              micro_batch=mb))
            continue
        direction = "F" if kind == "F" else "B"
        deferred = chunk.wgrad_s if kind == "BI" else 0.0
        key = (r, pl.chunks[i], stage, bool(pl.showing[i]), kind)
        if key not in shapes:
            shapes[key] = _pass_spans(rank_of[r], chunk, direction, 0.0, None, detailed and not deferred,
                                      f"s{stage}", sizes, deferred)
        spans.extend(Span(s.rank, s.lane, s.name, start + s.start_s, start + s.end_s, s.bytes, s.flops, 0, mb,
                          s.group, s.is_async) for s in shapes[key])
        if chunk.p2p_s > 0:
            what = "act" if direction == "F" else "grad"
            name = f"send/recv {what}" if lay.pp_p2p == "sequential" else f"send {what}"
            spans.append(Span(rank_of[r], "comm", name, end - chunk.p2p_s, end, micro_batch=mb, group="pp"))
    for r, run in enumerate(busy):
        if run is not None:
            spans.append(Span(rank_of[r], "compute", BUSY, run[0], run[1]))
            clock[r] = run[1]
    pipe_end = sched.end_s
    for r, (stage, tail) in enumerate(zip(res.stages, passes.tails(res.stages, sched.clocks))):
        (t, synced) = tail.sync
        hidden = max(0.0, stage.dp_step_s - stage.dp_exposed_s)  # of what runs around the step's end
        if stage.dp_step_s > 0 and stage.dp_step_s < stage.dp_total_s:
            # ZeRO-2: its gradients were reduce-scattered in every backward; what is left is the updated
            # weights' gather, which the next step's first forward hides (simulate's window is one forward):
            # drawn under this step's first forward, as the previous step's gather runs there, and what shows
            first = min((s.start_s for s in spans if s.rank == rank_of[r] and s.lane == "compute"), default=0.0)
            if hidden > 0:
                spans.append(Span(rank_of[r], "comm", "dp weight all-gather", first, first + hidden, group="dp",
                                  is_async=True))
            if synced > t:
                spans.append(Span(rank_of[r], "comm", "dp weight all-gather", t, synced, group="dp"))
        elif stage.dp_step_s > 0:
            # the sync under the last backward and the weights' gather, what shows of them at the step's end:
            # named by its collective, so it is drawn in that collective's colour
            sync = "dp gradient all-reduce" if lay.zero_stage == 0 else "dp gradient reduce-scatter (and weight gather)"
            spans.append(Span(rank_of[r], "comm", sync, t - hidden, t - hidden + stage.dp_step_s,
                              group="dp", is_async=hidden > 0))
        if tail.tied_wait[1] > tail.tied_wait[0]:
            spans.append(Span(rank_of[r], "idle", "wait", *tail.tied_wait))
        if tail.tied[1] > tail.tied[0]:
            spans.append(Span(rank_of[r], "comm", "tied embedding gradient all-reduce", *tail.tied, group="pp"))
        if tail.passes[1] > tail.passes[0]:
            spans.append(Span(rank_of[r], "compute", "gradient buffer passes", *tail.passes))
        spans.append(Span(rank_of[r], "compute", "optimizer step", *tail.optimizer))
        if tail.end_s < pipe_end:
            spans.append(Span(rank_of[r], "idle", "wait", tail.end_s, pipe_end))
    coarse = folding or len(spans) > max_spans
    drawn = "busy" if folding else "layers" if detailed else "passes"  # the level of detail (DRAWN)
    if len(spans) > max_spans and not folding:  # folded spans are busy blocks already, not passes
        spans, drawn = _passes_only(spans), "passes only"
    if len(spans) > max_spans:
        drawn = "busy"
    while len(spans) > max_spans:
        # an idle gap under half of one span's share of the step would not show: fold it in (and longer ones,
        # doubling, until the spans fit the budget: a browser stalls for minutes on a chart of 200k bars)
        before, spans = len(spans), _merge_busy(spans, min_idle_s=min_idle_s)
        if min_idle_s > res.step_time_s and len(spans) >= before:
            break  # nothing left to fold: every rank's step is one busy span and its syncs
        min_idle_s *= 2
    tl = Timeline(spans, source="predicted", meta={
        "case": res.case.name, "chip": res.chip.key, "schedule": lay.pp_schedule, "pp": p,
        "virtual_stages": v,
        "micro_batches": m, "ranks": "one chip per pipeline stage (tp/cp/dp rank 0)",
        "analytic_step_s": res.step_time_s, "detailed": detailed, "merged": coarse, "drawn": drawn,
    })
    tl.meta["simulated_step_s"] = tl.end_s
    return tl

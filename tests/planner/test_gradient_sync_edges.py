"""What of the data-parallel gradient sync a step always waits for: the edge buckets (the word embedding's
gradient is finished last and its weights are needed first: planner.simulate.edge_bucket_share) and the
passes over the gradient buffer on the compute stream (planner.simulate.grad_buffer_passes_s)."""

import pytest

from hardware import kernels
from hardware.chips import get_chip
from planner.api import estimate
from planner.case import Layout
from planner.models import MODEL_PRESETS
from planner.simulate import edge_bucket_share, grad_buffer_passes_s
from planner.timeline import predicted_timeline

LLAMA = MODEL_PRESETS["Llama 3 8B"]  # vocab 128256, d 4096
H100 = get_chip("h100")


def test_the_stage_with_the_embedding_holds_its_rows_in_the_edge_bucket():
    lay = Layout(dp=8, tp=2, pp=1)
    params = 4.0e9
    rows = 128256 * 4096 / 2
    assert edge_bucket_share(LLAMA, lay, True, params, 32) == pytest.approx((rows + (params - rows) / 32) / params)
    assert edge_bucket_share(LLAMA, lay, False, params, 32) == pytest.approx(1 / 32)


def test_megatron_passes_over_the_gradient_buffer_once_a_step():
    # zero (1 write), NaN-check norm (1 read), scale by 1/dp in place (1 read + 1 write), 4-byte gradients
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=1, grad_reduce_in_fp32=True)
    assert grad_buffer_passes_s(1e9, lay, H100, 8) == pytest.approx(kernels.pointwise_s(H100, 16e9))
    assert grad_buffer_passes_s(1e9, lay, H100, 1) == 0.0  # no data parallelism: no sync buffer
    assert grad_buffer_passes_s(1e9, Layout(dp=8, tp=1, pp=1, zero_stage=2), H100, 8) == 0.0
    assert grad_buffer_passes_s(1e9, Layout(dp=8, tp=1, pp=1, zero_stage=3), H100, 8) == 0.0
    assert grad_buffer_passes_s(1e9, lay, get_chip("tpu-v5p"), 8) == 0.0  # XLA fuses the scaling


def _case(**training):
    return {"model": {"layers": 4, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256,
                      "seq_len": 2048},
            "training": {"global_batch": 64, "micro_batch": 1, "recompute": "none", "zero_stage": 1,
                         "grad_reduce_overlap": True, "param_gather_overlap": True, **training},
            "parallel": {"dp": 8, "tp": 1, "pp": 1, "cp": 1},
            "cluster": {"chip": "h100", "num_chips": 8, "chips_per_node": 8}}


def test_the_step_waits_for_the_passes_and_draws_them():
    res = estimate(_case()).result
    stage = res.stages[0]
    # at the pace of the job's slowest GPU (res.chip)
    assert stage.grad_passes_s == pytest.approx(kernels.pointwise_s(res.chip, stage.params * 16))
    assert res.step_time_s == pytest.approx(res.pipeline_s + stage.dp_exposed_s + stage.optimizer_s
                                            + stage.grad_passes_s, rel=1e-12)
    spans = [s for s in predicted_timeline(res).spans if s.name == "gradient buffer passes"]
    assert [s.duration_s for s in spans] == [pytest.approx(stage.grad_passes_s)]


def test_a_big_vocabulary_keeps_more_of_the_sync_in_view():
    # with 4 layers and an untied 128K x 4096 embedding (0.53 G rows in the edge bucket of 1.92 G parameters,
    # the head's as many), the edge buckets are nearly half the sync: both the reduce-scatter's last and the
    # gather's first show
    res = estimate(_case()).result
    stage = res.stages[0]
    share = edge_bucket_share(res.case.model, res.layout, True, stage.params, 4)
    assert share == pytest.approx((128256 * 4096 + (stage.params - 128256 * 4096) / 4) / stage.params)
    assert share > 0.45
    assert stage.dp_exposed_s > share * stage.dp_total_s


def test_zero3_gathers_the_root_unit_before_the_lookup_and_reduces_it_last():
    # the embedding and the untied head (2 x 128256 x 4096) and the final norm, outside the wrapped layers:
    # gathered before the lookup and reduce-scattered after its backward, both with nothing to hide under
    from planner.costs import comm_s, topology
    from planner.flops import root_params

    res = estimate(_case(zero_stage=3)).result
    fwd, bwd = res.stages[0].chunks[0].end_comms
    params = root_params(res.case.model, 1)
    assert params == pytest.approx(2 * 128256 * 4096 + 4096)
    topo = topology(res.chip, 8, 1, 8)
    (gather,) = [c for c in fwd if c.name == "zero-3 all-gather (embedding, head)"]
    (reduce,) = [c for c in bwd if c.name == "zero-3 reduce-scatter (embedding, head)"]
    assert (gather.nbytes, gather.exposed_s) == (2 * params, pytest.approx(comm_s(topo, "all_gather", 2 * params)))
    assert reduce.exposed_s == reduce.time_s == pytest.approx(comm_s(topo, "reduce_scatter", 4 * params))
    # ZeRO-1 keeps the weights whole: nothing to gather
    assert not any("embedding, head" in c.name for ops in estimate(_case()).result.stages[0].chunks[0].end_comms
                   for c in ops)


def test_zero3_keeps_the_root_unit_gathered_beside_two_layers():
    # the peak holds the current and the prefetched layer's bf16 weights and the gathered root unit
    from planner.flops import root_params

    res = estimate(_case(zero_stage=3)).result
    root = root_params(res.case.model, 1)
    layer = (res.stages[0].params - root) / 4
    one = estimate(_case(zero_stage=3, recompute="none")).result
    assert one.memory.temporary_bytes >= 2 * (2 * layer + root)
    # the logits' fp32 buffers are the rest of the temporaries: 2048 tokens x 128256 x 8 bytes
    assert one.memory.temporary_bytes == pytest.approx(2 * (2 * layer + root) + 2048 * 128256 * 8)


def test_the_root_unit_is_gathered_once_a_micro_batch_whatever_the_lookups():
    # multi-token prediction looks the embedding up again, but FSDP gathers the root unit once
    from dataclasses import replace

    from planner.case import Cluster, Parallel
    from planner.presets import make_case

    for mtp in (0, 2):
        m = replace(LLAMA, mtp_layers=mtp)
        res = estimate(make_case(m, Cluster("a100-80gb", 64), global_batch=128, parallel=Parallel(dp=64, tp=1, pp=1),
                                 zero_stage=3, micro_batch=1)).result
        fwd, bwd = res.stages[0].chunks[0].end_comms
        assert [c.name for c in fwd].count("zero-3 all-gather (embedding, head)") == 1
        assert [c.name for c in bwd].count("zero-3 reduce-scatter (embedding, head)") == 1


def test_zero3_shows_the_first_layers_gather_and_reduce_scatter_whole():
    # the first layer follows only the lookup: its gather cannot hide under a previous layer, and its
    # reduce-scatter has only the lookup's backward after it; the other layers keep theirs hidden
    from planner.costs import overlap_slowdown

    res = estimate(_case(zero_stage=3)).result
    (first, one), (other, three) = res.stages[0].chunks[0].layer_costs
    assert (one, three) == (1, 3)

    def op(lc, ops, name):
        (c,) = [c for c in getattr(lc, ops) if c.name == name]
        return c

    for ops, name in (("fwd_comms", "zero-3 all-gather"), ("bwd_comms", "zero-3 reduce-scatter")):
        assert op(first, ops, name).exposed_s == op(first, ops, name).time_s
        assert op(other, ops, name).exposed_s < op(other, ops, name).time_s
    # the compute the hidden parts slowed is given back
    slow = overlap_slowdown(res.chip)
    gather = op(other, "fwd_comms", "zero-3 all-gather")
    assert other.fwd_compute_s - first.fwd_compute_s == pytest.approx(slow * (gather.time_s - gather.exposed_s))


def test_the_timeline_draws_the_backward_from_the_last_layer_to_the_first():
    # so the first layer's reduce-scatter, which nothing hides, closes the backward
    res = estimate(_case(zero_stage=3, global_batch=8)).result
    spans = [s for s in predicted_timeline(res).spans if s.rank == 0 and s.micro_batch == 0]
    bwd = {s.name: s.start_s for s in spans if s.name.startswith("bwd") and " L" in s.name}
    order = sorted(bwd, key=bwd.get)
    assert [name.rsplit(" ", 1)[1] for name in order] == ["L3", "L2", "L1", "L0"]


def _interleaved(dp=8, pp=2, v=2, layers=8):
    case = _case()
    case["model"]["layers"] = layers
    case["training"]["global_batch"] = 8 * dp
    case["parallel"].update(dp=dp, pp=pp, virtual_stages=v, pp_schedule="interleaved-1f1b" if v > 1 else "1f1b")
    case["cluster"]["num_chips"] = dp * pp
    case["cluster"]["chips_per_node"] = 8 if dp * pp >= 8 else dp * pp
    return estimate(case).result


def test_interleaved_chunks_sync_their_gradients_one_by_one_under_the_backward_left():
    """Megatron-Core's interleaved schedule starts each chunk's gradient sync once that chunk's last micro-batch
    backward is done (rank r: r backwards of the chunk below later), the last chunk first; the syncs queue on
    the same links, each its chunk's share of the stage's parameters (the word embedding's rows with the chunk
    that looks them up), and chunk c's has p x (the backwards of chunks 0 .. c - 1), less the delay, to hide
    under."""
    from planner import costs
    from planner.memory import chunk_params
    from planner.simulate import chunk_sync_windows

    res = _interleaved()
    lay, p, m = res.layout, res.layout.pp, res.case.model
    for i in (0, 1):
        stage = res.stages[i]
        b0, b1 = (ch.bwd_s for ch in stage.chunks)
        windows = chunk_sync_windows(stage.chunks, lay, i)
        assert windows == pytest.approx([0.0, max(0.0, p * b0 - i * b0)])
        (d0, _), (d1, _) = chunk_params(m, lay, i)
        # tp 1, untied: the lookup's rows (and the final norm) on stage 0's first chunk, the head's on the last's
        rows = m.vocab * m.hidden
        assert (d0 - d1 == pytest.approx(rows + m.hidden)) if i == 0 else (d1 - d0 == pytest.approx(rows))
        # ZeRO-1: the reduce-scatter, queued chunk by chunk, then the gather under the next forward
        rs = costs.comm_s(costs.data_topology(res.chip, lay, 8), "reduce_scatter", stage.params * lay.grad_bytes)
        ag = stage.dp_total_s - rs
        shown_rs = max(rs * d0 / (d0 + d1) - windows[0], rs - windows[1])
        fwd = sum(ch.fwd_s for ch in stage.chunks)
        edge = edge_bucket_share(m, lay, i == 0, stage.params, 4)
        want = (costs.charged_s(res.chip, rs, max(shown_rs, rs * edge))
                + costs.charged_s(res.chip, ag, max(ag - fwd, ag * edge)))
        assert stage.dp_exposed_s == pytest.approx(want, rel=1e-9), i


def test_one_chunk_a_stage_keeps_the_buckets_of_its_last_backward():
    """1F1B: the stage's buckets go out as its last backward produces them (no per-chunk windows)."""
    from planner.simulate import chunk_sync_windows

    res = _interleaved(v=1)
    assert chunk_sync_windows(res.stages[0].chunks, res.layout, 0) is None


def test_dense_and_expert_syncs_that_share_the_network_queue_in_one_window():
    # Mixtral on 2 nodes, dp 16, ep 2: both the dense group (16 ranks) and an expert's (8 ranks, 2 apart) leave
    # the node, so the experts' reduce-scatter hides only under what the dense one left of the backward (short
    # sequences: a backward shorter than the experts' sync)
    from planner import costs
    from planner.simulate import stage_params

    m = MODEL_PRESETS["Mixtral 8x7B"]
    case = {"model": {k: getattr(m, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len",
                                                  "mlp", "experts", "top_k")},
            "training": {"global_batch": 16, "micro_batch": 1, "recompute": "none", "zero_stage": 1},
            "parallel": {"dp": 16, "tp": 1, "pp": 1, "cp": 1, "ep": 2},
            "cluster": {"chip": "h100", "num_chips": 16, "chips_per_node": 8}}
    case["model"]["seq_len"] = 512
    res = estimate(case).result
    lay, chip, st = res.layout, res.chip, res.stages[0]
    dense_p, expert_p = stage_params(m, lay, 0)
    dense = costs.topology(chip, 16, costs.data_stride(lay), 8)
    experts = costs.topology(chip, lay.expert_dp, lay.expert_dp_stride, 8)
    assert costs.crosses_network(16, costs.data_stride(lay), chip, 8)
    assert costs.crosses_network(lay.expert_dp, lay.expert_dp_stride, chip, 8)
    s_d, s_e = (costs.comm_s(t, "reduce_scatter", p * lay.grad_bytes) for t, p in ((dense, dense_p),
                                                                                    (experts, expert_p)))
    g_d, g_e = (costs.comm_s(t, "all_gather", p * 2) for t, p in ((dense, dense_p), (experts, expert_p)))
    layers = m.layers
    window, fwd = sum(c.bwd_s for c in st.chunks) * (1 - 1 / layers), st.fwd_s
    edge = edge_bucket_share(m, lay, True, dense_p, layers)
    shown = (max(s_d - window, s_d * edge), max(s_e - max(0.0, window - s_d), s_e / layers),
             max(g_d - fwd, g_d * edge), max(g_e - max(0.0, fwd - g_d), g_e / layers))
    expected = sum(costs.charged_s(chip, total, part) for total, part in zip((s_d, s_e, g_d, g_e), shown))
    assert st.dp_exposed_s == pytest.approx(expected, rel=1e-9)
    apart = (max(s_e - window, s_e / layers), max(g_e - fwd, g_e / layers))  # each alone in the window
    assert s_d > 0 and apart[0] < shown[1] and apart[1] < shown[3]


def test_a_tied_embedding_inside_one_node_is_summed_over_nvlink():
    # pp 4 x tp 2 on one 8-GPU node: the first and last stages (ranks 0 and 6) share the node's switch
    from planner import costs
    from planner.memory import chunks_of
    from planner.simulate import tied_embedding_sync, tied_embedding_sync_s

    m = MODEL_PRESETS["Gemma 7B"] if "Gemma 7B" in MODEL_PRESETS else None
    if m is None or not m.tied_embeddings:
        from dataclasses import replace
        m = replace(LLAMA, tied_embeddings=True)
    lay = Layout(dp=1, tp=2, pp=4)
    seconds, holders = tied_embedding_sync_s(m, lay, H100, 8, chunks_of(m, lay))
    _, nbytes = tied_embedding_sync(m, lay, chunks_of(m, lay))
    assert holders == [0, 3]
    assert seconds == pytest.approx(costs.comm_s(costs.topology(H100, 2, 1, 8), "all_reduce", nbytes))
    assert not costs.crosses_network(2, 1, H100, 8)


def test_zero2_draws_its_step_end_gather_alone_beside_the_per_micro_batch_reduce_scatters():
    # ZeRO-2 reduce-scatters every micro-batch's gradients inside its backward; at the step's end only the
    # updated weights' gather is left to draw, so the data-parallel lane never overlaps itself
    from planner.case import Cluster, Parallel
    from planner.presets import make_case

    est = estimate(make_case("Llama 3 8B", "8x H100 (one node)", zero_stage=2, micro_batch=1))
    assert est.layout.zero_stage == 2 and est.result.micro_batches > 1
    assert est.result.stages[0].dp_step_s < est.result.stages[0].dp_total_s
    for case in (make_case("Llama 3 8B", "8x H100 (one node)", zero_stage=2, micro_batch=1),
                 make_case("Llama 3 8B", Cluster("h100", 16, 8), zero_stage=2, micro_batch=1,
                           parallel=Parallel(dp=4, tp=4, pp=1, cp=1))):
        est = estimate(case)
        stage = est.result.stages[0]
        dp = sorted((s for s in est.timeline.spans if s.rank == 0 and s.group == "dp"), key=lambda s: s.start_s)
        gathers = [s for s in dp if s.name == "dp weight all-gather"]
        assert sum(s.duration_s for s in gathers) == pytest.approx(stage.dp_step_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(dp, dp[1:]))
        assert max(s.end_s for s in est.timeline.spans) == pytest.approx(est.step_time_s, rel=1e-9)


def test_zero2_under_interleaving_reduce_scatters_each_chunks_gradients_in_its_own_backward():
    from planner.case import Parallel
    from planner.presets import make_case
    from planner.simulate import chunk_params

    est = estimate(make_case("Llama 3 70B", "2,048x H800 (DeepSeek-V3 scale)", zero_stage=2,
                             parallel=Parallel(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=5)))
    res = est.result
    assert res.layout.virtual_stages == 5 and res.micro_batches > 1
    chunks = res.stages[0].chunks
    shares = [d + e for d, e in chunk_params(res.case.model, res.layout, 0)]
    parts = [c.parts["dp_comm"] for c in chunks]
    assert all(p > 0 for p in parts)
    assert [p / sum(parts) for p in parts] == pytest.approx([s / sum(shares) for s in shares], rel=1e-9)

"""The pipeline's ends: TP's collectives around the vocabulary-parallel embedding and output head
(planner.costs.vocab_parallel_comms), and the shared word embedding's gradient summed between the first and
last stage (planner.simulate.tied_embedding_sync_s), against hand-worked counts."""

from dataclasses import replace

import pytest

from hardware.chips import get_chip
from planner.api import estimate
from planner.case import Cluster, Layout, Parallel
from planner.costs import comm_s, topology, vocab_parallel_comms
from planner.models import MODEL_PRESETS
from planner.presets import make_case
from planner.simulate import sent_bytes_per_step
from planner.timeline import predicted_timeline

GPT = MODEL_PRESETS["GPT-3 2.7B"]  # tied embeddings, d 2560, vocab 50257, 2048 tokens
H100 = get_chip("h100")
TOKENS = 2048
ACT = TOKENS * 2560 * 2  # one sequence's activation in bf16


def _ends(sp: bool, chip=H100, **lay):
    layout = Layout(dp=1, tp=4, pp=1, micro_batch=1, sequence_parallel=sp, attention="flash", **lay)
    return vocab_parallel_comms(GPT, layout, chip, "bf16", 8), layout


def test_without_tp_nothing_is_sent():
    assert vocab_parallel_comms(GPT, Layout(dp=8, tp=1, pp=1, micro_batch=1), H100, "bf16", 8) == {}


def test_without_sp_the_embedding_all_reduces_and_the_head_reduces_its_input_gradient():
    ends, _ = _ends(False, tp_grad_allreduce_overlap=True)
    (emb_f, emb_b), (head_f, head_b) = ends["embedding"], ends["head"]
    ar = comm_s(topology(H100, 4, 1, 8), "all_reduce", ACT)
    # the lookup's partial sums, with nothing to hide under
    assert [(c.name, c.kind, c.nbytes, c.exposed_s) for c in emb_f] == [
        ("tp all-reduce (embedding)", "all_reduce", ACT, pytest.approx(ar))]
    assert emb_b == ()
    # the head's input gradient under its weight-gradient GEMM (Megatron's async all-reduce)
    assert [(c.name, c.time_s) for c in head_b] == [("tp all-reduce (logits grad)", pytest.approx(ar))]
    assert head_b[0].exposed_s < ar
    # the fp32 cross-entropy's three reductions of 4 bytes a token, forward
    assert [(c.name, c.nbytes) for c in head_f] == [(f"tp all-reduce (loss {w})", 4 * TOKENS)
                                                    for w in ("max", "target logit", "sum of exponentials")]
    assert all(c.exposed_s == c.time_s for c in head_f)


def test_the_head_waits_for_its_input_gradient_without_the_async_all_reduce():
    (_, head_b) = _ends(False, tp_grad_allreduce_overlap=False)[0]["head"]
    assert head_b[0].exposed_s == head_b[0].time_s


def test_with_sp_the_ends_scatter_and_gather_the_sequence():
    ends, _ = _ends(True)
    (emb_f, emb_b), (head_f, head_b) = ends["embedding"], ends["head"]
    # learned absolute positions (the gpt style) are added to the whole sum: Megatron-Core all-reduces the
    # lookup, then scatters to the sequence shards locally, whose backward all-gathers
    assert [c.name for c in emb_f] == ["tp all-reduce (embedding)"]
    assert [c.name for c in emb_b] == ["tp all-gather (embedding grad)"]
    assert emb_b[0].exposed_s == emb_b[0].time_s
    # rotary positions (the llama style): the lookup's partial sums are reduce-scattered straight away
    llama = vocab_parallel_comms(MODEL_PRESETS["Llama 3 8B"], Layout(dp=1, tp=4, pp=1, micro_batch=1,
                                                                      sequence_parallel=True), H100, "bf16", 8)
    assert [c.name for c in llama["embedding"][0]] == ["tp reduce-scatter (embedding)"]
    assert [c.name for c in llama["embedding"][1]] == ["tp all-gather (embedding grad)"]
    # on a GPU the head's input gather is not pipelined with its GEMM (no userbuffers for the output layer)
    gather = head_f[0]
    assert (gather.name, gather.exposed_s) == ("tp all-gather (logits)", gather.time_s)
    assert [c.name for c in head_b] == ["tp all-gather (logits input)", "tp reduce-scatter (logits grad)"]


def test_on_a_tpu_the_head_gather_pipelines_with_its_gemm_as_the_layers_do():
    gather = _ends(True, chip=get_chip("tpu-v5p"), tp_comm_overlap=True)[0]["head"][0][0]
    assert gather.name == "tp all-gather (logits)" and gather.exposed_s < gather.time_s


def test_a_fused_cross_entropy_gathers_three_floats_a_token():
    head_f = _ends(False, cross_entropy="fused")[0]["head"][0]
    assert [(c.name, c.kind, c.nbytes) for c in head_f] == [("tp all-gather (loss statistics)", "all_gather",
                                                              12 * TOKENS * 4)]


def _gpt_case(pp: int, tied: bool = True, **training):
    m = replace(GPT, tied_embeddings=tied)
    return make_case(m, Cluster("h100", 16), global_batch=64,
                     parallel=Parallel(dp=16 // (4 * pp), tp=4, pp=pp, pp_schedule="1f1b" if pp > 1 else None,
                                       virtual_stages=1),
                     **{"micro_batch": 1, "recompute": "none", "zero_stage": 1, "sequence_parallel": False, **training})


def test_a_tied_embedding_split_over_stages_sums_its_gradient_after_the_flush():
    tied, untied, one = (estimate(_gpt_case(2)).result, estimate(_gpt_case(2, tied=False)).result,
                         estimate(_gpt_case(1)).result)
    # V/t x D fp32 main gradients, all-reduced between the first and last stage (2 ranks, 8 apart: other nodes)
    nbytes = GPT.vocab / 4 * GPT.hidden * 4
    expected = comm_s(topology(H100, 2, 8, 8), "all_reduce", nbytes)
    assert [s.tied_sync_s for s in tied.stages] == [pytest.approx(expected)] * 2
    assert [s.tied_sync_s for s in untied.stages] == [0.0, 0.0]
    assert [s.tied_sync_s for s in one.stages] == [0.0]
    # stage 0's sync ends last, so the step waits for all of it, counted with the pipeline's communication
    shown = tied.breakdown["pp_comm"] - untied.breakdown["pp_comm"]
    assert shown == pytest.approx(expected, rel=1e-9)
    assert tied.step_time_s - untied.step_time_s == pytest.approx(expected, rel=1e-6)
    # ... and it shows in the timeline on the pipeline's lane, one collective at one time on both stages,
    # and in the bytes sent over it
    spans = [s for s in predicted_timeline(tied).spans if s.name == "tied embedding gradient all-reduce"]
    assert len(spans) == 2 and {s.group for s in spans} == {"pp"}
    assert spans[0].start_s == spans[1].start_s and spans[0].duration_s == pytest.approx(expected)
    sent = sent_bytes_per_step(tied, 0)["pp"] - sent_bytes_per_step(untied, 0)["pp"]
    assert sent == pytest.approx(nbytes)  # a 2-rank all-reduce sends 2 (n-1)/n = 1 array


def test_the_ends_show_in_the_breakdown_and_the_timeline():
    res = estimate(_gpt_case(1)).result
    names = {s.name for s in predicted_timeline(res, max_layer_passes=10**6).spans if s.lane == "comm"}  # by layer
    assert {"tp all-reduce (embedding)", "tp all-reduce (logits grad)", "tp all-reduce (loss max)"} <= names
    stage = res.stages[0]
    ends = stage.chunks[0].end_comms
    shown = sum(c.exposed_s for ops in ends for c in ops)
    assert shown > 0
    assert res.breakdown["tp_comm"] == pytest.approx(
        res.micro_batches * (shown + sum(n * (sum(c.exposed_s for c in lc.fwd_comms + lc.bwd_comms))
                                          for lc, n in stage.chunks[0].layer_costs)))


def test_the_tied_sync_runs_once_a_step_whatever_the_runs_of_the_schedule():
    # staged ZeRO-3 repeats each stage's gradient reduce-scatter once per run of the schedule, not the tied sync
    runs = {k: estimate(_gpt_case(2, tied=k, zero_stage=3, schedule_runs=4)).result for k in (True, False)}
    tied_s = runs[True].stages[0].tied_sync_s
    assert tied_s > 0
    assert runs[True].step_time_s - runs[False].step_time_s == pytest.approx(tied_s, rel=1e-6)


def test_the_holders_are_the_stages_that_hold_the_embedding():
    # an untied model whose multi-token-prediction module sits a stage before the loss: the lookups share
    # the embedding between stages 0 and 2 of 4, two stages apart
    from planner.simulate import tied_embedding_sync
    from planner.stages import chunks_of

    m = replace(MODEL_PRESETS["DeepSeek-V3"], layers=8, mtp_layers=1)
    lay = Layout(dp=1, tp=1, pp=4, ep=1, micro_batch=1, pp_layout="Etttt|tttt|m|L")
    holders, nbytes = tied_embedding_sync(m, lay, chunks_of(m, lay))
    assert holders == [0, 2] and nbytes == pytest.approx(m.vocab * m.hidden * lay.grad_bytes)

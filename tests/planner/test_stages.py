"""The pipeline split (planner.stages): Megatron-Core's layout syntax, the default split, and multi-token
prediction modules, checked against hand-worked splits and DeepSeek-V3's published parameter count."""

import copy
import json
from dataclasses import replace

import pytest

from planner.api import estimate, search
from planner.case import Layout, parse_case
from planner.costs import layer_cost, logits_cost, mtp_extra_cost
from planner.flops import layer_matmul_params, layer_params, matmul_flops_per_token, mtp_proj_params
from planner.memory import stage_params
from planner.models import MODEL_PRESETS, SpecError
from planner.stages import Chunk, expand_layout, model_chunks, stage_chunks

DSV3 = MODEL_PRESETS["DeepSeek-V3"]


def test_megatron_docs_example_expands_to_its_table():
    # Megatron-Core's docs: DeepSeek-V3 at PP16 VPP2, "Et*3|(tt|)*29,m|L": stage 0 holds the embedding and
    # 3 layers, then 2; the last stage's second chunk the loss, the one before it the MTP module
    chunks = expand_layout("Et*3|(tt|)*29,m|L").split("|")
    assert len(chunks) == 32
    assert chunks[0] == "Ettt" and chunks[1:30] == ["tt"] * 29 and chunks[30:] == ["m", "L"]


def test_deepseek_v3_h100_layout_puts_mtp_and_loss_alone_on_the_last_stage():
    # Megatron-Bridge's H100 split at p 8, v 4; stage i holds model chunks i, i + 8, i + 16, i + 24
    stages = stage_chunks(61, 1, 8, 4, expand_layout("Et|(tt|)*30mL"))
    assert [c.layers for c in stages[0]] == [1, 2, 2, 2] and stages[0][0].embedding
    assert all([c.layers for c in stages[i]] == [2, 2, 2, 2] for i in range(1, 7))
    assert [c.layers for c in stages[7]] == [2, 2, 2, 0]
    assert stages[7][3] == Chunk(first=61, layers=0, embedding=False, mtp=1, loss=True)
    assert sum(c.layers for s in stages for c in s) == 61


def test_default_split_is_even_with_embedding_first_and_mtp_and_loss_last():
    chunks = model_chunks(61, 1, 8, 4)
    assert [c.layers for c in chunks] == [2] * 29 + [1] * 3  # the first chunks take the remainder
    assert chunks[0].embedding and not any(c.embedding for c in chunks[1:])
    assert chunks[-1].mtp == 1 and chunks[-1].loss and not any(c.loss or c.mtp for c in chunks[:-1])
    assert [c.first for c in chunks[:3]] == [0, 2, 4]


def _case(**parallel):
    return {"name": "v3", "model": {k: getattr(DSV3, k) for k in (
                "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "experts", "top_k", "head_dim",
                "shared_experts", "dense_layers", "dense_ffn", "q_lora_rank", "kv_lora_rank", "rope_head_dim",
                "mtp_layers")},
            "training": {"global_batch": 512, "micro_batch": 1, "recompute": "none", "zero_stage": 1},
            "parallel": {"dp": 16, "tp": 2, "pp": 8, "cp": 1, "ep": 16, **parallel},
            "cluster": {"chip": "h100", "num_chips": 256}}


def test_a_stated_layout_fixes_the_virtual_stages_and_the_interleaved_schedule():
    case = parse_case(_case(pp_layout="Et|(tt|)*30mL"))
    assert case.parallel.virtual_stages == 4 and case.parallel.pp_schedule == "interleaved-1f1b"
    assert case.parallel.pp_layout.count("|") == 31  # kept expanded
    assert estimate(case).result.layout.pp_layout == case.parallel.pp_layout


@pytest.mark.parametrize("parallel, field, words", [
    ({"pp_layout": "Et|(tt|)*30L"}, "parallel.pp_layout", "mtp_layers=1"),
    ({"pp_layout": "Et|(tt|)*29tmL"}, "parallel.pp_layout", "multiple of pp=8"),
    ({"pp_layout": "Et|(tt|)*30ttmL"}, "parallel.pp_layout", "layers=61"),
    ({"pp_layout": "tE|(tt|)*30mL"}, "parallel.pp_layout", "first in the first chunk"),
    ({"pp_layout": "Et|(tt|)*30Lm"}, "parallel.pp_layout", "last in the last chunk"),
    ({"pp_layout": "Et|(tt|)*29m|ttL"}, "parallel.pp_layout", "MTP follows the decoder"),
    ({"pp_layout": "Et|(tx|)*30mL"}, "parallel.pp_layout", "['x']"),
    ({"pp_layout": ""}, "parallel.pp_layout", "non-empty string"),
    ({"pp_layout": 7}, "parallel.pp_layout", "non-empty string"),
    ({"pp_layout": "Et|(tt|)*30mL", "virtual_stages": 2}, "parallel.virtual_stages", "4 per stage"),
    ({"pp_layout": "Et|(tt|)*30mL", "pp": None, "dp": None}, "parallel.pp_layout", "needs parallel.pp"),
    ({"pp_layout": "Et*31|t*30mL", "pp": 1, "dp": 128}, "parallel.pp_layout", "pp=1 runs the model as one"),
])
def test_bad_layouts_name_the_field_and_what_to_change(parallel, field, words):
    with pytest.raises(SpecError) as err:
        parse_case(_case(**parallel))
    assert err.value.field == field and words in str(err.value)


def test_a_negative_mtp_depth_is_refused():
    bad = _case()
    bad["model"]["mtp_layers"] = -1
    with pytest.raises(SpecError) as err:
        parse_case(bad)
    assert err.value.field == "model.mtp_layers"


def replace_mtp(n):
    return replace(DSV3, mtp_layers=n)


def test_mtp_parameters_match_deepseek_v3s_14b():
    # DeepSeek-V3 report: 671B main model + 14B MTP module (the Hugging Face checkpoint's layer 61: one MoE
    # layer, eh_proj W[2D, D], its norms, and its own copies of the embedding and the output head). On the
    # stage with the loss the module shares the output head, so the stage gains all of that but the head
    h, rows = DSV3.hidden, DSV3.vocab * DSV3.hidden
    lay = Layout(dp=1, tp=1, pp=2)
    added = sum(stage_params(DSV3, lay, 1)) - sum(stage_params(replace_mtp(0), lay, 1))
    assert added == layer_params(DSV3, True).total + 2 * h * h + 3 * h + rows
    assert round((added + rows) / 1e9) in (13, 14)  # 13.46B counted: the report's 14B, to its rounding


def test_mtp_flops_add_a_layer_a_projection_and_a_head():
    h, v = DSV3.hidden, DSV3.vocab
    extra = matmul_flops_per_token(DSV3) - matmul_flops_per_token(replace_mtp(0))
    assert extra == 2 * (layer_matmul_params(DSV3, True) + mtp_proj_params(DSV3) + v * h)


def test_an_mtp_module_costs_one_layer_its_own_ops_and_one_more_head_per_micro_batch():
    # one stage, one replica: the step is m x (forward + backward of the whole model), so one MTP module
    # adds m x (an MoE layer + its own ops + one more pass through the output head)
    base = {"name": "v3", "model": {**_case()["model"], "layers": 4, "dense_layers": 1},
            "training": {"global_batch": 4, "micro_batch": 1, "recompute": "none", "zero_stage": 0,
                         "sequence_parallel": False},
            "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1}, "cluster": {"chip": "h100", "num_chips": 1}}
    no_mtp = copy.deepcopy(base)
    no_mtp["model"]["mtp_layers"] = 0
    a, b = estimate(no_mtp).result, estimate(base).result
    lay, chip, m = b.layout, b.chip, b.case.model
    layer = layer_cost(m, lay, chip, "bf16", True, 8)
    per_micro_batch = (layer.fwd_compute_s + layer.bwd_compute_s + sum(mtp_extra_cost(m, lay, chip, "bf16"))
                       + sum(logits_cost(m, lay, chip, "bf16")))
    added = b.step_time_s - a.step_time_s - (b.breakdown["optimizer"] - a.breakdown["optimizer"])
    assert added == pytest.approx(4 * per_micro_batch, rel=1e-9)


def test_the_explanation_says_the_split_is_the_runs_own_and_compares_against_one_stage():
    case = _case(pp_layout="Et|(tt|)*30mL")
    case["training"]["recompute"] = "full"  # 114 GB per chip without it
    report = search(case, top=1)
    pp = next(w for w in report.ranked[0].explanation if w.startswith("PP=8"))
    assert "interleaved-1f1b with v=4, the layers split as the run states" in pp
    assert "would need" in pp  # one stage holding all 61 layers and the MTP module does not fit


def test_a_bad_layout_exits_2_from_the_cli(tmp_path, capsys):
    from planner.__main__ import main
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_case(pp_layout="Et|(tt|)*30L")))
    assert main(["estimate", str(path)]) == 2
    assert "parallel.pp_layout" in capsys.readouterr().err

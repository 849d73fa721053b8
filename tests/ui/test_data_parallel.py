"""The Data parallel / ZeRO lesson: formula helpers by hand, the page through AppTest, one live run."""

import pytest
from streamlit.testing.v1 import AppTest

from tests.ui.apptest_util import open_app
from ui.dp_lesson import LIVE_STRATEGIES, expected_comm_bytes_per_step, expected_memory
from ui.tables import CONTINUATION

PAGE = "app_pages/data_parallel.py"


def _page(**params) -> AppTest:
    return open_app(PAGE, **params)


def test_expected_memory_follows_zero_sharding():
    # Psi = 1000 fp32 params on 4 ranks: DP 4k+4k+8k; ZeRO-1 shards the 8k moments; ZeRO-2 also the
    # gradients; ZeRO-3 everything (16k / 4 = 4k in all).
    assert expected_memory(1000, 0, 4) == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert expected_memory(1000, 1, 4) == {"params": 4000, "grads": 4000, "optimizer": 2000}
    assert expected_memory(1000, 2, 4) == {"params": 4000, "grads": 1000, "optimizer": 2000}
    assert sum(expected_memory(1000, 3, 4).values()) == 4000


def test_expected_comm_is_two_or_three_ring_passes():
    # ring all-reduce of 4 kB over 4 ranks: each rank sends 2 x 3/4 x 4000 = 6000 bytes; ZeRO-3: 9000
    assert expected_comm_bytes_per_step(1000, 0, 4) == 6000
    assert expected_comm_bytes_per_step(1000, 2, 4) == 6000
    assert expected_comm_bytes_per_step(1000, 3, 4) == 9000
    assert expected_comm_bytes_per_step(1000, 1, 4, micro_batches=4) == 6000  # accumulated locally
    assert expected_comm_bytes_per_step(1000, 2, 4, micro_batches=4) == 15000
    assert expected_comm_bytes_per_step(1000, 3, 4, micro_batches=2, last_unit_params=100) == 17400


def test_zero_divides_each_chips_tp_x_pp_shard():
    # GPT-3 175B at tp = 8, pp = 8: each dp rank holds 1/64 of the model, so every stage fits (the page had
    # counted the whole model: "ZeRO-3 350.4 GB, none fits: shard the model" with the model already sharded)
    at = _page(model="GPT-3 175B", chip="h100", dp="8", tp="8", pp="8")
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(m.value for m in at.markdown)
    assert "(each chip's 1/64 shard under tp x pp = 64)" in text and "none fits" not in text
    assert "DP, ZeRO-1, ZeRO-2, ZeRO-3 fit" in text


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy, stage, mb", [("dp", 0, 4), ("dp", 2, 2), ("dp", 2, 4), ("fsdp", 3, 1),
                                                 ("fsdp", 3, 4)])
def test_the_bytes_formula_is_what_the_engine_sends(strategy, stage, mb):
    from engine.config import ParallelConfig, RunConfig
    from engine.run import run

    cfg = RunConfig(world=4, steps=1, micro_batches=mb, parallel=ParallelConfig(strategy=strategy, zero_stage=stage))
    summary, _ = run(cfg, traced=False)
    last = cfg.model.hidden * cfg.model.vocab + cfg.model.hidden
    assert summary.comm_bytes[0] == expected_comm_bytes_per_step(cfg.model.params, stage, 4, mb, last)


def test_page_shows_memory_and_comm_for_the_sidebar_model():
    at = _page(model="Llama 3 70B", chip="h100", dp="64")
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Data parallel, ZeRO and FSDP"
    text = " ".join(m.value for m in at.markdown)
    # Llama 3 70B (~70.6e9 params) at 16 bytes/param is ~1.1 TB under plain DP: nothing fits an 80 GB H100
    # until ZeRO-3 over 64 chips (~17.6 GB).
    assert "ZeRO-3 fits" in text
    charts = [c.key for c in at.get("plotly_chart")]
    assert charts == ["zero_memory", "bound_dp", "bound_fsdp"]  # the live run has not happened yet


@pytest.mark.multiprocess
def test_live_run_matches_the_reference_and_draws_the_timeline():
    at = _page()
    at.select_slider(key="live_world").set_value(2)
    at.selectbox(key="live_strategy").set_value(list(LIVE_STRATEGIES)[4])  # ZeRO-3 / FSDP
    at.select_slider(key="live_steps").set_value(3)
    at.button[0].click().run(timeout=120)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert "matches the single-process reference" in at.success[0].value
    # ZeRO memory; the predicted and the measured step side by side; measured memory
    assert len(at.get("plotly_chart")) == 6  # memory, two bound meters, predicted, measured, live memory
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Measured step time"].endswith(" ms") and metrics["Predicted step time"].endswith(" ms")
    assert metrics["Prediction error"].endswith("%")
    # the steps' spread, with the prediction placed among them
    assert any(c.value.startswith("Its 2 steps after the warm-up took ") and "the prediction, " in c.value
               for c in at.caption)
    text = " ".join(m.value for m in at.markdown)
    assert "Where they differ most" in text or "within 10 % of its predicted time" in text
    assert at.code[0].value.replace(CONTINUATION, " ").startswith(
        ".venv/bin/python -m engine run --strategy fsdp --world 2 --steps 3")
    assert at.get("download_button")



@pytest.mark.parametrize("chip, dp, tokens, verdict", [
    ("tpu-v5p", "4", "2048", "Communication-bound"),  # below 2,550 tokens per chip
    ("tpu-v5p", "4", "4096", "Compute-bound"),
    ("h100", "16", "2048", "Communication-bound"),  # across nodes: 2,475
])
def test_the_bound_meter_gives_the_scaling_books_verdict(chip, dp, tokens, verdict):
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/data_parallel.py", chip=chip, dp=dp, bound_tokens=tokens)
    assert not at.exception
    texts = [m.value for m in at.markdown if "C / W" in m.value and "tokens per chip >" in m.value]
    assert len(texts) == 2 and all(t.startswith(f"**{verdict}**") for t in texts), texts


def test_the_meters_rule_is_in_units_students_read():
    at = _page(chip="h100", dp="8")
    assert not at.exception, [e.value for e in at.exception]
    rules = [m.value for m in at.markdown if "C / W" in m.value and "tokens per chip >" in m.value]
    assert len(rules) == 2, rules
    for rule in rules:  # H100: 989 TFLOP/s of bf16 over 450 GB/s of NVLink (was "9.89e+14 / 4.5e+11")
        assert "C / W = 989 TFLOP/s / 450 GB/s = 2,198" in rule and "e+" not in rule


def test_one_replica_sends_nothing_and_the_page_says_so():
    at = _page(dp="1")
    assert not at.exception, [e.value for e in at.exception]
    captions = " ".join(c.value for c in at.caption)
    assert "no gradient sync" in captions and "1 ranks" not in captions
    assert all("all-reduce (= reduce-scatter" not in str(d.value) for d in [*at.dataframe, *at.table])

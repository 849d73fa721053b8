"""llm-foundry's published throughput tables (planner/data/llmfoundry-sweep.json): the rows are copied
from the README as printed, so these tests check the copy against the README's own arithmetic, and that
every row becomes a case the planner estimates. Test data only: no error threshold here (bench_planner
prints the errors)."""

import json

import pytest

from planner.case import parse_case
from planner.validation import HELDOUT_RUNS, LLMFOUNDRY_SWEEP, llmfoundry_sweep_runs, load_published_runs, validate

# the README's GPU_AVAILABLE_FLOPS: dense bf16 peaks (H100 SXM datasheet 989 TFLOP/s, A100 312)
PEAK = {"h100": 989e12, "a100-80gb": 312e12}


@pytest.fixture(scope="module")
def sweep():
    with open(LLMFOUNDRY_SWEEP) as f:
        return json.load(f)


def _rows(sweep):
    for table in sweep["tables"]:
        for row in table["rows"]:
            yield table, dict(zip(sweep["columns"], row, strict=True))


def test_every_row_reproduces_its_printed_mfu(sweep):
    # README "MFU and HFU": mfu = (3 * 2 N s + 3 * 4 L d s^2) * seq_per_sec / (gpus * peak). MFU is printed
    # to 0.01 points and tokens/s to the unit: 0.05 points covers both roundings; a mistyped leading digit does not
    for table, r in _rows(sweep):
        dims = sweep["models"][r["model"]]
        s = r["seq_len"]
        flops_per_seq = 2 * r["num_params"] * s + 4 * dims["layers"] * dims["hidden"] * s * s
        mfu = 3 * flops_per_seq * r["tokens_per_s"] / s / (r["gpus"] * PEAK[table["chip"]])
        assert abs(100 * mfu - r["mfu_percent"]) < 0.05, (table["title"], r)


def test_every_row_counts_the_parameters_of_its_model(sweep):
    # NumParams = L (12 d^2 + 13 d) + V d + s d + 2 d (models_source): the model dimensions are the right ones
    for _, r in _rows(sweep):
        dims = sweep["models"][r["model"]]
        d, s = dims["hidden"], r["seq_len"]
        assert r["num_params"] == dims["layers"] * (12 * d * d + 13 * d) + dims["vocab"] * d + s * d + 2 * d, r


def test_every_row_states_a_consistent_batch(sweep):
    for _, r in _rows(sweep):
        assert r["global_batch"] == r["micro_batch"] * r["grad_accum"] * r["gpus"], r
        assert r["global_batch_tokens"] == r["global_batch"] * r["seq_len"], r


def test_rows_held_out_elsewhere_are_in_heldout_runs_with_the_same_step_time(sweep):
    heldout = load_published_runs(HELDOUT_RUNS)
    for size, chip, gpus, seq in sweep["held_out_elsewhere"]:
        (r,) = [r for t, r in _rows(sweep)
                if t["chip"] == chip and (r["model"], r["gpus"], r["seq_len"]) == (size, gpus, seq)]
        (run,) = [h for h in heldout if h["name"].startswith(f"llmfoundry-mpt{size}-{chip}-{gpus}gpu-s{seq}")]
        assert run["published"]["step_time_s"] == pytest.approx(r["global_batch_tokens"] / r["tokens_per_s"], rel=1e-3)
        assert run["model"]["hidden"] == sweep["models"][size]["hidden"]


def test_every_row_not_held_out_elsewhere_becomes_a_case_the_planner_estimates(sweep):
    runs = llmfoundry_sweep_runs()
    assert len(runs) == sum(len(t["rows"]) for t in sweep["tables"]) - len(sweep["held_out_elsewhere"])
    assert len({r["name"] for r in runs}) == len(runs)
    for run in runs:
        parse_case(run)
    rows = validate(runs)
    assert all(r.predicted_s > 0 for r in rows)
    # each table's benchmark script chose the kernel: the large-scale sweep ran FlashAttention-2 on 7b
    by_name = {r["name"]: r for r in runs}
    assert by_name["llmfoundry-sweep-mpt7b-h100-512gpu-s2048-mb6"]["training"]["attention"] == "flash"
    assert by_name["llmfoundry-sweep-mpt7b-h100-8gpu-s4096-mb16"]["training"]["attention"] == "flash-triton"

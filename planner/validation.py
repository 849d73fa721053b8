"""Predicted vs published step times of published training runs. Test data only: no constant of the
planner is chosen on them (planner/costs.py, hardware/chips.toml say where each comes from).

Two sets:
* `PUBLISHED_RUNS`: the team's 18 A100 runs. ../shared/validation/published-runs.json is the authority
  for what they are; planner/data/ keeps a copy that adds each run's recipe (overlap fields, with the
  source's words in `recipe_source`), so a clone without ../shared validates too. tests/planner checks
  that the copy agrees with the shared file on every field the shared file has.
* `HELDOUT_RUNS` (planner/data/heldout-runs.json): further published runs on H100, H200, B200, GB200,
  A100 and TPUs, dense and MoE, each with its source and how its step time was derived; kept apart so
  that the planner can be checked on runs it was never looked at while being built.
* `LLMFOUNDRY_SWEEP` (planner/data/llmfoundry-sweep.json): llm-foundry's published throughput tables, MPT
  models of 125M to 70B parameters under PyTorch FSDP on 8 to 512 H100s or A100s, the rows as printed;
  `llmfoundry_sweep_runs` turns each into a case. One source's sweep, kept apart so that it does not
  outweigh the other held-out runs.

* `FEATURE_AB` (planner/data/feature-ab.json): published A/B measurements of one recipe field (the same run
  with it off and on); `feature_ab` gives the gain each predicts beside the one measured.

`attention_stated_only` writes a run as the issue's unseen runs are written (their attention kernel stated,
every other recipe field null), so the held-out runs can be read under that convention too; `validate(...,
bands=True)` adds the step times those null fields span one at a time (planner.api.assumptions), and whether the
published step falls inside.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner.api import assumptions, estimate, step_time_band_s
from planner.case import RECIPE_DEFAULTS
from planner.models import MODEL_PRESETS

# the repository sits beside ../shared (DESIGN.md)
SHARED_PUBLISHED_RUNS = Path(__file__).resolve().parents[2] / "shared" / "validation" / "published-runs.json"
BUNDLED_PUBLISHED_RUNS = Path(__file__).resolve().parent / "data" / "published-runs.json"
PUBLISHED_RUNS = BUNDLED_PUBLISHED_RUNS
HELDOUT_RUNS = Path(__file__).resolve().parent / "data" / "heldout-runs.json"
LLMFOUNDRY_SWEEP = Path(__file__).resolve().parent / "data" / "llmfoundry-sweep.json"
FEATURE_AB = Path(__file__).resolve().parent / "data" / "feature-ab.json"


@dataclass(frozen=True)
class ValidationRow:
    name: str
    source: str
    published_s: float
    predicted_s: float
    mfu: float
    tflops_per_chip: float
    chosen: dict
    fits: bool  # whether the planner's memory estimate fits the chip (every published run did)
    # the fastest and slowest step among the run's null recipe fields' values one at a time (`validate`'s bands)
    band_s: tuple[float, float] | None = None

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return (self.predicted_s - self.published_s) / self.published_s

    @property
    def within_band(self) -> bool | None:
        """Whether the published step lies within the steps the run's unstated recipe fields span (`band_s`); None
        where the row was validated without them."""
        return None if self.band_s is None else self.band_s[0] <= self.published_s <= self.band_s[1]


# Dubey et al. 2024 (Llama 3), Table 4: Llama 3 405B on H100s, TP 8, PP 16, 16M-token batches, BF16 MFU.
# Not used to choose any efficiency: a check that the model transfers to GQA, H100s, FlashAttention, CP.
# (chips, cp, dp, seq_len, global batch in sequences, published MFU)
LLAMA3_TABLE4 = [(8192, 1, 64, 8192, 2048, 0.43), (16384, 1, 128, 8192, 2048, 0.41),
                 (16384, 16, 8, 131072, 128, 0.38)]


def llama3_table4_cases() -> list[tuple[dict, float]]:
    """(case dict, published MFU) for each row of LLAMA3_TABLE4; unpublished choices are left null."""
    m = MODEL_PRESETS["Llama 3 405B"]
    out = []
    for chips, cp, dp, seq, batch, mfu in LLAMA3_TABLE4:
        model = {k: getattr(m, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "mlp")}
        out.append(({"name": f"llama3-405b-{chips}-h100-seq{seq}", "model": {**model, "seq_len": seq},
                     "training": {"global_batch": batch, "dtype": "bf16", "optimizer": "adam"},
                     "parallel": {"tp": 8, "cp": cp, "pp": 16, "dp": dp},
                     "cluster": {"chip": "h100", "num_chips": chips, "chips_per_node": 8}}, mfu))
    return out


def load_published_runs(path: str | Path = PUBLISHED_RUNS) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def llmfoundry_sweep_runs(path: str | Path = LLMFOUNDRY_SWEEP) -> list[dict]:
    """A case per row of llm-foundry's tables (the file's `about`), in heldout-runs.json's format: the layout
    and micro-batch as printed, the attention kernel each table's benchmark script set, the fused
    cross-entropy and the two metrics' cross-entropies, PyTorch's FSDP of the time, Composer's unfused Adam, no
    dropout, the gradient reduction Composer's mixed precision mode sets, every other recipe field null; rows already
    held out elsewhere are skipped."""
    with open(path) as f:
        sweep = json.load(f)
    skip = {tuple(k) for k in sweep["held_out_elsewhere"]}
    runs = []
    for table in sweep["tables"]:
        for row in table["rows"]:
            r = dict(zip(sweep["columns"], row, strict=True))
            size, chip, gpus, seq = r["model"], table["chip"], r["gpus"], r["seq_len"]
            if (size, chip, gpus, seq) in skip:
                continue
            dims = sweep["models"][size]
            runs.append({
                "name": f"llmfoundry-sweep-mpt{size}-{chip}-{gpus}gpu-s{seq}-mb{r['micro_batch']}",
                "source": f"{sweep['source']}; table '{table['title']}' (added in {table['added_in']})",
                "model": {**dims, "kv_heads": dims["heads"], "ffn": 4 * dims["hidden"], "seq_len": seq,
                          "mlp": "gelu", "experts": 0, "top_k": 0, "tied_embeddings": True},
                "training": {"global_batch": r["global_batch"], "micro_batch": r["micro_batch"],
                             "recompute": "full" if r["activation_checkpointing"] else "none", "dtype": "bf16",
                             "optimizer": "adam", "zero_stage": {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}[r["sharding"]],
                             "sequence_parallel": False,
                             "attention": table["attention"].get(size, table["attention"].get("*")),
                             "cross_entropy": sweep["cross_entropy"], "logit_metrics": sweep["logit_metrics"],
                             "fsdp_impl": sweep["fsdp_impl"], "optimizer_fused": sweep["optimizer_fused"],
                             "dropout": sweep["dropout"],
                             "fsdp_backward_prefetch": table["fsdp_backward_prefetch"],
                             # Composer's FSDP mixed precision DEFAULT and PURE reduce in the bf16 param dtype
                             # (composer/trainer/mosaic_fsdp.py get_mixed_precision at v0.16.0); FULL in fp32
                             "grad_reduce_in_fp32": r["mp_mode"] == "FULL"},
                "parallel": {"dp": gpus, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "pp_schedule": None,
                             "virtual_stages": 1},
                "cluster": {"chip": chip, "num_chips": gpus, "chips_per_node": 8},
                "published": {"step_time_s": r["global_batch_tokens"] / r["tokens_per_s"],
                              "mfu": r["mfu_percent"] / 100},
            })
    return runs


@dataclass(frozen=True)
class FeatureAB:
    """One published A/B of a recipe field: the throughput gain measured, and the planner's step time in
    each arm."""

    name: str
    label: str  # the source and the run, in a few words
    field: str
    measured_gain: float
    predicted_s: tuple[float, float]  # with the first arm's value, with the second's

    @property
    def predicted_gain(self) -> float:
        """The throughput gain the planner predicts: the first arm's step over the second's, less one."""
        return self.predicted_s[0] / self.predicted_s[1] - 1


def ab_arm_case(ab: dict, value) -> dict:
    """One arm of an A/B of feature-ab.json: its case with the A/B's field set to `value`."""
    case = {**ab["case"], "name": f"{ab['name']} ({ab['field']} {value})"}
    case["training"] = {**case["training"], ab["field"]: value}
    return case


def feature_ab(path: str | Path = FEATURE_AB) -> list[FeatureAB]:
    """Every A/B of `path` (feature-ab.json's `about`), both arms estimated."""
    with open(path) as f:
        data = json.load(f)
    out = []
    for ab in data["ab"]:
        (off, off_measured), (on, on_measured) = ab["arms"]
        times = tuple(estimate(ab_arm_case(ab, value)).step_time_s for value in (off, on))
        out.append(FeatureAB(ab["name"], ab["label"], ab["field"], on_measured / off_measured - 1, times))
    return out


def checkpointed(run: dict) -> bool:
    """Whether a run recomputes whole layers (activation checkpointing), the split the sweep is read by."""
    return run["training"].get("recompute") == "full"


def attention_stated_only(run: dict) -> dict:
    """The run as the issue's unseen runs are written: the attention kernel as stated, every other recipe
    field (planner.case.RECIPE_DEFAULTS) null, i.e. "what a current framework does on this chip"."""
    out = json.loads(json.dumps(run))
    for key in RECIPE_DEFAULTS:
        if key != "attention" and key in out["training"]:
            out["training"][key] = None
    return out


def validate(runs: list[dict], bands: bool = False) -> list[ValidationRow]:
    """Each run predicted beside its published step; `bands`: with the steps its null recipe fields span
    (`ValidationRow.band_s`)."""
    rows = []
    for run in runs:
        est = estimate(run)
        band = step_time_band_s(est, assumptions(run, est)) if bands else None
        rows.append(ValidationRow(run["name"], run.get("source", ""), run["published"]["step_time_s"],
                                  est.step_time_s, est.mfu, est.tflops_per_chip, est.chosen, est.fits, band))
    return rows


def summarize(rows: list[ValidationRow]) -> tuple[int, float, float]:
    """(runs, mean |error|, max |error|) of validated rows."""
    errors = [abs(r.error) for r in rows]
    return len(errors), sum(errors) / len(errors), max(errors)


def accuracy(runs: list[dict]) -> tuple[int, float, float]:
    """(runs, mean |error|, max |error|) of the planner's step time on published runs."""
    return summarize(validate(runs))


"""The chip table: every chip complete and sourced, sane ratios, and clear errors for bad tables."""

import math
import re

import pytest

from hardware.chips import (
    CHIPS,
    CHIPS_TOML,
    DTYPE_BYTES,
    ChipTableError,
    UnknownChipError,
    chip_fields,
    get_chip,
    load_chips,
)
from hardware.roofline import ridge_point

REQUIRED = ["a100-80gb", "h100", "h200", "b200", "gb200-nvl72", "h800",
            "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "gb300-nvl72", "tpu-v7", "mi300x", "mi355x"]
NUMBER_FIELDS = [f for f in chip_fields() if f not in ("name", "vendor", "kind")]


def test_required_chips_present_with_lower_case_keys():
    assert set(REQUIRED) <= set(CHIPS)
    assert all(key == key.lower() for key in CHIPS)


@pytest.mark.parametrize("key", REQUIRED)
def test_every_number_has_a_source(key):
    chip = CHIPS[key]
    for name in NUMBER_FIELDS:
        assert chip.sources.get(name, "").strip(), f"{key}.{name} has no source"


@pytest.mark.parametrize("key", REQUIRED)
def test_fields_present_and_consistent(key):
    chip = CHIPS[key]
    assert chip.key == key and chip.name and chip.vendor
    for name in ("bf16_flops_per_s", "hbm_bytes", "hbm_bytes_per_s", "scaleup_bytes_per_s",
                 "scaleout_bytes_per_s", "scaleup_latency_s", "scaleout_latency_s"):
        assert getattr(chip, name) > 0
    for name in ("matmul_efficiency", "hbm_efficiency", "link_efficiency"):
        assert 0.5 <= getattr(chip, name) <= 1.0
    # The network is always slower than the scale-up link, and its hop slower to start.
    assert chip.scaleout_bytes_per_s < chip.scaleup_bytes_per_s * (chip.ici_axes * 2 or 1)
    assert chip.scaleout_latency_s >= chip.scaleup_latency_s
    if chip.kind == "gpu":
        assert chip.ici_axes == 0 and chip.torus_shape is None and chip.torus_wrap_multiple == 0
        assert chip.scaleup_domain in (8, 72)
    else:
        assert chip.kind == "tpu"
        assert chip.ici_axes == len(chip.torus_shape) and math.prod(chip.torus_shape) == chip.scaleup_domain
        # fp8 matrix units arrive with TPU7x (Ironwood); v4 to v6e list bf16 and int8 only
        assert (chip.fp8_flops_per_s is None) == (chip.key != "tpu-v7")


@pytest.mark.parametrize("key", REQUIRED)
def test_ridge_points_in_sane_range(key):
    # Every current accelerator needs ~150-600 FLOPs per byte of HBM traffic to be compute-bound.
    assert 100 < ridge_point(CHIPS[key]) < 700
    assert ridge_point(CHIPS[key], achievable=True) == pytest.approx(
        ridge_point(CHIPS[key]) * CHIPS[key].matmul_efficiency / CHIPS[key].hbm_efficiency)


def test_published_values_pinned():
    # Values the worked examples and the validation runs rely on.
    assert get_chip("h100").bf16_flops_per_s == 989e12 and get_chip("h100").hbm_bytes_per_s == 3.35e12
    assert get_chip("h100").scaleup_bytes_per_s == 450e9
    assert get_chip("a100-80gb").bf16_flops_per_s == 312e12
    assert get_chip("tpu-v5p").bf16_flops_per_s == 4.59e14 and get_chip("tpu-v5p").scaleup_bytes_per_s == 9e10
    assert get_chip("tpu-v5e").bf16_flops_per_s == 1.97e14
    assert get_chip("b200").hbm_bytes == 192.3e9  # 183359 MiB, as nvidia-smi shows
    # H800: spec 200 GB/s per direction; DeepSeek-V3's measured 160 GB/s = spec x link_efficiency.
    assert get_chip("h800").scaleup_bw(achievable=True) == pytest.approx(160e9)


def test_fp8_is_twice_bf16_where_present():
    for chip in CHIPS.values():
        if chip.fp8_flops_per_s is not None:
            # Datasheets round each rate on its own (H100: 1,979 vs 2 x 989), hence 0.1%.
            assert chip.fp8_flops_per_s == pytest.approx(2 * chip.bf16_flops_per_s, rel=1e-3)


def test_peak_flops_by_dtype():
    h100 = get_chip("h100")
    assert h100.peak_flops_per_s("bf16") == 989e12
    assert h100.peak_flops_per_s("fp16") == 989e12
    assert h100.peak_flops_per_s("fp8") == 1979e12
    assert h100.peak_flops_per_s("bf16", achievable=True) == pytest.approx(989e12 * h100.matmul_efficiency)
    # fp8 at its own measured share, as hardware.kernels prices fp8 GEMMs
    assert h100.peak_flops_per_s("fp8", achievable=True) == pytest.approx(1979e12 * h100.fp8_matmul_efficiency)
    assert h100.hbm_bw(achievable=True) == pytest.approx(3.35e12 * h100.hbm_efficiency)
    with pytest.raises(ValueError, match="A100 80GB SXM has no fp8 tensor cores; choose bf16"):
        get_chip("a100-80gb").peak_flops_per_s("fp8")
    with pytest.raises(ValueError, match="no fp16 rate"):
        get_chip("tpu-v5e").peak_flops_per_s("fp16")
    with pytest.raises(ValueError, match="unknown dtype 'int4'; H100 SXM supports bf16, fp16, fp8"):
        h100.peak_flops_per_s("int4")
    with pytest.raises(ValueError, match="no fp32"):
        h100.peak_flops_per_s("fp32")
    assert get_chip("a100-80gb").dtypes == ("bf16", "fp16")
    assert DTYPE_BYTES == {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def test_unknown_chip_lists_known_keys():
    with pytest.raises(UnknownChipError) as err:
        get_chip("h1000")
    assert isinstance(err.value, ValueError)
    for key in REQUIRED:
        assert key in str(err.value)
    assert get_chip(" H100 ") is CHIPS["h100"]
    with pytest.raises(UnknownChipError):
        get_chip(None)


# --- malformed copies of chips.toml -------------------------------------------------------------

def _edit(text: str, chip: str, field: str, new_line: str | None) -> str:
    """Replace (or with None, delete) one field's line inside one chip's section."""
    start = text.index(f"[{chip}]\n")
    end = text.find("\n[", start + 1)
    end = len(text) if end < 0 else end
    section = text[start:end]
    pattern = re.compile(rf"^{re.escape(field)} = .*$\n", re.MULTILINE)
    assert pattern.search(section), f"{chip}.{field} not found"
    section = pattern.sub("" if new_line is None else new_line + "\n", section, count=1)
    return text[:start] + section + text[end:]


def _load_edited(tmp_path, chip, field, new_line):
    path = tmp_path / "chips.toml"
    path.write_text(_edit(CHIPS_TOML.read_text(), chip, field, new_line))
    with pytest.raises(ChipTableError) as err:
        load_chips(path)
    return err.value


def test_table_copy_loads_unchanged(tmp_path):
    path = tmp_path / "chips.toml"
    path.write_text(CHIPS_TOML.read_text())
    assert load_chips(path) == CHIPS


@pytest.mark.parametrize(
    ("chip", "field", "new_line", "problem"),
    [
        ("h100", "hbm_bytes", None, "is missing"),
        ("tpu-v5e", "hbm_bytes_per_s", "hbm_bytes_per_s = -8.19e11  # a source", "must be > 0"),
        ("b200", "bf16_flops_per_s", 'bf16_flops_per_s = "fast"  # a source', "must be a number"),
        ("h200", "hbm_bytes", "hbm_bytes = 150.8e9", "has no source"),
        ("a100-80gb", "scaleup_domain", "scaleup_domain = 8.5  # a source", "whole number"),
        ("h100", "link_efficiency", "link_efficiency = 1.3  # a source", "in (0, 1]"),
        ("tpu-v4", "ici_axes", "ici_axes = 2  # a source", "make them agree"),
        ("tpu-v5p", "fp8_flops_per_s", None, 'write "none"'),
        ("h800", "torus_shape", "torus_shape = [8]  # a source", "only TPUs have a torus"),
        ("h100", "kind", 'kind = "fpga"', "must be one of"),
        ("tpu-v6e", "torus_shape", 'torus_shape = [16, "x"]  # a source', "positive integers"),
        ("mi300x", "tp_comm_overlap", 'tp_comm_overlap = "yes"  # a source', "true or false"),
        ("h100", "tp_comm_overlap", None, "is missing"),
        ("a100-80gb", "tp_comm_overlap", "tp_comm_overlap = false", "has no source"),
    ],
)
def test_malformed_table_names_chip_and_field(tmp_path, chip, field, new_line, problem):
    err = _load_edited(tmp_path, chip, field, new_line)
    assert err.chip == chip and err.field == field
    assert f"chip {chip!r}" in str(err) and f"field {field!r}" in str(err) and problem in str(err)


def test_unknown_field_is_named(tmp_path):
    path = tmp_path / "chips.toml"
    path.write_text(CHIPS_TOML.read_text().replace("[h100]\n", "[h100]\nhbm_gb = 80  # a source\n"))
    with pytest.raises(ChipTableError, match="chip 'h100', field 'hbm_gb': is not a chip field"):
        load_chips(path)


def test_invalid_toml_is_a_clear_error_not_a_traceback(tmp_path):
    path = tmp_path / "chips.toml"
    path.write_text(CHIPS_TOML.read_text().replace("hbm_bytes = 85.5e9", "hbm_bytes = = 85.5e9", 1))
    with pytest.raises(ChipTableError, match="is not valid TOML") as err:
        load_chips(path)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ChipTableError, match="cannot read the chip table"):
        load_chips(tmp_path / "nope.toml")


def test_hash_in_a_url_stays_in_the_source(tmp_path):
    path = tmp_path / "chips.toml"
    line = "hbm_bytes = 80e9  # https://example.com/spec#memory"
    text = _edit(CHIPS_TOML.read_text(), "h100", "hbm_bytes", line)
    path.write_text(text)
    assert load_chips(path)["h100"].sources["hbm_bytes"] == "https://example.com/spec#memory"


def test_continued_source_comment_is_joined():
    assert "Why not 180e9" in get_chip("b200").sources["hbm_bytes"]


def test_importing_hardware_does_not_import_torch():
    # The planner and the pages use hardware/ without torch; only hardware.probe imports it, lazily.
    import subprocess
    import sys

    code = "import sys, hardware; assert 'torch' not in sys.modules, 'torch was imported'"
    repo_root = CHIPS_TOML.parent.parent
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=repo_root)


def test_hand_made_chip_is_validated_too():
    from dataclasses import replace

    with pytest.raises(ChipTableError, match="chip 'h100', field 'hbm_bytes_per_s': must be > 0"):
        replace(get_chip("h100"), hbm_bytes_per_s=0.0)
    with pytest.raises(ChipTableError, match="field 'torus_wrap_multiple'"):
        replace(get_chip("tpu-v5e"), torus_wrap_multiple=0)

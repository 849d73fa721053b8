"""The chip table: facts about one accelerator, loaded from ``chips.toml``.

``chips.toml`` is the one place to add a chip. Every number there carries its source in a comment on
the same line (continued on the following comment-only lines); the loader keeps those comments as
``Chip.sources`` so the pages can show where each number comes from, and refuses a number without one.

Units: FLOP/s, bytes, bytes/s, seconds. Link bandwidths are per direction.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
KINDS = ("gpu", "tpu", "cpu")
CHIPS_TOML = Path(__file__).with_name("chips.toml")

# Fields a chip entry in chips.toml must have, in the order the table shows them.
_TEXT_FIELDS = ("name", "vendor", "kind", "scaleup_topology")
_NUMBER_FIELDS = (
    "bf16_flops_per_s",
    "fp8_flops_per_s",
    "hbm_bytes",
    "hbm_bytes_per_s",
    "scaleup_bytes_per_s",
    "ici_axes",
    "scaleout_bytes_per_s",
    "scaleup_domain",
    "torus_shape",
    "torus_wrap_multiple",
    "scaleup_latency_s",
    "scaleout_latency_s",
    "matmul_efficiency",
    "hbm_efficiency",
    "link_efficiency",
    "matmul_half_area",
    "matmul_half_k",
    "fp8_matmul_efficiency",
    "attention_efficiency",
    "flash3_efficiency",
    "attention_head_dim_64",
    "flash3_head_dim_64",
    "norm_efficiency",
    "norm_bwd_efficiency",
    "scaleup_fill_s",
    "scaleout_fill_s",
    "scaleout_efficiency",
)
# Yes/no facts (TOML true / false), sourced like the numbers: what current software does on the chip.
_BOOL_FIELDS = ("tp_comm_overlap", "deepep_dispatch")
# Fields where the TOML value "none" means "this chip has no such thing".
_NONE_ALLOWED = ("fp8_flops_per_s", "torus_shape", "fp8_matmul_efficiency", "flash3_efficiency",
                 "attention_head_dim_64", "flash3_head_dim_64")
_INT_FIELDS = ("ici_axes", "scaleup_domain", "torus_wrap_multiple")
# Whole-number fields where 0 means "not a TPU".
_ZERO_ALLOWED = ("ici_axes", "torus_wrap_multiple", "scaleup_fill_s", "scaleout_fill_s")
_FRACTION_FIELDS = ("matmul_efficiency", "hbm_efficiency", "link_efficiency", "fp8_matmul_efficiency",
                    "attention_efficiency", "flash3_efficiency", "attention_head_dim_64", "flash3_head_dim_64",
                    "norm_efficiency", "norm_bwd_efficiency",
                    "scaleout_efficiency")
SCALEUP_TOPOLOGIES = ("switch", "mesh", "torus")


class ChipTableError(ValueError):
    """A chip entry is malformed; the message names the chip, the field and what to change."""

    def __init__(self, chip: str, field_name: str | None, problem: str):
        self.chip = chip
        self.field = field_name
        where = f"chip {chip!r}" + (f", field {field_name!r}" if field_name else "")
        super().__init__(f"{where}: {problem}")


class UnknownChipError(ValueError):
    """Asked for a chip key that is not in the table."""


@dataclass(frozen=True)
class Chip:
    key: str
    name: str
    vendor: str
    kind: str  # "gpu" | "tpu" | "cpu" (the probed machine)
    bf16_flops_per_s: float  # dense, no structured sparsity
    fp8_flops_per_s: float | None  # None where the chip has no fp8 matrix unit
    hbm_bytes: float
    hbm_bytes_per_s: float
    scaleup_bytes_per_s: float  # GPU: NVLink of one GPU, per direction; TPU: ONE ICI link, one direction
    ici_axes: int  # 0 for GPUs; TPU torus dimensionality
    scaleout_bytes_per_s: float  # per chip, per direction (InfiniBand / RoCE / DCN)
    scaleup_domain: int  # GPUs per NVLink domain; TPU: chips in the largest ICI slice
    torus_shape: tuple[int, ...] | None  # TPU: the slice shape collectives are mapped onto; None for GPUs
    torus_wrap_multiple: int  # TPU: an ICI axis whose length is a multiple of this has wraparound; 0 for GPUs
    scaleup_latency_s: float  # alpha per hop
    scaleout_latency_s: float  # alpha per hop
    matmul_efficiency: float  # achievable fraction of peak FLOP/s for large matmuls
    hbm_efficiency: float  # achievable fraction of HBM bandwidth
    link_efficiency: float  # achievable fraction of link bandwidth for large messages
    # kernel and collective efficiencies by shape and size (chips.toml header; hardware/kernels.py)
    matmul_half_area: float  # GEMM output area M*N at which the output-size factor is 1/2
    matmul_half_k: float  # GEMM inner dimension at which the K factor is 1/2
    fp8_matmul_efficiency: float | None  # sustained fp8 GEMM rate over the fp8 peak; None without fp8
    attention_efficiency: float  # FlashAttention-2 fwd+bwd FLOP/s at long sequences over peak
    flash3_efficiency: float | None  # the chip's newer attention kernels (FA3, cuDNN, FA4); None if none
    attention_head_dim_64: float | None  # FlashAttention-2's rate at head dim 64 over 128; None: not measured
    flash3_head_dim_64: float | None  # the newer kernels' at head dim 64 over 128; None: not measured or none
    norm_efficiency: float  # fused norm / softmax kernels, forward, over HBM peak
    norm_bwd_efficiency: float  # their backward
    scaleup_fill_s: float  # pipeline fill of one scale-up collective (measured NCCL curves' ramp)
    scaleout_fill_s: float  # the same over the scale-out network
    scaleout_efficiency: float  # achievable fraction of the NIC line rate
    scaleup_topology: str = "switch"  # "switch" | "mesh" | "torus" (chips.toml header)
    # a current framework pipelines TP collectives with their GEMMs on this chip (the recipe's null
    # tp_comm_overlap, planner.case.recipe)
    tp_comm_overlap: bool = False
    # a current framework sends MoE tokens once per destination node on this chip (DeepEP / HybridEP: the
    # recipe's null ep_dispatch, planner.case.recipe)
    deepep_dispatch: bool = False
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    fp32_flops_per_s: float | None = None  # only the probed CPU sets it: GPU/TPU tables quote bf16 and fp8
    # Not a table field: the share of its measured kernel rates a job's slowest chip reaches, set for a
    # cluster by planner.costs.cluster_chip (a synchronous step goes at the slowest chip's pace); 1 for one chip.
    pace: float = 1.0

    def __post_init__(self):
        _validate(self)

    def peak_flops_per_s(self, dtype: str, achievable: bool = False) -> float:
        """Dense matmul FLOP/s for ``dtype``; ``achievable`` scales by ``matmul_efficiency`` (fp8: by
        ``fp8_matmul_efficiency``)."""
        if dtype == "fp8":
            if self.fp8_flops_per_s is None:
                raise ValueError(f"{self.name} has no fp8 tensor cores; choose bf16")
            peak = self.fp8_flops_per_s
        elif dtype == "bf16":
            peak = self.bf16_flops_per_s
        elif dtype == "fp16":
            # GPU datasheets list FP16 at the bf16 rate; TPU matrix units take bf16, not fp16, and the
            # probe does not time fp16 on a CPU.
            if self.kind != "gpu":
                raise ValueError(f"{self.name} has no fp16 rate in this model; choose bf16")
            peak = self.bf16_flops_per_s
        elif dtype == "fp32":
            if self.fp32_flops_per_s is None:
                raise ValueError(
                    f"the table has no fp32 matmul rate for {self.name}; choose bf16"
                    + (" or fp8" if self.fp8_flops_per_s is not None else "")
                )
            peak = self.fp32_flops_per_s
        else:
            raise ValueError(f"unknown dtype {dtype!r}; {self.name} supports {', '.join(self.dtypes)}")
        if not achievable:
            return peak
        # fp8 GEMMs sustain their own share of the fp8 peak (the table's measured fp8 MSMF; hardware.kernels
        # prices them with it too): the bf16 share had shown H100 at 1,371 TFLOP/s for a measured 1,269
        return peak * (self.fp8_matmul_efficiency if dtype == "fp8" else self.matmul_efficiency)

    def hbm_bw(self, achievable: bool = False) -> float:
        """HBM bytes/s; ``achievable`` scales by ``hbm_efficiency``."""
        return self.hbm_bytes_per_s * (self.hbm_efficiency if achievable else 1.0)

    def scaleup_bw(self, achievable: bool = False) -> float:
        return self.scaleup_bytes_per_s * (self.link_efficiency if achievable else 1.0)

    def scaleout_bw(self, achievable: bool = False) -> float:
        return self.scaleout_bytes_per_s * (self.scaleout_efficiency if achievable else 1.0)

    @property
    def scaleup_link(self) -> str:
        """The name of the chip's scale-up links, as pages and messages say it: NVLink (NVIDIA), Infinity Fabric
        (AMD's GPUs), ICI (TPUs)."""
        if self.kind == "tpu":
            return "ICI"
        return "NVLink" if self.vendor == "NVIDIA" else "Infinity Fabric" if self.kind == "gpu" else "scale-up links"

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes ``peak_flops_per_s`` accepts for this chip."""
        out = ["bf16"] + (["fp16"] if self.kind == "gpu" else [])
        if self.fp8_flops_per_s is not None:
            out.append("fp8")
        if self.fp32_flops_per_s is not None:
            out.append("fp32")
        return tuple(out)


def _validate(chip: Chip) -> None:
    """The one place a chip's numbers are checked, for table entries and hand-made chips alike."""
    if not 0 < chip.pace <= 1:
        raise ChipTableError(chip.key, "pace", f"must be in (0, 1], got {chip.pace!r}")
    for name in _TEXT_FIELDS:
        value = getattr(chip, name)
        if not isinstance(value, str) or not value.strip():
            raise ChipTableError(chip.key, name, f"must be a non-empty string, got {value!r}")
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(chip, name), bool):
            raise ChipTableError(chip.key, name, f"must be true or false, got {getattr(chip, name)!r}")
    if chip.kind not in KINDS:
        raise ChipTableError(chip.key, "kind", f"must be one of {KINDS}, got {chip.kind!r}")
    if chip.scaleup_topology not in SCALEUP_TOPOLOGIES:
        raise ChipTableError(chip.key, "scaleup_topology",
                             f"must be one of {SCALEUP_TOPOLOGIES}, got {chip.scaleup_topology!r}")
    if (chip.kind == "tpu") != (chip.scaleup_topology == "torus"):
        raise ChipTableError(chip.key, "scaleup_topology", 'TPUs and only TPUs have a "torus" scale-up domain')
    if (chip.fp8_flops_per_s is None) != (chip.fp8_matmul_efficiency is None):
        raise ChipTableError(chip.key, "fp8_matmul_efficiency",
                             'give it exactly when fp8_flops_per_s is a number ("none" for both otherwise)')
    for name in _NUMBER_FIELDS + ("fp32_flops_per_s",):
        value = getattr(chip, name)
        if value is None:
            if name in _NONE_ALLOWED or name == "fp32_flops_per_s":
                continue
            raise ChipTableError(chip.key, name, "is missing")
        if name == "torus_shape":
            if not (isinstance(value, tuple) and value and all(_is_int(v) and v > 0 for v in value)):
                raise ChipTableError(chip.key, name, f"must be a list of positive integers, got {value!r}")
            continue
        if not _is_number(value):
            raise ChipTableError(chip.key, name, f"must be a number, got {value!r}")
        if name in _INT_FIELDS and not _is_int(value):
            raise ChipTableError(chip.key, name, f"must be a whole number, got {value!r}")
        if value < 0 or (value == 0 and name not in _ZERO_ALLOWED):
            allowed = ">= 0" if name in _ZERO_ALLOWED else "> 0"
            raise ChipTableError(chip.key, name, f"must be {allowed}, got {value!r}")
        if name in _FRACTION_FIELDS and value > 1:
            raise ChipTableError(chip.key, name,
                                 f"is a fraction of peak and must be in (0, 1], got {value!r}")
    if chip.kind == "tpu":
        if chip.torus_shape is None:
            raise ChipTableError(chip.key, "torus_shape", "a TPU needs its slice shape, e.g. [16, 16, 16]")
        if chip.ici_axes != len(chip.torus_shape):
            raise ChipTableError(
                chip.key, "ici_axes", f"is {chip.ici_axes} but torus_shape {chip.torus_shape} has "
                f"{len(chip.torus_shape)} axes; make them agree"
            )
        if math.prod(chip.torus_shape) != chip.scaleup_domain:
            raise ChipTableError(
                chip.key, "scaleup_domain", f"is {chip.scaleup_domain} but torus_shape {chip.torus_shape} "
                f"holds {math.prod(chip.torus_shape)} chips; make them agree"
            )
        if chip.torus_wrap_multiple < 1:
            raise ChipTableError(chip.key, "torus_wrap_multiple", "a TPU needs the axis length that wraps "
                                 "around (4 for v4/v5p, 16 for v5e/v6e)")
    elif chip.torus_shape is not None or chip.ici_axes != 0 or chip.torus_wrap_multiple != 0:
        raise ChipTableError(chip.key, "torus_shape", f"only TPUs have a torus; set torus_shape to \"none\" "
                             f"and ici_axes and torus_wrap_multiple to 0 for a {chip.kind}")


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return _is_number(value) and float(value).is_integer()


_ASSIGNMENT = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=\s*(.*)$")
_SECTION = re.compile(r"^\s*\[\s*([A-Za-z0-9_\-]+)\s*\]\s*(#.*)?$")


def _comment_after_value(value_text: str) -> str | None:
    """The comment text after a TOML value on one line; a '#' inside a quoted string is not a comment."""
    if value_text.startswith('"'):
        end = value_text.find('"', 1)
        rest = value_text[end + 1:] if end >= 0 else ""
    else:
        rest = value_text
    hash_at = rest.find("#")
    return rest[hash_at + 1:].strip() if hash_at >= 0 else None


def _source_comments(text: str) -> dict[str, dict[str, str]]:
    """Per chip section, per field: the comment beside the value plus the comment-only lines under it."""
    comments: dict[str, dict[str, str]] = {}
    section: str | None = None
    last_field: str | None = None
    for line in text.splitlines():
        if match := _SECTION.match(line):
            section, last_field = match.group(1), None
            comments.setdefault(section, {})
            continue
        stripped = line.strip()
        if section is None or not stripped:
            last_field = None
            continue
        if stripped.startswith("#"):
            if last_field is not None:
                more = stripped.lstrip("#").strip()
                comments[section][last_field] = f"{comments[section][last_field]} {more}".strip()
            continue
        if match := _ASSIGNMENT.match(line):
            last_field = match.group(1)
            comment = _comment_after_value(match.group(2).strip())
            if comment is None:
                last_field = None
            else:
                comments[section][last_field] = comment
    return comments


def load_chips(path: str | Path = CHIPS_TOML) -> dict[str, Chip]:
    """Read a chip table; any problem becomes a ChipTableError that names the chip and the field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ChipTableError(str(path), None, f"cannot read the chip table: {exc}") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ChipTableError(str(path), None, f"is not valid TOML ({exc}); fix that line") from None
    comments = _source_comments(text)
    chips: dict[str, Chip] = {}
    for key, entry in table.items():
        if not isinstance(entry, dict):
            raise ChipTableError(key, None, "must be a table: write [" + key + "] and its fields below it")
        if key != key.lower():
            raise ChipTableError(key, None, f"chip keys are lower-case; rename it to {key.lower()!r}")
        chips[key] = _chip_from_entry(key, entry, comments.get(key, {}))
    if not chips:
        raise ChipTableError(str(path), None, "holds no chips")
    return chips


def _chip_from_entry(key: str, entry: dict, comments: dict[str, str]) -> Chip:
    known = set(_TEXT_FIELDS) | set(_NUMBER_FIELDS) | set(_BOOL_FIELDS)
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ChipTableError(key, unknown[0], f"is not a chip field; the fields are {sorted(known)}")
    values: dict = {}
    for name in _TEXT_FIELDS + _NUMBER_FIELDS:
        if name not in entry:
            raise ChipTableError(key, name, "is missing" + (' (write "none" if the chip has none)'
                                                            if name in _NONE_ALLOWED else ""))
        value = entry[name]
        if name in _NUMBER_FIELDS:
            if value == "none" and name in _NONE_ALLOWED:
                value = None
            elif isinstance(value, str):
                raise ChipTableError(key, name, f"must be a number, got the string {value!r}")
            elif name == "torus_shape":
                if not isinstance(value, list):
                    raise ChipTableError(key, name, f"must be a list like [16, 16], got {value!r}")
                value = tuple(int(v) if _is_int(v) else v for v in value)
            elif name in _INT_FIELDS and _is_int(value):
                value = int(value)
            elif _is_number(value):
                value = float(value)
            if name not in comments or not comments[name]:
                raise ChipTableError(key, name, "has no source: add '# <datasheet URL or paper, table>' "
                                     "after the value")
        values[name] = value
    for name in _BOOL_FIELDS:  # true / false itself is checked with every chip's fields (_validate)
        if name not in entry:
            raise ChipTableError(key, name, "is missing (write true or false)")
        if not comments.get(name):
            raise ChipTableError(key, name, "has no source: add '# <where it says so>' after the value")
        values[name] = entry[name]
    if not comments.get("scaleup_topology"):
        raise ChipTableError(key, "scaleup_topology", "has no source: add '# <where it says so>' after the value")
    sources = {name: comments[name] for name in (*_NUMBER_FIELDS, *_BOOL_FIELDS, "scaleup_topology")}
    return Chip(key=key, sources=sources, **values)


def chip_fields() -> tuple[str, ...]:
    """Field names of a table entry, in display order (text fields first)."""
    return _TEXT_FIELDS + _NUMBER_FIELDS + _BOOL_FIELDS


CHIPS: dict[str, Chip] = load_chips()


def get_chip(key: str) -> Chip:
    """Look a chip up by its table key, e.g. ``"h100"``; an unknown key names the known ones."""
    if isinstance(key, str) and key in CHIPS:
        return CHIPS[key]
    if isinstance(key, str) and key.strip().lower() in CHIPS:
        return CHIPS[key.strip().lower()]
    raise UnknownChipError(f"unknown chip {key!r}; known chips: {', '.join(sorted(CHIPS))}")


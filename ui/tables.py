"""Table builders and the units numbers are read in: pure functions, data in, rows or text out
(st.dataframe takes a list of dicts)."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from planner.presets import TOKENS_PER_BATCH, default_global_batch

NO_VALUE = "—"

CHIP_COLUMN_HELP = {
    "bf16 TFLOP/s": "Peak dense matrix-multiply rate in bf16 (C).",
    "fp8 TFLOP/s": "Peak dense rate in fp8; a dash where the chip has no fp8 matrix units.",
    "HBM GB": ("High-bandwidth memory per chip: what weights, gradients, optimizer state and activations share. "
               "In 10^9 bytes, as software sees it: an '80GB' H100 shows 81,559 MiB in nvidia-smi, 85.5 GB."),
    "HBM TB/s": "Memory bandwidth (W_hbm): how fast the matrix units can be fed.",
    "Ridge FLOP/B": "C / W_hbm: the arithmetic intensity an operation needs to be compute-bound.",
    "Scale-up GB/s": "NVLink per GPU, or ICI per link for TPUs (W_ici; the domain says how many links), one direction.",
    "Scale-out GB/s": "InfiniBand / RoCE / data-centre network share of one chip, one direction.",
    "Scale-up domain": "How many chips the fast links join: an NVLink node, an NVL72 rack, a TPU torus slice.",
}


# A command line's lines at most this many characters (`shell_lines`): a code block in a lesson 466 px wide (an 800 px
# window with the sidebar open) holds about 50 of them
COMMAND_LINE_CHARS = 50
CONTINUATION = " \\\n    "  # how `shell_lines` continues a command on its next line


def shell_lines(command: str, chars: int = COMMAND_LINE_CHARS) -> str:
    """`command` (one or more shell commands, a line each) with each longer than `chars` continued on further lines
    (" \\", then indented), broken between arguments and never between a flag and its value: wrapped by the
    browser, a flag had been cut in two at its hyphen ("--kv-" / "heads"). Quoting and $VARIABLES stay as written."""
    out = []
    for line in command.replace("\\\n", " ").splitlines():  # a continuation already written: one line
        lexer = shlex.shlex(line, posix=False)
        lexer.whitespace_split, lexer.commenters = True, ""
        words = list(lexer)
        groups: list[str] = []
        for word in words:  # a flag and the value after it stay together
            if groups and groups[-1].startswith("-") and " " not in groups[-1] and not word.startswith("-"):
                groups[-1] += " " + word
            else:
                groups.append(word)
        lines = [""]
        for group in groups:  # each line within `chars` with its indent and its " \\"
            if lines[-1] and len(lines[-1]) + 1 + len(group) > chars - 2 - (4 if len(lines) > 1 else 0):
                lines.append(group)
            else:
                lines[-1] = f"{lines[-1]} {group}" if lines[-1] else group
        out.append(CONTINUATION.join(lines))
    return "\n".join(out)


def chip_table_rows(chips: Iterable) -> list[dict]:
    """One row per chip, in the units people quote (TFLOP/s, GB, TB/s, GB/s)."""
    rows = []
    for c in chips:
        # the links a TPU has in its domain's column: in the scale-up one ("45 per link x 6 links") the text was
        # cut at 1,280 px and pushed the domain out of view
        if c.kind == "tpu":
            shape = f"{'x'.join(map(str, c.torus_shape))} torus" if c.torus_shape else f"{c.scaleup_domain} chips"
            domain = f"{shape}, {2 * c.ici_axes} links a chip"
        else:
            domain = f"{c.scaleup_domain} GPUs"
        # the roofline's three numbers first (the rate, the bandwidth, their ratio), which the lesson uses next:
        # at 800 px the grid shows four columns, and the ridge point had been the sixth
        rows.append({
            "Chip": c.name,
            "bf16 TFLOP/s": round(c.bf16_flops_per_s / 1e12),
            "HBM TB/s": round(c.hbm_bytes_per_s / 1e12, 2),
            "Ridge FLOP/B": round(c.bf16_flops_per_s / c.hbm_bytes_per_s),
            # text: a table draws a missing number as "None"
            "fp8 TFLOP/s": f"{c.fp8_flops_per_s / 1e12:.0f}" if c.fp8_flops_per_s else NO_VALUE,
            "HBM GB": round(c.hbm_bytes / 1e9, 1),
            # short headers: at 1,280 px the long ones ("Scale-up GB/s per direction") pushed the last two
            # columns out of view; each column's help and the caption say per direction, per chip
            "Scale-up GB/s": round(c.scaleup_bytes_per_s / 1e9),
            "Scale-out GB/s": round(c.scaleout_bytes_per_s / 1e9, 1),
            "Scale-up domain": domain,
        })
    return rows


def count(n: int, noun: str) -> str:
    """A count with its noun, singular for one: "1 chip", "8 chips", "2 processes"."""
    if n == 1:
        return f"{n:,} {noun}"
    return f"{n:,} {noun}{'es' if noun.endswith(('s', 'x', 'ch', 'sh')) else 's'}"


def format_bytes(nbytes: float) -> str:
    """Binary units, as array sizes are usually quoted: 32 MiB, 1.5 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{nbytes:.0f} B"


def three_figures(value: float, unit: str) -> str:
    """`value` to three significant figures, a thousand or more whole and with separators ("1,234 h")."""
    return f"{value:,.0f} {unit}" if float(f"{value:.3g}") >= 1000 else f"{value:.3g} {unit}"


def format_seconds(seconds: float) -> str:
    """Three significant figures in the unit a student reads: ns, µs, ms, s, min, h. The unit is chosen after
    rounding, so 0.99996 s reads "1 s" (not "1e+03 ms") and 119.96 s "2 min" (not "120 s")."""
    rounded = float(f"{seconds:.3g}")
    if rounded >= 7200:  # a student reads hours, not 5.72e+04 s
        return three_figures(seconds / 3600, "h")
    if rounded >= 120:
        return f"{seconds / 60:.3g} min"
    if rounded >= 1:
        return f"{seconds:.3g} s"
    if rounded >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    if rounded >= 1e-6 or seconds <= 0:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e9:.3g} ns"  # a tiny matmul: 0.01 µs read "0.00 µs" of math


def step_unit(seconds: float) -> tuple[float, str]:
    """The unit a step of `seconds` is read in, as (seconds in one unit, its name): seconds while the step reads
    under 120 to the hundredth, then minutes and from two hours hours, as format_seconds switches (chosen after
    its rounding). One rule for everything that says a step: the metric, the span of steps around it, the time
    axis of its timeline (ui.timeline)."""
    if round(seconds, 2) < 120:
        return 1.0, "s"
    return (3600.0, "h") if float(f"{seconds:.3g}") >= 7200 else (60.0, "min")


def format_step(seconds: float, unit_of: float | None = None) -> str:
    """A step time as a metric shows it: seconds to the hundredth, a long one in minutes or hours to three figures
    (a metric's column is narrow). `unit_of`: the step whose unit (`step_unit`) this time is said in, so that a
    span of steps around it reads in the unit the step does."""
    scale, unit = step_unit(seconds if unit_of is None else unit_of)
    return f"{seconds:,.2f} s" if unit == "s" else three_figures(seconds / scale, unit)


def _decimal(value: float, unit: str, prefixes: tuple[tuple[str, float], ...]) -> str:
    for prefix, scale in prefixes:
        if value >= scale:
            scaled = value / scale
            return f"{scaled:,.0f} {prefix}{unit}" if scaled >= 100 else f"{scaled:.3g} {prefix}{unit}"
    return f"{value:,.3g} {unit}"


def format_flops(flops: float) -> str:
    """Decimal units, as datasheets quote them: 4.29 GFLOP, 157 MFLOP."""
    return _decimal(flops, "FLOP", (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)))


def format_flops_per_s(flops_per_s: float) -> str:
    """In TFLOP/s, as the chips table quotes C: 989 TFLOP/s, 2,250 TFLOP/s."""
    return _decimal(flops_per_s, "FLOP/s", (("T", 1e12), ("G", 1e9), ("M", 1e6)))


def format_bytes_per_s(bytes_per_s: float) -> str:
    """Decimal units, as bandwidths are quoted: 450 GB/s, 3.35 TB/s."""
    return _decimal(bytes_per_s, "B/s", (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)))


def batch_words(seq_len: int, chips: int, published: int | None = None) -> str:
    """That batch in words: "134,217,728 tokens per step (16,384 sequences of 8,192: ...)"; `published`: a
    published run's own batch (sequences), said as such."""
    sequences = published or default_global_batch(seq_len, chips)
    words = f"{sequences * seq_len:,} tokens per step ({sequences:,} sequences of {seq_len:,}"
    if published:
        words += ", as published"
    elif sequences * seq_len > 1.5 * TOKENS_PER_BATCH:
        words += f": one per chip, more than the planner's usual {TOKENS_PER_BATCH / 2**20:.0f}M tokens"
    return words + ")"


def search_counts(report) -> str:
    """What a layout search did (planner.layout_search.SearchResult), in words: how many layouts divide the model
    and the batch (`considered`, counted before any pruning), how many simulations ranked them (`evaluated`: the
    layouts' ZeRO and recomputation variants each one, so they may outnumber the layouts), and that any others
    were ruled out unsimulated, by memory or by a bound on their step (the search's pruning): "considered" had
    read as if every layout had been simulated with its variants."""
    layouts = f"{report.considered:,} {'layout divides' if report.considered == 1 else 'layouts divide'}"
    searched = f"{layouts} the model and the batch, searched in {report.elapsed_s:.2f} s"
    if not report.considered:
        return searched
    if not report.evaluated:
        return f"{searched}: none fits in memory, so none was simulated"
    return (f"{searched}: {report.evaluated:,} simulations of them and their ZeRO and recomputation variants; "
            "any others were ruled out unsimulated, by memory or by a bound on their step time")

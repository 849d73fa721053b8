"""The choices every page shares (model preset, chip, mesh shape), read from URL query parameters.

Pure: no Streamlit here. `app.py` binds the sidebar widgets to the same query-parameter names, so a
teacher can share a link that opens the same view; this module checks what a link carries before the
widgets see it, so a bad link gives a message saying what was wrong and which default is used.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from core.mesh import Mesh

MESH_AXES = ("dp", "tp", "pp", "cp", "ep")
MESH_AXIS_HELP = {
    "dp": "data parallel: replicas that each see a slice of the batch",
    "tp": "tensor parallel: each matmul split across chips (inside a node)",
    "pp": "pipeline parallel: layers split into stages",
    "cp": "context parallel: the sequence split across chips",
    "ep": "expert parallel: MoE experts spread across chips",
}
MAX_AXIS_DEGREE = 65536
DEFAULT_MESH = {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1}


@dataclass(frozen=True)
class Choices:
    model: str
    chip: str
    mesh: dict[str, int]

    @property
    def num_chips(self) -> int:
        n = 1
        for degree in self.mesh.values():
            n *= degree
        return n

    def device_mesh(self) -> Mesh:
        """The sidebar's mesh under the one mesh convention (core/mesh.py): rank order, strides."""
        return Mesh(self.mesh)

    def mesh_label(self) -> str:
        """e.g. 'dp=8 x tp=4' (axes of degree 1 left out)."""
        parts = [f"{axis}={d}" for axis, d in self.mesh.items() if d > 1]
        return " x ".join(parts) or "1 chip"


def _positive_int(text: str) -> int | None:
    """A sidebar size from a link: a whole number in ASCII digits ("²", "٣" and "2.5" are not one) from 1 to
    MAX_AXIS_DEGREE, or None."""
    text = str(text).strip()
    if not text.isascii():
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 1 <= value <= MAX_AXIS_DEGREE else None


LINK_VALUE_CHARS = 60  # the most of a link's value a message repeats


def link_value(text) -> str:
    """A value from a link as a message quotes it: in a code span, so Markdown shows it as typed (a link or
    markup in it stays text), and cut to LINK_VALUE_CHARS characters. An empty or blank one is said in words:
    Markdown shows an empty code span as two backticks ("Unknown chip `` in the link")."""
    text = str(text)
    if not text.strip():
        return "(empty)" if not text else "(blank)"
    if len(text) > LINK_VALUE_CHARS:
        text = text[:LINK_VALUE_CHARS] + "…"
    return "`" + text.replace("`", "'").replace("\n", " ") + "`"


def inert_markdown(message: str) -> str:
    """A message that may repeat what a user typed (a layer pattern, a link's value), with the characters that
    would make Markdown links, HTML, code, LaTeX or emphasis of it escaped: [ ] < > ` $ * _ ~."""
    return "".join("\\" + c if c in "[]<>`$*_~" else c for c in message)


def parse_choices(
    params: Mapping[str, str],
    chip_keys: Iterable[str],
    model_names: Iterable[str],
    default_chip: str,
    default_model: str,
    page_params: Iterable[str] = (),
) -> tuple[Choices, list[str]]:
    """Read the shared choices from query parameters; every unusable value becomes a message.

    Unknown parameters are reported too (a typo like `chp=h100` should not pass silently);
    `page_params` names the parameters that pages bind their own widgets to.
    """
    chip_keys, model_names = list(chip_keys), list(model_names)
    problems: list[str] = []

    chip = params.get("chip", default_chip)
    if chip not in chip_keys:
        problems.append(f"Unknown chip {link_value(chip)} in the link; using {default_chip}. "
                        f"Known chips: {', '.join(chip_keys)}.")
        chip = default_chip

    model = params.get("model", default_model)
    if model not in model_names:
        problems.append(f"Unknown model preset {link_value(model)} in the link; using {default_model}.")
        model = default_model

    mesh = dict(DEFAULT_MESH)
    for axis in MESH_AXES:
        if axis in params:
            value = _positive_int(params[axis])
            if value is None:
                problems.append(f"Mesh size {axis}={link_value(params[axis])} is not a whole number from 1 to "
                                f"{MAX_AXIS_DEGREE}; using {axis}={DEFAULT_MESH[axis]}.")
            else:
                mesh[axis] = value

    known = {"chip", "model", *MESH_AXES, *page_params}
    unknown = sorted(k for k in params if k not in known and not k.startswith("_"))
    if unknown:
        problems.append(unknown_params_message(unknown, known))
    return Choices(model, chip, mesh), problems


UNKNOWN_LISTED = 5  # unknown link parameters named one by one; the rest are counted


def unknown_params_message(unknown: list[str], known: Iterable[str]) -> str:
    """What a link's unknown parameters are told: the first few by name, each with the known one it is
    closest to (a misspelt "chp" reads "did you mean `chip`?"), the rest counted. Every page and the Lab
    together know about a hundred names: listing them all had buried the one a typo meant."""
    known = sorted(known)
    named = []
    for key in unknown[:UNKNOWN_LISTED]:
        close = difflib.get_close_matches(key[:64], known, n=1)
        named.append(link_value(key) + (f" (did you mean {link_value(close[0])}?)" if close else ""))
    more = len(unknown) - UNKNOWN_LISTED
    return (f"Ignored unknown link parameter(s): {', '.join(named)}"
            + (f" and {more} more" if more > 0 else "") + ". The sidebar's are chip, model and "
            + ", ".join(MESH_AXES) + "; each page's own are in the link it writes.")


def choice_link_problems(params: Mapping[str, str | list[str]],
                         options: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """A page's bound choices in a link (`options`: each key's options as its widget writes them in the link) that
    are none of them, each with what it takes: Streamlit's bound widgets drop such a value without a word, so the
    page says so (`ignored_link_message`) and takes it out of the link first. The widgets take one value each: a
    repeated key is dropped too, whatever its values (`?tp_micro_batch=2&tp_micro_batch=4` had put the slider back
    to its default silently). A value that is not a finite number is left to the app's own check
    (`non_finite_params`)."""
    bad = {}
    finite = set(params) - set(non_finite_params(params))
    for key, allowed in options.items():
        if key not in finite:
            continue
        allowed = [str(o) for o in allowed]
        values = params[key] if isinstance(params[key], list) else [params[key]]
        if len(values) != 1 or str(values[0]) not in allowed:
            bad[key] = ("one of " if len(values) == 1 else "one value, one of ") + ", ".join(allowed)
    return bad


def slider_link_problems(params, ranges: dict[str, tuple[float, float]]) -> dict[str, str]:
    """`choice_link_problems` for bound number sliders (`ranges`: key -> (lowest, highest)): a link value
    the slider drops without a word, one that is no number or out of its range (or repeated: a single slider
    takes one), each with what it takes. A value that is no finite number is left to the app's own check."""
    bad = {}
    finite = set(params) - set(non_finite_params(params))
    for key, (lo, hi) in ranges.items():
        if key not in finite:
            continue
        values = params[key] if isinstance(params[key], list) else [params[key]]
        try:
            ok = len(values) == 1 and lo <= float(str(values[0]).strip()) <= hi
        except ValueError:
            ok = False
        if not ok:
            bad[key] = f"one number from {lo:g} to {hi:g}"
    return bad


def ignored_link_message(bad: Mapping[str, str], params: Mapping[str, str]) -> str:
    """What a page tells about its own link values it ignores (`bad`: key -> what it takes), as the Lab does."""
    return ("Ignored from the link: " + "; ".join(f"{k}={link_value(params[k])} (it takes {what})"
                                                 for k, what in bad.items())
            + ". The page's own values are used instead.")


def non_finite_params(params: Mapping[str, str]) -> list[str]:
    """Link parameters whose value reads as an infinite or not-a-number float ("inf", "NaN", "1e999"):
    Streamlit's bound number widgets fail on them instead of falling back to their default, so the app
    drops them from the link before any widget reads it."""
    bad = []
    for key, value in params.items():
        for text in (value if isinstance(value, list) else [value]):
            try:
                number = float(str(text).strip())
            except ValueError:
                continue
            if not math.isfinite(number):
                bad.append(key)
                break
    return bad


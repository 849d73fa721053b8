"""Which model chunk holds which layers: the pipeline split, by default or as a run states it.

A model runs as p * v chunks in model order; chunk g sits on stage g % p as its virtual chunk g // p
(Megatron-LM's interleaved placement, Narayanan et al. 2021 sec. 2.2.2). By default the decoder layers
spread as evenly as possible (the first chunks take the remainder), the embedding sits on chunk 0 and the
output layer and loss on the last, after any multi-token-prediction modules (Megatron-Core puts MTP on
the last pipeline stage).

A run may state its split in Megatron-Core's `pipeline_model_parallel_layout` syntax (its docs, "Custom
Pipeline Model Parallel Layout"): one letter per piece, chunks separated by "|": E the embedding, t a
decoder layer, m a multi-token-prediction module, L the output layer and loss; "x*n" repeats a letter
and "(...)*n" a group; commas and spaces are ignored. DeepSeek-V3 on H100 at p = 8, v = 4
(Megatron-Bridge's performance script) is "Et|(tt|)*30mL": the embedding and one layer, thirty chunks
of two, and a last chunk of MTP + loss.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

LAYOUT_PIECES = "EtmL"
_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_LETTER = re.compile(r"([EtmL])\*(\d+)")


@dataclass(frozen=True)
class Chunk:
    """One model chunk: decoder layers first .. first + layers - 1 and what else it holds."""
    first: int
    layers: int
    embedding: bool = False
    mtp: int = 0  # multi-token-prediction modules
    loss: bool = False


def holds_word_embedding(m, chunks) -> bool:
    """Whether a stage with these chunks holds the word embedding matrix: for its lookup (E), a
    multi-token-prediction module's lookup of the next tokens (m, Megatron-Core), or an output head tied to
    it (L with tied embeddings)."""
    return any(c.embedding or c.mtp or (c.loss and m.tied_embeddings) for c in chunks)


def holds_untied_head(m, chunks) -> bool:
    """Whether a stage with these chunks holds an output projection of its own (L, untied embeddings)."""
    return not m.tied_embeddings and any(c.loss for c in chunks)


def expand_layout(text: str, limit: int | None = None) -> str:
    """The layout with every repetition written out, e.g. "E|(tt|)*2L" -> "E|tt|tt|L"; raises ValueError
    saying what is wrong. `limit`: the most characters a layout of the model can have; a repeat that would write
    out more is refused before it is written, and so is a layout written out that long."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"must be a non-empty string such as \"Et|(tt|)*30mL\", got {text!r}")
    out = text.replace(",", "").replace(" ", "")
    too_long = f"into more than the {limit} characters a layout of this model can have: check the repeat counts"

    def repeat(g):
        if len(g.group(2)) > 9:  # no layout repeats a piece a billion times; int() of thousands of digits refuses
            raise ValueError(f"repeats a piece {g.group(2)[:12]}... times, a count of {len(g.group(2)):,} digits: "
                             "check the repeat counts")
        if limit is not None and len(g.group(1)) * int(g.group(2)) > limit:
            raise ValueError(f"repeats {g.group(0)!r} {too_long}")
        return g.group(1) * int(g.group(2))

    while True:
        expanded = _GROUP.sub(repeat, out)
        if expanded == out:
            break
        if limit is not None and len(expanded) > limit:
            raise ValueError(f"writes out {too_long}")
        out = expanded
    out = _LETTER.sub(repeat, out)
    if limit is not None and len(out) > limit:
        raise ValueError(f"writes out {too_long}")
    bad = sorted(set(out) - set(LAYOUT_PIECES + "|"))
    if bad:
        raise ValueError(f"has {bad} after expanding repeats; use E (embedding), t (decoder layer), m (MTP "
                         "module), L (loss), | between chunks, x*n and (...)*n to repeat")
    return out


def check_layout(chunks: tuple[str, ...], layers: int, mtp_layers: int, pp: int) -> None:
    """Raise ValueError unless the expanded chunks hold the model once, in order, on whole stages."""
    if len(chunks) % pp:
        raise ValueError(f"has {len(chunks)} chunks, not a multiple of pp={pp} (one chunk per stage and virtual "
                         "stage)")
    text = "".join(chunks)
    if text.count("t") != layers:
        raise ValueError(f"has {text.count('t')} decoder layers (t), the model has layers={layers}")
    if text.count("m") != mtp_layers:
        raise ValueError(f"has {text.count('m')} MTP modules (m), the model has mtp_layers={mtp_layers}")
    if text.count("E") != 1 or not chunks[0].startswith("E"):
        raise ValueError("needs one E (embedding), first in the first chunk")
    if text.count("L") != 1 or not chunks[-1].endswith("L"):
        raise ValueError("needs one L (output layer and loss), last in the last chunk")
    if "m" in text and text.rfind("t") > text.find("m"):
        raise ValueError("puts an MTP module (m) before a decoder layer (t); MTP follows the decoder")


def _even_sizes(layers: int, chunks: int) -> list[int]:
    """Layers per model chunk in model order, spread as evenly as possible (the first take the remainder)."""
    base, extra = divmod(layers, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


def layer_split(layers: int, stages: int, virtual: int = 1) -> list[list[int]]:
    """Layers per model chunk for each stage of the even split: [stage][virtual chunk]."""
    sizes = _even_sizes(layers, stages * virtual)
    return [[sizes[c * stages + i] for c in range(virtual)] for i in range(stages)]


@lru_cache(maxsize=4096)
def model_chunks(layers: int, mtp_layers: int, pp: int, virtual: int, pp_layout: str | None = None
                 ) -> tuple[Chunk, ...]:
    """Every chunk in model order; `pp_layout` the expanded layout (`expand_layout`), None the default."""
    if pp_layout is None:
        sizes = _even_sizes(layers, pp * virtual)
        last = pp * virtual - 1
        starts = [0, *accumulate(sizes)]
        return tuple(Chunk(starts[g], n, g == 0, mtp_layers if g == last else 0, g == last)
                     for g, n in enumerate(sizes))
    pieces = pp_layout.split("|")
    if len(pieces) != pp * virtual:
        raise ValueError(f"the layout has {len(pieces)} chunks for pp x v = {pp * virtual}")
    starts = [0, *accumulate(p.count("t") for p in pieces)]
    return tuple(Chunk(starts[g], p.count("t"), "E" in p, p.count("m"), "L" in p) for g, p in enumerate(pieces))


@lru_cache(maxsize=1024)
def stage_chunks(layers: int, mtp_layers: int, pp: int, virtual: int, pp_layout: str | None = None
                 ) -> tuple[tuple[Chunk, ...], ...]:
    """[stage][virtual chunk]: model chunk c * pp + i sits on stage i."""
    chunks = model_chunks(layers, mtp_layers, pp, virtual, pp_layout)
    return tuple(tuple(chunks[c * pp + i] for c in range(virtual)) for i in range(pp))


def chunks_of(m, lay) -> tuple[tuple[Chunk, ...], ...]:
    """[stage][virtual chunk] of a model (`planner.models.ModelSpec`) under a layout (`planner.case.Layout`)."""
    return stage_chunks(m.layers, m.mtp_layers, lay.pp, lay.virtual_stages, lay.pp_layout)

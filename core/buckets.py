"""Data parallel's gradient buckets (torch DDP's scheme), one definition for the engine (engine/dp.py, which
all-reduces them) and the planner's prediction of a live run (planner/live.py, which times them).

Parameters are taken in reverse order (the order backward produces their gradients), one open bucket per
reduction group; a bucket closes when it holds at least `bucket_bytes`, a group's first one already at
`first_bucket_bytes` (DDP's first bucket, so that communication starts early in backward). A parameter with
no group (no other rank holds a replica of it) is in no bucket. Buckets are numbered in the order they
close, then the groups' last, partly filled ones in the order the groups first appeared.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

# torch DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB)
FIRST_BUCKET_BYTES = 1024 * 1024


def plan_buckets(params: Iterable[tuple[Hashable, int, str | None]], bucket_bytes: int,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> list[tuple[str, list]]:
    """`params`: (key, bytes of its gradient, reduction group or None) in the model's order; returns
    [(group, [keys])] per bucket, as the module docstring says."""
    out: list[tuple[str, list]] = []
    open_buckets: dict[str, tuple[list, list[int]]] = {}
    started: set[str] = set()
    for key, nbytes, group in reversed(list(params)):
        if group is None:
            continue
        keys, size = open_buckets.setdefault(group, ([], [0]))
        keys.append(key)
        size[0] += nbytes
        if size[0] >= (bucket_bytes if group in started else min(bucket_bytes, first_bucket_bytes)):
            out.append((group, keys))
            started.add(group)
            del open_buckets[group]
    return out + [(group, keys) for group, (keys, _) in open_buckets.items()]

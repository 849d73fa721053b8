"""Whether a schedule can run: every stage's F and B (or BI and BW) of every micro-batch once, on its own
rank, and every message sent before it is received."""

from __future__ import annotations

from core.schedules.build import (
    ACTIVATION,
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMPUTE_KINDS,
    FORWARD,
    RECV,
    SEND,
    Action,
    Schedule,
    ScheduleError,
)


def _peaks(order: tuple[Action, ...]) -> tuple[int, int]:
    held = pending = peak_held = peak_pending = 0
    for a in order:
        held += {FORWARD: 1, BACKWARD: -1, BACKWARD_INPUT: -1}.get(a.kind, 0)
        pending += {BACKWARD_INPUT: 1, BACKWARD_WEIGHT: -1}.get(a.kind, 0)
        peak_held, peak_pending = max(peak_held, held), max(peak_pending, pending)
    return peak_held, peak_pending


def check_schedule(schedule: Schedule) -> None:
    """Every stage runs F and B (or BI and BW) of every micro-batch once, on its own rank; every SEND
    has one RECV on the right peer. Dependencies and deadlocks are `simulate`'s to find."""
    p, m, num_stages = schedule.num_ranks, schedule.num_micro_batches, schedule.num_stages
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for {p} ranks")
    seen: dict[tuple[str, int, int], int] = {}
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if not (0 <= a.stage < num_stages and 0 <= a.micro_batch < m):
                raise ScheduleError(f"{schedule.name}: rank {rank} has {a}, outside {num_stages} stages "
                                    f"and {m} micro-batches")
            if a.stage % p != rank or a.chunk != a.stage // p:
                raise ScheduleError(f"{schedule.name}: rank {rank} has {a}, "
                                    f"whose stage is on rank {a.stage % p}")
            if a.is_compute:
                key = (a.kind, a.micro_batch, a.stage)
                seen[key] = seen.get(key, 0) + 1
            else:
                _, _, sender_stage = a.message
                receiver_stage = a.stage if a.kind == RECV else (
                    sender_stage + 1 if a.tensor == ACTIVATION else sender_stage - 1)
                if not 0 <= receiver_stage < num_stages or a.peer != (
                        receiver_stage if a.kind == SEND else sender_stage) % p:
                    raise ScheduleError(f"{schedule.name}: rank {rank} has {a}, whose peer is wrong")
                key = (a.kind, *a.message)
                seen[key] = seen.get(key, 0) + 1
    backward_kinds = (BACKWARD_INPUT, BACKWARD_WEIGHT) if schedule.split_backward else (BACKWARD,)
    for kind in (FORWARD,) + backward_kinds:
        for stage in range(num_stages):
            for mb in range(m):
                if seen.get((kind, mb, stage), 0) != 1:
                    raise ScheduleError(f"{schedule.name}: {kind} of micro-batch {mb} on stage {stage} runs "
                                        f"{seen.get((kind, mb, stage), 0)} times, must run once")
    computes = sum(1 for key in seen if key[0] in COMPUTE_KINDS)
    if computes != (1 + len(backward_kinds)) * num_stages * m:
        raise ScheduleError(f"{schedule.name}: mixes fused B with split BI/BW")
    for key, count in seen.items():
        if key[0] == SEND and (count != 1 or seen.get((RECV, *key[1:])) != 1):
            raise ScheduleError(f"{schedule.name}: message {key[1:]} is sent {count} times and received "
                                f"{seen.get((RECV, *key[1:]), 0)} times, must be once each")
        if key[0] == RECV and (SEND, *key[1:]) not in seen:
            raise ScheduleError(f"{schedule.name}: message {key[1:]} is received but never sent")

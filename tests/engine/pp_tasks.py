"""Pipeline tasks for tests that inject faults into a real schedule (run on the workers)."""

from unittest import mock

from engine import train
from engine.pipeline import executor as pp


def crash_in_schedule(ctx, cfg, rank: int, after_actions: int):
    """Run the pipeline, but `rank` raises after `after_actions` of its schedule's actions."""
    run_action, done = pp.Pipeline.run_action, [0]

    def failing(self, action):
        if ctx.rank == rank:
            if done[0] == after_actions:
                raise RuntimeError(f"injected failure on rank {rank} before {action}")
            done[0] += 1
        return run_action(self, action)

    with mock.patch.object(pp.Pipeline, "run_action", failing):
        return train.run_rank(ctx, cfg)

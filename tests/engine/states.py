"""States gathered from real runs, and their bit-for-bit comparison (shared by the strategy and mesh tests)."""

import torch


def states(pool, cfg):
    """Rank 0's gathered state after every step of `cfg` on `pool`."""
    results = pool.run("engine.train:run_rank", {"cfg": cfg, "traced": False, "return_states": True})
    return results[0]["states"]


def assert_equal_states(a, b, label):
    for step, (sa, sb) in enumerate(zip(a, b, strict=True)):
        for quantity in ("grads", "params", "exp_avg", "exp_avg_sq"):
            for name, t in sa[quantity].items():
                assert torch.equal(t, sb[quantity][name]), f"{label}: step {step} {quantity} {name}"

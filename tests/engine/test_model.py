"""Single-process checks of the pieces every strategy builds on: model, AdamW, reference, verify."""

import dataclasses

import pytest
import torch

from engine.config import ModelConfig, RunConfig
from engine.model import build_model, global_batch, loss_fn
from engine.optim import AdamW, adamw_
from engine.reference import reference_run
from engine.verify import compare


def test_model_is_deterministic_from_seed_and_moe_runs():
    for mlp in ("dense", "moe"):
        m = ModelConfig(mlp=mlp)
        a, b = build_model(m, seed=3), build_model(m, seed=3)
        for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(pa, pb), na  # same seed, same construction order: bit-identical
        tokens, targets = global_batch(m, 3, 0, 2)
        loss = loss_fn(a(tokens), targets)
        # Small init: the first prediction is close to uniform over the 256-token vocabulary.
        assert loss.item() == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)


def test_adamw_matches_torch_single_tensor_adamw_exactly():
    h = AdamW(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    torch.manual_seed(0)
    ours = torch.randn(50)
    theirs = torch.nn.Parameter(ours.clone())
    opt = torch.optim.AdamW([theirs], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                            weight_decay=h.weight_decay, foreach=False)
    m, v = torch.zeros(50), torch.zeros(50)
    for step in range(1, 4):
        g = torch.randn(50)
        theirs.grad = g.clone()
        opt.step()
        adamw_(ours, g, m, v, step, h)
        # Same elementwise operations in the same order: no tolerance needed.
        assert torch.equal(ours, theirs.detach())


def test_verify_catches_a_gradient_that_was_not_averaged():
    cfg = RunConfig(world=2, steps=2)
    ref = reference_run(cfg)
    snaps = [{"params": s.params, "grads": {n: g * 2 for n, g in s.grads.items()}, "exp_avg": s.exp_avg,
              "exp_avg_sq": s.exp_avg_sq} for s in ref]
    result = compare(cfg, ref, snaps, [s.loss for s in ref])
    assert not result["passed"] and any("grads" in f for f in result["failures"])
    ok = compare(cfg, ref, [dataclasses.asdict(s) for s in ref], [s.loss for s in ref])
    assert ok["passed"] and ok["max_abs_diff"] == 0.0


def test_verify_params_bound_adds_up_per_step_and_still_catches_a_skipped_update():
    cfg = RunConfig(world=2, steps=3)
    ref = reference_run(cfg)

    def moved(by_lr: float, step: int) -> dict:
        """Every step's state equal to the reference's, except one weight moved at `step` and after."""
        snaps = [dataclasses.asdict(s) for s in ref]
        for s in snaps[step:]:
            name = next(iter(s["params"]))
            s["params"] = dict(s["params"], **{name: s["params"][name] + by_lr * cfg.lr})
        return compare(cfg, ref, snaps, [s.loss for s in ref])

    # 0.1 lr of difference per step taken: 0.15 lr is too much after one step, within bound after three.
    assert not moved(0.15, 0)["passed"]
    assert moved(0.15, 2)["passed"]
    # A step not applied leaves the weight a whole lr away (Adam moves every weight by about lr).
    assert not moved(1.0, 2)["passed"]


def test_unit_flops_add_up_to_six_n_per_token_plus_attention():
    from engine.model import param_count, unit_forward_flops

    m = ModelConfig()
    forward = sum(unit_forward_flops(m, i, 1) for i in range(m.layers + 2))
    attention = m.layers * 4 * m.seq_len * m.seq_len * m.hidden
    embed = m.vocab * m.hidden
    norms = m.hidden * (2 * m.layers + 1)
    # Kaplan et al. 2020: forward = 2 N per token for the matmul weights N (no embedding, no norms).
    assert forward == 2 * m.seq_len * (param_count(m) - embed - norms) + attention


@pytest.mark.parametrize("m", [ModelConfig(), ModelConfig(mlp="moe", experts=4, top_k=2),
                               ModelConfig(layers=3, hidden=96, heads=6, kv_heads=3, ffn=200, vocab=300)])
def test_counted_parameters_match_the_built_model(m):
    from engine.model import param_count

    assert m.params == param_count(m)

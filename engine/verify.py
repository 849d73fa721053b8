"""Compare a strategy's gathered state with the single-process reference, step by step.

Each quantity has its own tolerance and the reason for it. The strategies never reproduce the
reference bit for bit: the reference takes one mean over the global batch, a strategy takes a mean per
micro-batch per rank and then sums over ranks, so floating-point additions happen in another order
(and BLAS blocks a smaller matmul differently). The differences start at float32 rounding (~1e-7
relative) and Adam's normalisation m / sqrt(v) can enlarge them for gradients near zero, so parameters
get a tolerance proportional to the learning rate rather than pure rounding.

A run that repeats the reference's arithmetic (engine.reference.reproduces_reference: on the CPU, no axis but pp)
is compared bit for bit, every quantity in either precision, against the reference given the run's own
micro-batches. Other equalities that are exact (ZeRO against plain data parallel with the same reduction
order) are asserted in the tests, not here. A mixed-precision (bf16) run has its own, looser tolerances
(`BF16_TOLERANCES`), measured against the same precision's single-process run.
"""

from __future__ import annotations

import hashlib

import torch

from engine.config import RunConfig
from engine.model import build_model
from engine.optim import AdamW
from engine.reference import reproduces_reference

# quantity -> (rtol, atol, why)
TOLERANCES: dict[str, tuple[float, float, str]] = {
    "loss": (1e-5, 1e-6, "a mean of per-rank means vs one mean: fp32 summation order differs"),
    "grads": (1e-4, 1e-5, "per-rank partial sums then an all-reduce vs one backward over the whole batch; "
                          "from step 2 on the weights already differ (see params), so the gradients do too "
                          "(measured up to 2e-6); and every tensor within 1e-4 of its norm (NORM_REL_FIRST: a "
                          "gradient whose elements are all below atol is still compared). After a weight's "
                          "rounding-decided Adam step, from the next step a tensor need only be within 1e-3 of "
                          "its norm (DIVERGED_REL; measured 2e-5 apart elementwise)"),
    "exp_avg": (1e-4, 1e-6, "a linear mix of gradients: inherits their error, scaled by (1 - beta1)"),
    "exp_avg_sq": (1e-3, 1e-9, "squares of gradients: twice their relative error, tiny absolute values"),
    "params": (0.0, 0.0, "Adam's step is about lr per weight whatever the gradient's size, so a "
                          "rounding-level gradient difference on a near-zero gradient moves the weight by a "
                          "fraction of lr, and each step's difference adds to the last (momentum carries it "
                          "even where the next gradient is 0): atol = PARAM_ATOL_LR x lr x steps taken "
                          "(measured per step up to 0.011 lr at world 4 and 0.056 lr on pp=2,cp=2,tp=2 with "
                          "2 micro-batches, whose gradients agree to 5e-7: there 0.050, 0.056, 0.108 lr "
                          "after steps 1-3); where both runs' gradient history is near zero (Adam's "
                          "sqrt(v_hat) < 1e-6, 100 x its eps) rounding decides the step's sign: 2 lr for that step. "
                          "No relative part: fp32 rounds a weight by 6e-8 of itself, far under lr (an rtol of "
                          "1e-4 had added 0.1 lr to a norm weight of 1)"),
}
PARAM_ATOL_LR = 0.1
EXACT_WORDS = ("bit for bit: this layout repeats the reference's arithmetic (engine.reference.reproduces_reference)")
# Adam moves a weight by lr x m_hat / (sqrt(v_hat) + eps): where its gradients so far are all near zero
# (sqrt(v_hat) under NEAR_ZERO_GRAD, 100 x Adam's eps, engine.optim), the step turns from -lr to +lr on a sign that
# rounding decides, so two runs' steps may differ by up to ADAM_FLIP_LR x lr. A weight gets that bound in a step
# only where BOTH runs' sqrt(v_hat) are this small: a sharding bug that leaks a gradient into a weight whose true
# gradient is 0 shows a larger v_hat on its own side and keeps the strict bound (a reviewer's case: a 5e-6 leak,
# within the gradients' atol, moving the weight by lr). Measured: Mamba-2 at tp=2, 2 SSM groups, seed 0: 0.104 lr
# after one step on out_proj, whose gradients agree to 1e-9.
NEAR_ZERO_GRAD = 1e-6
ADAM_FLIP_LR = 2.0


# Once a weight has taken a rounding-decided Adam step, so that the two runs' weights differ by more than the
# strict params bound (PARAM_ATOL_LR x lr a step) anywhere in the model (up to ADAM_FLIP_LR x lr where `flips`
# allows it), from the next step every gradient differs by each weight's sensitivity to it, not by rounding: then
# a tensor need only be this close to the reference in norm (measured: Mamba-2 at tp=2, 2 SSM groups, seed 0,
# after such a step: elements 2e-5 apart, 2.7e-4 of the norm). Until then every step keeps the first step's
# bounds, elementwise and NORM_REL_FIRST (measured on dense layouts at later steps: up to 8.2e-6 of the norm); a
# norm-only 1e-3 from the second step on had let a gradient 5e-4 too large pass (a reviewer's case). The switch
# reads the weights, not `flips`: an embedding row of a token not in the batch has an Adam scale of zero in both
# runs and takes no step at all, and a `flips` count had switched every run at step 2.
DIVERGED_REL = 1e-3

# The elementwise bounds' absolute floors (atol) are larger than every element of some tensors' gradients
# (Mamba-2's A_log and conv biases: all below 7e-6), so a tensor whose gradient came out at half its size passed
# them (a reviewer's case), and Adam's step, which ignores a gradient's scale, hid it in the weights too. So the
# gradients and moments must also be this close to the reference in norm: NORM_REL_FIRST at the first step
# (measured up to 2.4e-6 of the norm on 10 fp32 layouts, dense, MoE, Mamba-2 and hybrid at 2-8 ranks), then
# DIVERGED_REL (measured up to 2.7e-4, once the weights differ).
NORM_REL_FIRST = 1e-4


def _weights_diverged(ref: dict, run: dict, atol: float) -> bool:
    """Whether some weight of `run` is farther than `atol` from the reference's (DIVERGED_REL)."""
    for name, b in ref.items():
        a = run.get(name)
        if a is not None and torch.as_tensor(a).shape == b.shape and \
                bool(((torch.as_tensor(a).double() - b.double()).abs() > atol).any()):
            return True
    return False


def param_atol(lr: float, steps: int) -> float:
    """The params bound after `steps` optimizer steps (TOLERANCES["params"]) for weights whose gradients were never
    near zero (`NEAR_ZERO_GRAD`)."""
    return PARAM_ATOL_LR * lr * steps


def adam_scale(exp_avg_sq: torch.Tensor, step: int, beta2: float = AdamW.beta2) -> torch.Tensor:
    """Adam's denominator before eps, sqrt(v_hat), after optimizer step `step` (1-based: engine.optim.adamw_)."""
    return (exp_avg_sq.double() / (1 - beta2 ** step)).sqrt()


def flips(ref_exp_avg_sq: torch.Tensor, run_exp_avg_sq: torch.Tensor, step: int) -> torch.Tensor:
    """Where rounding decides the sign of Adam's step `step` (1-based): both runs' sqrt(v_hat) near zero."""
    return (adam_scale(ref_exp_avg_sq, step) < NEAR_ZERO_GRAD) & (adam_scale(run_exp_avg_sq, step) < NEAR_ZERO_GRAD)


def param_atol_by_element(lr: float, flipped: list[torch.Tensor]) -> torch.Tensor:
    """Each weight's params bound after the steps whose `flips` masks are `flipped`: PARAM_ATOL_LR x lr a step,
    ADAM_FLIP_LR x lr in a step where rounding decides its sign."""
    per_step = [torch.where(f, torch.tensor(ADAM_FLIP_LR, dtype=torch.float64),
                            torch.tensor(PARAM_ATOL_LR, dtype=torch.float64)) for f in flipped]
    return lr * torch.stack(per_step).sum(0)

# Mixed precision (dtype bfloat16, engine.model.mixed_precision) against the single-process run in the same
# precision. bf16 keeps 8 significant bits, so every matmul output is rounded to about 2^-9 relative, and
# each layout rounds at other points (a tensor-parallel partial sum, a shorter batch, a context slice): the
# differences are noise of that size, not rounding of fp32's 2^-24, and an element near zero can differ by
# more than itself. So tensors are compared by the norm of their difference against their own norm.
# quantity -> (relative L2 error allowed, why); measured on 15 layouts at 2-8 ranks (dense, Mamba-2, hybrid).
BF16_TOLERANCES: dict[str, tuple[float, str]] = {
    "loss": (5e-4, "relative: a mean over thousands of bf16-rounded logits (measured up to 7e-5)"),
    "grads": (0.03, "||a - b|| / ||b||: dense layers differ by 1-2 % (measured up to 1.6 %); a Mamba-2 mixer's "
                    "parameters get BF16_SSM_GRADS (A_log measured up to 7 %: its gradient is a small sum of many "
                    "large bf16 terms)"),
    "exp_avg": (0.1, "a linear mix of the gradients: their relative error or less (measured up to 4 %)"),
    "exp_avg_sq": (0.1, "squares of the gradients (measured up to 5 %)"),
    "params": (2.0, "max |a - b| in units of lr per step: Adam moves a weight by about lr whatever its "
                    "gradient's size, so a near-zero gradient whose sign differs moves it the other way (up to "
                    "2 lr per step; measured 4.8 lr after 3 steps); and the weights' move since they were "
                    "initialised within BF16_UPDATE_REL of the reference's, in norm"),
}
# A Mamba-2 mixer's parameters (engine/mamba.py: its projections, per-head parameters and convolutions) take
# gradients summed over every position through the scan's long bf16 products: 0.1 of the norm for them (A_log
# measured up to 7 %; in_dt, in_b, in_c and D up to 3.4 % under tp = 2); the rest keep 0.03, where 0.1 for every
# tensor had let a dense gradient 4 % too large pass (a reviewer's case).
BF16_SSM_GRADS = 0.1
BF16_SSM_PARAMS = (".mixer.",)  # engine.model's name of a Mamba-2 block's mixer


def bf16_grads_bound(name: str) -> float:
    """The relative L2 bound of one tensor's bf16 gradient (BF16_TOLERANCES["grads"], BF16_SSM_GRADS)."""
    return BF16_SSM_GRADS if any(part in name for part in BF16_SSM_PARAMS) else BF16_TOLERANCES["grads"][0]


# 2 lr per step is more than a whole Adam step (about lr): a run whose weights never moved passed it after one step
# (a reviewer's case). So the move itself is compared: ||a - b|| <= BF16_UPDATE_REL ||b - initial|| (measured up to
# 0.25, a norm's weights after one step, on 12 bf16 layouts at 2-8 ranks; weights that never moved give 1).
BF16_UPDATE_REL = 0.5


# Replicas. The reference is compared with one rank's gathered state per pipeline stage; every other rank of the
# stage gathers the same full state from its own copies (a dp replica's weights, a tp rank's norm, an ep rank's
# dense layers), and those must agree bit for bit: replicas apply the same reduced gradients in the same order
# (a collective gives every rank the same sum). So each rank hashes its gathered state after every step
# (`state_digest`), and `replica_failures` names any copy that differs from the one compared.


def state_digest(state: dict[str, dict[str, torch.Tensor]]) -> dict[tuple[str, str], str]:
    """(quantity, name) -> a hash of the tensor's bytes, for comparing replicas (the comment above)."""
    out = {}
    for quantity, tensors in state.items():
        for name, t in tensors.items():
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[(quantity, name)] = hashlib.blake2b(raw, digest_size=16).hexdigest()
    return out


def replica_failures(reports: list[tuple[int, list[dict], list[list[str]]]]) -> list[str]:
    """Each rank's (pipeline stage, digest after each step, copies it found differing after each step), in rank
    order -> the copies that differ from those of the first rank of their stage (the one compared with the
    reference), and the copies a plan found differing inside one rank's gathered state (tensor parallel's
    repeated KV heads)."""
    failures, first = [], {}
    for rank, (stage, digests, differing) in enumerate(reports):
        first.setdefault(stage, rank)
        for step, (digest, names) in enumerate(zip(digests, differing, strict=True)):
            failures += [f"step {step} {name}: the copies of this tensor on rank {rank} differ (every copy must "
                         "agree bit for bit)" for name in names]
            if first[stage] == rank:
                continue
            theirs = reports[first[stage]][1][step]
            # both ranks' names: a replica that gathered fewer tensors than the one compared had passed
            for key in sorted(k for k in set(digest) | set(theirs) if digest.get(k) != theirs.get(k)):
                other = first[stage]
                what = (f"rank {rank} gathered no {key[0]} of it, rank {other} did" if key not in digest else
                        f"rank {rank} gathered {key[0]} of it, rank {other} did not" if key not in theirs else
                        f"rank {rank}'s gathered {key[0]} differs from rank {other}'s")
                failures.append(f"step {step} {key[1]}: {what}, a replica of the same pipeline stage (replicas "
                                "must agree bit for bit)")
    return failures


def _diff(a: torch.Tensor, b: torch.Tensor, rtol: float, atol) -> tuple[float, bool]:
    """(max |a - b|, whether |a - b| <= atol + rtol |b| everywhere); `atol` a number or one per element."""
    a, b = a.double(), b.double()
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    return max_abs, bool(((a - b).abs() <= torch.as_tensor(atol, dtype=torch.float64) + rtol * b.abs()).all())


def _bf16_ok(quantity: str, a: torch.Tensor, b: torch.Tensor, step: int, lr: float,
             initial: torch.Tensor | None = None, name: str = "") -> tuple[float, bool, str]:
    """(the difference reported, within tolerance, the bound in words) under BF16_TOLERANCES; `initial`: the
    weights before the first step (params only); `name`: the tensor's (its gradients' bound, bf16_grads_bound)."""
    a, b = a.double(), b.double()
    bound = bf16_grads_bound(name) if quantity == "grads" else BF16_TOLERANCES[quantity][0]
    if quantity == "params":
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        moved = (b - initial.double()).norm().item() if initial is not None else 0.0
        elementwise = diff <= bound * lr * (step + 1)
        words = f"max |diff| <= {bound:g} lr x {step + 1} steps"
        if moved == 0:
            return diff, elementwise, words
        share = (a - b).norm().item() / moved
        # a failure says which bound failed and by how much: the max |diff| alone may be inside its own
        return diff, elementwise and share <= BF16_UPDATE_REL, (
            f"{words}, and ||diff|| <= {BF16_UPDATE_REL:g} ||the reference's move since initialised||: it is "
            f"{share:.3g} of it")
    if quantity == "loss":
        diff = abs(a.item() - b.item())
        return diff, diff <= bound * abs(b.item()), f"rel {bound:g}"
    diff, norm = (a - b).norm().item(), b.norm().item()
    share = f": it is {diff / norm:.3g} of it" if norm > 0 else ""  # the bound is relative: say the share too
    return diff, diff <= bound * norm + 1e-30, f"||diff|| <= {bound:g} ||reference||{share}"


def compare(cfg: RunConfig, reference: list, snapshots: list[dict], losses: list[float],
            replicas: list[str] = ()) -> dict:
    """Return {passed, max_abs_diff, by_quantity: {q: max_abs_diff}, failures: [...], tolerances}; `replicas`:
    the replicas' failures (`replica_failures`), which fail the check too."""
    by_quantity: dict[str, float] = {}
    failures: list[str] = list(replicas)
    bf16 = cfg.dtype == "bfloat16"
    exact = reproduces_reference(cfg)
    initial = dict(build_model(cfg.model, cfg.seed).named_parameters()) if bf16 and snapshots else {}
    # whether the runs' weights differ by more than the strict params bound after each step (DIVERGED_REL)
    diverged_by_step = [] if bf16 or exact else [
        _weights_diverged(r.params, snap.get("params", {}), param_atol(cfg.lr, k + 1))
        for k, (r, snap) in enumerate(zip(reference, snapshots, strict=True))]

    def within(quantity: str, step: int, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool, str]:
        """(the difference reported, within tolerance, the tolerance in words)."""
        if exact:
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            return diff, bool(torch.equal(a, b)), EXACT_WORDS
        if bf16:
            diff, ok, bound = _bf16_ok(quantity, a, b, step, cfg.lr, initial.get(name), name)
            return diff, ok, f"{bound}, bf16"
        rtol, atol, _ = TOLERANCES[quantity]
        if quantity == "params":
            flipped = [flips(torch.as_tensor(r.exp_avg_sq[name]), torch.as_tensor(s["exp_avg_sq"][name]), k + 1)
                       for k, (r, s) in enumerate(zip(reference[:step + 1], snapshots[:step + 1], strict=True))]
            diff, ok = _diff(a, b, rtol, param_atol_by_element(cfg.lr, flipped))
            n = int(sum(f.sum() for f in flipped))
            return diff, ok, (f"rtol {rtol:g}, atol {param_atol(cfg.lr, step + 1):g}"
                              + (f"; {ADAM_FLIP_LR:g} lr a step at {n} near-zero Adam scales" if n else ""))
        diff, ok = _diff(a, b, rtol, atol)
        if quantity == "loss":
            return diff, ok, f"rtol {rtol:g}, atol {atol:g}"
        # in norm too (NORM_REL_FIRST); after a rounding-decided Adam step, on the norm alone (DIVERGED_REL: the
        # weights differ already). A reference tensor of zeros is left to the elements.
        diverged = any(diverged_by_step[:step])
        rel = DIVERGED_REL if diverged else NORM_REL_FIRST
        norm = b.double().norm().item()
        if norm == 0:
            return diff, ok, f"rtol {rtol:g}, atol {atol:g}"
        share = (a.double() - b.double()).norm().item() / norm
        close = share <= rel
        if diverged:
            return diff, close, (f"||diff|| <= {rel:g} ||reference||, after a weight's rounding-decided Adam step: it "
                                 f"is {share:.3g} of it")
        return diff, ok and close, (f"rtol {rtol:g}, atol {atol:g} and ||diff|| <= {rel:g} ||reference||: it is "
                                    f"{share:.3g} of it")

    def note(quantity: str, step: int, name: str, a, b) -> None:
        # a loss is a Python float: compared in float64, not rounded to float32 first
        a, b = (torch.tensor(x, dtype=torch.float64) if isinstance(x, float) else torch.as_tensor(x) for x in (a, b))
        where = f"{step} {name}" if name else f"{step}"
        if a.shape != b.shape:  # a difference would broadcast: a [1] of zeros had matched a [4, 8] of zeros
            failures.append(f"step {where}: {quantity} has shape {list(a.shape)}, the reference's {list(b.shape)}")
            return
        diff, ok, bound = within(quantity, step, name, a, b)
        by_quantity[quantity] = max(by_quantity.get(quantity, 0.0), diff)
        if not ok:
            failures.append(f"step {where}: {quantity} differs by {diff:.3g} ({bound})")

    for step, (ref, loss) in enumerate(zip(reference, losses, strict=True)):
        note("loss", step, "", loss, ref.loss)
    for step, (ref, snap) in enumerate(zip(reference, snapshots, strict=True)):
        for quantity in ("grads", "params", "exp_avg", "exp_avg_sq"):
            ref_tensors = getattr(ref, quantity)
            missing = set(ref_tensors) ^ set(snap[quantity])
            if missing:
                failures.append(f"step {step}: {quantity} names differ from the reference: "
                                f"{sorted(missing)[:3]}")
                continue
            for name, t in ref_tensors.items():
                note(quantity, step, name, snap[quantity][name], t)
    return {
        "passed": not failures,
        "exact": exact,  # compared bit for bit (reproduces_reference)
        "max_abs_diff": max(by_quantity.values(), default=0.0),
        "by_quantity": by_quantity,
        "failures": failures[:20],
        "steps": cfg.steps,
        "tolerances": {q: {"rtol": 0.0, "atol": 0.0, "why": EXACT_WORDS} for q in TOLERANCES} if exact else
        _bf16_tolerances(cfg) if bf16 else
        {q: {"rtol": r, "atol": param_atol(cfg.lr, cfg.steps) if q == "params" else a, "why": w}
         for q, (r, a, w) in TOLERANCES.items()},
    }


def _bf16_tolerances(cfg: RunConfig) -> dict:
    out = {}
    for q, (bound, why) in BF16_TOLERANCES.items():
        if q == "params":
            out[q] = {"rtol": 0.0, "atol": bound * cfg.lr * cfg.steps, "why": why}
        else:
            out[q] = {"rtol": bound, "atol": 0.0, "why": why}
    return out

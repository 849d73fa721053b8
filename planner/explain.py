"""Explanations in words of why a layout wins, or what a runner-up loses to the winner."""

from __future__ import annotations

from dataclasses import replace

from hardware.kernels import FLASH_KERNELS, TRITON_FLASH_SLOWDOWN, head_dim_factor
from planner.case import DEFAULT_RECOMPUTE_MODULES
from planner.costs import window_skips_keys
from planner.memory import memory_per_chip, optimizer_state_bytes
from planner.simulate import StepResult, simulate, usable_hbm_bytes

_KIND_WORDS = {
    "compute": "compute", "recompute": "recomputation", "tp_comm": "exposed TP collectives",
    "cp_comm": "the exposed context-parallel ring", "ep_comm": "expert all-to-alls",
    "zero3_comm": "ZeRO-3 gathers", "pp_comm": "pipeline sends", "bubble": "the pipeline bubble",
    "dp_comm": "exposed gradient sync", "optimizer": "the optimizer update",
}


def _pct(x: float, total: float) -> str:
    return f"{100 * x / total:.1f}%"


def _link(res: StepResult, n: int, stride: int) -> str:
    if res.chip.kind == "tpu":
        return "ICI" if n * stride <= res.chip.scaleup_domain else "the data-center network"
    return res.chip.scaleup_link if n * stride <= res.extra["chips_per_node"] else "the network"


def explain(res: StepResult, best: StepResult | None = None) -> list[str]:
    """Sentences about `res`; with `best` (another result) the first one says what it loses to it."""
    lay, step, bd = res.layout, res.step_time_s, res.breakdown
    m, case = res.case.model, res.case
    hbm = usable_hbm_bytes(res.chip)
    words: list[str] = []
    if best is not None and res is not best:
        diffs = {k: bd[k] - best.breakdown[k] for k in bd}
        worst = max(diffs, key=diffs.get)
        words.append(f"{_pct(step - best.step_time_s, best.step_time_s)} slower than the best, mostly "
                     f"{_KIND_WORDS[worst]} (+{diffs[worst]:.3g} s per step).")
    if lay.tp > 1:
        words.append(f"TP={lay.tp} splits every layer's matmuls over {lay.tp} chips; its collectives stay on "
                     f"{_link(res, lay.tp, 1)} and cost {_pct(bd['tp_comm'], step)} of the step.")
    else:
        words.append("No TP: each chip holds whole layers, so no tensor-parallel collectives run.")
    if lay.pp > 1:
        mem_pp1 = None
        if lay.pp > 1 and m.layers >= 1:
            mem_pp1 = memory_per_chip(m, replace(lay, pp=1, virtual_stages=1, pp_schedule="1f1b", pp_layout=None,
                                                 dp=lay.dp), res.micro_batches, case.training.optimizer,
                                      case.training.dtype)
        reason = (f"without it a chip would need {mem_pp1.total_bytes / 1e9:.0f} GB"
                  if mem_pp1 is not None and mem_pp1.total_bytes > hbm else "it beats more DP or TP here")
        sched = (f"{lay.pp_schedule} with v={lay.virtual_stages}" if lay.virtual_stages > 1
                 else lay.pp_schedule) + (", the layers split as the run states" if lay.pp_layout else "")
        runs = (f" in {lay.schedule_runs} runs of the schedule, each filling and draining the pipeline"
                if lay.schedule_runs > 1 else "")
        words.append(f"PP={lay.pp} ({sched}, m={res.micro_batches} micro-batches of {lay.micro_batch}{runs}) "
                     "because "
                     f"{reason}; on the slowest stage the bubble costs {_pct(bd['bubble'], step)} and the sends "
                     f"{_pct(bd['pp_comm'], step)}.")
    if lay.cp > 1:
        if m.has_ssm:
            ssm = {"state": "the SSM state chain", "alltoall": "the SSM all-to-alls"}[lay.ssm_cp]
            comm = f"{ssm} and the K/V ring show" if m.attention_layers else f"{ssm} shows"
        else:
            comm = "the K/V ring shows"
        words.append(f"CP={lay.cp} splits each {m.seq_len}-token sequence into {m.seq_len // lay.cp}-token "
                     f"shards; {comm} {_pct(bd['cp_comm'], step)}.")
    if lay.ep > 1:
        local = m.experts // lay.ep
        experts = f"{local} expert{'s' if local != 1 else ''}" + (
            " whole (the tp ranks folded into ep)" if lay.experts_folded else
            f", each split {lay.tp} ways by tp," if lay.tp > 1 else "")
        link = _link(res, lay.ep, lay.etp)
        how = (" (DeepEP: a token crosses the network once per node its experts are on)"
               if lay.ep_dispatch == "deepep" and link == "the network" else "")
        words.append(f"EP={lay.ep} puts {experts} on each chip; the all-to-alls over {link}{how} cost "
                     f"{_pct(bd['ep_comm'], step)}.")
    if lay.dp * lay.cp > 1:  # the gradient sync and ZeRO's shards span dp x cp
        zero = {0: "replicated optimizer state", 1: "ZeRO-1 (sharded optimizer state)",
                2: "ZeRO-2 (sharded optimizer state and gradients)", 3: "ZeRO-3 (everything sharded)"}
        z3 = f" and ZeRO-3 gathers {_pct(bd['zero3_comm'], step)}" if lay.zero_stage == 3 else ""
        group = f"DP={lay.dp}" + (f" (x CP={lay.cp}: {lay.dp * lay.cp} ranks sum each gradient)" if lay.cp > 1 else "")
        if lay.ep > 1 and not lay.experts_folded and lay.dp % lay.ep == 0:  # a mesh draws dp / ep x ep
            group += (f" (Megatron-LM's count, EP's {lay.ep} ranks among them: {lay.dp // lay.ep} x ep={lay.ep} in a "
                      "device mesh)")
        words.append(f"{group} with {zero[lay.zero_stage]}; gradient sync shows "
                     f"{_pct(bd['dp_comm'], step)}{z3}.")
    rc = {"none": "No recomputation: the activations fit",
          "selective": ("Selective recomputation (attention core only)"
                        if lay.recompute_modules == DEFAULT_RECOMPUTE_MODULES
                        else f"Selective recomputation of {', '.join(lay.recompute_modules)}"),
          "selective-op": "Op-level selective recomputation (every second matmul and the memory-bound ops)",
          "dots": ("Matmul outputs kept, everything else recomputed (JAX's checkpoint_dots_with_no_batch_dims: "
                   "norms, activations and the attention core run again)"),
          "full": ("Full recomputation: only layer inputs are kept" if lay.recompute_layers is None else
                   f"Full recomputation of the first {lay.recompute_layers} "
                   f"layer{'s' if lay.recompute_layers > 1 else ''}"
                   f"{'' if lay.one_chunk else ' of each chunk'} (only their inputs kept); "
                   "the others keep everything")}[lay.recompute]
    usable = usable_hbm_bytes(res.chip)
    fit = "of the" if res.fits else "per chip, more than the"
    # what the recomputation costs, only where there is one ("recomputation costs 0.0%" had followed "No
    # recomputation")
    cost = "" if lay.recompute == "none" else f"; recomputation costs {_pct(bd['recompute'], step)}"
    words.append(f"{rc}; peak memory {res.memory.total_bytes / 1e9:.1f} GB {fit} {usable / 1e9:.1f} GB a chip can "
                 f"use (of its {res.chip.hbm_bytes / 1e9:.0f} GB){cost}.")

    def longer(**instead) -> str:
        """How much longer the step is than with the layout's `instead` fields (its recipe's cost)."""
        other = simulate(case, replace(lay, **instead), res.chip).step_time_s
        return _pct(step - other, other)

    if lay.fusion == "eager":
        parts = "Bias, dropout and residual add" if lay.dropout_on(m) else "Bias and residual add"
        what = (f"{parts} run as separate eager PyTorch kernels" if m.gpt_style else
                "Norms and rotary embeddings run as eager PyTorch modules, each a chain of kernels")
        words.append(f"{what}: the step takes {longer(fusion='fused')} longer than with fused kernels "
                     "(torch.compile, Transformer Engine).")
    if lay.layer_zero3 and lay.fsdp_impl != "in-place":
        what = {"fsdp2": "PyTorch's fully_shard copies every gathered layer out of its buffer and every "
                         "gradient into the reduce-scatter's input",
                "fsdp1": "FSDP's flat parameters concatenate and divide every layer's gradients before the "
                         "reduce-scatter"}[lay.fsdp_impl]
        words.append(f"{what}: the step takes {longer(fsdp_impl='in-place')} longer than gathering and reducing "
                     "in place (Megatron FSDP).")
    if lay.logit_metrics:
        who = ("The trainer's logged metric runs" if lay.logit_metrics == 1 else
               f"The trainer's {lay.logit_metrics} logged metrics each run")
        words.append(f"{who} a cross-entropy over the logits: the step takes {longer(logit_metrics=0)} longer.")
    if not lay.optimizer_fused and case.training.optimizer == "adam":
        words.append(f"Adam runs as PyTorch's elementwise ops one at a time: the step takes "
                     f"{longer(optimizer_fused=True)} longer than with one fused multi-tensor kernel.")
    if lay.grad_accum_cast and lay.fp32_accumulation_pass:
        words.append(f"Each micro-batch's gradient is cast to fp32 in a copy of its own before it is added "
                     f"(DeepSpeed's BF16 optimizer): the step takes {longer(grad_accum_cast=False)} longer than "
                     "adding the bf16 gradient directly.")
    if lay.pp > 1 and lay.pp_p2p == "sequential":
        words.append(f"Each stage sends and receives its micro-batches' activations and gradients as blocking "
                     f"operations one after the other (DeepSpeed's pipeline engine): the step takes "
                     f"{longer(pp_p2p='batched')} longer than exchanging both ways at once (Megatron-LM).")
    if not lay.master_weights:
        opt = case.training.optimizer
        words.append(f"No fp32 master weights: the weights stay in bf16 and the optimizer keeps "
                     f"{optimizer_state_bytes(opt, False)} bytes of state a parameter, not "
                     f"{optimizer_state_bytes(opt)}.")
    if m.attention_layers and lay.attention in FLASH_KERNELS:
        factor = head_dim_factor(res.chip, lay.attention, m.head_dim_)
        if factor < 1:
            words.append(f"Attention heads are {m.head_dim_:g} wide: the attention kernel runs at {factor:.0%} of its "
                         f"FLOP rate at head dim 128 on {res.chip.name} (less matmul work per tile of keys it "
                         "loads; the chip table's measured ratio).")
    if m.windowed_share and m.sliding_window < m.seq_len:
        layers = round(m.windowed_share * m.attention_layers)
        if window_skips_keys(m, lay):
            how = (f"the kernel computes only that band of each score matrix, about {m.sliding_window:,} keys per "
                   f"query instead of up to {m.seq_len:,}")
        else:
            why = {"flash-triton": "the Triton kernel has no window and computes the whole causal triangle",
                   "materialized": "materialised scores are computed over the whole square, then masked"}
            how = why.get(lay.attention, "under context parallelism the K/V ring still passes every shard") \
                + ": the window saves nothing here"
        words.append(f"{layers} of the {m.attention_layers} attention layers attend within a sliding window of "
                     f"{m.sliding_window:,} tokens: {how}.")
    if lay.attention == "flash-triton":
        fwd, bwd = TRITON_FLASH_SLOWDOWN
        words.append(f"Attention runs FlashAttention written in Triton ({fwd:g}x FlashAttention-2's forward time, "
                     f"{bwd:g}x its backward): the step takes {longer(attention='flash')} longer than with "
                     "FlashAttention-2.")
    executed = ("" if abs(res.tflops_per_chip - res.model_tflops_per_chip) < 0.5 else
                f" ({res.tflops_per_chip:.0f} executed, recomputation included)")
    words.append(f"MFU {100 * res.mfu:.1f}%, {res.model_tflops_per_chip:.0f} model TFLOP/s per chip{executed}.")
    return words

"""The live engine: real sharded training steps of a small Transformer on N local processes.

    config       frozen RunConfig / ModelConfig / ParallelConfig; `validate` raises ConfigError (torch-free)
    parallelize  a rank's layout in one fixed order: the plans, then one sharder by ZeRO stage
    train        the one rank loop (the task the pool executes), pipeline or not
    launch       the reusable worker pool (`get_pool`), per-rank errors and timeouts, no orphans
    worker       the worker process entry (`python -m engine.worker`; also runs under torchrun)
    comm         the only module calling torch.distributed: process groups of the mesh (core/mesh.py), every
                 operation a comm span
    recorder     per-rank spans on a clock aligned with rank 0
    model        Llama-style decoder (RMSNorm, rotary GQA attention, SwiGLU or top-k MoE)
    optim        elementwise AdamW shared by every sharder and the reference
    reference    the single-process ground truth
    strategy     the Plan hooks and the shared unit-by-unit forward/backward driver with compute spans
    plans:       tp (column/row-parallel linears, vocab-parallel embedding and loss, sequence parallel),
                 tp_comm (its conjugate autograd operations), cp (zig-zag split, ring or all-gathered K/V),
                 ring_attention (the ring's arithmetic, no processes), ep (experts over ep, all-to-all
                 dispatch), pipeline/ (the stage cut and ZB-H1's split backward; the schedule executor)
    sharders:    dp (ZeRO-0: naive or bucketed, overlapped), flat (flat per-unit buffers and shards),
                 zero (ZeRO-1 and ZeRO-2), fsdp (ZeRO-3 with prefetch)
    memory       activation bytes from autograd's saved tensors
    verify       comparison with the reference, tolerance and reason per quantity
    run          `run(cfg)` -> (RunSummary, Timeline): what the CLI and pages call
    sweep        collective timing sweep on the pool (hardware/this_machine.py fits alpha and beta)
    calibrate, predict   this machine's calibration on the pools, and the planner's prediction of a run
    cli          `python -m engine run ...`

The torch-free ideas both engines share live below them in core/: the mesh convention, the timeline
format, the pipeline schedules as data.

Importing `engine` imports no torch; `config`, `run`, `launch` and `sweep` stay torch-free in the calling
process (the workers import it).
"""

"""The live engine: real sharded training steps of a small Transformer on N local processes.

    config     frozen RunConfig / ModelConfig / ParallelConfig; `validate` raises ConfigError
    mesh       named mesh axes -> rank coordinates and process groups
    launch     the reusable worker pool (`get_pool`), per-rank errors and timeouts, no orphans
    worker     the worker process entry (`python -m engine.worker`; also runs under torchrun)
    comm       the only module calling torch.distributed; every operation becomes a comm span
    recorder   per-rank spans on a clock aligned with rank 0
    model      Llama-style decoder (RMSNorm, rotary GQA attention, SwiGLU or top-k MoE)
    optim      elementwise AdamW shared by every strategy and the reference
    reference  the single-process ground truth
    strategy   the shared unit-by-unit forward/backward driver with compute spans
    dp         data parallel: naive or bucketed and overlapped, gradient accumulation
    flat       flat per-unit parameters and shards (ZeRO's common ground)
    zero       ZeRO-1 and ZeRO-2
    fsdp       ZeRO-3 / FSDP with prefetch
    replicated whole parameters with gradients summed over named mesh axes (cp and ep build on it)
    cp         context parallel: zig-zag sequence split, ring attention (or all-gathered K/V)
    ring_attention  the ring's arithmetic: log-sum-exp merge, block backward, zig-zag plan (no processes)
    ep         expert parallel: experts split over ep, tokens dispatched and combined by all-to-all
    tp         tensor parallel (column/row-parallel linears, vocab-parallel embedding and loss) and
               sequence parallel, composed with dp / ZeRO / FSDP over the dp or fsdp axis
    tp_comm    tp's conjugate autograd operations: f/g (all-reduce) and the sp all-gather/reduce-scatter
    schedules  pipeline schedules as data (GPipe, 1F1B, interleaved 1F1B, ZB-H1) and their simulator
    pp         pipeline executor: walks a schedule's actions with p2p sends, composed with dp/fsdp/tp
    pp_stage   which units a pipeline stage holds, tp over stages, ZB-H1's input/weight backward split
    pp_timeline  a measured pipeline step's bubbles (idle spans) and bubble fraction (no torch)
    memory     activation bytes from autograd's saved tensors
    train      one rank's run (the task the pool executes)
    verify     comparison with the reference, tolerance and reason per quantity
    run        `run(cfg)` -> (summary dict, Timeline): what the CLI and pages call
    sweep      collective timing sweep on the pool and the alpha-beta fit
    cli        `python -m engine run ...`
    trace      the shared Timeline / Span format (no torch)

Importing `engine` imports no torch; `config`, `run`, `launch`, `sweep` and `trace` stay torch-free
in the calling process (the workers import it).
"""

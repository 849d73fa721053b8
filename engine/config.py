"""What one live run is: the model, the parallel layout and the run itself, validated in one place.

Every impossible combination becomes a `ConfigError` whose message says what to change, so the CLI and
the pages can show it instead of a traceback. This module must not import torch (pages validate input
before they start any worker).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.mesh import AXES, Mesh
from core.schedules import SCHEDULE_NAMES
from core.ssd import MAX_SSM_EXPAND, mamba_block_flops

STRATEGIES = ("dp", "fsdp", "cp", "ep", "pp", "tp")
MLPS = ("dense", "moe")
ZERO_STAGES = (0, 1, 2, 3)
# The mesh axis a strategy splits over when no --mesh is given (all other strategies: dp = world); with
# a --mesh the strategy is only the run's label and fsdp's default ZeRO stage.
DEFAULT_AXIS = {"cp": "cp", "ep": "ep", "pp": "pp", "tp": "tp"}
CP_VARIANTS = ("ring", "allgather")
# How a Mamba-2 layer's scan crosses the cp ranks (engine/ssm_cp.py): final states passed rank to rank in
# sequence order, or an all-to-all from sequence shards to head shards and back.
SSM_CP_VARIANTS = ("state", "alltoall")
ARCHS = ("transformer", "mamba2", "hybrid")
ATTENTION, MAMBA = "A", "M"  # a layer's kind in ModelConfig.pattern
DP_COMM_MODES = ("naive", "bucketed")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")  # bfloat16: mixed precision, engine.model.mixed_precision
MAX_WORLD = 64  # more local processes than this only thrashes a laptop-sized machine
# The largest model and batch a run may state, checked before anything is built or counted from them (a model
# of 10^12 layers spelled its layer kinds out as a 10^12-letter string): far beyond what fits this machine's
# memory or a GPU's, so only a typo reaches them.
MAX_MODEL = {"layers": 4096, "hidden": 65536, "heads": 4096, "kv_heads": 4096, "ffn": 262144, "vocab": 1048576,
             "seq_len": 1048576, "experts": 4096, "ssm_state": 4096, "ssm_head_dim": 4096, "ssm_expand": MAX_SSM_EXPAND,
             "ssm_groups": 4096, "conv_width": 1024, "ssm_chunk": 1048576}
NO_FLAG = ("ssm_expand", "conv_width")  # model fields `python -m engine run` has no flag for
MAX_MICRO_BATCHES = 4096  # micro-batches per step, and sequences per micro-batch
MAX_STEPS = 1_000_000  # a million optimizer steps of a small model is days here; the seed range needs a bound
MAX_CAPACITY_FACTOR = 1000.0  # any factor from experts / top_k up already keeps every token an expert is sent


class ConfigError(ValueError):
    """A run that cannot be executed as asked; the message says what to change."""


@dataclass(frozen=True)
class ModelConfig:
    """A small Llama-style decoder (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP), a Mamba-2
    stack (Dao & Gu 2024, one mixer per layer and no MLP, as the paper's models) or a hybrid of the two."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    vocab: int = 256
    seq_len: int = 32
    mlp: str = "dense"  # "dense" (SwiGLU) or "moe" (top-k routed SwiGLU experts)
    experts: int = 4
    top_k: int = 2
    # Tokens an expert accepts per sequence: ceil(C * seq_len * top_k / experts) (GShard, Lepikhin et al.
    # 2020, section 3.2); None: no limit, no token dropped.
    capacity_factor: float | None = None
    rope_theta: float = 10000.0
    arch: str = "transformer"  # "transformer", "mamba2" or "hybrid" (layers of both kinds, `pattern`)
    # hybrid only: one letter per layer, "A" attention + MLP block, "M" Mamba-2 block; "" alternates M, A
    pattern: str = ""
    # Mamba-2 block (engine/mamba.py; Dao & Gu 2024 sec. 7): inner width expand * hidden, split into heads
    # of ssm_head_dim channels; B and C shared by groups of heads (ngroups); state size N per head;
    # causal depthwise conv of width conv_width; the SSD algorithm's chunk length.
    ssm_state: int = 16
    ssm_head_dim: int = 16
    ssm_expand: int = 2
    ssm_groups: int = 4
    conv_width: int = 4
    ssm_chunk: int = 8

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ssm_inner(self) -> int:
        return self.ssm_expand * self.hidden

    @property
    def ssm_heads(self) -> int:
        return self.ssm_inner // self.ssm_head_dim

    @property
    def kinds(self) -> str:
        """Each layer's kind, ATTENTION or MAMBA, in order."""
        if self.arch == "transformer":
            return ATTENTION * self.layers
        if self.arch == "mamba2":
            return MAMBA * self.layers
        return self.pattern or "".join(MAMBA if i % 2 == 0 else ATTENTION for i in range(self.layers))

    @property
    def has_attention(self) -> bool:
        return ATTENTION in self.kinds

    @property
    def mamba_params(self) -> int:
        """One Mamba-2 block: its RMSNorm, in_proj (z, x, B, C, dt), the conv (weights and bias) over x, B
        and C, dt_bias, A_log and D per head, the gated norm over the inner width, out_proj."""
        h, di, gn, nh = self.hidden, self.ssm_inner, self.ssm_groups * self.ssm_state, self.ssm_heads
        return h + h * (2 * di + 2 * gn + nh) + (di + 2 * gn) * (self.conv_width + 1) + 3 * nh + di + di * h

    @property
    def params(self) -> int:
        """Parameters of `engine.model.Transformer(self)`, counted without building it (the server caps
        a run's model size before anything is allocated; tests/engine/test_model.py checks the two agree)."""
        h = self.hidden
        attention = h * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        swiglu = 3 * h * self.ffn
        mlp = swiglu if self.mlp == "dense" else h * self.experts + self.experts * swiglu
        layers = sum(2 * h + attention + mlp if k == ATTENTION else self.mamba_params for k in self.kinds)
        return self.vocab * h + layers + h + h * self.vocab


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks split the work: named mesh axes, the strategy and its knobs."""

    strategy: str = "dp"
    mesh: tuple[tuple[str, int], ...] = ()  # e.g. (("dp", 4),); empty means dp = world
    zero_stage: int | None = None  # None: 0 for dp, 3 for fsdp
    dp_comm: str = "bucketed"  # dp gradient sync: "naive" (after backward) or "bucketed" (overlapped)
    bucket_bytes: int = 16 * 1024  # small on purpose: the tiny model must still make several buckets
    prefetch: bool = True  # fsdp: all-gather the next unit while this one computes
    sequence_parallel: bool = False  # tp: norms on sequence shards, all-gather/reduce-scatter (engine/tp.py)
    schedule: str = "1f1b"  # pipeline schedule when the mesh has pp > 1 (core/schedules)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved-1f1b only)
    cp_variant: str = "ring"  # cp: K/V passed around a ring, or all-gathered at once
    ssm_cp: str = "state"  # cp of a Mamba-2 layer: states passed rank to rank, or all-to-all (SSM_CP_VARIANTS)

    @property
    def stage(self) -> int:
        if self.zero_stage is not None:
            return self.zero_stage
        return 3 if self.strategy == "fsdp" or dict(self.mesh).get("fsdp", 1) > 1 else 0

    def axes(self, world: int) -> tuple[tuple[str, int], ...]:
        return self.mesh or ((DEFAULT_AXIS.get(self.strategy, "dp"), world),)

    def degree(self, axis: str, world: int) -> int:
        return dict(self.axes(world)).get(axis, 1)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    world: int = 2
    steps: int = 3
    micro_batches: int = 1
    micro_batch_size: int = 2  # sequences per rank per micro-batch
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    lr: float = 1e-3
    weight_decay: float = 0.1
    timeout_s: float = 60.0  # hard wall-clock limit of one run, start-up excluded
    collective_timeout_s: float = 30.0  # every collective fails after this, instead of gloo's 30 minutes

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.parallel.axes(self.world))

    @property
    def pp(self) -> int:
        return self.parallel.degree("pp", self.world)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks: dp x fsdp x ep ranks read different sequences
        (core/mesh.py), each micro-batch after micro-batch."""
        return self.mesh.batch_shards * self.micro_batches * self.micro_batch_size


def unit_forward_flops(m: ModelConfig, unit: int, sequences: int) -> float:
    """Forward FLOPs of one unit (0 the embedding, 1..layers the blocks, layers + 1 the head) on
    `sequences` sequences: 2 per multiply-add of every matmul (Kaplan et al. 2020, "Scaling Laws",
    section 2.1), attention scores and values counted in full (the fused kernel computes the masked half
    too). Backward is twice this."""
    tokens = sequences * m.seq_len
    if unit == 0:
        return 0.0  # an embedding is a lookup
    if unit == m.layers + 1:
        return 2.0 * tokens * m.hidden * m.vocab
    if m.kinds[unit - 1] == MAMBA:
        return mamba_forward_flops(m, sequences)
    attn_params = m.hidden * m.head_dim * (2 * m.heads + 2 * m.kv_heads)
    swiglu_params = 3 * m.hidden * m.ffn
    mlp_params = swiglu_params if m.mlp == "dense" else m.hidden * m.experts + m.top_k * swiglu_params
    scores_and_values = 2 * 2 * sequences * m.seq_len * m.seq_len * m.heads * m.head_dim
    return 2.0 * tokens * (attn_params + mlp_params) + scores_and_values


def mamba_forward_flops(m: ModelConfig, sequences: int) -> float:
    """One Mamba-2 block on `sequences` sequences (core/ssd.py counts it)."""
    return mamba_block_flops(sequences, m.seq_len, m.hidden, m.ssm_inner, m.ssm_heads, m.ssm_head_dim,
                             m.ssm_groups, m.ssm_state, m.ssm_chunk, m.conv_width)


def step_flops(cfg: RunConfig) -> float:
    """Model FLOPs of one optimizer step over all ranks: forward + backward (3x forward) of every unit on
    the global batch (recomputation and padding not counted: what MFU counts)."""
    return 3.0 * sum(unit_forward_flops(cfg.model, u, cfg.global_batch) for u in range(cfg.model.layers + 2))


def strategy_for(mesh: tuple[tuple[str, int], ...]) -> str:
    """The label of a run given only its mesh (every mesh runs the same composed layout,
    engine/parallelize.py): cp or ep when the mesh has them, fsdp for an fsdp axis, else dp."""
    degrees = dict(mesh)
    for axis in ("cp", "ep"):
        if degrees.get(axis, 1) > 1:
            return axis
    return "fsdp" if degrees.get("fsdp", 1) > 1 and degrees.get("pp", 1) == 1 else "dp"


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """`"tp=2,dp=2"` -> `(("dp", 2), ("tp", 2))`: in the mesh's axis order whatever the order written,
    so a mesh always groups the same ranks (tp innermost; core/mesh.py says why)."""
    axes: list[tuple[str, int]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not value.strip().isdecimal() or not value.strip().isascii():
            raise ConfigError(f"mesh entry {part!r} must look like name=degree, e.g. --mesh dp=2,tp=2")
        if name not in AXES:
            raise ConfigError(f"mesh axis {name!r} is unknown; use one of {', '.join(AXES)}")
        if name in dict(axes):
            raise ConfigError(f"mesh axis {name!r} appears twice in {text!r}; name each axis once")
        axes.append((name, int(value)))
    if not axes:
        raise ConfigError(f"--mesh {text!r} names no axis; write e.g. --mesh dp=4")
    return tuple(sorted(axes, key=lambda a: AXES.index(a[0])))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _between(name: str, value: int, lo: int, hi: int, flag: str, why: str = "") -> None:
    """Refuse `value` outside lo..hi with the way back: fewer (or smaller) above, at least `lo` below."""
    if lo <= value <= hi:
        return
    advice = f"use at most {hi:,}" if value > hi else f"use {lo} or more"
    raise ConfigError(f"{name}={value:,} must be between {lo:,} and {hi:,}{why}: {advice} for {flag}")


# every size of the model is a count, whichever layers use it: a negative one is a typo even where it is unused
# (--experts -4 on a dense model had run)
COUNT_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "experts", "top_k",
                "ssm_state", "ssm_head_dim", "ssm_expand", "ssm_groups", "conv_width", "ssm_chunk")


def _flag_words(name: str) -> str:
    """' (--ssm-state)': the command-line flag that sets model field `name`, for a message; '' where none does."""
    return "" if name in NO_FLAG else f" (--{name.replace('_', '-')})"


def validate_model(m: ModelConfig) -> None:
    for name in COUNT_FIELDS:
        _check(getattr(m, name) >= 1, f"model {name}={getattr(m, name)} must be at least 1{_flag_words(name)}")
    for name, most in MAX_MODEL.items():
        _check(getattr(m, name) <= most, f"model {name}={getattr(m, name):,} is more than the engine runs (at most "
               f"{most:,}): choose a smaller {name}{_flag_words(name)}")
    _check(m.mlp in MLPS, f"mlp={m.mlp!r} must be one of {', '.join(MLPS)}")
    _check(m.capacity_factor is None or m.mlp == "moe",
           f"capacity_factor={m.capacity_factor} limits the tokens each expert takes, and this model has no experts: "
           "drop --capacity-factor" + (" or use --mlp moe" if m.has_attention else ""))
    _validate_mamba(m)
    if not m.has_attention:
        _check(m.mlp == "dense", "a Mamba-2 stack has no MLP to make MoE: use --arch hybrid for MoE layers "
               "beside Mamba-2 layers, or a dense MLP (no --mlp moe, no --strategy ep or ep axis)")
        return
    # one token attends to itself alone: its softmax is 1 whatever the query and key, so wq and wk get no
    # gradient but rounding noise, which Adam scales to full-size updates that no layout reproduces
    _check(m.seq_len >= 2, f"seq_len={m.seq_len}: attention over a single token teaches the query and key weights "
           "nothing; use --seq-len 2 or more")
    _check(m.hidden % m.heads == 0, f"hidden={m.hidden} is not divisible by heads={m.heads}; "
           f"choose hidden as a multiple of {m.heads}")
    _check(m.head_dim % 2 == 0, f"head_dim=hidden/heads={m.head_dim} must be even for rotary embeddings; "
           f"change hidden or heads")
    _check(m.heads % m.kv_heads == 0, f"heads={m.heads} is not divisible by kv_heads={m.kv_heads}; "
           f"grouped-query attention needs each KV head shared by the same number of query heads")
    if m.mlp == "moe":
        _check(m.experts >= 1, f"experts={m.experts} must be at least 1 for mlp='moe'")
        _check(1 <= m.top_k <= m.experts, f"top_k={m.top_k} must be between 1 and experts={m.experts}")
        keeps_all = m.experts / m.top_k  # from this factor up every token an expert is sent is kept
        most = max(MAX_CAPACITY_FACTOR, keeps_all)
        _check(m.capacity_factor is None or 0 < m.capacity_factor <= most,
               f"capacity_factor={m.capacity_factor} must be a positive number up to {most:,.0f} "
               f"(from experts / top_k = {keeps_all:g} up every token an expert is sent is kept), "
               "or left out for no limit")


def _validate_mamba(m: ModelConfig) -> None:
    _check(m.arch in ARCHS, f"arch={m.arch!r} must be one of {', '.join(ARCHS)}")
    shown = m.pattern if len(m.pattern) <= 40 else m.pattern[:40] + "…"  # a typo of thousands of letters
    _check(not m.pattern or m.arch == "hybrid", f"a layer pattern ({shown!r}) needs arch='hybrid'")
    if m.pattern:
        others = sorted(set(m.pattern) - {ATTENTION, MAMBA})
        _check(not others, f"pattern={shown!r} has {', '.join(map(repr, others[:5]))}: each layer is "
               f"{ATTENTION} for attention or {MAMBA} for Mamba-2 (capitals), e.g. {('MA' * m.layers)[:m.layers]}")
        _check(len(m.pattern) == m.layers,
               f"pattern={shown!r} must have one letter per layer (layers={m.layers}; it has {len(m.pattern):,}), "
               f"{ATTENTION} for attention or {MAMBA} for Mamba-2, e.g. {('MA' * m.layers)[:m.layers]}")
    if MAMBA not in m.kinds:
        return
    for name in ("ssm_state", "ssm_head_dim", "ssm_expand", "ssm_groups", "conv_width", "ssm_chunk"):
        _check(getattr(m, name) >= 1, f"model {name}={getattr(m, name)} must be at least 1")
    _check(m.ssm_inner % m.ssm_head_dim == 0,
           f"the Mamba-2 inner width ssm_expand*hidden={m.ssm_inner} is not divisible by ssm_head_dim="
           f"{m.ssm_head_dim}; choose a head width that divides {m.ssm_inner}")
    _check(m.ssm_heads % m.ssm_groups == 0,
           f"ssm_groups={m.ssm_groups} does not divide the {m.ssm_heads} Mamba-2 heads: each group of heads "
           f"shares one B and C; choose ssm_groups dividing {m.ssm_heads}")
    _check(m.seq_len % m.ssm_chunk == 0,
           f"ssm_chunk={m.ssm_chunk} does not divide seq_len={m.seq_len}: the SSD scan cuts each sequence "
           f"into equal chunks; choose a chunk length dividing {m.seq_len}")


def validate(cfg: RunConfig) -> RunConfig:
    """Raise `ConfigError` naming what to change, or return `cfg` unchanged."""
    validate_model(cfg.model)
    p = cfg.parallel
    _check(1 <= cfg.world <= MAX_WORLD, f"world={cfg.world} must be between 1 and {MAX_WORLD}")
    _check(1 <= cfg.steps <= MAX_STEPS, f"steps={cfg.steps:,} must be between 1 and {MAX_STEPS:,} (--steps)")
    _between("micro_batches", cfg.micro_batches, 1, MAX_MICRO_BATCHES, "--micro-batches")
    _between("micro_batch_size", cfg.micro_batch_size, 1, MAX_MICRO_BATCHES, "--micro-batch-size")
    _check(cfg.device in DEVICES, f"device={cfg.device!r} must be one of {', '.join(DEVICES)}")
    _check(cfg.dtype in DTYPES, f"dtype={cfg.dtype!r} is not supported; use {', '.join(DTYPES)}")
    _check(math.isfinite(cfg.lr) and cfg.lr > 0, f"lr={cfg.lr} must be a positive finite number")
    largest = (2**64 - cfg.steps) // SEED_STRIDE  # data_seed(seed, steps - 1) < 2**64
    _check(0 <= cfg.seed <= largest, f"seed={cfg.seed} must be between 0 and {largest:,} (each step's batch is "
           f"seeded with seed x {SEED_STRIDE:,} + step, at most 2**64 - 1)")
    # finite: a run without a limit could hang the app, and JSON has no Infinity
    _check(math.isfinite(cfg.timeout_s) and cfg.timeout_s > 0,
           f"timeout_s={cfg.timeout_s} must be a positive, finite number of seconds (--timeout-s)")
    _check(math.isfinite(cfg.collective_timeout_s) and cfg.collective_timeout_s > 0,
           f"collective_timeout_s={cfg.collective_timeout_s} must be a positive, finite number of seconds")
    _check(p.strategy in STRATEGIES, f"strategy={p.strategy!r} is not available; use one of "
           f"{', '.join(STRATEGIES)}")
    _check(p.stage in (0, 1, 2, 3), f"zero_stage={p.stage} must be 0, 1, 2 or 3")
    _check(p.degree("fsdp", cfg.world) == 1 or p.stage >= 1,
           "the fsdp axis is where ZeRO shards, and zero stage 0 shards nothing: drop --zero-stage 0 or "
           "name the axis dp")
    if p.strategy == "fsdp":
        _check(p.stage >= 1, "fsdp with zero_stage=0 shards nothing: use --strategy dp --zero-stage 0")
    _check(p.dp_comm in DP_COMM_MODES, f"dp_comm={p.dp_comm!r} must be one of {', '.join(DP_COMM_MODES)}")
    _check(p.bucket_bytes >= 4, f"bucket_bytes={p.bucket_bytes} must hold at least one float32")
    axes = p.axes(cfg.world)
    product = 1
    for name, degree in axes:
        _check(name in AXES, f"mesh axis {name!r} is unknown; use one of {', '.join(AXES)}")
        _check(degree >= 1, f"mesh axis {name}={degree} must be at least 1")
        product *= degree
    _check(product == cfg.world, f"mesh {','.join(f'{n}={d}' for n, d in axes)} has {product} ranks but "
           f"world={cfg.world}; make the degrees multiply to the world size")
    _validate_cp_ep(cfg)
    _validate_tp(cfg)
    _validate_pp(cfg)
    if cfg.dtype == "bfloat16":
        _check(cfg.model.mlp == "dense",
               "bfloat16 with an MoE layer: a token near a routing tie picks other experts when a layout rounds "
               "its activations differently, so no tolerance can check the run against the reference; use "
               "--dtype float32 for MoE")
    if cfg.device == "cuda":
        _check(cfg.dtype == "float32", "the cuda path checks against the fp32 reference; use dtype float32")
    return cfg


def _validate_cp_ep(cfg: RunConfig) -> None:
    p, m = cfg.parallel, cfg.model
    cp, ep, tp = (p.degree(a, cfg.world) for a in ("cp", "ep", "tp"))
    _check(p.strategy != "cp" or "cp" in dict(p.axes(cfg.world)),
           "--strategy cp needs a cp axis in --mesh, e.g. --mesh dp=2,cp=2 (or no --mesh: cp = world)")
    _check(p.strategy != "ep" or "ep" in dict(p.axes(cfg.world)),
           "--strategy ep needs an ep axis in --mesh, e.g. --mesh dp=2,ep=2 (or no --mesh: ep = world)")
    _check(p.cp_variant in CP_VARIANTS,
           f"cp_variant={p.cp_variant!r} must be one of {', '.join(CP_VARIANTS)}")
    if cp > 1 and MAMBA in m.kinds:
        _validate_ssm_cp(cfg, cp, tp)
    if cp > 1 and m.has_attention:
        _check(m.seq_len % (2 * cp) == 0, f"seq_len={m.seq_len} is not divisible by 2 × cp = {2 * cp} (cp={cp}): "
               f"the load-balanced split cuts each sequence into 2 × cp equal chunks; choose seq_len as a "
               f"multiple of {2 * cp}" + (" or a smaller cp" if cp > 2 else ""))
        _check(m.mlp == "dense" or m.capacity_factor is None,
               "capacity_factor counts an expert's tokens per whole sequence, which cp splits across ranks: "
               "drop --capacity-factor with a cp axis")
    if ep > 1:
        _check(m.has_attention, "expert parallel splits the experts of MoE layers, and a Mamba-2 stack has "
               "no MLP: use --arch hybrid --mlp moe, or another axis")
        _check(m.mlp == "moe", "expert parallel splits the experts of an MoE layer: use --mlp moe")
        _check(m.experts % ep == 0, f"experts={m.experts} is not divisible by ep={ep}: each rank holds "
               f"experts/ep whole experts; choose experts as a multiple of {ep} or another ep")
    if tp > 1 and p.sequence_parallel and m.mlp == "moe":
        _check(m.capacity_factor is None,
               "capacity_factor counts an expert's tokens per whole sequence, which sequence parallel splits "
               "across the tp ranks: drop --capacity-factor or --sequence-parallel")


def _validate_ssm_cp(cfg: RunConfig, cp: int, tp: int) -> None:
    """A Mamba-2 layer under cp: each rank scans whole SSD chunks of its slice of the sequence (one slice
    of T/cp, or two of T/(2 cp) when attention layers need the load-balanced split: engine/ssm_cp.py)."""
    p, m = cfg.parallel, cfg.model
    _check(p.ssm_cp in SSM_CP_VARIANTS, f"ssm_cp={p.ssm_cp!r} must be one of {', '.join(SSM_CP_VARIANTS)}")
    slices = 2 * cp if m.has_attention else cp  # with attention layers, their check says it (below)
    _check(m.has_attention or m.seq_len % slices == 0, f"seq_len={m.seq_len} is not divisible by {slices}: "
           f"context parallel cuts each sequence into {slices} equal slices; choose seq_len as a multiple of "
           f"{slices}")
    if m.seq_len % slices:
        return
    if p.ssm_cp == "state":
        piece = m.seq_len // slices
        _check(piece % m.ssm_chunk == 0, f"ssm_chunk={m.ssm_chunk} does not divide the {piece} positions of "
               f"one context-parallel slice: choose a chunk length dividing {piece}, or --ssm-cp alltoall")
        _check(piece >= m.conv_width - 1, f"a context-parallel slice of {piece} positions is shorter than the "
               f"conv's reach of conv_width-1={m.conv_width - 1} positions back: use a longer sequence or "
               f"a smaller cp")
    else:
        split = tp * cp
        _check(m.ssm_groups % split == 0,
               f"the all-to-all variant gives each of the tp*cp={split} ranks whole groups of Mamba-2 heads, "
               f"but ssm_groups={m.ssm_groups}: choose ssm_groups as a multiple of {split}, or --ssm-cp state")


def _validate_pp(cfg: RunConfig) -> None:
    p, m = cfg.parallel, cfg.model
    pp, v, mb = cfg.pp, p.virtual_stages, cfg.micro_batches
    _check(p.strategy != "pp" or "pp" in dict(p.axes(cfg.world)),
           "--strategy pp needs a pp axis in --mesh, e.g. --mesh pp=2,dp=2")
    _check(p.schedule in SCHEDULE_NAMES,
           f"schedule={p.schedule!r} must be one of {', '.join(SCHEDULE_NAMES)}")
    _between("virtual_stages", v, 1, MAX_MODEL["layers"], "--virtual-stages",
             " (each chunk of a pipeline rank holds at least one layer)")
    _check(p.schedule != "zb-h1" or MAMBA not in m.kinds,
           "zb-h1 splits every module's backward into its input and weight parts, and a Mamba-2 block uses "
           "its conv and per-head parameters outside any module's forward: use --schedule 1f1b or "
           "interleaved-1f1b with Mamba-2 layers")
    if pp == 1:  # before the schedule's own checks: their advice (another schedule) would not help here
        _check(v == 1, f"virtual_stages={v} splits each pipeline rank's layers into chunks, and this mesh has no "
               "pp axis: add one (e.g. --mesh pp=2) or drop --virtual-stages")
        _check(p.schedule == ParallelConfig.schedule, f"--schedule {p.schedule} orders pipeline stages, and this mesh "
               "has no pp axis: add one (e.g. --mesh pp=2) or drop --schedule")
        return
    _check(v == 1 or p.schedule == "interleaved-1f1b",
           f"{p.schedule} runs one stage per rank: set --virtual-stages 1 or use --schedule interleaved-1f1b")
    _check(m.layers % (pp * v) == 0,
           f"layers={m.layers} is not divisible by pp*virtual_stages={pp * v}: each pipeline stage holds "
           "the same number of layers; " + (f"give --pattern a multiple of {pp * v} letters (one per layer)"
                                            if m.pattern else f"choose layers as a multiple of {pp * v}"))
    if p.schedule == "interleaved-1f1b":
        # Narayanan et al. 2021 section 2.2: micro-batches enter the interleaved pipeline in groups of pp.
        below, above = mb - mb % pp, mb - mb % pp + pp
        _check(mb % pp == 0, f"interleaved-1f1b needs micro_batches to be a multiple of pp={pp} (got {mb}): "
               f"use --micro-batches {f'{below} or {above}' if below else above}")


SEED_STRIDE = 1_000_003  # a prime: different (seed, step) pairs of a run seed different batches


def data_seed(seed: int, step: int) -> int:
    """The seed of one optimizer step's batch (engine.model.global_batch): torch takes 0 .. 2**64 - 1."""
    return seed * SEED_STRIDE + step


def machine_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


# The engine trains in fp32: each parameter's weight and gradient, and Adam's two moments (ui/dp_lesson's ZeRO table)
FP32_WEIGHT_BYTES, FP32_GRAD_BYTES, ADAM_STATE_BYTES = 4, 4, 8


def least_activation_bytes(cfg: RunConfig) -> float:
    """The fewest activation bytes (4 a value, 2 in a bf16 run) autograd keeps for the backward, over all
    processes: one micro-batch per data-parallel replica (tp, cp and pp split it, ep's ranks each read their
    own), each layer keeping at least the inputs its backward cannot do without. An attention + MLP layer: the
    two norms' inputs, the attention projection's input, q, k and v, the output projection's input, the MLP's
    input and (dense) two of its F-wide inputs (a SwiGLU MLP keeps three); a Mamba-2 or MoE block less surely,
    two of D. The engine keeps 2 to 30 times this (measured, summed over two ranks: the default dp run at
    64 x 256 tokens a micro-batch 380 MB against 185 MB here; D = 256, F = 1,024, 8 heads of which 2 KV, at
    16 x 256 tokens 488 MB against 243 MB; Mamba-2 943 MB against 34 MB), so the floor refuses no run that
    fits; without it, a run of about 46 GiB had passed as 4 GiB."""
    m, p = cfg.model, cfg.parallel
    replicas = cfg.world // (p.degree("tp", cfg.world) * p.degree("cp", cfg.world) * p.degree("pp", cfg.world))
    kv = 2 * m.kv_heads * (m.hidden // m.heads)
    attention = 5 * m.hidden + kv + (2 * m.hidden if m.mlp == "moe" else m.hidden + 2 * m.ffn)
    per_token = sum(attention if kind == ATTENTION else 2 * m.hidden for kind in m.kinds)
    value_bytes = 2 if cfg.dtype == "bfloat16" else 4
    return value_bytes * replicas * cfg.micro_batch_size * m.seq_len * per_token


def least_memory_bytes(cfg: RunConfig, check: bool = False) -> float:
    """Bytes a CPU run needs at the least, over all its processes: every parameter's weight and Adam moments
    once, however the ranks shard them, with either its gradient or, where a strategy frees the gradients for
    the step (fsdp, the naive dp sync), one micro-batch's fp32 logits and their gradient on a rank of the loss
    (split over tp); the layers' activations (`least_activation_bytes`); each process's copy of the step's
    token ids (`batch_bytes`); --check's single-process reference holds one more whole model and batch beside
    them."""
    m = cfg.model
    logits = cfg.micro_batch_size * m.seq_len * m.vocab / cfg.parallel.degree("tp", cfg.world)
    state = (FP32_WEIGHT_BYTES + ADAM_STATE_BYTES) * m.params + least_activation_bytes(cfg)
    run = state + max(FP32_GRAD_BYTES * m.params, 2 * 4 * logits)
    whole = (FP32_WEIGHT_BYTES + FP32_GRAD_BYTES + ADAM_STATE_BYTES) * m.params
    return run + (whole if check else 0) + batch_bytes(cfg) * (cfg.world + check)


TOKEN_BYTES = 8  # torch.randint's int64 token ids


def batch_bytes(cfg: RunConfig) -> float:
    """The step's token ids, which every process draws whole (engine.model.global_batch): the global batch of
    seq_len + 1 tokens (inputs and their next-token targets are views of it)."""
    return cfg.global_batch * (cfg.model.seq_len + 1) * TOKEN_BYTES


def check_fits_machine(cfg: RunConfig, check: bool = False) -> None:
    """Refuse (ConfigError) a CPU run that cannot fit this machine's memory before any worker allocates it."""
    total = machine_memory_bytes()
    need = least_memory_bytes(cfg, check)
    reference = ", and --check's reference model" if check else ""
    _check(cfg.device != "cpu" or total is None or need <= total,
           f"this run needs at least {need / 2**30:,.1f} GiB ({cfg.model.params:,} parameters' fp32 weights and Adam "
           f"moments, and their gradients or the logits of {cfg.micro_batch_size} x {cfg.model.seq_len} tokens over "
           f"{cfg.model.vocab:,} words, the layers' activations, and each process's {cfg.global_batch:,} sequences "
           f"of token ids{reference}), "
           f"and this machine has {total / 2**30 if total else 0:,.1f} GiB: make the model smaller (--vocab, --hidden, "
           "--layers, --ffn, --experts) or the batch (--micro-batches, --micro-batch-size, --seq-len)")


def _tp_sizes(heads: int, kv_heads: int) -> str:
    """The tp degrees that split the query heads and split (or replicate) the KV heads."""
    ok = [t for t in range(1, heads + 1) if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]
    return "{" + ", ".join(map(str, ok)) + "}"


def _validate_tp(cfg: RunConfig) -> None:
    p, m = cfg.parallel, cfg.model
    tp = p.degree("tp", cfg.world)
    _check(p.strategy != "tp" or "tp" in dict(p.axes(cfg.world)),
           "--strategy tp needs a tp axis in --mesh, e.g. --mesh dp=2,tp=2 (or no --mesh: tp = world)")
    _check(not p.sequence_parallel or tp > 1,
           "--sequence-parallel shards the tensor-parallel norms along the sequence: it needs tp > 1 "
           "(--strategy tp, or --mesh ...,tp=N)")
    if tp == 1:
        return
    if MAMBA in m.kinds:
        # Dao & Gu 2024 sec. 8: split by heads, with each group's B, C and norm on one rank.
        _check(m.ssm_groups % tp == 0,
               f"ssm_groups={m.ssm_groups} is not divisible by tp={tp}: tensor parallel splits a Mamba-2 layer "
               f"by heads, each rank holding whole groups (their B, C and norm); choose ssm_groups as a "
               f"multiple of {tp}")
    if not m.has_attention:
        _check(m.vocab % tp == 0, f"vocab={m.vocab} is not divisible by tp={tp}: each rank holds vocab/tp of "
               f"it; choose vocab as a multiple of {tp} or another tp")
    else:
        _validate_tp_attention(cfg, tp)
    if p.sequence_parallel:
        cp = p.degree("cp", cfg.world)
        held = m.seq_len // cp
        _check(held % tp == 0, f"seq_len={m.seq_len} is not divisible by tp*cp={tp * cp}: sequence parallel "
               f"splits the {held} positions a rank holds into tp equal parts; choose seq_len as a multiple "
               f"of {2 * cp * tp if cp > 1 else tp} or drop --sequence-parallel")


def _validate_tp_attention(cfg: RunConfig, tp: int) -> None:
    m = cfg.model
    sizes = _tp_sizes(m.heads, m.kv_heads)
    _check(m.heads % tp == 0, f"heads={m.heads} is not divisible by tp={tp}: each rank computes heads/tp "
           f"attention heads; use tp in {sizes} or another number of heads")
    # A KV head is split off whole (kv_heads % tp == 0) or, with more ranks than KV heads, replicated on
    # tp/kv_heads neighbouring ranks, each serving its own query heads of that group (engine/tp.py).
    _check(m.kv_heads % tp == 0 or tp % m.kv_heads == 0,
           f"kv_heads={m.kv_heads} is not divisible by tp={tp} (nor tp by kv_heads): use tp in {sizes} "
           f"or another number of kv heads")
    # An MoE layer's experts are not split over tp (engine/tp.py): only a dense MLP's ffn must divide.
    for name in ("ffn", "vocab") if m.mlp == "dense" else ("vocab",):
        size = getattr(m, name)
        _check(size % tp == 0, f"{name}={size} is not divisible by tp={tp}: each rank holds {name}/tp of "
               f"it; choose {name} as a multiple of {tp} or another tp")

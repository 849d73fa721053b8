"""Case files: a model, a training recipe, a parallel layout and a cluster, validated in one place.

A case is one JSON object shaped like an entry of `../shared/validation/published-runs.json`:
`model`, `training`, `parallel`, `cluster` blocks (extra top-level keys such as `name`, `source`,
`published` are kept or ignored). A null (or absent) choice field means "let the planner choose the
best value"; `Case` keeps those as None and `Layout` is the fully chosen form the simulator runs.
Every error is a `SpecError` naming the field, e.g. "parallel.tp: 3 does not divide heads=32".
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, fields, replace
from functools import cached_property

from core.mesh import Mesh
from planner.models import LAYER_STYLES, MLP_KINDS, ModelSpec, SpecError
from planner.stages import check_layout, expand_layout

RECOMPUTE = ("none", "selective", "selective-op", "dots", "full")
# "dots": JAX's jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims, MaxText's remat_policy "minimal"
# (MaxText/layers/models.py at 76bd53b0f): the outputs of the weight matmuls are saved, everything else (norms,
# activations, adds, the attention core) runs again before the backward (planner.flops.dots_saved_matmuls)


def dots_modelled(m: ModelSpec) -> bool:
    """Whether the planner models "dots" for `m`: dense attention + MLP layers (not MoE or Mamba layers)."""
    return not (m.is_moe or m.layer_pattern)


# What "selective" runs again before each layer's backward, by Megatron-Core's module names
# (TransformerConfig.recompute_modules, default ["core_attn"]): "core_attn" the attention kernel,
# "mla_up_proj" MLA's query and key/value up-projections, "layernorm" the two pre-norms, "mlp" a dense
# layer's MLP, "shared_experts" an MoE layer's shared experts, "moe_act" the routed experts' activation.
# (Megatron's "moe", the whole MoE layer with its all-to-alls, is not modelled.)
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "mlp", "shared_experts", "moe_act")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "zb-h1")
DTYPES = ("bf16", "fp16", "fp8")
OPTIMIZERS = ("adam", "sgd", "adafactor")
# "flash": FlashAttention-2 (Dao 2023), on every GPU; "flash3": the chip's newer kernels (FlashAttention-3,
# cuDNN fused attention, FA4); "flash-triton": FlashAttention written in Triton (flash_attn_triton.py,
# llm-foundry's attn_impl 'triton', 2023); "materialized": the scores written out and softmaxed (Megatron-LM
# 2021-22)
ATTENTION_KERNELS = ("flash", "flash3", "flash-triton", "materialized")
# How the run was executed, where it changes the cost. A null field means what a current framework does
# (Megatron-Core / NeMo, torchtitan, MaxText in 2024-25): FlashAttention, every overlap below on where the
# chip's software has it. The planner reports what it took in `chosen`.
RECIPE_DEFAULTS = {
    # the chip's best FlashAttention kernel (hardware.kernels.best_flash_kernel): flash3 on Hopper and
    # Blackwell (Transformer Engine and PyTorch SDPA pick cuDNN / FA3 there), FlashAttention-2 elsewhere
    "attention": None,
    # DP gradient reduction bucketed under the backward (PyTorch DDP, Li et al. 2020 sec. 3.2.3;
    # Megatron-Core --overlap-grad-reduce; FSDP reduce-scatters each unit as its backward ends)
    "grad_reduce_overlap": True,
    # ZeRO-1/2 parameter all-gather under the next step's forward (Megatron-Core --overlap-param-gather),
    # ZeRO-3 / FSDP gathers prefetched one layer ahead (FSDP forward/backward prefetch)
    "param_gather_overlap": True,
    # TP all-gather / reduce-scatter pipelined with the GEMMs that consume / produce them (collective
    # matmul, Wang et al. 2023; Transformer Engine userbuffers, Megatron-Core --tp-comm-overlap;
    # torchtitan async TP; XLA collective matmul on TPU) where current software does it on the chip:
    # the chip table's tp_comm_overlap (on from Hopper, off on A100)
    "tp_comm_overlap": None,
    # without sequence parallelism, the column-parallel GEMMs' input-gradient all-reduce issued before their
    # weight-gradient GEMM and waited for after it (Megatron-LM's asynchronous tensor-parallel all-reduce, on
    # by default since 2021-09-02, commit 3f65246911, turned off by --no-async-tensor-model-parallel-allreduce;
    # always in Megatron-Core's LinearWithGradAccumulationAndAsyncCommunication). False: after the backward
    # GEMMs, exposed (Megatron-LM before, and the Megatron-DeepSpeed forks' copy_to_tensor_model_parallel_region),
    # unless tp_comm_overlap is on, which overlaps this all-reduce with the others
    "tp_grad_allreduce_overlap": True,
    # expert all-to-all overlapped with another micro-batch's compute (DeepSeek-V3's DualPipe, Megatron-Core's
    # overlap_moe_expert_parallel_comm; costs.paired_ep_exposed_s); off in the common frameworks' default schedules
    "ep_comm_overlap": False,
    # each micro-batch's weight gradients added into the step's gradient inside the weight-gradient GEMM
    # (Megatron-LM's gradient_accumulation_fusion since February 2022, commit 83b1e42f: cuBLAS accumulates
    # into the fp32 main_grad; Megatron-Core's default): no pass of its own. False: a separate elementwise
    # pass per micro-batch over the stage's gradients (simulate.grad_accumulation_s): Megatron-LM 2021's
    # main_grad.add_ hook, autograd's in-place add, DeepSpeed's BF16_Optimizer update_hp_grads
    "grad_accum_fusion": True,
    # without grad_accum_fusion, each micro-batch's bf16 gradient cast to the fp32 accumulator's dtype in a copy of
    # its own before the add (DeepSpeed's BF16_Optimizer.update_hp_grads: hp_grad.data.add_(lp.grad.data.to(
    # hp_grad.dtype)), deepspeed/runtime/bf16_optimizer.py): 8 bytes more a parameter per micro-batch. False: the
    # add reads the bf16 gradient itself (Megatron-LM's main_grad.add_, PyTorch's type-promoting add_)
    "grad_accum_cast": False,
    # how tokens reach their experts (EP_DISPATCH): the chip table's deepep_dispatch, "deepep" where a current
    # framework's MoE recipes run a deduplicating dispatcher on the chip (Megatron-Bridge's flex dispatcher with
    # DeepEP or HybridEP on Hopper and Blackwell), else the NCCL all-to-all (A100, AMD, XLA on TPU). DeepEP sends
    # a token once per node, then once per rank that holds any of its experts (planner.costs)
    "ep_dispatch": None,
    # how the memory-bound ops run (FUSION): fused kernels (Transformer Engine / Megatron-Core, Apex,
    # torch.compile, Liger) in every framework's tuned recipe; "eager" where a run says so (PyTorch eager
    # RMSNorm and rotary: torchtitan with compile off)
    "fusion": "fused",
    # how fp8 GEMMs get their operands (FP8_CASTS), for dtype "fp8": Transformer Engine's fused casts
    # (Megatron-Core / NeMo) unless a run says torchao's dynamic scaling (torchtitan's Float8Linear)
    "fp8_casts": "fused",
    # how the loss runs over the logits (CROSS_ENTROPY): unfused passes over fp32 logits, Megatron-Core's
    # vocab_parallel_cross_entropy (TransformerConfig cross_entropy_loss_fusion defaults to False: Megatron-LM
    # core_r0.8.0, megatron/core/model_parallel_config.py) and torchtitan's cross_entropy(pred.float())
    "cross_entropy": "fp32",
    # the data-parallel gradients kept, accumulated and reduced in fp32 (4 bytes each) rather than in the
    # working precision (2): null is by dtype, true for bf16 and fp8 (Megatron-LM's arguments.py forces
    # accumulate_allreduce_grads_in_fp32 for bf16; Megatron-Bridge's model recipes set ddp.grad_reduce_in_fp32;
    # torchtitan's FSDP reduces in fp32) and false for fp16 (Megatron-LM 2021). False where a run says so:
    # Megatron-Bridge's performance recipes (perf_recipes/_common.py, 'cfg.ddp.grad_reduce_in_fp32 = False'),
    # Composer's FSDP mixed precision 'DEFAULT' (reduce_dtype None: the bf16 param dtype)
    "grad_reduce_in_fp32": None,
    # full-vocabulary cross-entropies a trainer runs over each micro-batch's logits for the metrics it logs,
    # beside the loss, under no_grad (planner.costs.logits_cost): none in Megatron-LM, NeMo, torchtitan,
    # DeepSpeed or MaxText, which log the loss they computed. Composer runs every train metric of the model
    # on every micro-batch after its backward (composer/trainer/trainer.py _train_microbatch ->
    # _eval_train_metrics at v0.16.4), and llm-foundry's MPT has two, LanguageCrossEntropy and
    # LanguagePerplexity, each a torch.nn.CrossEntropyLoss over the logits (use_train_metrics defaults to
    # True: llmfoundry/models/mpt/modeling_mpt.py at b2a43a147): 2
    "logit_metrics": 0,
    # how a fully sharded data-parallel implementation (ZeRO-3) moves the weights it gathers and the gradients
    # it reduces through HBM besides the collectives (FSDP_IMPLS, planner.costs.fsdp_copy_bytes); None: "fsdp2"
    # on GPUs (PyTorch's fully_shard, which torchtitan and NeMo AutoModel run), "in-place" on TPUs (XLA)
    "fsdp_impl": None,
    # when a fully sharded layer's backward gathers its weights (BACKWARD_PREFETCH): "pre", the next layer's gather
    # issued before this layer's gradients are computed, so it hides under them (PyTorch FSDP2's fully_shard, which
    # torchtitan and NeMo AutoModel run; FullyShardedDataParallel's default BackwardPrefetch.BACKWARD_PRE;
    # Megatron-FSDP); "post", issued after them (BackwardPrefetch.BACKWARD_POST: torch/distributed/fsdp/
    # _runtime_utils.py _get_handle_to_prefetch prefetches from a handle's post-backward state; the default of
    # Composer's FSDP config: composer/trainer/dist_strategy.py at v0.16, fsdp_config.setdefault(
    # 'backward_prefetch', 'BACKWARD_POST')), so each layer's backward waits for its own gather
    # (planner.costs._zero3_comms)
    "fsdp_backward_prefetch": "pre",
    # Adam's update as one multi-tensor kernel (Apex / Transformer Engine FusedAdam in Megatron-LM, NeMo and
    # DeepSpeed; torch.optim.AdamW(fused=True), torchtitan's default since 2025-02): OPTIMIZER_STEP_BYTES. False:
    # PyTorch's elementwise ops one at a time, per tensor or foreach (Composer's DecoupledAdamW, llm-foundry's
    # optimizer; torchtitan's foreach AdamW before): planner.costs.UNFUSED_ADAM_BYTES
    "optimizer_fused": True,
    # how a pipeline stage exchanges a micro-batch's activation and gradient with its neighbours (PP_P2P):
    # "batched", a pass's send and the next pass's receive as one exchange both ways at once (Megatron-LM's
    # send_forward_recv_backward and send_backward_recv_forward, p2p_communication.py's batch_isend_irecv;
    # torch.distributed.pipelining's _sorted_batch_p2p); "sequential", each a blocking operation of its own
    # (DeepSpeed's PipelineEngine, 1F1B only: before v0.8.3 its TrainSchedule issued SendActivation then RecvGrad,
    # and RecvActivation then SendGrad, in the step before a pass; PR 2862 reordered them, still two; p2p.py's
    # send and recv block until the peer posts the match): two transfers on a pass's critical path instead of
    # one (planner.simulate.pipeline_p2p_s)
    "pp_p2p": "batched",
    # the optimizer updates an fp32 master copy of the weights and keeps its moments in fp32, the bf16 weights a
    # copy of it (mixed-precision training, Micikevicius et al. 2018 sec. 3.1; Megatron-LM's and DeepSpeed's
    # optimizers; FSDP2's fp32 sharded parameters under a bf16 MixedPrecisionPolicy, torchtitan and NeMo
    # AutoModel's default). False: the parameters themselves kept in bf16 and the moments in their dtype
    # (torch.optim's zeros_like(param)): NeMo AutoModel's DeepSeek-V3 benchmark casts the model to bf16
    # (deepseek_v3/model.py, self.to(dtype)) before building AdamW (planner.memory.optimizer_state_bytes,
    # planner.costs.optimizer_step_s)
    "master_weights": True,
    # dropout on the attention and MLP outputs before the residual add (and on materialised attention scores):
    # null takes the layer style's (model.layer_style): on in the gpt style (Megatron-LM's --hidden-dropout and
    # --attention-dropout default 0.1), off in the llama style. False where a run sets the probabilities to 0,
    # which PyTorch skips (torch.nn.functional.dropout returns its input when p is 0): llm-foundry's MPT
    # (MPTConfig resid_pdrop and attn_config attn_pdrop default 0.0, llmfoundry/models/mpt/configuration_mpt.py
    # at b2a43a147, which its benchmark YAMLs leave)
    "dropout": None,
}
# "all_to_all": one copy of a token per routed expert, sent straight to the expert's rank (NCCL
# all-to-all). "deepep": one copy per destination node over the network, forwarded to the experts' GPUs
# over NVLink (DeepSeek-V3, arXiv 2412.19437 sec. 3.2.2; the DeepEP library's normal kernels).
EP_DISPATCH = ("all_to_all", "deepep")
# "fused": each norm, rotary and gated activation one kernel over HBM; "eager": PyTorch eager modules, an
# RMSNorm and a rotary embedding each a chain of elementwise kernels through fp32 (planner.costs._elementwise)
FUSION = ("fused", "eager")
# "fused": Transformer Engine casts each GEMM input once, in a kernel that writes its transposed copy too
# (planner.costs: read 2 + write 1 + 1 bytes per element); "dynamic": torchao.float8's tensorwise dynamic scaling,
# an amax pass and a cast for every operand of every GEMM, the weight's in each pass too
FP8_CASTS = ("fused", "dynamic")
# "fp32": the logits upcast to fp32 and softmaxed by separate kernels, 38 bytes per logit forward and 14 backward
# (planner.costs.logits_cost); "fused": one kernel reads the bf16 logits and keeps one value per token, the
# backward reads them again and writes their gradient (flash-attention's csrc/xentropy, the default loss_fn
# 'fused_crossentropy' of llm-foundry's MPT; Transformer Engine's, which Megatron-Bridge's performance recipes set
# with cross_entropy_fusion_impl "te", and Liger's)
CROSS_ENTROPY = ("fp32", "fused")
# "fsdp2": PyTorch's fully_shard (torch >= 2.4; torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): each
# all-gather is copied out of its buffer into the parameters (split_with_sizes_copy), forward and backward, and
# each reduce-scatter's gradients copied into its input (chunk_cat), averaged by NCCL itself. "fsdp1":
# FullyShardedDataParallel's flat parameters (torch <= 2.3): the gathers land in the flat parameter the weights
# are views of, and backward autograd concatenates the views' gradients into the flat gradient, which FSDP
# divides in place before reducing (_runtime_utils._reduce_grad: gradient_predivide_factor is 2 or more for any
# group of 2 or more ranks).
# "in-place": gathers into and reductions out of the buffers the weights and gradients live in (Megatron-FSDP;
# XLA on TPU): no pass of their own
FSDP_IMPLS = ("fsdp2", "fsdp1", "in-place")
BACKWARD_PREFETCH = ("pre", "post")
PP_P2P = ("batched", "sequential")
RECIPE_FLAGS = tuple(k for k in RECIPE_DEFAULTS
                     if k not in ("attention", "ep_dispatch", "fusion", "fp8_casts", "cross_entropy", "logit_metrics",
                                  "fsdp_impl", "fsdp_backward_prefetch", "pp_p2p"))
# The values each recipe field can take (`recipe_choices`), for the planner's table of what its assumptions are
# worth (planner.api.assumptions); logit_metrics, a count, is left out.
RECIPE_CHOICES = {"attention": ATTENTION_KERNELS, "ep_dispatch": EP_DISPATCH, "fusion": FUSION, "fp8_casts": FP8_CASTS,
                  "cross_entropy": CROSS_ENTROPY, "fsdp_impl": FSDP_IMPLS, "fsdp_backward_prefetch": BACKWARD_PREFETCH,
                  "pp_p2p": PP_P2P, **{k: (False, True) for k in RECIPE_FLAGS}}
# Context parallelism for Mamba-2 layers (planner.costs): "state" passes each rank's final SSM state to
# the next rank; "alltoall" reshards sequence -> heads around the scan (Megatron-Core). Null: the search
# tries both where they apply, else "state".
SSM_CP = ("state", "alltoall")


@dataclass(frozen=True)
class Training:
    global_batch: int  # sequences per optimizer step
    micro_batch: int | None = None
    # gradient accumulation around the pipeline schedule: the whole schedule (fill, steady state, drain)
    # runs this many times per optimizer step, each over global_batch / (dp * schedule_runs) sequences, as
    # loops around torch.distributed.pipelining's schedule.step() do (NeMo AutoModel's benchmark recipe);
    # None: 1, one schedule over the whole local batch (Megatron-LM). Without pipeline stages the same
    # micro-batches run either way.
    schedule_runs: int | None = None
    recompute: str | None = None
    recompute_modules: tuple[str, ...] | None = None  # RECOMPUTE_MODULES under "selective"; None: ["core_attn"]
    # under "full": how many layers of each pipeline chunk run again whole, counted from the chunk's first
    # (Megatron-Core's recompute_method "block" with recompute_num_layers; NeMo's performance recipes recompute
    # 1-5 layers this way to fit, e.g. Llama 3 8B on 8 H100 in fp8: 5 of 32); the others keep everything.
    # None: every layer, or, with recompute null too, the fewest that fit where a GPU case needs full
    # recomputation (planner.layout_search)
    recompute_layers: int | None = None
    dtype: str = "bf16"
    optimizer: str = "adam"
    zero_stage: int | None = None
    sequence_parallel: bool | None = None
    # the recipe (RECIPE_DEFAULTS); None: what a current framework does
    attention: str | None = None
    grad_reduce_overlap: bool | None = None
    param_gather_overlap: bool | None = None
    tp_comm_overlap: bool | None = None
    tp_grad_allreduce_overlap: bool | None = None
    ep_comm_overlap: bool | None = None
    grad_accum_fusion: bool | None = None
    grad_accum_cast: bool | None = None
    ep_dispatch: str | None = None  # EP_DISPATCH
    fusion: str | None = None  # FUSION
    fp8_casts: str | None = None  # FP8_CASTS, with dtype "fp8"
    cross_entropy: str | None = None  # CROSS_ENTROPY
    grad_reduce_in_fp32: bool | None = None
    logit_metrics: int | None = None
    fsdp_impl: str | None = None  # FSDP_IMPLS
    fsdp_backward_prefetch: str | None = None  # BACKWARD_PREFETCH
    optimizer_fused: bool | None = None
    pp_p2p: str | None = None  # PP_P2P
    master_weights: bool | None = None
    dropout: bool | None = None
    ssm_cp: str | None = None  # SSM_CP


@dataclass(frozen=True)
class Parallel:
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    # expert tensor parallel (Megatron-Core's expert_tensor_parallel_size): how many of the tp ranks split each
    # routed expert, 1 or tp ("tp": whatever tp is). 1 folds the tp ranks into the experts' own layout
    # (Megatron-Core's MoE parallel folding: ep x etp x expert-dp = tp x cp x dp): each expert whole on its rank,
    # the tokens a rank holds on its sequence shard sent over ep, no TP collective around the experts; tp splits
    # them as the dense layers (Megatron-Core's default when unset; the sidebar mesh's ep axis, core/mesh.py).
    # None: 1, what current MoE recipes set (Megatron-Bridge's DeepSeek, Qwen3 MoE, GPT-OSS and other recipes:
    # expert_tensor_parallel_size = 1)
    etp: int | str | None = None
    pp_schedule: str | None = None
    virtual_stages: int | None = None
    # which chunk holds which layers, in Megatron-Core's pipeline_model_parallel_layout syntax (planner.stages),
    # kept expanded ("Et|tt|...|mL"); None: the layers spread evenly, embedding first, MTP and loss last
    pp_layout: str | None = None


@dataclass(frozen=True)
class Cluster:
    chip: str
    num_chips: int
    chips_per_node: int | None = None  # None: the chip's scale-up domain (8 for an HGX node)
    # each chip's share of the scale-out network, bytes/s one way (a node's NIC line rate / its chips); None: the
    # chip table's (e.g. 400 Gb/s InfiniBand per H100); for a cluster wired otherwise (BLOOM's Jean Zay: 4 x 100
    # Gb/s Omni-Path per 8-GPU node = 6.25e9)
    network_bytes_per_s: float | None = None
    # TPU multislice: the job's slices, each num_chips / slices chips joined over the data-center network (a
    # group larger than a slice crosses it); None: one slice, or the fewest equal ones the chips need
    # (planner.costs.tpu_slices)
    slices: int | None = None


@dataclass(frozen=True)
class Case:
    model: ModelSpec
    training: Training
    parallel: Parallel
    cluster: Cluster
    name: str = ""


@dataclass(frozen=True)
class Layout:
    """Every choice made: what the simulator runs. The degrees are Megatron-LM's (dp counts every
    data-parallel rank of the dense layers, the ep ranks among them); `mesh` is the same layout under the
    one mesh convention (core/mesh.py), which gives every group's rank order and stride."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    attention: str = "flash"
    grad_reduce_overlap: bool = True
    param_gather_overlap: bool = True
    tp_comm_overlap: bool | None = None  # None: the chip's own (Chip.tp_comm_overlap; costs.tp_overlaps)
    tp_grad_allreduce_overlap: bool = True
    ep_comm_overlap: bool = False
    grad_accum_fusion: bool = True
    grad_accum_cast: bool = False
    ep_dispatch: str = "all_to_all"
    fusion: str = "fused"
    fp8_casts: str = "fused"
    cross_entropy: str = "fp32"
    grad_reduce_in_fp32: bool = True
    logit_metrics: int = 0
    fsdp_impl: str = "fsdp2"
    fsdp_backward_prefetch: str = "pre"
    optimizer_fused: bool = True
    pp_p2p: str = "batched"
    master_weights: bool = True
    dropout: bool | None = None  # None: the model's layer style (`dropout_on`)
    ssm_cp: str = "state"
    schedule_runs: int = 1  # Training.schedule_runs
    pp_layout: str | None = None  # Parallel.pp_layout
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES  # what "selective" runs again
    recompute_layers: int | None = None  # Training.recompute_layers; None: every layer of a chunk
    etp: int = 1  # Parallel.etp: 1, or tp

    @property
    def num_chips(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def recompute_split(self) -> int | None:
        """How many layers of each chunk full recomputation covers when it covers only some
        (`recompute_layers`, planner.memory.recompute_split); None: every layer, or another mode."""
        return self.recompute_layers if self.recompute == "full" else None

    @property
    def one_chunk(self) -> bool:
        """Whether the model runs as one chunk (no pipeline stages, no virtual ones)."""
        return self.pp * self.virtual_stages == 1

    @property
    def recompute_label(self) -> str:
        """The recomputation in a few words, for tables: the mode, and how many layers per chunk full covers."""
        if self.recompute == "full" and self.recompute_layers is not None:
            n = self.recompute_layers
            return f"full ({n} layer{'s' if n != 1 else ''}{'' if self.one_chunk else ' a chunk'})"
        return self.recompute

    def dropout_on(self, m: ModelSpec) -> bool:
        """Whether the layers run dropout (RECIPE_DEFAULTS "dropout"; None: the gpt layer style does)."""
        return m.gpt_style if self.dropout is None else self.dropout

    @property
    def fp32_accumulation_pass(self) -> bool:
        """Whether each micro-batch's gradients are added into an fp32 buffer by a pass of their own (no
        grad_accum_fusion), the pass `grad_accum_cast` casts for."""
        return not self.grad_accum_fusion and self.grad_reduce_in_fp32

    @property
    def grad_bytes(self) -> int:
        """Bytes of one data-parallel gradient as it is kept, accumulated and reduced (grad_reduce_in_fp32)."""
        return 4 if self.grad_reduce_in_fp32 else 2

    @property
    def staged_zero3(self) -> bool:
        """ZeRO-3 under pipeline parallelism: a stage's weights gathered once per step and its gradients
        reduce-scattered once, none per layer and micro-batch (planner.costs' docstring)."""
        return self.zero_stage == 3 and self.pp > 1

    @property
    def layer_zero3(self) -> bool:
        """ZeRO-3 without pipeline parallelism: every layer's weights gathered and its gradients
        reduce-scattered in each micro-batch's passes (planner.costs._zero3_comms)."""
        return self.zero_stage == 3 and not self.staged_zero3

    def per_run(self, micro_batches: int) -> int:
        """The micro-batches of one run of the pipeline schedule, of a step's `micro_batches`
        (`schedule_runs` runs each fill and drain the pipeline over an equal share)."""
        return micro_batches // self.schedule_runs

    @property
    def experts_folded(self) -> bool:
        """Whether the experts fold the tp ranks into their own layout (`Parallel.etp` 1 under tp > 1)."""
        return self.etp < self.tp

    @property
    def expert_dp(self) -> int:
        """The ranks an expert's weights are replicated over, its gradient summed over and ZeRO shards it over:
        tp x cp x dp / (ep x etp) (Megatron-Core's expert data parallel); dp x cp / ep when etp is tp."""
        return max(1, self.tp * self.cp * self.dp // (self.ep * self.etp))

    @property
    def expert_dp_stride(self) -> int:
        """How far apart the members of an expert's data-parallel group are: past its etp x ep ranks."""
        return self.etp * self.ep

    @cached_property
    def mesh(self) -> Mesh:
        """The dense layers' groups, computed once per layout (the search asks for strides in its inner loop): as
        Megatron-Core builds them, with ep = 1 (tp, then cp, then dp, then pp: parallel_state's decoder rank
        generator), so a cp group's members are tp apart whether the model has experts or not. The experts'
        groups are apart from it (Megatron-Core's expert rank generator, etp-ep-dp-pp): ep `etp` apart, an
        expert's replicas `expert_dp_stride` apart."""
        return Mesh.from_megatron(self.dp, self.tp, self.pp, self.cp)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def as_json(value, longest: int = 60) -> str:
    """A value of a case file as the file spells it (null, true, "fp8", [1, 2]), cut at `longest` characters: what
    a message quotes back, where Python's repr would say None, True or 'fp8'."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= longest else text[:longest - 3] + "..."


def _int(block: dict, key: str, prefix: str, *, required: bool, nullable: bool = True, minimum: int = 1,
         default=None):
    if key not in block:
        if required:
            raise SpecError(f"{prefix}.{key}", "missing (required)")
        return default
    v = block[key]
    if v is None:
        if not nullable:
            raise SpecError(f"{prefix}.{key}", "must not be null")
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise SpecError(f"{prefix}.{key}", f"must be an integer >= {minimum}, got {as_json(v)}")
    return v


def _etp(block: dict) -> int | str | None:
    """parallel.etp: 1, tp's degree, "tp" or null (Parallel.etp)."""
    v = block.get("etp")
    if isinstance(v, str) and v != "tp":
        raise SpecError("parallel.etp", f"must be 1, tp's degree, \"tp\" or null, got {as_json(v)}")
    return v if v == "tp" else _int(block, "etp", "parallel", required=False)


def mesh_parallel(mesh: Mesh, model: ModelSpec) -> Parallel:
    """A mesh in the one convention (core/mesh.py: the sidebar's) as a case's layout: Megatron-LM's degrees, ep
    among the data-parallel ranks, the experts split by tp as the mesh's ep axis beside tp draws them."""
    return Parallel(**mesh.megatron_degrees(), etp="tp" if model.is_moe else None)


def _bool(block: dict, key: str, prefix: str) -> bool | None:
    v = block.get(key)
    if v is not None and not isinstance(v, bool):
        raise SpecError(f"{prefix}.{key}", f"must be true, false or null, got {as_json(v)}")
    return v


def _choice(block: dict, key: str, prefix: str, options: tuple, default=None):
    v = block.get(key, default)
    if v is None:
        return default
    if v not in options:
        raise SpecError(f"{prefix}.{key}",
                        f"must be one of {', '.join(map(as_json, options))} or null, got {as_json(v)}")
    return v


def _check_keys(block, allowed: set, prefix: str) -> dict:
    if not isinstance(block, dict):
        raise SpecError(prefix, f"must be a JSON object, got {as_json(block)}")
    for k in block:
        if k not in allowed:
            raise SpecError(f"{prefix}.{k}", f"unknown field; known: {sorted(allowed)}")
    return block


_MODEL_KEYS = {f.name for f in fields(ModelSpec)}
SSM_FIELDS = ("ssm_state", "ssm_head_dim", "ssm_expand", "ssm_groups", "ssm_conv", "ssm_chunk")


def parse_model(block, name: str = "case") -> ModelSpec:
    block = _check_keys(block, _MODEL_KEYS, "model")
    kw = {"name": block.get("name", name)}
    if not isinstance(kw["name"], str):
        raise SpecError("model.name" if "name" in block else "name", f"must be a string, got {as_json(kw['name'])}")
    pattern = block.get("layer_pattern", "")
    if not isinstance(pattern, str):
        raise SpecError("model.layer_pattern", f"must be a string of 'M', '*' and '-', got {as_json(pattern)}")
    kw["layer_pattern"] = pattern
    for key in ("layers", "hidden", "vocab", "seq_len"):
        kw[key] = _int(block, key, "model", required=True, nullable=False)
    # a pattern without attention ("*") or MLP ("-") layers needs no heads or ffn
    for key, char in (("heads", "*"), ("ffn", "-")):
        used = not pattern or char in pattern
        kw[key] = _int(block, key, "model", required=used, nullable=False, minimum=1 if used else 0, default=0)
    kw["kv_heads"] = _int(block, "kv_heads", "model", required=False, nullable=False,
                          minimum=1 if kw["heads"] else 0, default=kw["heads"])
    defaults = {f.name: f.default for f in fields(ModelSpec)}
    # (a block written from a ModelSpec carries the defaults: those are harmless)
    stated = [key for key in SSM_FIELDS if block.get(key) not in (None, defaults[key])]
    if stated and "M" not in pattern:
        raise SpecError(f"model.{stated[0]}", "applies to Mamba-2 layers, which the model has none of: give a "
                        "layer_pattern with 'M' layers or leave the ssm_ fields out")
    for key in SSM_FIELDS:
        kw[key] = _int(block, key, "model", required=False, nullable=False, default=defaults[key])
    for key in ("experts", "top_k", "shared_experts", "dense_layers", "q_lora_rank", "kv_lora_rank",
                "rope_head_dim", "expert_groups", "expert_groups_per_token", "mtp_layers", "sliding_window",
                "sliding_window_layers"):
        kw[key] = _int(block, key, "model", required=False, nullable=False, minimum=0, default=0)
    for key in ("head_dim", "dense_ffn"):
        kw[key] = _int(block, key, "model", required=False, default=None)
    kw["mlp"] = _choice(block, "mlp", "model", MLP_KINDS, default="swiglu")
    kw["layer_style"] = _choice(block, "layer_style", "model", LAYER_STYLES)
    kw["tied_embeddings"] = bool(_bool(block, "tied_embeddings", "model"))
    kw["parallel_block"] = bool(_bool(block, "parallel_block", "model"))
    causal = _bool(block, "causal", "model")
    kw["causal"] = True if causal is None else causal
    return ModelSpec(**kw)


# A case file's top-level keys: the four blocks, and what the published-run files say of a run beside them
CASE_KEYS = {"model", "training", "parallel", "cluster", "name", "source", "published", "recipe_source", "confidence"}


def parse_case(data) -> Case:
    """Build a validated Case from a decoded JSON object; raises SpecError naming the bad field."""
    if not isinstance(data, dict):
        raise SpecError("case", f"must be a JSON object, got {as_json(data)}")
    for key in ("model", "training", "cluster"):
        if key not in data:
            raise SpecError(key, "missing (required block)")
    _check_keys(data, CASE_KEYS, "case")
    name = data.get("name", "case")
    model = parse_model(data["model"], name)

    t = _check_keys(data["training"], {f.name for f in fields(Training)}, "training")
    flags = {k: _bool(t, k, "training") for k in ("sequence_parallel", *RECIPE_FLAGS)}
    zero = t.get("zero_stage")
    if zero is not None and (isinstance(zero, bool) or not isinstance(zero, int) or zero not in (0, 1, 2, 3)):
        raise SpecError("training.zero_stage", f"must be 0, 1, 2, 3 or null, got {as_json(zero)}")
    training = Training(
        global_batch=_int(t, "global_batch", "training", required=True, nullable=False),
        micro_batch=_int(t, "micro_batch", "training", required=False),
        schedule_runs=_int(t, "schedule_runs", "training", required=False),
        recompute=_choice(t, "recompute", "training", RECOMPUTE),
        recompute_modules=_recompute_modules(t, model),
        recompute_layers=_int(t, "recompute_layers", "training", required=False),
        dtype=_choice(t, "dtype", "training", DTYPES, "bf16"),
        optimizer=_choice(t, "optimizer", "training", OPTIMIZERS, "adam"),
        zero_stage=zero, attention=_choice(t, "attention", "training", ATTENTION_KERNELS),
        ssm_cp=_choice(t, "ssm_cp", "training", SSM_CP),
        ep_dispatch=_choice(t, "ep_dispatch", "training", EP_DISPATCH),
        fusion=_choice(t, "fusion", "training", FUSION), fp8_casts=_choice(t, "fp8_casts", "training", FP8_CASTS),
        cross_entropy=_choice(t, "cross_entropy", "training", CROSS_ENTROPY),
        logit_metrics=_int(t, "logit_metrics", "training", required=False, minimum=0),
        fsdp_impl=_choice(t, "fsdp_impl", "training", FSDP_IMPLS),
        fsdp_backward_prefetch=_choice(t, "fsdp_backward_prefetch", "training", BACKWARD_PREFETCH),
        pp_p2p=_choice(t, "pp_p2p", "training", PP_P2P),
        **flags,
    )

    training = implied_recompute(training)
    p = _check_keys(data.get("parallel", {}), {f.name for f in fields(Parallel)}, "parallel")
    parallel = Parallel(
        **{k: _int(p, k, "parallel", required=False)
           for k in ("dp", "tp", "pp", "cp", "ep", "virtual_stages")},
        etp=_etp(p),
        pp_schedule=_choice(p, "pp_schedule", "parallel", SCHEDULES),
    )
    if p.get("pp_layout") is not None:
        parallel = _with_pp_layout(parallel, p["pp_layout"], model)

    c = _check_keys(data["cluster"], {f.name for f in fields(Cluster)}, "cluster")
    if "chip" not in c or not isinstance(c["chip"], str):
        raise SpecError("cluster.chip", f"missing or not a string: {as_json(c.get('chip'))}")
    from hardware.chips import get_chip
    try:
        get_chip(c["chip"])
    except ValueError as e:
        raise SpecError("cluster.chip", str(e)) from None
    net = c.get("network_bytes_per_s")
    if net is not None and (isinstance(net, bool) or not isinstance(net, (int, float)) or not 1e6 <= net < math.inf):
        raise SpecError("cluster.network_bytes_per_s", f"must be a finite number of bytes/s per chip, at least 1e6 "
                        f"(e.g. 50e9 for 400 Gb/s), or null, got {as_json(net)}")
    cluster = Cluster(c["chip"], _int(c, "num_chips", "cluster", required=True, nullable=False),
                      _int(c, "chips_per_node", "cluster", required=False), None if net is None else float(net),
                      _int(c, "slices", "cluster", required=False))
    case = Case(model, training, parallel, cluster, name)
    check_fixed(case)
    return case


def _recompute_modules(block: dict, model: ModelSpec) -> tuple[str, ...] | None:
    """The stated modules of selective recomputation, checked against the recompute mode and the model."""
    v = block.get("recompute_modules")
    if v is None:
        return None
    field = "training.recompute_modules"
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise SpecError(field, f"must be a non-empty list of {RECOMPUTE_MODULES} or null, got {as_json(v)}")
    unknown = [x for x in v if x not in RECOMPUTE_MODULES]
    if unknown:
        hint = (" (the whole MoE layer, all-to-alls included, is not modelled: name \"moe_act\" and "
                "\"shared_experts\", or use recompute \"full\")" if "moe" in unknown else "")
        raise SpecError(field, f"unknown {unknown}; use {RECOMPUTE_MODULES}{hint}")
    if len(set(v)) != len(v):
        raise SpecError(field, f"names a module twice: {v}")
    if block.get("recompute") not in (None, "selective"):
        raise SpecError(field, f"applies to recompute \"selective\" (or null), not {as_json(block.get('recompute'))}")
    if model.layer_pattern:
        raise SpecError(field, "is not modelled for a layer pattern; use recompute \"selective\" without it")
    needs = {"mla_up_proj": (model.is_mla, "an MLA model (kv_lora_rank > 0)"),
             "mlp": (not model.is_moe or model.dense_layers > 0, "dense MLP layers"),
             "shared_experts": (model.shared_experts > 0, "shared experts"),
             "moe_act": (model.is_moe, "routed experts")}
    for name in v:
        ok, what = needs.get(name, (True, ""))
        if not ok:
            raise SpecError(field, f"{name!r} needs {what}; this model has none")
    return tuple(v)


def implied_recompute(t: Training) -> Training:
    """A null recompute mode that the stated details imply: modules name what "selective" reruns, a layer
    count what "full" covers."""
    if t.recompute is None and t.recompute_modules:
        return replace(t, recompute="selective")
    if t.recompute is None and t.recompute_layers is not None:
        return replace(t, recompute="full")
    return t


def _with_pp_layout(parallel: Parallel, text, model: ModelSpec) -> Parallel:
    """`parallel` with its stated pipeline layout expanded and checked; the layout fixes the virtual stages
    (chunks / pp) and, with more than one, the interleaved schedule."""
    if not parallel.pp:
        raise SpecError("parallel.pp_layout", "needs parallel.pp: the layout's chunks are dealt over the stages")
    try:
        # a piece (E, t, m, L) per letter, and a | per chunk: at most one chunk per piece on each of pp stages, as
        # empty chunks may pad a stage's virtual stages
        expanded = expand_layout(text, limit=min((model.layers + model.mtp_layers + 2) * (parallel.pp + 1),
                                                 MAX_LAYOUT_CHARS))
        chunks = tuple(expanded.split("|"))
        check_layout(chunks, model.layers, model.mtp_layers, parallel.pp)
    except ValueError as e:
        raise SpecError("parallel.pp_layout", str(e)) from None
    virtual = len(chunks) // parallel.pp
    if parallel.pp == 1 and virtual > 1:
        raise SpecError("parallel.pp_layout", f"has {len(chunks)} chunks, but pp=1 runs the model as one: join them "
                        "(drop the |) or set parallel.pp")
    if parallel.virtual_stages and parallel.virtual_stages != virtual:
        raise SpecError("parallel.virtual_stages", f"{parallel.virtual_stages}, but pp_layout has {len(chunks)} "
                        f"chunks over pp={parallel.pp} stages: {virtual} per stage")
    schedule = parallel.pp_schedule or ("interleaved-1f1b" if virtual > 1 else None)
    return replace(parallel, virtual_stages=virtual, pp_schedule=schedule, pp_layout=expanded)


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list) -> dict:
    """A JSON object's pairs as a dict, refusing a key stated twice (json keeps the last one silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


# The largest case file read: 64 MiB, 8x the biggest a case can be (a pipeline layout of MAX_LAYOUT_CHARS
# characters in a few MB of JSON); a device, a pipe or a mistaken log file is refused before it is read.
MAX_CASE_BYTES = 64 * 2 ** 20


def load_case(path: str) -> Case:
    try:
        # before opening it: opening a pipe waits for a writer
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a folder: open() says so below
            raise SpecError("case", f"{path} is not a regular file (a device, a pipe or a socket): give the path "
                            "of a case's JSON file")
        with open(path, "rb") as f:
            raw = f.read(MAX_CASE_BYTES + 1)  # never more, whatever the file says its size is
        if len(raw) > MAX_CASE_BYTES:
            raise SpecError("case", f"{path} is larger than {MAX_CASE_BYTES // 2 ** 20} MiB, far more than a case "
                            "(a few KB): give the path of a case's JSON file")
        # a BOM (Windows editors write one) is not part of the JSON
        data = json.loads(raw.decode("utf-8-sig"), object_pairs_hook=_unique_keys)
    except SpecError:
        raise
    except json.JSONDecodeError as e:
        raise SpecError("case", f"malformed JSON in {path}: {e}") from None
    except _DuplicateKey as e:
        raise SpecError("case", f"{path} states {str(e)!r} twice in one object; keep one") from None
    except UnicodeDecodeError:
        raise SpecError("case", f"{path} is not UTF-8 text: save the case as a UTF-8 JSON file") from None
    except ValueError as e:
        if "digits" in str(e):  # an integer of more digits than Python converts (sys.int_info)
            raise SpecError("case", f"{path} holds an integer of thousands of digits, more than any field takes: "
                            "check the numbers in the file") from None
        raise SpecError("case", f"malformed JSON in {path}: {e}") from None
    except RecursionError:
        raise SpecError("case", f"{path} nests its JSON too deeply to be a case file") from None
    except OSError as e:
        raise SpecError("case", f"cannot read {path}: {e.strerror}") from None
    return parse_case(data)


def _divides(a: int, b: int) -> bool:
    return b % a == 0


# The most sequences a step may take: 2^24, 256x the largest published batch (65,536 sequences of 128 tokens,
# You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", LAMB), room for a
# sequence per chip on the largest clusters. A mistyped 10^15 is refused here (pipelines also stop at
# layout_search.MAX_PIPELINE_PASSES).
MAX_GLOBAL_BATCH = 2 ** 24
# The most chips a case may state: 2^24, about 50x the largest training clusters announced (xAI's Colossus, some
# 200,000 GPUs in 2025), room for what-ifs. A mistyped 10^12 is refused here rather than searched.
MAX_NUM_CHIPS = 2 ** 24
# The longest pipeline layout written out (parallel.pp_layout), whatever pp says: pp is checked after the layout
MAX_LAYOUT_CHARS = 2 ** 20
# The most full-vocabulary metrics a case may say its trainer computes beside the loss (training.logit_metrics)
MAX_LOGIT_METRICS = 16


def check_fixed(case: Case) -> None:
    """Divisibility checks on the fields the case fixes, each naming the field to change."""
    m, p, n, t = case.model, case.parallel, case.cluster.num_chips, case.training
    if n > MAX_NUM_CHIPS:  # before anything walks the chips' divisors (planner.costs.tpu_slices)
        raise SpecError("cluster.num_chips", f"{n:,} is more than the {MAX_NUM_CHIPS:,} chips the planner models (the "
                        "largest clusters built hold a few hundred thousand); use fewer chips")
    if t.global_batch > MAX_GLOBAL_BATCH:
        raise SpecError("training.global_batch", f"{t.global_batch:,} sequences is more than the {MAX_GLOBAL_BATCH:,} "
                        "the planner models (the largest published batch is 65,536; a step takes at least one "
                        "sequence per chip, so fewer chips or a smaller batch)")
    if t.recompute == "dots" and not dots_modelled(m):
        raise SpecError("training.recompute", "\"dots\" (JAX's checkpoint_dots_with_no_batch_dims) is modelled for "
                        "dense attention + MLP layers only, not MoE or Mamba layers: use \"full\" or \"selective\"")
    if t.recompute_layers is not None:
        if t.recompute != "full":
            raise SpecError("training.recompute_layers", f"applies to recompute \"full\" (or null), not "
                            f"{t.recompute!r}" + (" (recompute_modules makes it \"selective\")"
                                                  if t.recompute_modules else ""))
        if not 1 <= t.recompute_layers <= m.layers:
            raise SpecError("training.recompute_layers", f"must be 1 to the model's {m.layers} layers, got "
                            f"{t.recompute_layers}; null recomputes every layer")
    if t.fsdp_backward_prefetch == "post" and t.fsdp_impl != "fsdp1":
        raise SpecError("training.fsdp_backward_prefetch", "\"post\" is FullyShardedDataParallel's BACKWARD_POST: "
                        "state fsdp_impl \"fsdp1\" with it (fully_shard and XLA always gather one layer ahead)")
    _check_slices(case.cluster)
    _check_node(case.cluster)
    if t.grad_accum_cast and t.grad_accum_fusion is not False:
        raise SpecError("training.grad_accum_cast", "casts the gradient before a separate accumulation pass: state "
                        "grad_accum_fusion false with it (a fused accumulation adds inside the GEMM)")
    if t.grad_accum_cast and not grads_in_fp32(t):
        raise SpecError("training.grad_accum_cast", "casts the gradient to an fp32 accumulator, and this run keeps its "
                        "gradients in the working precision (grad_reduce_in_fp32): drop one of the two")
    if t.pp_p2p == "sequential" and case.parallel.pp_schedule not in (None, "1f1b"):
        raise SpecError("training.pp_p2p", f"\"sequential\" is DeepSpeed's pipeline engine, which runs 1F1B only, not "
                        f"{case.parallel.pp_schedule!r}: state pp_schedule \"1f1b\" with it")
    if t.zero_stage is not None and case.parallel.pp is not None and \
            not zero_stage_runs(t, case.parallel.pp, t.zero_stage):
        raise SpecError("training.zero_stage", f"ZeRO-{t.zero_stage} with {case.parallel.pp} pipeline stages, and "
                        "pp_p2p \"sequential\" is DeepSpeed's pipeline engine, which refuses ZeRO-2 and ZeRO-3 under "
                        "pipeline parallelism: state zero_stage 0 or 1 (or pp_p2p \"batched\")")
    if not m.is_moe:
        for name in ("ep_dispatch", "ep_comm_overlap"):
            if getattr(t, name) is not None:
                raise SpecError(f"training.{name}", "routes tokens to experts, and this model has none: set it to null")
    if t.logit_metrics is not None and t.logit_metrics > MAX_LOGIT_METRICS:
        raise SpecError("training.logit_metrics", f"{t.logit_metrics} cross-entropies over every micro-batch's logits: "
                        f"trainers log a few (Composer's MPT 2); at most {MAX_LOGIT_METRICS}")
    if t.fp8_casts and t.dtype != "fp8":
        raise SpecError("training.fp8_casts", f"applies to dtype \"fp8\", not {t.dtype!r}")
    if t.dropout and not m.gpt_style:
        raise SpecError("training.dropout", "dropout is modelled in the gpt layer style (bias, dropout and residual "
                        "add per block); a llama-style layer runs none: set model.layer_style \"gpt\" or leave it null")
    fixed = {k: getattr(p, k) for k in ("dp", "tp", "pp", "cp") if getattr(p, k) is not None}
    prod = 1
    for v in fixed.values():
        prod *= v
    if not _divides(prod, n) or (len(fixed) == 4 and prod != n):
        raise SpecError("parallel", f"dp*tp*pp*cp = {prod} must {'equal' if len(fixed) == 4 else 'divide'} "
                        f"cluster.num_chips={n} (given {fixed})")
    if p.tp and m.has_ssm and not ssm_tp_ok(m, p.tp):
        raise SpecError("parallel.tp", f"{p.tp} must divide model.ssm_groups={m.ssm_groups}: each TP rank holds "
                        "whole B/C groups, so a Mamba-2 layer needs one all-reduce (Dao & Gu 2024 sec. 8.1); "
                        f"use tp in {[d for d in range(1, m.ssm_groups + 1) if ssm_tp_ok(m, d)]}")
    if case.training.ssm_cp is not None and not m.has_ssm:
        raise SpecError("training.ssm_cp", "applies to Mamba-2 layers, which the model has none of: leave it null")
    if case.training.ssm_cp == "alltoall" and p.tp and p.cp and m.has_ssm and not ssm_alltoall_ok(m, p.tp, p.cp):
        raise SpecError("training.ssm_cp", f"\"alltoall\" reshards heads over tp*cp = {p.tp * p.cp} ranks, which "
                        f"must divide the {m.ssm_heads} SSM heads and ssm_groups={m.ssm_groups}; use \"state\" "
                        "or a smaller cp")
    if p.tp and not layout_tp_ok(m, p.tp):
        raise SpecError("parallel.tp", f"{p.tp} must divide heads={m.heads}, hidden={m.hidden} and "
                        f"ffn={m.ffn}, and divide or be divided by kv_heads={m.kv_heads}")
    if p.pp and p.pp > m.layers:
        raise SpecError("parallel.pp", f"{p.pp} stages for {m.layers} layers: each stage holds at least one "
                        f"layer; use at most {m.layers} stages")
    if p.pp and p.virtual_stages and p.pp * p.virtual_stages > m.layers and not p.pp_layout:
        raise SpecError("parallel.virtual_stages", f"pp*v = {p.pp * p.virtual_stages} > layers={m.layers}: each "
                        f"chunk holds at least one layer; use at most {m.layers // p.pp} virtual stages")
    if p.cp and not _divides(p.cp, m.seq_len):
        raise SpecError("parallel.cp", f"{p.cp} does not divide seq_len={m.seq_len}")
    if p.ep and p.ep > 1:
        if not m.is_moe:
            raise SpecError("parallel.ep", "ep > 1 needs an MoE model (model.experts > 0)")
        if not _divides(p.ep, m.experts):
            raise SpecError("parallel.ep", f"{p.ep} does not divide experts={m.experts}")
        # the ranks ep is carved from (Megatron-Core's expert rank generator: world = etp x ep x expert dp x pp):
        # the dense layers' context- and data-parallel ones, with the experts folding the tp ranks (etp 1 under
        # tp > 1) tp x cp x dp; dp as the stated degrees imply it when it is null
        free = [k for k in ("dp", "tp", "pp", "cp") if getattr(p, k) is None]
        dp = p.dp or (case.cluster.num_chips // (p.tp * p.pp * p.cp) if free == ["dp"] else None)
        folded = p.tp is not None and p.etp not in ("tp", p.tp) and p.tp > 1
        if dp and p.tp and p.cp is not None:  # a null cp may still give ep its ranks
            pool = dp * p.tp * p.cp if folded else dp * p.cp
            if not _divides(p.ep, pool):
                raise SpecError("parallel.ep", f"{p.ep} must divide tp*cp*dp = {pool}: with etp 1 the "
                                               "expert-parallel ranks are the tp, cp and dp ranks" if folded else
                                f"{p.ep} must divide cp*dp = {pool}: expert-parallel ranks are context- and "
                                "data-parallel ranks of the dense layers (core/mesh.py)")
    if p.etp is not None and p.etp != 1:
        if not m.is_moe:
            raise SpecError("parallel.etp", f"{p.etp!r} needs an MoE model (model.experts > 0); use 1 or null")
        if p.etp != "tp" and p.tp is None:
            raise SpecError("parallel.etp", f"{p.etp} needs parallel.tp stated: etp is 1 or tp, or \"tp\"")
        if p.etp != "tp" and p.etp != p.tp:
            raise SpecError("parallel.etp", f"{p.etp} must be 1 (experts whole, the tp ranks folded into ep) or "
                                            f"tp={p.tp} (experts split as the dense layers), or \"tp\"")
    if m.is_moe and p.tp and p.tp > 1 and case.training.sequence_parallel is False:
        raise SpecError("training.sequence_parallel", "an MoE model under tp > 1 needs sequence parallelism "
                                                      "(Megatron-Core refuses to train without it): use true or null")
    gb, mb = case.training.global_batch, case.training.micro_batch
    if p.dp and not _divides(p.dp, gb):
        raise SpecError("parallel.dp", f"{p.dp} does not divide training.global_batch={gb}")
    if p.dp and mb and not _divides(p.dp * mb, gb):
        raise SpecError("training.micro_batch", f"dp*micro_batch = {p.dp * mb} does not divide "
                        f"global_batch={gb}")
    runs = case.training.schedule_runs
    if runs and p.dp and not _divides(p.dp * (mb or 1) * runs, gb):
        raise SpecError("training.schedule_runs", f"dp*micro_batch*schedule_runs = {p.dp * (mb or 1) * runs} "
                        f"does not divide global_batch={gb}: each run of the schedule takes whole micro-batches")
    if p.pp_schedule == "interleaved-1f1b" and p.virtual_stages == 1:
        raise SpecError("parallel.virtual_stages", "interleaved-1f1b needs virtual_stages >= 2 (or null)")
    if p.pp_schedule in ("1f1b", "gpipe", "zb-h1") and p.virtual_stages and p.virtual_stages > 1:
        raise SpecError("parallel.pp_schedule", f"virtual_stages={p.virtual_stages} needs interleaved-1f1b")
    if p.pp == 1 and ((p.virtual_stages or 1) > 1 or p.pp_schedule == "interleaved-1f1b"):
        field = "parallel.virtual_stages" if (p.virtual_stages or 1) > 1 else "parallel.pp_schedule"
        raise SpecError(field, "interleaving needs pipeline stages: with pp=1 there is one stage and no chunks to "
                               "interleave; set pp > 1, or virtual_stages 1 and another schedule (or null)")
    if p.pp and p.pp > 1 and p.dp and mb and p.pp_schedule == "interleaved-1f1b":
        per_run = gb // (p.dp * mb * (runs or 1))  # micro-batches of one run of the schedule
        if per_run % p.pp:
            raise SpecError("training.global_batch", f"interleaved-1f1b runs micro-batches in groups of pp={p.pp}, "
                            f"but a run has global_batch / (dp x micro_batch x schedule_runs) = {per_run}: choose "
                            f"a global batch that gives a multiple of {p.pp}, or another schedule")


def _check_node(cl: Cluster) -> None:
    """A stated node: no more chips than the chip's scale-up domain joins (an HGX H100 node's NVSwitch joins 8,
    a GB200 NVL72 rack's 72); fewer is a partly used node or rack, as NeMo's 64 GPUs of a 72-GPU rack."""
    if cl.chips_per_node is None:
        return
    from hardware.chips import get_chip

    chip = get_chip(cl.chip)
    if cl.num_chips > cl.chips_per_node and cl.num_chips % cl.chips_per_node:
        raise SpecError("cluster.chips_per_node", f"{cl.chips_per_node} does not divide num_chips={cl.num_chips}: "
                        "a cluster of more than one node is whole nodes; state the chips each node holds")
    if cl.chips_per_node > chip.scaleup_domain:
        raise SpecError("cluster.chips_per_node", f"{cl.chips_per_node} is more than {chip.name}'s scale-up domain "
                        f"of {chip.scaleup_domain} chips on {chip.scaleup_link}; state the chips one node joins, at "
                        f"most {chip.scaleup_domain}")


def _check_slices(cl: Cluster) -> None:
    """A stated slice count: TPUs only, dividing the chips into slices the largest slice holds."""
    if cl.slices is None:
        return
    from hardware.chips import get_chip
    from planner.costs import slice_shape

    chip = get_chip(cl.chip)
    if chip.kind != "tpu":
        raise SpecError("cluster.slices", f"TPU multislice only; {chip.name} clusters state chips_per_node and "
                        "network_bytes_per_s instead")
    if cl.slices < 1 or cl.num_chips % cl.slices or not slice_shape(chip, cl.num_chips // cl.slices):
        shape = "x".join(map(str, chip.torus_shape))
        raise SpecError("cluster.slices", f"{cl.slices} must divide num_chips={cl.num_chips} into slices of a TPU "
                        f"slice shape inside {chip.name}'s largest, {shape} (axes that are multiples of 4)")


# DeepSpeed's PipelineEngine, the one pp_p2p "sequential" stands for, refuses ZeRO-2 and ZeRO-3 under pipeline
# parallelism (deepspeed/runtime/pipe/engine.py, PipelineEngine.__init__: assert zero_optimization_stage() < 2,
# "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"): ZeRO-1 at most with its pipeline stages
PIPELINE_ENGINE_MAX_ZERO = 1


def zero_stage_runs(t: Training, pp: int, zero_stage: int) -> bool:
    """Whether a run of recipe `t` can shard at `zero_stage` over `pp` pipeline stages: the one rule the case's
    check (`check_fixed`) and the layout search read."""
    return not (pp > 1 and t.pp_p2p == "sequential" and zero_stage > PIPELINE_ENGINE_MAX_ZERO)


def default_tp_overlap(chip, m: ModelSpec) -> bool:
    """Whether a current framework pipelines TP's collectives with the GEMMs of `m` on `chip`: the chip
    table's tp_comm_overlap, except MLA models on GPUs: Megatron-Core's TELinear turns userbuffers off for the
    whole model when it builds a module whose buffer name is not qkv, proj, fc1 or fc2, as MLA's down
    projections are (megatron/core/extensions/transformer_engine.py, since core_v0.14)."""
    return bool(chip.tp_comm_overlap) and not (m.is_mla and chip.kind == "gpu")


def grads_in_fp32(t: Training) -> bool:
    """Whether the run keeps and reduces its gradients in fp32 (RECIPE_DEFAULTS "grad_reduce_in_fp32"; null: every
    dtype but fp16)."""
    return t.dtype != "fp16" if t.grad_reduce_in_fp32 is None else t.grad_reduce_in_fp32


def recipe(t: Training, chip, m: ModelSpec) -> dict:
    """The case's recipe with every null field replaced by RECIPE_DEFAULTS (what a current framework does)."""
    from hardware.kernels import best_flash_kernel

    out = {k: default if getattr(t, k) is None else getattr(t, k) for k, default in RECIPE_DEFAULTS.items()}
    if out["dropout"] is None:
        out["dropout"] = m.gpt_style
    if out["attention"] is None:
        out["attention"] = best_flash_kernel(chip)
    if out["tp_comm_overlap"] is None:
        out["tp_comm_overlap"] = default_tp_overlap(chip, m)
    if out["ep_dispatch"] is None:
        out["ep_dispatch"] = "deepep" if chip.deepep_dispatch else "all_to_all"
    out["grad_reduce_in_fp32"] = grads_in_fp32(t)
    if out["fsdp_impl"] is None:
        out["fsdp_impl"] = "in-place" if chip.kind == "tpu" else "fsdp2"
    for name in ("attention", "ep_dispatch", "fsdp_impl"):
        why = recipe_refusal(name, out[name], chip)
        if why:
            raise SpecError(f"training.{name}", why)
    return out


def recipe_refusal(name: str, value, chip) -> str | None:
    """Why `chip` cannot run recipe field `name` at `value` (what to use instead), or None: the one rule both the
    case's checks (`recipe`) and the values the planner tries (`recipe_choices`) read."""
    if name == "attention" and value == "flash3" and chip.flash3_efficiency is None:
        return f"{chip.name} has no FlashAttention-3-class kernel; use \"flash\""
    if name == "attention" and value == "flash-triton" and chip.kind != "gpu":
        return f"{chip.name} is not a GPU: FlashAttention in Triton runs on GPUs; use \"flash\""
    if name == "ep_dispatch" and value == "deepep" and not (chip.kind == "gpu" and chip.vendor == "NVIDIA"):
        return (f"DeepEP runs on NVIDIA GPUs (NVSHMEM over NVLink and InfiniBand), not {chip.name}: use "
                "\"all_to_all\"")
    if name == "fsdp_impl" and value in ("fsdp1", "fsdp2") and chip.kind == "tpu":
        return f"PyTorch's FSDP runs on GPUs; XLA on {chip.name} gathers and reduces in place: use \"in-place\""
    return None


def recipe_choices(name: str, chip) -> tuple:
    """The values recipe field `name` can take on `chip` (RECIPE_CHOICES less what `recipe_refusal` refuses)."""
    return tuple(v for v in RECIPE_CHOICES.get(name, ()) if not recipe_refusal(name, v, chip))


def ssm_tp_ok(m: ModelSpec, tp: int) -> bool:
    """TP splits a Mamba-2 layer by heads with whole groups per rank (Dao & Gu 2024 sec. 8.1)."""
    return m.ssm_groups % tp == 0 and m.ssm_heads % tp == 0


def ssm_alltoall_ok(m: ModelSpec, tp: int, cp: int) -> bool:
    """The all-to-all CP variant gives each of tp * cp ranks whole heads and groups (Megatron-Core)."""
    return m.ssm_groups % (tp * cp) == 0 and m.ssm_heads % (tp * cp) == 0


def transformer_tp_ok(m: ModelSpec, tp: int) -> bool:
    """TP splits attention by heads (KV heads split or repeated) and the MLP by its width."""
    kv_ok = not m.kv_heads or m.kv_heads % tp == 0 or tp % m.kv_heads == 0
    ffns = [m.ffn] + ([m.dense_ffn_] if m.dense_layers else [])
    return m.heads % tp == 0 and m.hidden % tp == 0 and all(f % tp == 0 for f in ffns) and kv_ok


def layout_tp_ok(m: ModelSpec, tp: int) -> bool:
    return (not m.has_ssm or ssm_tp_ok(m, tp)) and transformer_tp_ok(m, tp)

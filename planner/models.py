"""Model shapes: the `model` block of a case file, and presets with the public shapes of real models.

A `ModelSpec` describes one decoder-only Transformer: dense (GELU or SwiGLU MLP), grouped-query
attention, Mixture-of-Experts (routed experts with top-k routing, optional always-on shared experts,
optional dense first layers) and DeepSeek's multi-head latent attention (MLA, low-rank Q and KV
projections). The arithmetic on these shapes lives in `planner.flops` and `planner.memory`.

It also describes Mamba-2 and hybrid stacks with `layer_pattern`, one character per layer in
Nemotron-H's notation (`hybrid_override_pattern`, NVIDIA 2025, arXiv 2504.03624): "M" a Mamba-2 mixer
layer, "*" an attention layer, "-" an MLP layer, each one pre-norm block with its residual. An empty
pattern is the Transformer layer (attention + MLP) every layer. The Mamba-2 mixer (Dao & Gu 2024,
arXiv 2405.21060 sec. 7; mamba_ssm's `Mamba2` module), model width D:

    d_inner = ssm_expand * D,  H = d_inner / ssm_head_dim SSM heads of P = ssm_head_dim channels,
    G = ssm_groups groups of B and C (shared by H / G heads, like GQA's kv heads), N = ssm_state,
    a causal depthwise conv of width ssm_conv, the SSD scan in chunks of ssm_chunk tokens.

A layer kind, as `planner.flops`, `planner.memory` and `planner.costs` take it: False a dense
Transformer layer, True an MoE one, or a pattern character ("M", "*", "-").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from core.ssd import MAX_SSM_EXPAND

# "relu2": squared ReLU, 2 matrices and no biases (So et al. 2021, Primer; Nemotron-H's MLP)
# Llama-style gated MLP (3 matrices), GPT-style GELU (2), squared ReLU (2, Nemotron-H)
MLP_KINDS = ("swiglu", "gelu", "relu2")
# What surrounds the matmuls of a layer (ModelSpec.layer_style): "gpt" (GPT-2/3, Megatron-LM's GPT): LayerNorm with
# a bias, biases on every projection, learned position embeddings, a dropout after attention and after the MLP;
# "llama": RMSNorm, no biases, rotary embeddings, no dropout
LAYER_STYLES = ("gpt", "llama")
MAMBA, ATTENTION, MLP = "M", "*", "-"
PATTERN_CHARS = MAMBA + ATTENTION + MLP
# The most layers a model may have: the planner keeps a model's layer kinds one by one (ModelSpec.kinds), so
# a mistyped count of billions would take minutes and gigabytes before any answer; published models have
# at most a few hundred.
MAX_LAYERS = 10_000
# The largest width, vocabulary or sequence a model may state: 2^26 is ~64x the widest published model's
# hidden size and 6x the longest published context (Llama 4 Scout's 10M), and keeps every FLOP and byte count
# a float can hold (a mistyped 10^200 would overflow them).
MAX_DIM = 2 ** 26


def _at_most(field: str, v: int, most: int = MAX_DIM) -> None:
    """Raise SpecError for a size `v` of `field` above `most`, quoting a mistyped giant as 1.23e+200 (or its digit
    count), not its hundreds of digits."""
    if v > most:
        shown = f"{v:,}" if v < 10**15 else f"{float(v):.3g}" if v < 10**308 else f"a {len(str(v))}-digit number"
        raise SpecError(field, f"{shown} is more than the {most:,} the planner models; check the number")


class SpecError(ValueError):
    """A bad value in a case file or spec; `field` names it (e.g. "model.heads")."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # MLP inner size (per expert for MoE)
    vocab: int
    seq_len: int
    mlp: str = "swiglu"  # "gelu" (2 matrices), "swiglu" (3 matrices) or "relu2" (2 matrices)
    experts: int = 0  # routed experts; 0 = dense
    top_k: int = 0
    head_dim: int | None = None  # None: hidden // heads (Gemma uses 256 with hidden 3072)
    shared_experts: int = 0  # always-on experts of size `ffn` beside the routed ones (DeepSeek)
    dense_layers: int = 0  # first layers with a dense MLP of size `dense_ffn` (DeepSeek-V3: 3)
    dense_ffn: int | None = None  # inner size of those dense MLPs; None: ffn
    q_lora_rank: int = 0  # MLA (DeepSeek-V2/V3): rank of the Q down-projection; 0 = plain query
    kv_lora_rank: int = 0  # MLA: rank of the joint KV latent; 0 = ordinary (GQA) attention
    rope_head_dim: int = 0  # MLA: extra decoupled-RoPE query/key width per head
    tied_embeddings: bool = False  # output projection shares the input embedding matrix
    # PaLM's parallel formulation (Chowdhery et al. 2022 sec. 2; MaxText's default decoder layer): attention and
    # the MLP read the same normed input and their outputs join the residual together, y = x + attn(ln(x)) +
    # mlp(ln(x)), so attention's output projection only feeds the residual (planner.flops.residual_output_matmuls);
    # one norm (planner.flops.pre_norms) and one three-way add (planner.costs._elementwise). GPT-NeoX's parallel
    # residual, two norms of the same x, is not this block. TP collectives are costed as a sequential block's
    parallel_block: bool = False
    # LAYER_STYLES; None: "gpt" with a GELU MLP, else "llama" (MaxText's GPT-3-like models run a GELU or ReLU MLP
    # with RMSNorm, no biases, rotary and no dropout: "llama")
    layer_style: str | None = None
    # causal attention (a decoder); False: every query attends to every key, twice a causal kernel's work
    # (MaxText's October 2023 runs called its flash kernel with causal=False)
    causal: bool = True
    # sliding-window attention: `sliding_window_layers` of the attention layers (0: all of them, when a window
    # is set) let each query attend to itself and the `sliding_window` - 1 keys before it (Mistral 7B v0.1:
    # 4096 on every layer; gpt-oss: 128 on every second layer); 0 = full causal attention everywhere
    sliding_window: int = 0
    sliding_window_layers: int = 0
    # group-limited routing (DeepSeek-V2/V3): the experts form `expert_groups` groups and each token's
    # top_k experts come from its best `expert_groups_per_token` groups; 0 = any expert
    expert_groups: int = 0
    expert_groups_per_token: int = 0
    # multi-token prediction depth (DeepSeek-V3, arXiv 2412.19437 sec. 2.2; Hugging Face config
    # num_nextn_predict_layers, Megatron-Core mtp_num_layers): each module norms the hidden state and the
    # next token's embedding, projects their concatenation [2D -> D], runs one more layer of the model's
    # last kind and the shared output head; trained beside the main model, counted apart from its parameters
    mtp_layers: int = 0
    # Mamba-2 and hybrids (module docstring); defaults are Mamba-2 2.7B's (arXiv 2405.21060 sec. 9 setup)
    layer_pattern: str = ""  # one of "M*-" per layer; "" = attention + MLP every layer
    ssm_state: int = 128  # N, d_state
    ssm_head_dim: int = 64  # P, headdim
    ssm_expand: int = 2  # d_inner = expand * hidden
    ssm_groups: int = 1  # G, ngroups
    ssm_conv: int = 4  # d_conv
    ssm_chunk: int = 256  # Q, chunk_size of the SSD algorithm

    def __post_init__(self):
        self.validate()

    @property
    def gpt_style(self) -> bool:
        """The "gpt" layer style (LAYER_STYLES), stated or taken from a GELU MLP."""
        return self.layer_style == "gpt" if self.layer_style else self.mlp == "gelu"

    @property
    def head_dim_(self) -> int:
        return self.head_dim or (self.hidden // self.heads if self.heads else 0)

    @cached_property  # asked for in the search's inner loop; a spec is frozen
    def layer_kinds(self) -> tuple:
        """The kind of every layer, first to last (module docstring)."""
        if self.layer_pattern:
            return tuple(self.layer_pattern)
        return tuple(self.is_moe and i >= self.dense_layers for i in range(self.layers))

    @cached_property
    def kinds(self) -> tuple:
        """The kinds present, each once, in order of first appearance."""
        return tuple(dict.fromkeys(self.layer_kinds))

    @property
    def has_ssm(self) -> bool:
        return MAMBA in self.layer_pattern

    @property
    def attention_layers(self) -> int:
        return self.layer_pattern.count(ATTENTION) if self.layer_pattern else self.layers

    @property
    def ssm_inner(self) -> int:
        return self.ssm_expand * self.hidden

    @property
    def ssm_heads(self) -> int:
        return self.ssm_inner // self.ssm_head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def dense_ffn_(self) -> int:
        return self.dense_ffn or self.ffn

    def validate(self, prefix: str = "model") -> None:
        """Raise SpecError naming the first field that is wrong and saying what to change."""
        self._validate_pattern(prefix)
        pattern = self.layer_pattern
        attention = not pattern or ATTENTION in pattern
        needed = ["layers", "hidden", "vocab", "seq_len"] + (["heads", "kv_heads"] if attention else []) \
            + (["ffn"] if not pattern or MLP in pattern else [])
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if f in needed else 0):
                what = "a positive integer" if f in needed else "a non-negative integer (unused here)"
                raise SpecError(f"{prefix}.{f}", f"must be {what}, got {v!r}")
        for f in ("hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "head_dim", "dense_ffn"):
            v = getattr(self, f)
            if isinstance(v, int):
                _at_most(f"{prefix}.{f}", v)
        if self.layers > MAX_LAYERS:
            raise SpecError(f"{prefix}.layers", f"{self.layers:,} is more than the {MAX_LAYERS:,} layers the planner "
                            "models (published models have a few hundred at most); check the number")
        if self.mlp not in MLP_KINDS:
            raise SpecError(f"{prefix}.mlp", f"must be one of {MLP_KINDS}, got {self.mlp!r}")
        if self.layer_style is not None and self.layer_style not in LAYER_STYLES:
            raise SpecError(f"{prefix}.layer_style", f"must be one of {LAYER_STYLES} or null, got {self.layer_style!r}")
        if self.layer_style == "gpt" and self.mlp == "swiglu":
            raise SpecError(f"{prefix}.layer_style", "\"gpt\" (biases, LayerNorm, dropout) is modelled with a GELU or "
                            "squared-ReLU MLP, not a gated one: use \"llama\" or null with mlp \"swiglu\"")
        if pattern and len(pattern) != self.layers:
            raise SpecError(f"{prefix}.layer_pattern", f"has {len(pattern)} characters for layers={self.layers}; "
                            "give one per layer")
        if not attention:
            for f in ("sliding_window", "sliding_window_layers"):
                if getattr(self, f):
                    raise SpecError(f"{prefix}.{f}", "the model has no attention layers to window; set it to 0")
            return
        if self.heads % self.kv_heads:
            raise SpecError(f"{prefix}.kv_heads", f"{self.kv_heads} does not divide heads={self.heads}")
        if self.head_dim is None and self.hidden % self.heads:
            raise SpecError(f"{prefix}.heads", f"{self.heads} does not divide hidden={self.hidden}; "
                            "set head_dim")
        for f in ("experts", "top_k", "shared_experts", "dense_layers", "q_lora_rank", "kv_lora_rank",
                  "rope_head_dim", "expert_groups", "expert_groups_per_token", "mtp_layers", "sliding_window",
                  "sliding_window_layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SpecError(f"{prefix}.{f}", f"must be a non-negative integer, got {v!r}")
            _at_most(f"{prefix}.{f}", v)
        if not self.is_mla:
            for f in ("q_lora_rank", "rope_head_dim"):
                if getattr(self, f):
                    raise SpecError(f"{prefix}.{f}", "applies to multi-head latent attention (MLA), which kv_lora_rank "
                                    "> 0 turns on; set kv_lora_rank or set this to 0")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise SpecError(f"{prefix}.top_k", f"must be in 1..experts={self.experts}, got {self.top_k}")
        if not self.experts and (self.top_k or self.shared_experts):
            raise SpecError(f"{prefix}.experts", "top_k/shared_experts need experts > 0")
        if self.expert_groups or self.expert_groups_per_token:
            if not self.experts or not self.expert_groups or self.experts % self.expert_groups:
                raise SpecError(f"{prefix}.expert_groups", f"must divide experts={self.experts} (or set both "
                                "expert_groups and expert_groups_per_token to 0)")
            if not 1 <= self.expert_groups_per_token <= self.expert_groups:
                raise SpecError(f"{prefix}.expert_groups_per_token", f"must be in 1..expert_groups="
                                f"{self.expert_groups}, got {self.expert_groups_per_token}")
        if self.dense_layers >= self.layers and self.experts:
            raise SpecError(f"{prefix}.dense_layers", f"must be below layers={self.layers}")
        if not self.experts and self.dense_layers:
            raise SpecError(f"{prefix}.dense_layers", "applies to MoE models (the first layers, whose MLP is dense, "
                            "before the experts'); every layer of a dense model has its ffn: set it to 0")
        if self.dense_ffn is not None and not self.dense_layers:
            raise SpecError(f"{prefix}.dense_ffn", "sizes the MLP of an MoE model's dense_layers, and this model has "
                            "none: set dense_layers, or drop dense_ffn (a dense model's MLP is ffn)")
        if self.mtp_layers > self.layers:
            raise SpecError(f"{prefix}.mtp_layers", f"{self.mtp_layers} multi-token prediction modules for "
                            f"{self.layers} layers; published models add 1 (DeepSeek-V3): check the number")
        if self.sliding_window_layers and not self.sliding_window:
            raise SpecError(f"{prefix}.sliding_window_layers", "needs sliding_window (the window's keys); set it "
                            "or set sliding_window_layers to 0")
        if self.sliding_window_layers > self.attention_layers:
            raise SpecError(f"{prefix}.sliding_window_layers", f"{self.sliding_window_layers} is more than the "
                            f"model's {self.attention_layers} attention layers")
        if self.sliding_window and not self.causal:
            raise SpecError(f"{prefix}.sliding_window", "a sliding window is modelled for causal attention only; "
                            "set causal to true or sliding_window to 0")

    @property
    def windowed_share(self) -> float:
        """The share of the attention layers with a sliding window (`sliding_window`)."""
        if not self.sliding_window or not self.attention_layers:
            return 0.0
        return (self.sliding_window_layers or self.attention_layers) / self.attention_layers

    def _validate_pattern(self, prefix: str) -> None:
        pattern = self.layer_pattern
        if not isinstance(pattern, str):
            raise SpecError(f"{prefix}.layer_pattern", f"must be a string, got {pattern!r}")
        bad = sorted(set(pattern) - set(PATTERN_CHARS))
        if bad:
            raise SpecError(f"{prefix}.layer_pattern", f"has {bad}; use only 'M' (Mamba-2), '*' (attention) "
                            "and '-' (MLP), one per layer")
        if not pattern:
            return
        if self.experts or self.dense_layers:
            raise SpecError(f"{prefix}.experts", "MoE layers in a layer pattern are not modelled; set experts "
                            "and dense_layers to 0")
        if self.mtp_layers:
            raise SpecError(f"{prefix}.mtp_layers", "multi-token prediction with a layer pattern is not modelled; "
                            "set mtp_layers to 0")
        if self.mlp == "gelu" or self.layer_style == "gpt":
            field = "mlp" if self.mlp == "gelu" else "layer_style"
            raise SpecError(f"{prefix}.{field}", "a layer pattern uses the RMSNorm recipe without biases; choose "
                            "mlp \"swiglu\" or \"relu2\" and layer_style \"llama\" or null")
        for f in ("ssm_state", "ssm_head_dim", "ssm_expand", "ssm_groups", "ssm_conv", "ssm_chunk"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SpecError(f"{prefix}.{f}", f"must be a positive integer, got {v!r}")
            _at_most(f"{prefix}.{f}", v, MAX_SSM_EXPAND if f == "ssm_expand" else MAX_DIM)
        if MAMBA not in pattern:
            return
        if self.ssm_inner % self.ssm_head_dim:
            raise SpecError(f"{prefix}.ssm_head_dim", f"{self.ssm_head_dim} does not divide d_inner = ssm_expand "
                            f"x hidden = {self.ssm_inner}; the SSM heads d_inner / ssm_head_dim must be whole")
        if self.ssm_heads % self.ssm_groups:
            raise SpecError(f"{prefix}.ssm_groups", f"{self.ssm_groups} does not divide the {self.ssm_heads} SSM "
                            "heads (d_inner / ssm_head_dim); each group serves a whole number of heads")


# Shapes from each model's paper or released config.json.
MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    # Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
    ModelSpec("GPT-3 175B", 96, 12288, 96, 96, 49152, 50257, 2048, "gelu"),
    # Table 2.1's "GPT-3 2.7B": 32 layers, d_model 2560, 32 heads of 80, context 2048; the token embedding
    # is shared with the output (GPT-2/3). A Transformer of Mamba-2 2.7B's size and width, for side by side.
    ModelSpec("GPT-3 2.7B", 32, 2560, 32, 32, 10240, 50257, 2048, "gelu", tied_embeddings=True),
    # Meta Llama 3 8B / 70B config.json; Llama 3 405B: Dubey et al. 2024, Table 3
    ModelSpec("Llama 3 8B", 32, 4096, 32, 8, 14336, 128256, 8192),
    ModelSpec("Llama 3 70B", 80, 8192, 64, 8, 28672, 128256, 8192),
    ModelSpec("Llama 3 405B", 126, 16384, 128, 8, 53248, 128256, 8192),
    # Touvron et al. 2023, Llama 2 13B config.json
    ModelSpec("Llama 2 13B", 40, 5120, 40, 40, 13824, 32000, 4096),
    # Gemma 7B config.json (GeGLU MLP: 3 matrices like SwiGLU; head_dim 256; tied embeddings)
    ModelSpec("Gemma 7B", 28, 3072, 16, 16, 24576, 256000, 8192, "swiglu", head_dim=256,
              tied_embeddings=True),
    # Mixtral 8x7B config.json (Jiang et al. 2024)
    ModelSpec("Mixtral 8x7B", 32, 4096, 32, 8, 14336, 32000, 4096, "swiglu", experts=8, top_k=2),
    # DeepSeek-V3 config.json (DeepSeek-AI 2024, arXiv 2412.19437 sec. 4.2): MLA with q rank 1536,
    # kv rank 512, 64-wide decoupled RoPE; 256 routed + 1 shared expert of 2048, top-8; first 3 layers
    # dense (18432); the 256 experts in n_group = 8 groups, each token routed within topk_group = 4 of
    # them (sec. 4.2: "each token will be sent to at most 4 nodes"); one multi-token prediction module
    # (sec. 4.2: MTP depth D = 1; config.json num_nextn_predict_layers 1). Not modelled: the FP8 recipe.
    ModelSpec("DeepSeek-V3", 61, 7168, 128, 128, 2048, 129280, 4096, "swiglu", experts=256, top_k=8,
              head_dim=128, shared_experts=1, dense_layers=3, dense_ffn=18432, q_lora_rank=1536,
              kv_lora_rank=512, rope_head_dim=64, expert_groups=8, expert_groups_per_token=4, mtp_layers=1),
]}

# Mamba-2 and hybrid shapes, apart from MODEL_PRESETS so pages that assume attention in every layer
# (heads > 0) keep their model list; `planner.presets.make_case` and the lesson take names from both.
SSM_PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    # state-spaces/mamba2-2.7b config.json: d_model 2560, n_layer 64, d_intermediate 0 (no MLP), vocab
    # 50277 padded to pad_vocab_size_multiple=16 -> 50288 rows, tie_embeddings true; Mamba2 defaults
    # (mamba_ssm): d_state 128, headdim 64, expand 2, ngroups 1, d_conv 4, chunk_size 256. Trained at
    # 2048 tokens (Dao & Gu 2024 sec. 9.2).
    ModelSpec("Mamba-2 2.7B", 64, 2560, 0, 0, 0, 50288, 2048, layer_pattern=MAMBA * 64, tied_embeddings=True),
    # nvidia/Nemotron-H-8B-Base-8K config.json (the 8B of NVIDIA 2025, arXiv 2504.03624): 52 layers, 24
    # Mamba-2 + 24 MLP + 4 attention in hybrid_override_pattern; d_model 4096, squared-ReLU MLP 21504,
    # 32 query heads / 8 kv heads of 128; 128 SSM heads of 64, state 128, 8 groups, conv 4, chunk 128;
    # vocab 131072, untied; 8192-token context. QK-norms are left out.
    ModelSpec("Nemotron-H 8B", 52, 4096, 32, 8, 21504, 131072, 8192, "relu2", head_dim=128,
              layer_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", ssm_state=128,
              ssm_head_dim=64, ssm_expand=2, ssm_groups=8, ssm_conv=4, ssm_chunk=128),
]}

DEFAULT_MODEL = "Llama 3 8B"

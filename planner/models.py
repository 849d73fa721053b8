"""Model shapes: the `model` block of a case file, and presets with the public shapes of real models.

A `ModelSpec` describes one decoder-only Transformer: dense (GELU or SwiGLU MLP), grouped-query
attention, Mixture-of-Experts (routed experts with top-k routing, optional always-on shared experts,
optional dense first layers) and DeepSeek's multi-head latent attention (MLA, low-rank Q and KV
projections). The arithmetic on these shapes lives in `planner.flops` and `planner.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

MLP_KINDS = ("gelu", "swiglu")


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
    mlp: str = "swiglu"  # "gelu" (2 matrices) or "swiglu" (3 matrices)
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

    def __post_init__(self):
        self.validate()

    @property
    def head_dim_(self) -> int:
        return self.head_dim or self.hidden // self.heads

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
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SpecError(f"{prefix}.{f}", f"must be a positive integer, got {v!r}")
        if self.mlp not in MLP_KINDS:
            raise SpecError(f"{prefix}.mlp", f"must be one of {MLP_KINDS}, got {self.mlp!r}")
        if self.heads % self.kv_heads:
            raise SpecError(f"{prefix}.kv_heads", f"{self.kv_heads} does not divide heads={self.heads}")
        if self.head_dim is None and self.hidden % self.heads:
            raise SpecError(f"{prefix}.heads", f"{self.heads} does not divide hidden={self.hidden}; "
                            "set head_dim")
        for f in ("experts", "top_k", "shared_experts", "dense_layers", "q_lora_rank", "kv_lora_rank",
                  "rope_head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SpecError(f"{prefix}.{f}", f"must be a non-negative integer, got {v!r}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise SpecError(f"{prefix}.top_k", f"must be in 1..experts={self.experts}, got {self.top_k}")
        if not self.experts and (self.top_k or self.shared_experts):
            raise SpecError(f"{prefix}.experts", "top_k/shared_experts need experts > 0")
        if self.dense_layers >= self.layers and self.experts:
            raise SpecError(f"{prefix}.dense_layers", f"must be below layers={self.layers}")


# Shapes from each model's paper or released config.json.
MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    # Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
    ModelSpec("GPT-3 175B", 96, 12288, 96, 96, 49152, 50257, 2048, "gelu"),
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
    # dense (18432). Not modelled: multi-token prediction module, node-limited routing, FP8 recipe.
    ModelSpec("DeepSeek-V3", 61, 7168, 128, 128, 2048, 129280, 4096, "swiglu", experts=256, top_k=8,
              head_dim=128, shared_experts=1, dense_layers=3, dense_ffn=18432, q_lora_rank=1536,
              kv_lora_rank=512, rope_head_dim=64),
]}

DEFAULT_MODEL = "Llama 3 8B"

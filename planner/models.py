"""Model shapes: the `model` block of a case file, and presets with the public shapes of real models."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def head_dim_(self) -> int:
        return self.head_dim or self.hidden // self.heads


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
    # Gemma 7B config.json (GeGLU MLP: 3 matrices like SwiGLU; head_dim 256)
    ModelSpec("Gemma 7B", 28, 3072, 16, 16, 24576, 256000, 8192, "swiglu", head_dim=256),
    # Mixtral 8x7B config.json (Jiang et al. 2024)
    ModelSpec("Mixtral 8x7B", 32, 4096, 32, 8, 14336, 32000, 4096, "swiglu", experts=8, top_k=2),
]}

DEFAULT_MODEL = "Llama 3 8B"

"""Cluster presets and a builder for cases from objects (for the app's sidebar and the pages).

Model presets live in `planner.models.MODEL_PRESETS` (and `SSM_PRESETS`, Mamba-2 and hybrids). A
cluster here is a chip key from `hardware/chips.toml`, a chip count and, for GPUs, the NVLink domain
size; a TPU cluster runs on the slice shape `planner.costs.tpu_slice_shape` gives for its chip count.
"""

from __future__ import annotations

from dataclasses import fields

from planner.case import Case, Cluster, Parallel, Training, check_fixed, implied_recompute
from planner.models import MODEL_PRESETS, SSM_PRESETS, ModelSpec, SpecError

CLUSTER_PRESETS: dict[str, Cluster] = {
    # DGX/HGX H100: 8 GPUs on NVSwitch, one 400 Gb/s NIC each (NVIDIA DGX H100 user guide)
    "8x H100 (one node)": Cluster("h100", 8, 8),
    "64x A100 80GB (8 DGX nodes)": Cluster("a100-80gb", 64, 8),
    "1,024x H100 (128 nodes)": Cluster("h100", 1024, 8),
    # Dubey et al. 2024 (Llama 3) sec. 3.3: Llama 3 405B trained on up to 16K H100s
    "16,384x H100 (Llama 3 405B scale)": Cluster("h100", 16384, 8),
    # DeepSeek-V3 report sec. 3.1: 2,048 H800s, 8 per node over NVLink
    "2,048x H800 (DeepSeek-V3 scale)": Cluster("h800", 2048, 8),
    # Cloud TPU v5p slices: v5p-N names N TensorCores = N/2 chips (Cloud TPU v5p docs)
    "TPU v5p-128 (64 chips, 4x4x4)": Cluster("tpu-v5p", 64),
    "TPU v5p-1024 (512 chips, 8x8x8)": Cluster("tpu-v5p", 512),
    "TPU v5p-8192 (4,096 chips, 16x16x16)": Cluster("tpu-v5p", 4096),
    "TPU v5p-12288 (6,144 chips, 16x16x24, the largest slice)": Cluster("tpu-v5p", 6144),
}
DEFAULT_CLUSTER = "8x H100 (one node)"

TOKENS_PER_BATCH = 4 * 2 ** 20  # ~4M tokens per step, a common pre-training batch (GPT-3 used 3.2M for 175B)


def default_global_batch(seq_len: int, multiple: int, tokens: int = TOKENS_PER_BATCH) -> int:
    """Sequences per step for about `tokens` tokens, rounded to a multiple of `multiple` and at least that:
    the chip count, so that any data-parallel degree divides it, or a mesh's data-parallel degree (one
    sequence per data-parallel rank at the least; a tensor, pipeline or context parallel group shares its
    sequences)."""
    return max(multiple, round(tokens / seq_len / multiple) * multiple)


def make_case(model: ModelSpec | str, cluster: Cluster | str, global_batch: int | None = None,
              parallel: Parallel | None = None, **training) -> Case:
    """A case from objects or preset names; unset layout fields are left for the planner to choose.

    `global_batch` defaults to about TOKENS_PER_BATCH tokens, rounded to a multiple of the chip count
    so any data-parallel degree divides it.
    """
    if isinstance(model, str):
        presets = {**MODEL_PRESETS, **SSM_PRESETS}
        if model not in presets:
            raise SpecError("model", f"unknown preset {model!r}; known: {sorted(presets)}")
        model = presets[model]
    if isinstance(cluster, str):
        if cluster not in CLUSTER_PRESETS:
            raise SpecError("cluster", f"unknown preset {cluster!r}; known: {sorted(CLUSTER_PRESETS)}")
        cluster = CLUSTER_PRESETS[cluster]
    if global_batch is None:
        global_batch = default_global_batch(model.seq_len, cluster.num_chips)
    known = {f.name for f in fields(Training)} - {"global_batch"}
    for key in training:
        if key not in known:
            raise SpecError(f"training.{key}", f"unknown field; known: {sorted(known)}")
    t = implied_recompute(Training(global_batch=global_batch, **training))
    case = Case(model, t, parallel or Parallel(), cluster,
                f"{model.name} on {cluster.num_chips} x {cluster.chip}")
    from hardware.chips import get_chip
    try:
        get_chip(cluster.chip)
    except ValueError as e:
        raise SpecError("cluster.chip", str(e)) from None
    check_fixed(case)
    return case

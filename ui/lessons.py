"""The route through the lessons: one list that app.py, the home page and the tests share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Lesson:
    title: str
    path: str  # page script, relative to the repo root
    url_path: str
    icon: str
    summary: str
    # query parameters the page binds its own widgets to (shared links carry them)
    params: tuple[str, ...] = ()


LESSONS: list[Lesson] = [
    Lesson("Hardware & roofline", "app_pages/hardware.py", "hardware", ":material/memory:",
           "What a chip can do: FLOP/s, memory bandwidth, links. Arithmetic intensity and the ridge point "
           "decide whether a matmul is compute-bound or memory-bound. Measure this machine too.",
           params=("tokens", "d_model", "d_ff", "dtype", "achievable", "compare")),
    Lesson("Collectives", "app_pages/collectives.py", "collectives", ":material/hub:",
           "All-gather, reduce-scatter, all-reduce and all-to-all, step by step on a ring; what they cost "
           "(latency against bandwidth, inside a node or across nodes); and this machine's own alpha and beta.",
           params=("collective", "ring_n", "group", "stride", "rows", "cols", "achievable")),
    Lesson("Data parallel, ZeRO and FSDP", "app_pages/data_parallel.py", "data-parallel", ":material/content_copy:",
           "Replicate the model, split the batch, all-reduce the gradients; then shard optimizer state, "
           "gradients and weights (ZeRO-1/2/3, FSDP). Memory and bytes on real chips, and a real verified run "
           "on this machine with every rank's timeline.",
           params=("bound_tokens",)),
    Lesson("Tensor and sequence parallel", "app_pages/tensor_parallel.py", "tensor-parallel",
           ":material/view_column:",
           "Split every matmul across the chips of a node: column- then row-parallel layers, attention by "
           "heads, one all-reduce per pair; sequence parallel for the same bytes and less activation memory. "
           "Memory and communication on real chips, and real verified TP and TP + SP runs on this machine.",
           params=("tp_degree", "tp_micro_batch")),
    Lesson("Pipeline parallel", "app_pages/pipeline.py", "pipeline", ":material/linear_scale:",
           "Split the layers into stages and pass activations chip to chip. GPipe, 1F1B, interleaved and "
           "zero-bubble schedules drawn step by step, their bubbles and activation memory, the cost on real "
           "chips, and a real verified pipeline run on this machine.",
           params=("schedule", "stages", "micro_batches", "virtual", "t_b", "t_comm", "real_pp", "real_m")),
    Lesson("Context parallel", "app_pages/context_parallel.py", "context-parallel", ":material/all_inclusive:",
           "Split long sequences over chips: the causal load balance of the zig-zag split, ring attention "
           "step by step with the log-sum-exp merge, when the K/V ring hides under the attention on real "
           "chips, and real verified ring and all-gather runs on this machine.",
           params=("cp_split", "cp_degree", "cp_seq_len")),
    Lesson("Expert parallel", "app_pages/expert_parallel.py", "expert-parallel", ":material/alt_route:",
           "Mixture-of-Experts: top-k routing, total against active parameters, experts spread over chips "
           "and the dispatch and combine all-to-alls; a routing simulation with capacity and skew, the "
           "all-to-all's cost on real chips, and a real verified expert-parallel run on this machine.",
           params=("ep_tokens", "ep_experts", "ep_top_k", "ep_degree", "ep_capacity", "ep_skew",
                   "ep_micro_batch", "ep_moe_model", "ep_model_degree")),
    Lesson("Transformer vs Mamba", "app_pages/mamba.py", "mamba", ":material/waves:",
           "A state-space model mixes positions through a fixed-size state instead of attention: the Mamba-2 "
           "block and its chunked scan, FLOPs per token as the sequence grows, what tensor and context "
           "parallel move for each, the fastest layout of each on your chips, and real verified runs of both.",
           params=("ssm_seq_len",)),
    Lesson("Putting it together: N-D meshes", "app_pages/meshes.py", "meshes", ":material/grid_on:",
           "How real runs combine the strategies on one mesh (Llama 3 405B, DeepSeek-V3): the rank order, "
           "each axis's groups drawn on the nodes, which stay inside NVLink and which cross the network, the "
           "planner's cost of the layout, and the same mesh scaled down and run for real on this machine.",
           params=("mesh_preset", "mesh_axis")),
    Lesson("Plan a training run", "app_pages/planner.py", "planner", ":material/query_stats:",
           "Combine the strategies on a device mesh for a real model on real chips: memory per chip, step "
           "time, MFU and a predicted timeline; then search every layout for the fastest that fits.",
           params=("batch_tokens", "layout_mode", "search_top")),
]

# The rest of the route, in teaching order; each becomes a page when its live engine or planner lands.
PLANNED: list[tuple[str, str]] = []


def page_params() -> set[str]:
    return {p for lesson in LESSONS for p in lesson.params}

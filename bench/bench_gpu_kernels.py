"""Op-level kernel rates on a CUDA GPU: the evidence behind a chip's efficiencies in hardware/chips.toml.

    python bench/bench_gpu_kernels.py [--out FILE.json] [--quick]
    python bench/bench_gpu_kernels.py --compare FILE.json [--chip h200]    (no GPU needed)

The first form needs a CUDA GPU (exits 2 without one). Times, with CUDA events after a warm-up, each as a median:
- GEMMs: cuBLAS bf16 (and fp8 through torch._scaled_mm, tensor-wise scales) at 8192^3, the curve's
  reference shape, three times (start, middle, end: the clock can drift); every (M, K, N) that the planner
  costs for the Hopper runs of planner/data (held-out, fitted-on, llm-foundry); and a grid of M, N, K. Each
  shape runs as `In[M, K] @ W[N, K]^T` (torch.matmul into a preallocated output), replayed from a CUDA graph
  (no launch gaps) over enough input sets to overflow the L2 cache. Inputs are random normal: zeros can run
  faster than real data.
- attention: torch's scaled-dot-product backends (flash = FlashAttention-2, cudnn, efficient), causal,
  bf16, head dims 64 and 128, 1k-16k keys, 16k tokens per call at width 2048, forward and forward +
  backward, counted as the kernels' benchmarks count (forward 4 s^2 d h / 2, backward 2.5x).
- memory-bound kernels: copy, RMSNorm and LayerNorm forward and backward, GELU, SwiGLU's silu(a) * b,
  and one AdamW step (fused and foreach), as bytes through HBM per second.
Writes every number to --out (JSON) and prints a short table. No thresholds: a measurement, not a test.
--compare prints a measurement file beside what hardware/kernels.py models for that chip: each GEMM's
measured / modelled rate, attention by kernel, head dim and length, memory-bound kernels over the HBM peak.
Recorded: hardware/data/h200-kernels-2026-12-04.json (one H200, torch 2.11 + CUDA 13.0, cuDNN 9.19; the GEMMs
ran at the 700 W limit, 1350-1485 MHz from the 10th to the 90th percentile by nvidia-smi dmon:
hardware/data/h200-kernels-2026-12-04-dmon.log).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

L2_FLUSH_BYTES = 256e6  # several times a Hopper L2 (50-60 MB): the input sets a small shape cycles through
TARGET_S = 4e-3  # replay at least this long per timing


def planner_gemm_shapes(chips=("h100", "h100-gt500", "h200")) -> dict[str, list[tuple[int, int, int]]]:
    """Every (M, K, N) the planner costs, by dtype, for the runs of planner/data on these chips."""
    from hardware import kernels
    from planner.api import estimate
    from planner.validation import HELDOUT_RUNS, llmfoundry_sweep_runs, load_published_runs

    seen: dict[str, set] = {"bf16": set(), "fp8": set()}
    original = kernels.matmul_s

    def spy(chip, dtype, m, k, n, batch=1.0):
        seen.setdefault(dtype, set()).add((round(m), round(k), round(n)))
        return original(chip, dtype, m, k, n, batch)

    kernels.matmul_s = spy
    try:
        for run in load_published_runs(HELDOUT_RUNS) + load_published_runs() + llmfoundry_sweep_runs():
            if run["cluster"]["chip"] in chips:
                estimate(run)
    finally:
        kernels.matmul_s = original
    return {k: sorted(v) for k, v in seen.items()}


def compare(path: str, chip_key: str) -> int:
    """Print a measurement file beside the chip table's model of the same kernels."""
    from hardware import kernels
    from hardware.chips import get_chip
    from planner.gpu_steps import PLANNER_KERNEL

    chip = get_chip(chip_key)
    data = json.loads(Path(path).read_text())
    refs = [data[k][0][3] for k in ("gemm_ref_start", "gemm_ref_middle", "gemm_ref_end") if k in data]
    print(f"{data['device']} (torch {data['torch']}, CUDA {data['cuda']}, cuDNN {data['cudnn']}) against the "
          f"chip table's {chip.name}")
    print(f"bf16 8192^3: {refs} TFLOP/s measured (start, middle, end); modelled "
          f"{kernels.matmul_rate(chip, 'bf16', 8192, 8192, 8192) / 1e12:.0f}")
    for name, dtype in (("gemm_planner_bf16", "bf16"), ("gemm_planner_fp8", "fp8"), ("gemm_grid_bf16", "bf16")):
        rows = [r for r in data.get(name, []) if r[3]]
        if not rows:
            continue
        ratios = sorted(r[3] * 1e12 / kernels.matmul_rate(chip, dtype, r[0], r[2], r[1]) for r in rows)
        pick = [ratios[int(q * (len(ratios) - 1))] for q in (0.0, 0.1, 0.5, 0.9, 1.0)]
        print(f"{name:18s} {len(rows):4d} shapes, measured / modelled: min {pick[0]:.2f}  p10 {pick[1]:.2f}  "
              f"median {pick[2]:.2f}  p90 {pick[3]:.2f}  max {pick[4]:.2f}")
    print("attention fwd+bwd TFLOP/s (causal; backward counted 2.5x the forward), measured / modelled:")
    for a in data.get("attention", []):
        kernel = PLANNER_KERNEL.get(a["kernel"])
        if kernel is None or "error" in a:
            continue
        fwd_s, bwd_s = kernels.flash_attention_s(chip, 1e12, a["seq"], kernel, a["head_dim"])
        model = 3.5e12 / (fwd_s + bwd_s) / 1e12
        print(f"  {a['kernel']:6s} as {kernel:6s} head dim {a['head_dim']:3d} {a['seq']:6d} keys: "
              f"{a['fwd_bwd_tflops']:6.1f} / {model:6.1f} = {a['fwd_bwd_tflops'] / model:.2f}")
    peak = chip.hbm_bytes_per_s / 1e9
    mem = data.get("memory_bound", {})
    table = {"copy": chip.hbm_efficiency, "rmsnorm_fwd": chip.norm_efficiency, "layernorm_fwd": chip.norm_efficiency,
             "rmsnorm_bwd": chip.norm_bwd_efficiency, "layernorm_bwd": chip.norm_bwd_efficiency}
    print("memory-bound, fraction of the HBM peak: measured (chip table)")
    for key, value in mem.items():
        if key.endswith("_GBps"):
            name = key[: -len("_GBps")]
            cited = f" ({table[name]:.2f})" if name in table else ""
            if name == "swiglu_fwd":
                cited = " (eager: silu then multiply, two kernels over strided halves; 3 bytes counted of 5)"
            print(f"  {name:16s} {value / peak:.2f}{cited}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-kernels.json")
    ap.add_argument("--quick", action="store_true", help="the reference shapes only")
    ap.add_argument("--compare", metavar="FILE.json", help="print a measurement beside the chip table's model")
    ap.add_argument("--chip", default="h200", help="the chip table entry --compare reads")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare, args.chip)
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("error: no CUDA device here; this benchmark measures a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    result: dict = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                    "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(result, indent=1))

    def events_time(fn, reps: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    def timed(fn, repeats: int = 5) -> float:
        """Median seconds of one call of `fn`, captured in a CUDA graph of enough calls to run TARGET_S."""
        fn()
        torch.cuda.synchronize()
        once = events_time(fn, 3)
        calls = max(1, min(200, math.ceil(TARGET_S / max(once, 1e-7))))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return statistics.median(events_time(graph.replay, 1) / calls for _ in range(repeats))

    def gemm(m: int, k: int, n: int, dtype: str) -> float:
        """TFLOP/s of In[m, k] . W[n, k]^T."""
        per_set = 2 * (m * k + n * k + m * n)
        sets = max(1, min(16, math.ceil(L2_FLUSH_BYTES / per_set)))
        if dtype == "fp8":
            xs = [torch.randn(m, k, device=dev).to(torch.float8_e4m3fn) for _ in range(sets)]
            ws = [torch.randn(n, k, device=dev).to(torch.float8_e4m3fn) for _ in range(sets)]
            one = torch.ones((), device=dev)
            outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
            state = [0]

            def call():
                i = state[0] = (state[0] + 1) % sets
                outs[i] = torch._scaled_mm(xs[i], ws[i].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        else:
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
            outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
            state = [0]

            def call():
                i = state[0] = (state[0] + 1) % sets
                torch.matmul(xs[i], ws[i].t(), out=outs[i])
        return 2 * m * k * n / timed(call) / 1e12

    def gemm_table(name: str, shapes, dtype: str):
        rows = []
        t0 = time.time()
        for m, k, n in shapes:
            try:
                rows.append([m, k, n, round(gemm(m, k, n, dtype), 2)])
            except Exception as exc:  # a shape the library refuses (fp8 needs dims divisible by 16)
                rows.append([m, k, n, None, f"{type(exc).__name__}: {str(exc)[:80]}"])
        torch.cuda.empty_cache()
        result[name] = rows
        save()
        ok = [r[3] for r in rows if r[3] is not None]
        print(f"{name}: {len(ok)}/{len(rows)} shapes in {time.time() - t0:.0f} s, "
              f"median {statistics.median(ok) if ok else float('nan'):.0f} TFLOP/s", flush=True)

    ref = [(8192, 8192, 8192)]
    gemm_table("gemm_ref_start", ref, "bf16")
    if not args.quick:
        shapes = planner_gemm_shapes()
        result["planner_shapes_counted"] = {k: len(v) for k, v in shapes.items()}
        gemm_table("gemm_planner_bf16", shapes.get("bf16", []), "bf16")
        gemm_table("gemm_ref_middle", ref, "bf16")
        dims = (256, 1024, 4096, 8192)
        gemm_table("gemm_grid_bf16", [(m, k, n) for m in dims for k in dims for n in dims], "bf16")
        gemm_table("gemm_ref_fp8", ref, "fp8")
        gemm_table("gemm_planner_fp8", shapes.get("fp8", []), "fp8")
    gemm_table("gemm_ref_end", ref, "bf16")

    # attention: tokens per call fixed at 16k, width 2048 (the FlashAttention-2 benchmark's setting)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    att = []
    for name, backend in backends.items():
        for hd in (64, 128):
            for s in ((2048, 8192) if args.quick else (1024, 2048, 4096, 8192, 16384)):
                b, h = max(1, 16384 // s), 2048 // hd
                try:
                    q, k_, v = (torch.randn(b, h, s, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
                                for _ in range(3))
                    dout = torch.randn(b, h, s, hd, device=dev, dtype=torch.bfloat16)
                    with sdpa_kernel([backend]):
                        def fwd():
                            return F.scaled_dot_product_attention(q, k_, v, is_causal=True)

                        def fwd_bwd():
                            o = fwd()
                            o.backward(dout)
                            q.grad = k_.grad = v.grad = None

                        fwd_bwd()
                        torch.cuda.synchronize()
                        reps = 5 if s >= 4096 else 20
                        f_s = statistics.median(events_time(fwd, reps) for _ in range(3))
                        fb_s = statistics.median(events_time(fwd_bwd, reps) for _ in range(3))
                    flops_fwd = 4 * b * h * s * s * hd / 2
                    att.append({"kernel": name, "head_dim": hd, "seq": s, "batch": b, "heads": h,
                                "fwd_tflops": round(flops_fwd / f_s / 1e12, 1),
                                "bwd_tflops": round(2.5 * flops_fwd / (fb_s - f_s) / 1e12, 1),
                                "fwd_bwd_tflops": round(3.5 * flops_fwd / fb_s / 1e12, 1)})
                except Exception as exc:
                    att.append({"kernel": name, "head_dim": hd, "seq": s,
                                "error": f"{type(exc).__name__}: {exc}"[:160]})
                finally:
                    q = k_ = v = dout = None
    result["attention"] = att
    save()
    for a in att:
        print("attention", a, flush=True)

    # memory-bound kernels: bytes through HBM / time
    mem = {}
    t_, width = 16384, 8192
    x = torch.randn(t_, width, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t_, width, device=dev, dtype=torch.bfloat16)
    w = torch.ones(width, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b_ = torch.zeros(width, device=dev, dtype=torch.bfloat16, requires_grad=True)
    elems = t_ * width

    def seconds(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        return statistics.median(events_time(fn, reps) for _ in range(3))

    def rate(fn, nbytes):
        return round(nbytes / seconds(fn) / 1e9, 1)

    def fwd_bwd_rates(name, f):
        def fwd():
            with torch.no_grad():
                f(x)

        def both():
            f(x).backward(dy)
            x.grad = w.grad = b_.grad = None

        fwd_s, both_s = seconds(fwd), seconds(both)
        mem[name + "_fwd_GBps"] = round(4 * elems / fwd_s / 1e9, 1)  # read x, write y (2 bytes each)
        mem[name + "_bwd_GBps"] = round(6 * elems / (both_s - fwd_s) / 1e9, 1)  # read x, dy; write dx

    try:
        xd = x.detach()
        mem["copy_GBps"] = rate(lambda: xd.clone(), 4 * elems)
        fwd_bwd_rates("rmsnorm", lambda t: F.rms_norm(t, (width,), w, 1e-5))
        fwd_bwd_rates("layernorm", lambda t: F.layer_norm(t, (width,), w, b_, 1e-5))
        mem["gelu_tanh_fwd_GBps"] = rate(lambda: F.gelu(xd, approximate="tanh"), 4 * elems)
        half = xd.view(t_, 2, width // 2)
        mem["swiglu_fwd_GBps"] = rate(lambda: F.silu(half[:, 0]) * half[:, 1], 3 * elems)
        x = dy = xd = half = None  # free 1 GB before the optimizer's 8
        torch.cuda.empty_cache()
        params = [torch.randn(4096, 4096, device=dev, requires_grad=True) for _ in range(32)]  # 537M fp32
        for p in params:
            p.grad = torch.randn_like(p)
        n_params = sum(p.numel() for p in params)
        for variant in ("fused", "foreach"):
            opt = torch.optim.AdamW(params, lr=1e-4, **{variant: True})
            opt.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                opt.step()
            torch.cuda.synchronize()
            step_s = (time.perf_counter() - t0) / 5
            # read param, grad, m, v; write param, m, v: 28 bytes per fp32 parameter
            mem[f"adamw_{variant}_GBps"] = round(28 * n_params / step_s / 1e9, 1)
            mem[f"adamw_{variant}_ms_per_1e9_params"] = round(step_s / n_params * 1e12, 2)
            del opt
    except Exception as exc:
        mem["error"] = f"{type(exc).__name__}: {exc}"[:200]
    result["memory_bound"] = mem
    save()
    print("memory-bound", mem, flush=True)
    refs = [result[k][0][3] for k in ("gemm_ref_start", "gemm_ref_middle", "gemm_ref_end") if k in result]
    print(f"bf16 8192^3: {refs} TFLOP/s (start, middle, end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

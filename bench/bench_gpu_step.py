"""One GPU's training step of a Llama- or GPT-style model, kernel by kernel, beside the planner's prediction.

    python bench/bench_gpu_step.py [--out DIR] [--layers 8] [--seq 8192] [--micro-batch 1]
                                   [--hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 --mlp swiglu]
    python bench/bench_gpu_step.py --compare DIR_OR_STEP.json [--chip h200]    (no GPU needed)

On a CUDA GPU: a Llama 3 8B-wide model (hidden 4096, 32 heads, 8 KV heads, SwiGLU 14336, vocabulary 128256)
cut to --layers layers, bf16 weights, PyTorch eager as torchtitan writes it without torch.compile (fused
RMSNorm kernel, rotary and SwiGLU's product as elementwise ops, the loss over fp32 logits, fused AdamW), or
with --mlp gelu a GPT block (LayerNorm, biases, GELU) at the widths given, for
each attention backend (SDPA flash = FlashAttention-2, cudnn). Times ten steps with CUDA events and traces
three with the PyTorch profiler, then writes one Chrome trace per backend and step.json (the step times and each
trace's kernel classes) to --out.
--compare reads them and prints, per kernel class (GEMM, attention, optimizer, the rest: memory-bound, copies
and memsets among them), the summed kernel time, the share of the step the GPU sat idle between kernels, and
what the planner predicts for the same one-chip run, class by class (planner.gpu_steps). No thresholds: a
measurement, not a test.
Recorded (one H200, PyTorch 2.11): hardware/data/h200-step-2026-12-04-s8k.json and -s2k.json (1 x 8192 and
4 x 2048 tokens), -gpt1.7b.json (Megatron-LM's weak-scaling GPT 1.7B, 4 x 4096 tokens, its load per GPU) and
-gpt7.1b-8layers.json (8 layers of its 7.1B at tp 1, 2 x 4096 tokens). The eager rotary here (a cat and
products over strided halves) costs ~50 ms of the GPT 1.7B's "other" class, which Megatron's fused rotary
does not spend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.gpu_steps import LLAMA3_8B_WIDTHS  # noqa: E402

BACKENDS = ("flash", "cudnn")
TIMED_STEPS, TRACED_STEPS = 10, 3  # steps timed with CUDA events (their median is the step), then traced
GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # the profiler's categories of GPU work


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel by its name, in planner.costs.KERNEL_CLASSES' words (cuBLAS / CUTLASS GEMMs,
    attention, the optimizer, and the rest: memory-bound)."""
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attention", "cudnn_generated", "sdpa")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass", "gemv", "s16816", "s1688")):
        return "gemm"
    if any(k in low for k in ("adam", "multi_tensor")):
        return "optimizer"
    return "memory-bound"


def measure(args) -> int:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print("error: no CUDA device here; this benchmark measures a GPU step", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    h, heads, kv, ffn, vocab, mlp = args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab, args.mlp
    hd = h // heads
    gelu = mlp == "gelu"  # a GPT block: LayerNorm and biases, GELU (tanh) between two GEMMs
    options = {"expand_kv": False}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            norm = nn.LayerNorm if gelu else nn.RMSNorm
            self.attn_norm, self.mlp_norm = norm(h), norm(h)
            self.wqkv = nn.Linear(h, (heads + 2 * kv) * hd, bias=gelu)
            self.wo = nn.Linear(heads * hd, h, bias=gelu)
            self.w13 = nn.Linear(h, ffn if gelu else 2 * ffn, bias=gelu)
            self.w2 = nn.Linear(ffn, h, bias=gelu)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q, k, v = self.wqkv(self.attn_norm(x)).split([heads * hd, kv * hd, kv * hd], dim=-1)
            q, k, v = q.view(b, t, heads, hd), k.view(b, t, kv, hd), v.view(b, t, kv, hd)

            def rotate(u):  # rotary as elementwise ops (rotate-half form)
                u1, u2 = u.chunk(2, dim=-1)
                return u * cos + torch.cat((-u2, u1), dim=-1) * sin

            q, k, v = rotate(q).transpose(1, 2), rotate(k).transpose(1, 2), v.transpose(1, 2)
            if options["expand_kv"]:  # a backend without grouped-query support: K/V repeated per query head
                k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not options["expand_kv"])
            x = x + self.wo(o.transpose(1, 2).reshape(b, t, heads * hd))
            if gelu:
                return x + self.w2(F.gelu(self.w13(self.mlp_norm(x)), approximate="tanh"))
            a, g = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
            return x + self.w2(F.silu(a) * g)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, h)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = (nn.LayerNorm if gelu else nn.RMSNorm)(h)
            self.head = nn.Linear(h, vocab, bias=False)

        def forward(self, tokens, cos, sin):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, cos, sin)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = Model().to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tokens = torch.randint(0, vocab, (args.micro_batch, args.seq + 1), device=dev)
    pos = torch.arange(args.seq, device=dev, dtype=torch.float32)
    freqs = torch.outer(pos, 500000.0 ** (-torch.arange(0, hd, 2, device=dev) / hd))
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[None, :, None, :].to(torch.bfloat16)
    sin = torch.cat((freqs.sin(), freqs.sin()), -1)[None, :, None, :].to(torch.bfloat16)

    def step():
        logits = model(tokens[:, :-1], cos, sin)
        loss = F.cross_entropy(logits.float().view(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
              "model": {"hidden": h, "heads": heads, "kv_heads": kv, "ffn": ffn, "vocab": vocab, "mlp": mlp},
              "seq": args.seq, "micro_batch": args.micro_batch,
              "params": sum(p.numel() for p in model.parameters()), "backends": {}}
    for name in BACKENDS:
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]
        try:
            with sdpa_kernel([backend]):
                options["expand_kv"] = False
                try:
                    step()
                except RuntimeError:
                    opt.zero_grad(set_to_none=True)
                    options["expand_kv"] = True
                for _ in range(3):  # warm-up
                    step()
                torch.cuda.synchronize()
                times = []
                for _ in range(TIMED_STEPS):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(TRACED_STEPS):
                        step()
                    torch.cuda.synchronize()
                trace = out_dir / f"trace-{name}.json"
                prof.export_chrome_trace(str(trace))
        except Exception as exc:
            result["backends"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{name}: {result['backends'][name]['error']}", flush=True)
            continue
        result["backends"][name] = {"step_s": times, "median_step_s": statistics.median(times),
                                    "kv_expanded": options["expand_kv"], "trace": trace_classes(trace)}
        print(f"{name}: median step {statistics.median(times) * 1e3:.1f} ms over {TIMED_STEPS} "
              f"({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}), K/V expanded: {options['expand_kv']}", flush=True)
    (out_dir / "step.json").write_text(json.dumps(result, indent=1))
    return 0


def trace_classes(path: Path, steps: int = TRACED_STEPS) -> dict:
    """Summed GPU seconds per class over a trace of `steps` steps (kernels, and copies and memsets as
    memory-bound), the GPU's busy (union) and span seconds, per step."""
    events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") in GPU_EVENTS and "dur" in e)
    classes: dict[str, float] = {}
    top: dict[str, float] = {}
    busy, reach = 0.0, None
    for start, end, name in kernels:
        classes[kernel_class(name)] = classes.get(kernel_class(name), 0.0) + (end - start) / 1e6
        top[name] = top.get(name, 0.0) + (end - start) / 1e6
        if reach is None or start >= reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    span = (max(end for _, end, _ in kernels) - kernels[0][0]) / 1e6 if kernels else 0.0
    return {"classes": {k: v / steps for k, v in classes.items()}, "busy_s": busy / 1e6 / steps,
            "span_s": span / steps, "top": sorted(((k, v / steps) for k, v in top.items()), key=lambda kv: -kv[1])[:12]}


def compare(args) -> int:
    from planner.gpu_steps import comparisons

    path = Path(args.compare)
    if path.is_dir():  # a --out folder of this script, or a folder of recordings such as hardware/data
        paths = [path / "step.json"] if (path / "step.json").exists() else sorted(path.glob("*-step-*.json"))
    else:
        paths = [path] if path.is_file() else []
    if not paths:
        print(f"error: --compare {path}: no step.json or *-step-*.json recording there", file=sys.stderr)
        return 2
    for fusion in ("eager", "fused"):
        print(f"\nThe planner with fusion {fusion} (the bench's model fuses its norms, not its rotary):")
        for c in comparisons(paths, args.chip, fusion):
            print(f"{c.label}, SDPA {c.backend}: step {c.measured_s * 1e3:.1f} ms measured, "
                  f"{c.predicted_s * 1e3:.1f} predicted ({c.error:+.1%}); GPU idle {c.idle_share:.1%} of the span")
            for cls in sorted(set(c.measured) | {k for k, v in c.predicted.items() if v}):
                print(f"  {cls:12s} {c.measured.get(cls, 0.0) * 1e3:8.1f} ms traced  "
                      f"{c.predicted.get(cls, 0.0) * 1e3:8.1f} ms predicted")
    if path.is_dir() and (path / "step.json").exists():  # the traces are there: their longest kernels
        record = json.loads((path / "step.json").read_text())
        for backend in record["backends"]:
            if (path / f"trace-{backend}.json").exists():
                print(f"\nlongest kernels per step, SDPA {backend}:")
                for kname, sec in trace_classes(path / f"trace-{backend}.json")["top"]:
                    print(f"    {sec * 1e3:7.2f} ms  {kernel_class(kname):12s} {kname[:90]}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-step")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=1)
    for key in ("hidden", "heads", "kv_heads", "ffn", "vocab"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=LLAMA3_8B_WIDTHS[key])
    ap.add_argument("--mlp", choices=["swiglu", "gelu"], default=LLAMA3_8B_WIDTHS["mlp"])
    ap.add_argument("--compare", metavar="DIR_OR_STEP.json",
                    help="print recorded steps beside the planner's prediction: a --out folder, a folder of "
                         "recordings (hardware/data) or one recording")
    ap.add_argument("--chip", default="h200")
    args = ap.parse_args()
    return compare(args) if args.compare else measure(args)


if __name__ == "__main__":
    sys.exit(main())

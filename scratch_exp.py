import time, statistics, torch

def task(ctx, reps=150):
    import torch.distributed as dist
    from engine.calibrate import _fixed_compute, _busy
    inp, out = torch.ones(4608), torch.empty(4608)
    res = {}
    def run(gap, name):
        dist.barrier()
        ts = []
        for i in range(reps):
            gap()
            t0 = time.perf_counter(); dist.all_to_all_single(out, inp); ts.append(time.perf_counter() - t0)
        ts = ts[5:]; ts.sort()
        res[name] = (statistics.mean(ts), ts[len(ts)//2], ts[int(len(ts)*0.9)], ts[-1], sum(t > 1e-3 for t in ts)/len(ts))
    for g in (50e-6, 300e-6, 1e-3, 3e-3):
        run(lambda g=g: _busy(g), f"spin {g*1e6:.0f}us")
        c, _ = _fixed_compute(g)
        run(c, f"torch {g*1e6:.0f}us")
    return res

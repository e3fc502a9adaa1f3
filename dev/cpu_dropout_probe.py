"""CPU dropout: flashcore's cpu_flash against torch's CPU SDPA, with dropout_p = 0.1 and without,
forward and forward + backward (3.5x the forward's FLOPs), GFLOP/s at 2 threads (torch and
flashcore alike: torch.set_num_threads). Median of 5 calls after one warm-up.

usage: PYTHONPATH=<package> python3 dev/cpu_dropout_probe.py
"""
import sys, time, statistics
import torch, torch.nn.functional as F
import flashcore
torch.set_num_threads(2)
def best(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
for (B, S, H, D, causal) in [(1, 2048, 16, 64, False), (1, 2048, 16, 128, False), (1, 2048, 16, 64, True)]:
    q, k, v = (torch.randn(B, S, H, D, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, S, H, D)
    flop = 4 * B * H * S * S * D / (2 if causal else 1)
    res = {}
    for name, fn in [
        ("fc p=0.1", lambda: flashcore.flash_attn_func(q, k, v, dropout_p=0.1, causal=causal)),
        ("fc none", lambda: flashcore.flash_attn_func(q, k, v, causal=causal)),
        ("sdpa p=0.1", lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.1, is_causal=causal).transpose(1, 2)),
        ("sdpa none", lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)),
    ]:
        with torch.no_grad():
            f = best(fn)
        step = best(lambda: torch.autograd.grad(fn(), (q, k, v), dout))
        res[name] = (flop / f / 1e9, 3.5 * flop / step / 1e9)
    print(f"d{D} S{S} H{H} {'causal' if causal else 'full'}: " + ", ".join(f"{n} {a:.1f} / {b:.1f}" for n, (a, b) in res.items()),
          f"| fc/sdpa with dropout {res['fc p=0.1'][0] / res['sdpa p=0.1'][0]:.2f}x / {res['fc p=0.1'][1] / res['sdpa p=0.1'][1]:.2f}x", flush=True)

"""CUDA-event timing shared by bench/peers.py and the dev/ scripts (TARGETS.md's rule: calls back
to back between events, median of repeats)."""
import statistics
import time

import torch

def ms_per_call(fn, calls):
    """Milliseconds per call of `calls` calls issued back to back between two CUDA events."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / calls


def bench_ms(fn, warmup=3, rep=10, warm_s=0.2):
    """Median milliseconds per call of fn (bench_window without the window's start)."""
    return bench_window(fn, warmup, rep, warm_s)[0]


def bench_window(fn, warmup=3, rep=10, warm_s=0.2):
    """(median ms per call, time.time() when the warm-up began): the warm-up's start, after the first
    call, opens the window in which bench/peers.py reads the clocks of the timing."""
    # Warm up for a while, not just a few calls. With 3 calls, the first implementation timed in
    # a cell after the host-side pause between cells (flashcore) came out low in the first
    # (S=512) cell of each head dim: d128 fwd+bwd 0.80x FA2 here, where the back-to-back event
    # timing of dev/backward_breakdown.py had it 1.17x ahead.
    # The first call runs before the warm-up's clock starts: a peer's first call at a new shape
    # may spend a long time on the host (cuDNN builds its plan) while the GPU idles, and with that
    # time counted as warm-up its timed calls followed an idle GPU after only `warmup` calls,
    # below the power cap that every other implementation in the cell ran at (docs/PERF.md,
    # session 62).
    fn()
    torch.cuda.synchronize()
    warm_start = time.time()
    t0 = time.perf_counter()
    n = 1
    while n < warmup or time.perf_counter() - t0 < warm_s:
        fn()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    one = ms_per_call(fn, 1)
    # Calls back to back (TARGETS.md): at least 3 per timed repeat, ~10 ms worth. One call between
    # two events also times the host issuing it: a fwd+bwd step of ~1.2 ms at S=512 then read
    # ~1.7 ms for flashcore (whose host side takes ~0.6 ms to issue a training step).
    inner = max(3, min(50, int(10.0 / max(one, 1e-3))))
    ts = sorted(ms_per_call(fn, inner) for _ in range(rep))
    return ts[len(ts) // 2], warm_start


def events_rate(fn, work, repeats=5, calls=20):
    """`work` per call (FLOPs or bytes) / time, in units of 1e12 per second (TFLOP/s or TB/s): one
    warm-up call, then the median of `repeats` timings of `calls` calls back to back (the dev/ A/B
    scripts' fixed-count form of bench_ms)."""
    fn()
    torch.cuda.synchronize()
    return statistics.median(work / (ms_per_call(fn, calls) / 1e3) / 1e12 for _ in range(repeats))


def training_rates(fwd, flop, backward=True):
    """Forward TFLOP/s and forward + backward TFLOP/s (3.5x the forward's FLOPs) of fwd(), which
    returns the output of tensors that require grad; (forward, None) when not `backward`."""
    with torch.no_grad():
        f = events_rate(fwd, flop)
    if not backward:
        return f, None
    dout = torch.randn_like(fwd())
    return f, events_rate(lambda: fwd().backward(dout), 3.5 * flop)


def graph_replay_us(fn, reps=200):
    """Device time per call of `fn` captured `reps` times back to back in one CUDA graph (the seed
    shape's measure: no host launch cost, only the kernels and the gaps between them)."""
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()  # warm-up on a side stream, as capture requires
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
    return bench_ms(g.replay, 2, 10) * 1e3 / reps


def sdpa_graph_replay_us(backend, q, k, v, reps=50):
    """graph_replay_us of torch's SDPA forced onto `backend` (an SDPBackend) for flash_attn-layout
    tensors (batch, seqlen, heads, head_dim), unmasked, GQA where the heads differ; NaN where the
    backend declines the inputs."""
    import torch.nn.functional as F  # here: the module's other users never call SDPA

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    try:
        with torch.nn.attention.sdpa_kernel(backend):
            return graph_replay_us(
                lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=q.shape[2] != k.shape[2]), reps)
    except RuntimeError:
        return float("nan")

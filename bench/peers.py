"""flashcore next to its peers, in one process on one GPU (the GPU machine's benchmark).

Measures, in this order and within a time budget:
  1. ceilings: bf16 8192^3 matmul rate, 4 GiB read bandwidth;
  2. the TARGETS.md training grid (16k tokens, model dim 2048, seqlen 512..16k, hdim 64/128/256,
     causal and not): flashcore vs PyTorch SDPA's flash (FlashAttention-2), cuDNN and efficient
     backends, forward and forward+backward, TFLOP/s and ratios;
  3. the seed shape (B=1 H=8 S=512 D=64 fp16): device time per call under CUDA-graph replay;
  4. extra device memory of a forward at seqlen 16k vs naive attention;
  4b. GQA with few query tokens (32 / 8 heads, d128, bf16, 4 / 16 / 64 tokens against 4096 keys,
     causal): flashcore (the Hopper forward packs the group into its tiles) vs SDPA cuDNN with
     enable_gqa, device time under CUDA-graph replay; then one token against 65536 keys through
     flash_attn_func (AUTO's decode route), K+V TB/s;
  5. the CPU path: flashcore cpu_flash vs torch CPU SDPA (fp32) at equal thread counts, forward,
     (unless --no-backward) forward+backward, and decode against a KV cache.
Writes JSON lines to OUT/bench.jsonl, a PNG plot, and prints a summary table last.
Timing follows TARGETS.md: calls back to back between CUDA events, median of repeats; in the
training grid every implementation of a cell is timed in --rounds interleaved rounds and keeps
its best one (TARGETS.md's peer table is the best of several runs per cell and peer).

usage: python3 bench/peers.py OUTDIR [--quick] [--no-backward] [--no-forward] [--skip seed,memory,gqa,cpu]
                              [--budget SECONDS] [--rounds R]
       python3 bench/peers.py OUTDIR --cpu-only [--threads 2,16]   (section 5 alone, no GPU needed)
"""
import argparse
import json
import math
import os
import time

# torch's idle OpenMP workers otherwise keep spinning after each CPU call and take a core from
# the next one (flashcore's, in the CPU comparison); passive waiting leaves torch no slower.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcore
from gpu_clocks import ClockSampler
from targets import report as target_report
from timing import bench_ms, bench_window, graph_replay_us

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--quick", action="store_true", help="a few cells only")
ap.add_argument("--no-backward", action="store_true")
ap.add_argument("--no-forward", action="store_true", help="training grid: fwd+bwd cells only")
ap.add_argument("--skip", default="", help="sections to leave out, comma-separated (seed,memory,gqa,cpu)")
ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole script")
ap.add_argument("--dtype", default="bf16", help="grid dtypes, comma-separated (bf16,fp16)")
ap.add_argument("--cpu-only", action="store_true", help="only the CPU comparison (no GPU needed)")
ap.add_argument("--hdims", default="64,128,256", help="training-grid head dims, comma-separated")
ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384",
                help="training-grid sequence lengths, comma-separated")
ap.add_argument("--rounds", type=int, default=2,
                help="training grid: interleaved timing rounds per cell (each implementation's best is kept)")
ap.add_argument("--threads", default="2,16", help="CPU thread counts to compare, comma-separated")
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
T0 = time.time()
ROWS = []
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRID_DTYPES = [d for d in args.dtype.split(",") if d]
# SM clock and power while each training-grid timing runs (bench/gpu_clocks.py; off without
# nvidia-smi): at the power limit the clock follows each kernel's energy per FLOP.
CLOCKS = None if args.cpu_only else ClockSampler()


def emit(**kw):
    ROWS.append(kw)
    with open(os.path.join(args.out, "bench.jsonl"), "a") as f:
        f.write(json.dumps(kw) + "\n")


def left():
    return args.budget - (time.time() - T0)


def flops(b, h, s, d, causal, mode):
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def matmul_tflops(n=8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * n ** 3 / bench_ms(lambda: a @ b) / 1e9
    del a, b
    return tflops


def ceilings():
    emit(kind="ceiling", what="bf16_matmul_8192", tflops=matmul_tflops())
    x = torch.randn(2 * 1024 ** 3 // 2, device="cuda", dtype=torch.bfloat16)
    emit(kind="ceiling", what="read_4GiB_sum", tbps=x.numel() * 2 / bench_ms(lambda: x.sum(dtype=torch.float32)) / 1e9)
    del x
    torch.cuda.empty_cache()


def grid_cells():
    cells = []
    for d in (int(x) for x in args.hdims.split(",") if x):
        for causal in (False, True):
            for s in [int(x) for x in args.seqlens.split(",")]:
                cells.append((16384 // s, 2048 // d, s, d, causal))
    if args.quick:
        cells = [c for c in cells if c[2] in (1024, 8192) and c[3] in (64, 128)]
    return cells


def _flashcore_on(backend, q, k, v, causal):
    """flashcore forced onto one backend (the AUTO choice is the 'flashcore' column)."""
    flashcore.set_default_backend(backend)
    try:
        return flashcore.flash_attn_func(q, k, v, causal=causal)
    finally:
        flashcore.set_default_backend("auto")


def training_grid():
    modes = [m for m in ("fwd", "fwd+bwd") if not (m == "fwd" and args.no_forward) and
             not (m == "fwd+bwd" and args.no_backward)]
    for dt in GRID_DTYPES:
        for cell in grid_cells():
            if left() < 60:
                emit(kind="skipped", what=f"training grid from {dt} {cell} (budget)")
                return
            _training_cell(dt, modes, *cell)


# Cells whose forward is held to a share of the matmul rate (#5: d128 and d256 at 16k, no mask): the
# 8192^3 matmul is timed again just before and after them, so that both numbers come from the
# same stretch of the run: the matmul rate moves within a run (H100, session 18, two runs: 696-697
# TFLOP/s in the run's first seconds, where the "ceiling" rows are taken, 607-689 beside the 16k
# cells; the report gives the share against both).
MATMUL_SHARE_CELLS = {(128, 16384), (256, 16384)}


def _training_cell(dt, modes, b, h, s, d, causal):
    if dt == "bf16" and "fwd" in modes and not causal and (d, s) in MATMUL_SHARE_CELLS:
        before = matmul_tflops()
        _training_cell_impls(dt, modes, b, h, s, d, causal)
        emit(kind="ceiling_beside", what="bf16_matmul_8192", hdim=d, seqlen=s, causal=causal,
             tflops_before=before, tflops_after=matmul_tflops())
        return
    _training_cell_impls(dt, modes, b, h, s, d, causal)


def _training_cell_impls(dt, modes, b, h, s, d, causal):
    """Every implementation of one cell, timed in `--rounds` interleaved rounds (each round times
    each implementation once with bench_ms, in the same order); the cell reports each one's best
    round, as TARGETS.md's peer table does (best of several runs per cell and peer). One timing
    per implementation made the ratio depend on the order: on the H100 (session 19), SDPA cuDNN
    read 5-12% faster the first time it was timed in an S = 512 cell than in the next two, and
    flashcore, timed first, did not."""
    DT = DTYPES[dt]
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=DT) for _ in range(3))
    dout = torch.randn_like(q)
    for mode in modes:
        impls = {"flashcore": lambda: flashcore.flash_attn_func(q, k, v, causal=causal)}
        if mode == "fwd" and flashcore.backend_available("cuda_sm90"):
            impls["flashcore_sm80"] = lambda: _flashcore_on("cuda_sm80", q, k, v, causal)
        for name, be in SDPA.items():
            # SDPA layout (b, h, s, d) as views, taken at call time so autograd sees q, k, v
            impls[name] = (lambda be=be: _sdpa(be, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               causal))
        rounds = {name: [] for name in impls}
        windows = {name: [] for name in impls}  # (start, end) of each round's timing
        errors = {}
        for _ in range(max(1, args.rounds)):
            for name, fn in impls.items():
                if name in errors:
                    continue
                try:
                    ms, warm_start = _time_impl(mode, name, fn, q, k, v, dout)
                    rounds[name].append(ms)
                    windows[name].append((warm_start, time.time()))
                except Exception as e:  # a peer may not support a shape (e.g. efficient at d=256 bwd)
                    errors[name] = str(e).splitlines()[0][:160]
        for name in impls:
            if name in errors:
                emit(kind="train", impl=name, mode=mode, dtype=dt, batch=b, heads=h, seqlen=s, hdim=d,
                     causal=causal, error=errors[name])
                continue
            ms = min(rounds[name])
            best = rounds[name].index(ms)
            per_round = [CLOCKS.window(*w) if CLOCKS else None for w in windows[name]]
            clocks = per_round[best]
            # Each round's clock too: whether a round ran at the power cap says which state it was
            # timed in (the best round of a peer may be one that followed an idle host pause).
            rounds_clocks = ({"sm_mhz_rounds": [c["sm_mhz"] if c else None for c in per_round],
                              "power_capped_rounds": [c["power_capped"] if c else None for c in per_round]}
                             if CLOCKS and len(per_round) > 1 else {})
            emit(kind="train", impl=name, mode=mode, dtype=dt, batch=b, heads=h, seqlen=s, hdim=d,
                 causal=causal, ms=ms, ms_rounds=rounds[name], tflops=flops(b, h, s, d, causal, mode) / ms / 1e9,
                 **({k: clocks[k] for k in ("sm_mhz", "watts", "temperature", "power_capped")} if clocks else {}), **rounds_clocks)
    del q, k, v, dout
    torch.cuda.empty_cache()


def _time_impl(mode, name, fn, q, k, v, dout):
    """bench_window of one implementation: the forward under no_grad, or a forward + backward step."""
    if mode == "fwd":
        with torch.no_grad():
            return bench_window(fn)
    for x in (q, k, v):
        x.requires_grad_(True)

    def step():
        o = fn()
        if not name.startswith("flashcore"):
            o = o.transpose(1, 2)
        o.backward(dout)

    try:
        return bench_window(step)
    finally:
        for x in (q, k, v):
            x.grad = None
            x.requires_grad_(False)


def _sdpa(be, q, k, v, causal, enable_gqa=False):
    with sdpa_kernel([be]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa)


def seed_shape():
    b, h, s, d = 1, 8, 512, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    impls = {"flashcore": lambda: flashcore.flash_attn_func(q, k, v)}
    if flashcore.backend_available("cuda_sm90"):
        impls["flashcore_sm80"] = lambda: _flashcore_on("cuda_sm80", q, k, v, False)
    for name, be in SDPA.items():
        impls[name] = (lambda be=be: _sdpa(be, qt, kt, vt, False))
    impls["naive_torch"] = lambda: torch.softmax((qt @ kt.transpose(-1, -2)) / math.sqrt(d), -1) @ vt
    for name, fn in impls.items():
        try:
            emit(kind="seed", impl=name, us=graph_replay_us(fn))
        except Exception as e:
            emit(kind="seed", impl=name, error=str(e).splitlines()[0][:160])


def memory():
    b, h, s, d = 1, 16, 16384, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = flashcore.flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    naive = b * h * s * s * 2 * 2  # bf16 scores + probabilities
    emit(kind="memory", seqlen=s, flashcore_extra_bytes=int(extra), naive_bytes=naive)


def gqa_short():
    """Few query tokens per head under GQA (chunked prefill, speculative decoding): flashcore against
    SDPA cuDNN over the same keys. SDPA's causal mask is top-left aligned, so with fewer queries than
    keys it is another mask: cuDNN runs unmasked, which costs it no more than the causal call."""
    b, hq, hk, d, keys = 8, 32, 8, 128, 4096
    k, v = (torch.randn(b, keys, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kt, vt = (x.transpose(1, 2) for x in (k, v))
    for tokens in (4, 16, 64):
        if left() <= 0:
            emit(kind="skipped", what="gqa_short %d tokens (budget)" % tokens)
            continue
        q = torch.randn(b, tokens, hq, d, device="cuda", dtype=torch.bfloat16)
        qt = q.transpose(1, 2)
        flop = 4.0 * b * hq * tokens * (keys - (tokens - 1) / 2) * d
        impls = {"flashcore": lambda: flashcore.flash_attn_func(q, k, v, causal=True),
                 "sdpa_cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, False, enable_gqa=True)}
        for name, fn in impls.items():
            try:
                emit(kind="gqa_short", impl=name, tokens=tokens, keys=keys, heads_q=hq, heads_kv=hk, hdim=d,
                     tflops=flop / (graph_replay_us(fn, 50) * 1e-6) / 1e12)
            except Exception as e:
                emit(kind="gqa_short", impl=name, tokens=tokens, error=str(e).splitlines()[0][:160])
    # Decoding through flash_attn_func (one token against one long sequence): AUTO's decode route.
    if left() <= 0:
        emit(kind="skipped", what="decode through flash_attn_func (budget)")
        return
    keys = 65536
    k, v = (torch.randn(1, keys, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(1, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kv_bytes = 2 * k.numel() * k.element_size()
    impls = {"flashcore": lambda: flashcore.flash_attn_func(q, k, v, causal=True),
             "sdpa_cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, False, enable_gqa=True)}
    for name, fn in impls.items():
        try:
            emit(kind="decode_via_forward", impl=name, keys=keys, heads_q=hq, heads_kv=hk, hdim=d,
                 tbps=kv_bytes / (graph_replay_us(fn, 50) * 1e-6) / 1e12)
        except Exception as e:
            emit(kind="decode_via_forward", impl=name, error=str(e).splitlines()[0][:160])


def cpu_path():
    shapes = [(1, 16, 1024, 64, False), (1, 16, 2048, 64, True), (1, 16, 2048, 128, False)]
    if args.quick:
        shapes = shapes[:1]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for (b, h, s, d, causal) in shapes:
            if left() < 20:
                return
            q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

            _cpu_forward_cell(threads, q, k, v, qt, kt, vt, causal)
            if args.no_backward or left() < 30:
                continue
            _cpu_training_cell(threads, q, k, v, qt, kt, vt, causal)
        for (b, h, s, d, causal) in [] if args.quick else shapes:
            if left() < 20:
                return
            _cpu_bf16_cells(threads, b, h, s, d, causal)
        for (b, kv_len) in [] if args.quick else [(1, 8192), (4, 4096)]:
            if left() < 20:
                return
            _cpu_decode_cell(threads, b, kv_len)


def _cpu_forward_cell(threads, q, k, v, qt, kt, vt, causal, **tags):
    """One forward cell against torch's CPU SDPA on the same tensors ((b, s, h, d) and its (b, h, s, d)
    copies). On a CPU with AMX, where flashcore's 16-bit forward (or fp32 with FLASHCORE_CPU_AMX=1)
    runs on the tile unit, its AVX path is timed beside it."""
    b, s, h, d = q.shape
    fc_fwd = lambda: flashcore.attention_forward(q, k, v, causal=causal, num_threads=threads)
    with torch.no_grad():
        fns = [fc_fwd, lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)]
        ms = _interleaved_ms(fns + ([lambda: _without_amx(fc_fwd)] if CPU_HAS_AMX else []))
    f = flops(b, h, s, d, causal, "fwd")
    extra = {"flashcore_avx_gflops": f / ms[2] / 1e6} if CPU_HAS_AMX else {}
    emit(kind="cpu", mode="fwd", **tags, threads=threads, batch=b, heads=h, seqlen=s, hdim=d, causal=causal,
         flashcore_gflops=f / ms[0] / 1e6, torch_sdpa_gflops=f / ms[1] / 1e6, **extra)


def _cpu_training_cell(threads, q, k, v, qt, kt, vt, causal, **tags):
    """One training step (forward + backward of a fixed dout): flash_attn_func's autograd (its CPU
    path honours torch.set_num_threads) against SDPA's, on the same tensors as _cpu_forward_cell.
    For 16-bit inputs on a CPU with AMX, flashcore's AVX path is timed beside."""
    b, s, h, d = q.shape
    for x in (q, k, v, qt, kt, vt):
        x.requires_grad_(True)
    dout = torch.randn_like(q)
    dout_t = dout.transpose(1, 2).contiguous()
    fc_step = lambda: flashcore.flash_attn_func(q, k, v, causal=causal).backward(dout)
    avx_beside = CPU_HAS_AMX and q.dtype != torch.float32
    ms = _interleaved_ms(
        [fc_step, lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(dout_t)]
        + ([lambda: _without_amx(fc_step)] if avx_beside else []))
    for x in (q, k, v, qt, kt, vt):
        x.requires_grad_(False)
        x.grad = None
    f = flops(b, h, s, d, causal, "fwd+bwd")
    extra = {"flashcore_avx_gflops": f / ms[2] / 1e6} if avx_beside else {}
    emit(kind="cpu", mode="fwd+bwd", **tags, threads=threads, batch=b, heads=h, seqlen=s, hdim=d, causal=causal,
         flashcore_gflops=f / ms[0] / 1e6, torch_sdpa_gflops=f / ms[1] / 1e6, **extra)


def _cpu_bf16_cells(threads, b, h, s, d, causal):
    """The forward and the training step on bf16 tensors (not part of #2's fp32 target)."""
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    _cpu_forward_cell(threads, q, k, v, qt, kt, vt, causal, dtype="bf16")
    if not args.no_backward and left() >= 30:
        _cpu_training_cell(threads, q, k, v, qt, kt, vt, causal, dtype="bf16")


def _cpu_has_amx():
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_bf16" in f.read()
    except OSError:
        return False


CPU_HAS_AMX = _cpu_has_amx()


def _without_amx(fn):
    """fn() with cpu_flash's AMX paths switched off (FLASHCORE_CPU_AMX is read at every call)."""
    os.environ["FLASHCORE_CPU_AMX"] = "0"
    try:
        return fn()
    finally:
        del os.environ["FLASHCORE_CPU_AMX"]


def _cpu_decode_cell(threads, b, kv_len, hq=32, hk=8, d=128):
    """One query token per sequence against a KV cache (GQA 32 / 8, d=128, fp32): flashcore's
    flash_attn_with_kvcache against torch SDPA with enable_gqa on contiguous (b, h, s, d) copies
    (its fastest layout here). K+V bytes read per second."""
    q = torch.randn(b, 1, hq, d)
    kc, vc = torch.randn(b, kv_len, hk, d), torch.randn(b, kv_len, hk, d)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, kc, vc))
    with torch.no_grad():
        ms_fc, ms_pt = _interleaved_ms(
            [lambda: flashcore.flash_attn_with_kvcache(q, kc, vc),
             lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)])
    nbytes = 2 * kc.numel() * kc.element_size()
    emit(kind="cpu_decode", threads=threads, batch=b, kv_len=kv_len, heads_q=hq, heads_kv=hk, hdim=d,
         flashcore_gbps=nbytes / ms_fc / 1e6, torch_sdpa_gbps=nbytes / ms_pt / 1e6)


def _interleaved_ms(fns, seconds=2.0, max_pairs=25):
    """Median ms per call of each function, timed in alternation (a, b, a, b, ...) so that a
    slow spell of a shared machine hits both alike; back-to-back blocks of 3 calls each moved one
    side's median by 10% from run to run on the 2-core development VM."""
    for fn in fns:
        fn()
    t0 = time.perf_counter()
    fns[0]()
    pairs = max(5, min(max_pairs, int(seconds / max(time.perf_counter() - t0, 1e-4) / len(fns))))
    times = [[] for _ in fns]
    for _ in range(pairs):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [sorted(ts)[len(ts) // 2] * 1e3 for ts in times]


def plot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    train = [r for r in ROWS if r.get("kind") == "train" and "tflops" in r
             and r.get("dtype", GRID_DTYPES[0]) == GRID_DTYPES[0]]
    if not train:
        return
    fig, axes = plt.subplots(2, 6, figsize=(24, 8), sharex=True)
    for mi, mode in enumerate(("fwd", "fwd+bwd")):
        for ci, (d, causal) in enumerate([(d, c) for d in (64, 128, 256) for c in (False, True)]):
            ax = axes[mi][ci]
            for impl in ("flashcore", "flashcore_sm80", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
                pts = sorted((r["seqlen"], r["tflops"]) for r in train
                             if r["impl"] == impl and r["mode"] == mode and r["hdim"] == d and r["causal"] == causal)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode} d={d} {'causal' if causal else 'full'}")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "tflops_vs_seqlen.png"), dpi=80)


def summary():
    device = "CPU only" if args.cpu_only else torch.cuda.get_device_name()
    print("\n==== flashcore vs peers (same process, %s) ====" % device)
    for r in ROWS:
        if r["kind"] == "ceiling":
            print("ceiling %-18s %s" % (r["what"], r.get("tflops") or r.get("tbps")))
        if r["kind"] == "ceiling_beside":
            print("ceiling %-18s beside d%d %s %d: %.1f before, %.1f after" % (
                r["what"], r["hdim"], "causal" if r["causal"] else "full", r["seqlen"], r["tflops_before"],
                r["tflops_after"]))
    train = [r for r in ROWS if r["kind"] == "train"]
    key = lambda r: (r["mode"], r.get("dtype", "bf16"), r["hdim"], r["causal"], r["seqlen"])
    cells = sorted({key(r) for r in train})
    print("%-8s %-5s %-5s %-6s %-6s %10s %10s %10s %10s %10s %8s %8s %10s" % (
        "mode", "dtype", "hdim", "mask", "seqlen", "flashcore", "fc_sm80", "sdpa_fa2", "cudnn", "effic.", "vs FA2",
        "vs cuDNN", "MHz fc/cu"))
    ratios = {}
    for c in cells:
        by = {r["impl"]: r.get("tflops") for r in train if key(r) == c}
        # The SM clock of each timing window (from the warm-up's start, after the first call).
        # Every forward window runs at the power cap, and there the clock follows each kernel's
        # energy per cycle: flashcore's kernels do more work per cycle than cuDNN's and often run
        # below its clock (docs/PERF.md, sessions 61-62).
        mhz = {r["impl"]: r.get("sm_mhz") for r in train if key(r) == c}
        fc_mhz, cu_mhz = mhz.get("flashcore"), mhz.get("sdpa_cudnn")
        fc, f80, fa2, cu, ef = (by.get(n) for n in ("flashcore", "flashcore_sm80", "sdpa_flash", "sdpa_cudnn",
                                                    "sdpa_efficient"))
        fmt = lambda x: "%10.1f" % x if x else "%10s" % "-"
        r1 = fc / fa2 if fc and fa2 else None
        r2 = fc / cu if fc and cu else None
        if r1:
            ratios.setdefault((c[0], "sdpa_flash"), []).append(r1)
        if r2:
            ratios.setdefault((c[0], "sdpa_cudnn"), []).append(r2)
        print("%-8s %-5s %-5d %-6s %-6d %s %s %s %s %s %8s %8s %10s" % (
            c[0], c[1], c[2], "causal" if c[3] else "full", c[4], fmt(fc), fmt(f80), fmt(fa2), fmt(cu), fmt(ef),
            "%.2fx" % r1 if r1 else "-", "%.2fx" % r2 if r2 else "-",
            "%.0f/%.0f" % (fc_mhz, cu_mhz) if fc_mhz and cu_mhz else "-"))
    for (mode, peer), rs in sorted(ratios.items()):
        gm = math.exp(sum(math.log(x) for x in rs) / len(rs))
        print("%s vs %s: geomean %.2fx, min %.2fx, max %.2fx over %d cells" % (mode, peer, gm, min(rs), max(rs),
                                                                                len(rs)))
    for r in ROWS:
        if r["kind"] == "seed":
            print("seed B=1 H=8 S=512 D=64 fp16 %-15s %s" % (r["impl"], "%.1f us" % r["us"] if "us" in r else r["error"]))
        if r["kind"] == "memory":
            print("memory fwd S=16k: flashcore extra %.1f MiB vs naive %.1f MiB" % (r["flashcore_extra_bytes"] / 2**20,
                                                                                    r["naive_bytes"] / 2**20))
        if r["kind"] == "cpu":
            print("cpu %-7s %2d threads s=%d d=%d %s%s: flashcore %.1f GFLOP/s, torch SDPA %.1f GFLOP/s (%.2fx)" % (
                r.get("mode", "fwd"), r["threads"], r["seqlen"], r["hdim"], "causal" if r["causal"] else "full",
                " " + r["dtype"] if "dtype" in r else "",
                r["flashcore_gflops"],
                r["torch_sdpa_gflops"], r["flashcore_gflops"] / r["torch_sdpa_gflops"])
                + ("; AVX path %.1f (%.2fx)" % (r["flashcore_avx_gflops"], r["flashcore_avx_gflops"] / r["torch_sdpa_gflops"])
                   if "flashcore_avx_gflops" in r else ""))
        if r["kind"] == "cpu_decode":
            print("cpu decode %2d threads %dx%d (GQA %d/%d, d=%d, fp32): flashcore %.1f GB/s, torch SDPA %.1f GB/s "
                  "(%.2fx)" % (r["threads"], r["batch"], r["kv_len"], r["heads_q"], r["heads_kv"], r["hdim"],
                               r["flashcore_gbps"], r["torch_sdpa_gbps"], r["flashcore_gbps"] / r["torch_sdpa_gbps"]))
        if r["kind"] == "gqa_short" and r["impl"] == "flashcore":
            peer = next((p for p in ROWS if p["kind"] == "gqa_short" and p["impl"] == "sdpa_cudnn"
                         and p.get("tokens") == r["tokens"] and "tflops" in p), None)
            if "tflops" in r:
                print("gqa %d/%d d%d bf16, 8 x %d tokens x %d keys, causal: flashcore %.1f TFLOP/s%s" % (
                    r["heads_q"], r["heads_kv"], r["hdim"], r["tokens"], r["keys"], r["tflops"],
                    ", SDPA cuDNN %.1f (%.2fx)" % (peer["tflops"], r["tflops"] / peer["tflops"]) if peer else ""))
        if r["kind"] == "decode_via_forward" and r["impl"] == "flashcore" and "tbps" in r:
            peer = next((p for p in ROWS if p["kind"] == "decode_via_forward" and p["impl"] == "sdpa_cudnn"
                         and "tbps" in p), None)
            print("flash_attn_func decoding, GQA %d/%d d%d bf16, 1 token x %d keys: flashcore %.2f TB/s of K+V%s" % (
                r["heads_q"], r["heads_kv"], r["hdim"], r["keys"], r["tbps"],
                ", SDPA cuDNN %.2f (%.2fx)" % (peer["tbps"], r["tbps"] / peer["tbps"]) if peer else ""))
        if r["kind"] == "skipped":
            print("skipped:", r["what"])
    for line in target_report(ROWS):
        print(line)


skipped = set(filter(None, args.skip.split(",")))
sections = (cpu_path,) if args.cpu_only else tuple(
    fn for name, fn in (("ceilings", ceilings), ("seed", seed_shape), ("grid", training_grid), ("memory", memory),
                        ("gqa", gqa_short), ("cpu", cpu_path)) if name not in skipped)
for section in sections:
    try:
        section()
    except Exception as e:  # keep going: a later section's numbers are still worth having
        emit(kind="error", section=section.__name__, error=repr(e)[:300])
        print("section", section.__name__, "failed:", repr(e)[:300])
if CLOCKS:
    CLOCKS.stop()
plot()
summary()

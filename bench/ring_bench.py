"""Ring attention (flashcore.ring_attention) over the GPUs of one host (NCCL) or CPU processes
(gloo): the time of a forward and of a forward + backward over the whole sequence, split across
the ranks, next to flashcore on one device over the same sequence in the same run.

Each rank holds seqlen-per-rank tokens (batch 1); the whole sequence is world x that. Times are
the slowest rank's median of back-to-back calls. Efficiency = one device's time / (world x the
ring's time): 1.0 means the ring splits the work without loss (communication hidden, ranks
balanced).

usage: python3 bench/ring_bench.py [--world N] [--seqlen-per-rank 8192] [--heads 16] [--dim 128]
                                   [--causal] [--layout contiguous|zigzag] [--device cuda|cpu]
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed(fn, device, repeats):
    """Median seconds of one call over `repeats` timed calls, after a warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run(rank, a, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = a.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=a.world)
    import flashcore
    from flashcore.ring_attention import ring_flash_attn_func, zigzag_shard

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    seqlen = a.world * a.seqlen_per_rank
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seqlen, a.heads, a.dim, generator=gen, dtype=torch.float32) for _ in range(3))

    def shard(x):
        if a.layout == "zigzag":
            return zigzag_shard(x, rank, a.world)
        return x[:, rank * a.seqlen_per_rank:(rank + 1) * a.seqlen_per_rank]

    local = [shard(x).to(dev, dtype).contiguous().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(local[0])

    def forward():
        with torch.no_grad():
            ring_flash_attn_func(*local, causal=a.causal, layout=a.layout)

    def step():
        ring_flash_attn_func(*local, causal=a.causal, layout=a.layout).backward(dout)

    times = torch.tensor([timed(forward, device, a.repeats), timed(step, device, a.repeats)], dtype=torch.float64,
                         device=dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        whole = [x.to(dev, dtype).requires_grad_() for x in (q, k, v)]
        dout_whole = torch.randn_like(whole[0])

        def one_forward():
            with torch.no_grad():
                flashcore.flash_attn_func(*whole, causal=a.causal)

        def one_step():
            flashcore.flash_attn_func(*whole, causal=a.causal).backward(dout_whole)

        single = [timed(one_forward, device, a.repeats), timed(one_step, device, a.repeats)]
        flop = 4.0 * a.heads * seqlen * seqlen * a.dim / (2 if a.causal else 1)
        print(f"ring over {a.world} x {device} ({'NCCL' if device == 'cuda' else 'gloo'}), {a.layout}, "
              f"causal={a.causal}, {seqlen} tokens (batch 1, {a.heads} heads, d {a.dim}, {dtype})")
        for name, ring_s, one_s, factor in (("forward", times[0].item(), single[0], 1.0),
                                            ("fwd+bwd", times[1].item(), single[1], 3.5)):
            print(f"  {name}: ring {ring_s * 1e3:.3f} ms ({factor * flop / ring_s / a.world / 1e12:.1f} TFLOP/s per "
                  f"rank); one device {one_s * 1e3:.3f} ms ({factor * flop / one_s / 1e12:.1f} TFLOP/s); "
                  f"efficiency {one_s / (a.world * ring_s):.2f}")
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=0, help="ranks (default: every GPU, or 2 CPU processes)")
    ap.add_argument("--seqlen-per-rank", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--layout", default="contiguous", choices=("contiguous", "zigzag"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    if a.world == 0:
        a.world = torch.cuda.device_count() if a.device == "cuda" else 2
    spawn_ranks(run, a)


def spawn_ranks(body, a):
    """Runs body(rank, a, port) in a.world processes that meet at a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(body, args=(a, port), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()

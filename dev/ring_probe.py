"""Where a GPU ring's time goes (flashcore.ring_attention over NCCL, every GPU of the host): per
configuration, the slowest rank's median time of
  - the ring's forward and forward + backward at several sm_margin values;
  - its attention calls alone (the blocks each step computes, against the rank's own shard, no
    messages, no merges) and its messages alone (one K/V shift, sent and received);
and one device over the whole sequence. Ideal ring time = the attention alone.

usage: PYTHONPATH=<package> python3 dev/ring_probe.py [--seqlen-per-rank 8192] [--margins 0,8,16,32]
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from ring_bench import spawn_ranks, timed  # noqa: E402  (the bench's timing and rank start)


def timed_ms(fn, repeats):
    return timed(fn, "cuda", repeats) * 1e3


def print_timeline(fn):
    """The GPU kernels and copies of one call of fn (after a warm-up), from the first one's
    start: where the ring's time goes between its attention calls, merges and messages."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
        fn()  # the partner rank runs three calls
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and
            (e.name.startswith(("cuda", "nccl", "c10d", "aten::empty", "aten::copy_")) or "flashcore" in e.name
             or "_C" in e.name or "batch_isend" in e.name)]
    if not gpu:
        print("  (no CUDA events recorded)")
        return
    t0 = min(e.time_range.start for e in gpu + host)
    print("  timeline of one ring forward on rank 0 (us from the first event: start, end, GPU / host, name)")
    for e, where in sorted([(e, "GPU") for e in gpu] + [(e, "host") for e in host], key=lambda x: x[0].time_range.start):
        print(f"    {e.time_range.start - t0:9.1f} {e.time_range.end - t0:9.1f} {where:4s}  {e.name[:100]}")


def slowest(ms, dev):
    t = torch.tensor([ms], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run(rank, a, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=a.world)
    import flashcore
    from flashcore import ring_attention as ra
    from flashcore._torch import _forward_impl

    dev = f"cuda:{rank}"
    world, n = a.world, a.seqlen_per_rank
    margins = [int(m) for m in a.margins.split(",")]
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, world * n, a.heads, a.dim, generator=gen) for _ in range(3)]
    scale = a.dim ** -0.5
    for layout, causal in (("contiguous", False), ("zigzag", True), ("contiguous", True)):
        shard = (lambda x: ra.zigzag_shard(x, rank, world)) if layout == "zigzag" else \
            (lambda x: x[:, rank * n:(rank + 1) * n])
        local = [shard(x).to(dev, torch.bfloat16).contiguous().requires_grad_() for x in full]
        dout = torch.randn_like(local[0])
        rows = {}

        def attention_alone():
            with torch.no_grad():
                for step in range(world):
                    source = (rank - step) % world
                    for r, kk, c in ra._step_blocks(layout, causal, rank, source, n, n):
                        _forward_impl(local[0][:, r], local[1][:, kk], local[2][:, kk], None, None, None, 0, 0,
                                      scale, c, -1, -1, 0.0, 0, False)

        ring = ra._Ring(None)

        def messages_alone():
            _, requests = ring.shift((local[1], local[2]))
            ra._wait(requests)

        if a.timeline and rank == 0 and layout == "contiguous" and not causal:
            print_timeline(lambda: ra.ring_flash_attn_func(*[x.detach() for x in local], causal=causal, layout=layout,
                                                           sm_margin=0))
        elif a.timeline:
            with torch.no_grad():
                for _ in range(3):  # the partner of the profiled calls (warm-up, profiled, spare)
                    ra.ring_flash_attn_func(*local, causal=causal, layout=layout, sm_margin=0)
            torch.cuda.synchronize()
        rows["attention alone (fwd)"] = slowest(timed_ms(attention_alone, a.repeats), dev)
        rows["one K/V shift"] = slowest(timed_ms(messages_alone, a.repeats), dev)
        for m in margins:
            def fwd():
                with torch.no_grad():
                    ra.ring_flash_attn_func(*local, causal=causal, layout=layout, sm_margin=m)

            def step():
                ra.ring_flash_attn_func(*local, causal=causal, layout=layout, sm_margin=m).backward(dout)

            rows[f"ring fwd, sm_margin {m}"] = slowest(timed_ms(fwd, a.repeats), dev)
            rows[f"ring fwd+bwd, sm_margin {m}"] = slowest(timed_ms(step, a.repeats), dev)
        if rank == 0:
            whole = [x.to(dev, torch.bfloat16).requires_grad_() for x in full]
            d_whole = torch.randn_like(whole[0])

            def one_fwd():
                with torch.no_grad():
                    flashcore.flash_attn_func(*whole, causal=causal)

            def one_step():
                flashcore.flash_attn_func(*whole, causal=causal).backward(d_whole)

            one = (timed_ms(one_fwd, a.repeats), timed_ms(one_step, a.repeats))
            print(f"\n{layout}, causal={causal}, {world} x {n} tokens, {a.heads} heads, d {a.dim}, bf16 "
                  f"(one device: fwd {one[0]:.3f} ms, fwd+bwd {one[1]:.3f} ms)")
            for name, ms in rows.items():
                ref = one[1] if "fwd+bwd" in name else one[0]
                eff = f"  efficiency {ref / (world * ms):.2f}" if name.startswith("ring") else ""
                print(f"  {name:32s} {ms:8.3f} ms{eff}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen-per-rank", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--margins", default="0,8,16,32")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--timeline", action="store_true", help="print one ring forward's GPU timeline (rank 0)")
    a = ap.parse_args()
    a.world = torch.cuda.device_count()
    spawn_ranks(run, a)


if __name__ == "__main__":
    main()

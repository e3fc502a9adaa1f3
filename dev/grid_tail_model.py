#!/usr/bin/env python3
"""A list-scheduling model of a non-persistent grid's makespan under a causal mask: the model
behind the sm80 grids' tail (src/cuda/sm80/grid_order.hpp; docs/PERF.md,
session 49).

The GPU hands a grid's CTAs out in index order as slots free up; here each of `slots` resident
CTAs is a slot, a CTA's cost is its key tiles plus a fixed start-up (`--overhead`, in tiles), and
the makespan is divided by the ideal (total cost / slots). Orders compared:
  plain   - pair by pair, each pair's heaviest block first (the sm80 forward before session 49);
  fa2     - pair by pair, lightest first (FlashAttention-2's grid);
  lpt     - the whole grid in order of falling cost (loses L2 reuse on a GPU: not modelled);
  tailN   - plain, with the last N waves of blocks (whole pairs) in order of falling cost (kept:
            N = 2).
usage: python3 dev/grid_tail_model.py [--slots 264] [--block-m 128] [--block-n 32] [--overhead 1]
       [--heads 16] [--dims 128]   (training grid: batch = 16384 / S, heads = 2048 / d)
"""
import argparse
import heapq


def makespan(costs, slots):
    ends = [0.0] * slots
    for c in costs:
        t = heapq.heappop(ends)
        heapq.heappush(ends, t + c)
    return max(ends)


def orders(pairs, blocks, cost, slots, tail_waves):
    plain = [cost(blocks - 1 - j) for _ in range(pairs) for j in range(blocks)]
    out = {"plain": plain, "fa2": [cost(j) for _ in range(pairs) for j in range(blocks)],
           "lpt": sorted(plain, reverse=True)}
    for waves in tail_waves:
        tail_pairs = min(pairs, -(-waves * slots // blocks))
        cut = (pairs - tail_pairs) * blocks
        out[f"tail{waves}"] = plain[:cut] + sorted(plain[cut:], reverse=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=264, help="resident CTAs (SMs x CTAs per SM)")
    ap.add_argument("--block-m", type=int, default=128, help="query rows per CTA")
    ap.add_argument("--block-n", type=int, default=32, help="keys per tile (the cost unit)")
    ap.add_argument("--overhead", type=float, default=1.0, help="a CTA's fixed cost, in tiles")
    ap.add_argument("--dims", default="64,128,256")
    a = ap.parse_args()
    waves = (1, 2, 4)
    print(f"makespan / ideal, causal, {a.slots} slots, {a.block_m} x {a.block_n} tiles, overhead {a.overhead}")
    print(f"{'d':>4} {'S':>6} " + " ".join(f"{k:>7}" for k in ["plain", "fa2", "lpt"] + [f"tail{w}" for w in waves]))
    for d in (int(x) for x in a.dims.split(",")):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            pairs, blocks = (16384 // s) * (2048 // d), s // a.block_m

            def cost(i):
                return (i + 1) * a.block_m / a.block_n + a.overhead

            res = orders(pairs, blocks, cost, a.slots, waves)
            ideal = sum(res["plain"]) / a.slots
            print(f"{d:>4} {s:>6} " + " ".join(f"{makespan(res[k], a.slots) / ideal:7.3f}" for k in res))


if __name__ == "__main__":
    main()

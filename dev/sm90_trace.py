"""Summarizes a trace written by dev/sm90_trace.cu: for each warpgroup role, the SM cycles spent
between consecutive events, grouped by (from event -> to event) and, for the forward, by where in a
tile it happened (head: up to the first softmax, body, tail: after the last softmax), per tile on
average (the backward: per query step too). The gap before an event is mostly the wait that event
ends (K landing, the issue turn, S completing), plus the instructions before that wait.

usage: python3 dev/sm90_trace.py TRACE.bin [--ctas N]
"""
import argparse
import collections
import struct

# forward_trace.cuh's and backward_trace.cuh's event codes
FWD_NAMES = {1: "tile_begin", 2: "q_ready", 3: "k_ready", 4: "v_ready", 5: "turn_taken", 6: "s_ready",
         7: "softmax_done", 8: "pv_done", 9: "epilogue_done", 10: "epi_enter", 11: "epi_staged",
         20: "q_slot_free", 21: "k_slot_free", 22: "v_slot_free"}
BWD_NAMES = {1: "tile_begin", 2: "step_begin", 3: "s_ready", 4: "dv_issued", 5: "ds_stored", 6: "ds_shared",
             7: "dq_ready", 8: "dq_sent", 9: "step_end", 10: "tile_end", 20: "stage_free", 21: "kv_free"}

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--ctas", type=int, default=0, help="summarize only the first N traced CTAs")
args = ap.parse_args()

with open(args.trace, "rb") as f:
    d, s, causal, ctas, roles, cap, backward = struct.unpack("7i", f.read(28))
    counts = struct.unpack(f"{ctas * roles}i", f.read(4 * ctas * roles))
    raw = f.read()
records = struct.iter_unpack("2I", raw)
table = [list() for _ in range(ctas * roles)]
for i, (ev, clk) in enumerate(records):
    slot = i // cap
    if i % cap < min(counts[slot], cap):
        table[slot].append((ev & 0xFF, ev >> 8, clk))

NAMES = BWD_NAMES if backward else FWD_NAMES
print(f"{'bwd' if backward else 'fwd'} d{d} S{s} {'causal' if causal else 'full'}: {ctas} traced CTAs, records per role "
      f"{[counts[c * roles + r] for c in range(1) for r in range(roles)]} (CTA 0)")
use_ctas = args.ctas or ctas
for role in range(roles):
    gaps = collections.defaultdict(lambda: [0, 0])  # (phase, from, to) -> [cycles, count]
    tiles = 0
    steps = 0
    tile_cycles = []
    for cta in range(use_ctas):
        ev = table[cta * roles + role]
        if not ev:
            continue
        # Split into tiles at tile_begin.
        starts = [i for i, e in enumerate(ev) if e[0] == 1]
        for t, a in enumerate(starts):
            b = starts[t + 1] if t + 1 < len(starts) else len(ev)
            tile = ev[a:b]
            tiles += 1
            steps += sum(1 for e in tile if e[0] == 2)
            end_clk = ev[b][2] if b < len(ev) else tile[-1][2]
            tile_cycles.append((end_clk - tile[0][2]) & 0xFFFFFFFF)
            sm = [i for i, e in enumerate(tile) if e[0] == 7]
            first_sm, last_sm = (sm[0], sm[-1]) if sm else (len(tile), len(tile))
            seq = tile + ([ev[b]] if b < len(ev) else [])
            for i in range(1, len(seq)):
                phase = "head" if i <= first_sm else ("tail" if i > last_sm else "body")
                if role == 0 or backward:
                    phase = "-"
                key = (phase, NAMES.get(seq[i - 1][0], "?"), NAMES.get(seq[i][0], "?"))
                gaps[key][0] += (seq[i][2] - seq[i - 1][2]) & 0xFFFFFFFF
                gaps[key][1] += 1
    if not tiles:
        continue
    name = "producer" if role == 0 else f"consumer {role - 1}"
    tile_cycles.sort()
    per_step = f", {steps / tiles:.1f} steps per tile, {sum(tile_cycles) / steps:.0f} cycles per step" if steps else ""
    print(f"\n== {name}: {tiles} tiles, cycles per tile median {tile_cycles[len(tile_cycles) // 2]}, "
          f"mean {sum(tile_cycles) / tiles:.0f}{per_step}")
    order = {"head": 0, "body": 1, "tail": 2, "-": 3}
    total = sum(v[0] for v in gaps.values())
    for key in sorted(gaps, key=lambda k: (order[k[0]], -gaps[k][0])):
        cyc, n = gaps[key]
        if cyc / tiles < 20:
            continue
        print(f"  {key[0]:>4} {key[1]:>14} -> {key[2]:<14} per tile {cyc / tiles:8.0f} cyc "
              f"({100 * cyc / total:4.1f}%)  each {cyc / n:7.0f} x {n / tiles:.1f}")

"""The training-grid targets, checked against a benchmark run: where each cell stands against its target.

A target is a ratio to SDPA cuDNN measured in the same run (TARGETS.md: the best of FlashAttention-3 and
cuDNN on the reference H100, divided by cuDNN there). This module holds those ratios and turns the rows
that bench/peers.py writes (kind "train" and "seed") into the numbers the GPU issues ask for:
- Hopper forward and forward + backward: cells at target, geomean of (flashcore / cuDNN) / target
  (must be >= 1.05), the cells furthest below;
- the portable sm80 forward (flashcore_sm80 rows) against SDPA FA2 (>= 1.10x every cell), fwd+bwd
  against FA2 (>= 1.0x);
- the seed shape against 0.6x the fastest SDPA backend;
- the Hopper forward at d128 and d256, 16k, without a mask, as a share of the bf16 matmul rate
  (>= 0.90): against the matmul timed at the start of the run and, where bench/peers.py wrote
  them, against the matmul timed just before and after the cell (the mean of the two).

usage: python3 bench/targets.py OUT/bench.jsonl   (bench/peers.py prints the same report last)
"""
import json
import math
import sys

# (hdim, causal, seqlen) -> (fwd target / cuDNN, fwd+bwd target / cuDNN), from TARGETS.md's table.
_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
_TABLE = {
    (64, False): ((1.00, 1.00, 1.00, 1.01, 1.09, 1.15), (1.00, 1.00, 1.08, 1.06, 1.14, 1.17)),
    (64, True): ((1.00, 1.00, 1.00, 1.09, 1.07, 1.17), (1.00, 1.00, 1.05, 1.15, 1.19, 1.20)),
    (128, False): ((1.00, 1.00, 1.00, 1.04, 1.00, 1.05), (1.00, 1.00, 1.00, 1.00, 1.09, 1.12)),
    (128, True): ((1.00, 1.00, 1.10, 1.00, 1.19, 1.13), (1.00, 1.00, 1.00, 1.08, 1.12, 1.12)),
    (256, False): ((1.00, 1.00, 1.02, 1.05, 1.12, 1.06), (1.00, 1.00, 1.08, 1.12, 1.22, 1.24)),
    (256, True): ((1.00, 1.00, 1.00, 1.10, 1.22, 1.17), (1.00, 1.00, 1.00, 1.06, 1.02, 1.18)),
}
TARGETS = {(d, c, s): (fwd[i], fb[i]) for (d, c), (fwd, fb) in _TABLE.items() for i, s in enumerate(_SEQLENS)}
GEOMEAN_TARGET = 1.05  # geomean of ratio / target over the grid (Hopper issue)
SM80_FWD_VS_FA2 = 1.10
SM80_FB_VS_FA2 = 1.00
SEED_FRACTION = 0.6
MATMUL_SHARE = 0.90


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def report(rows):
    """Lines describing how the run's training-grid and seed rows stand against the targets."""
    lines = []
    train = [r for r in rows if r.get("kind") == "train" and r.get("tflops")]
    by_cell = {}
    for r in train:
        cell = (r["mode"], r.get("dtype", "bf16"), r["hdim"], bool(r["causal"]), r["seqlen"])
        by_cell.setdefault(cell, {})[r["impl"]] = r["tflops"]
    for mode, index in (("fwd", 0), ("fwd+bwd", 1)):
        for dtype in sorted({c[1] for c in by_cell if c[0] == mode}):
            scored = []  # (ratio / target, cell, ratio, target)
            for cell, impls in sorted(by_cell.items()):
                if cell[0] != mode or cell[1] != dtype:
                    continue
                target = TARGETS.get((cell[2], cell[3], cell[4]))
                if target is None or "flashcore" not in impls or "sdpa_cudnn" not in impls:
                    continue
                ratio = impls["flashcore"] / impls["sdpa_cudnn"]
                scored.append((ratio / target[index], cell, ratio, target[index]))
            if not scored:
                continue
            met = sum(1 for x in scored if x[0] >= 1.0)
            gm = _geomean([x[0] for x in scored])
            lines.append("%s %s vs target (x cuDNN): %d of %d cells at target, geomean ratio/target %.3f (needs >= %.2f)"
                         % (mode, dtype, met, len(scored), gm, GEOMEAN_TARGET))
            worst = sorted(scored)[:4]
            lines.append("  furthest below: " + ", ".join(
                "d%d %s %d %.2f (%.2f)" % (c[2], "causal" if c[3] else "full", c[4], ratio, target)
                for _, c, ratio, target in worst))
    for mode, impl, need in (("fwd", "flashcore_sm80", SM80_FWD_VS_FA2), ("fwd+bwd", "flashcore", SM80_FB_VS_FA2)):
        for dtype in sorted({c[1] for c in by_cell if c[0] == mode}):
            ratios = [impls[impl] / impls["sdpa_flash"] for cell, impls in by_cell.items()
                      if cell[0] == mode and cell[1] == dtype and impl in impls and "sdpa_flash" in impls]
            if ratios:
                lines.append("%s %s %s vs SDPA FA2: %d of %d cells >= %.2fx, geomean %.3fx, min %.2fx"
                             % (mode, dtype, impl, sum(1 for x in ratios if x >= need), len(ratios), need,
                                _geomean(ratios), min(ratios)))
    start = [r["tflops"] for r in rows if r.get("kind") == "ceiling" and r.get("what") == "bf16_matmul_8192"]
    beside = {(r["hdim"], r["seqlen"], bool(r["causal"])): (r["tflops_before"] + r["tflops_after"]) / 2
              for r in rows if r.get("kind") == "ceiling_beside"}
    for d in (128, 256):
        fc = by_cell.get(("fwd", "bf16", d, False, 16384), {}).get("flashcore")
        if not fc or not start:
            continue
        line = "fwd bf16 d%d 16k: %.1f TFLOP/s = %.1f%% of the run's first matmul (%.1f)" % (
            d, fc, 100 * fc / start[0], start[0])
        if (d, 16384, False) in beside:
            mm = beside[(d, 16384, False)]
            line += ", %.1f%% of the matmul timed beside it (%.1f)" % (100 * fc / mm, mm)
        lines.append(line + " (needs >= %.0f%%)" % (100 * MATMUL_SHARE))
    seed = {r["impl"]: r["us"] for r in rows if r.get("kind") == "seed" and "us" in r}
    peers = [us for impl, us in seed.items() if impl.startswith("sdpa_")]
    if "flashcore" in seed and peers:
        lines.append("seed shape: flashcore %.1f us, fastest SDPA %.1f us: %.2fx (needs <= %.1fx, %.1f us)"
                     % (seed["flashcore"], min(peers), seed["flashcore"] / min(peers), SEED_FRACTION,
                        SEED_FRACTION * min(peers)))
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        print("\n".join(report([json.loads(line) for line in f if line.strip()])))

"""Summarizes Nsight Compute's SASS source page (CSV, from dev/ncu_sass_hotspots.sh): the
instructions with the most warp-stall samples, each with the two instructions before it, and the
share of all samples per opcode, and the executed warp instructions per opcode (where a kernel
spends its instructions: compare two kernels' lists).
usage: python3 dev/ncu_sass_hotspots.py SASS.csv [TOP]"""
import collections
import csv
import sys

path = sys.argv[1]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
with open(path, newline="") as f:
    rows = list(csv.reader(f))
head = next(i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r))
cols = [c.strip() for c in rows[head]]
body = [r for r in rows[head + 1:] if len(r) == len(cols)]
src = cols.index("Source")
addr = next((i for i, c in enumerate(cols) if c.startswith("Address")), None)
samp = next(i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (All"))
nis = next((i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (Not")), samp)


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


total = sum(num(r[samp]) for r in body) or 1.0
print("columns:", "; ".join(cols))
print("instructions %d, samples %d" % (len(body), total))
by_op = collections.Counter()
for r in body:
    by_op[r[src].split()[0] if r[src].split() else "?"] += num(r[samp])
print("samples by opcode:", ", ".join("%s %.1f%%" % (k, 100 * v / total) for k, v in by_op.most_common(14)))
execd = next((i for i, c in enumerate(cols) if c == "Instructions Executed"), None)
if execd is not None:
    ex_op = collections.Counter()
    for r in body:
        words = r[src].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
        ex_op[op.split(".")[0]] += num(r[execd])
    ex_total = sum(ex_op.values()) or 1.0
    print("executed warp instructions %.2f M; by opcode:" % (ex_total / 1e6), ", ".join(
        "%s %.2f M" % (k, v / 1e6) for k, v in ex_op.most_common(24)))
order = sorted(range(len(body)), key=lambda i: -num(body[i][samp]))[:top]
for i in sorted(order):
    r = body[i]
    ctx = " | ".join(body[j][src].strip()[:50] for j in range(max(0, i - 2), i))
    print("%5.1f%% (not issued %5.1f%%) %s %-60s  after: %s" % (
        100 * num(r[samp]) / total, 100 * num(r[nis]) / total, r[addr] if addr is not None else i,
        r[src].strip()[:60], ctx))

"""Summarizes Nsight Compute's SASS source page (CSV, from dev/ncu_sass_hotspots.sh): the
instructions with the most warp-stall samples, each with the two instructions before it, and the
share of all samples per opcode, and the executed warp instructions per opcode (where a kernel
spends its instructions: compare two kernels' lists); the stall reasons over the whole kernel and
for each hot instruction; and the samples per stretch of code between two barriers (BAR.SYNC),
with the tensor instructions each stretch holds: which phase of a loop's step the time goes to.
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
# Stall reasons: the per-reason sample columns (all samples, not the "Not Issued" copies).
reasons = [(i, c[len("stall_"):]) for i, c in enumerate(cols) if c.startswith("stall_") and "Not Issued" not in c]
if reasons:
    by_reason = collections.Counter({name: sum(num(r[i]) for r in body) for i, name in reasons})
    print("stall reasons over the kernel:", ", ".join(
        "%s %.1f%%" % (k, 100 * v / total) for k, v in by_reason.most_common(10) if v > 0))


def top_reasons(r, n=2):
    got = sorted(((num(r[i]), name) for i, name in reasons), reverse=True)[:n]
    return " ".join("%s %.0f%%" % (name, 100 * v / (num(r[samp]) or 1)) for v, name in got if v > 0)


order = sorted(range(len(body)), key=lambda i: -num(body[i][samp]))[:top]
for i in sorted(order):
    r = body[i]
    ctx = " | ".join(body[j][src].strip()[:50] for j in range(max(0, i - 2), i))
    print("%5.1f%% (not issued %5.1f%%) %s %-60s [%s]  after: %s" % (
        100 * num(r[samp]) / total, 100 * num(r[nis]) / total, r[addr] if addr is not None else i,
        r[src].strip()[:60], top_reasons(r), ctx))

# Stretches between barriers, in address order (a loop's phases when it holds its barriers).
print("stretches between barriers (first address, instructions, HMMA/HGMMA, samples, executed warp"
      " instructions and their commonest opcodes): a stretch run once per CTA that executes as many"
      " instructions as a loop step is the prologue or epilogue to slim (session 58)")
stretch = {"first": None, "n": 0, "mma": 0, "samples": 0.0, "ops": collections.Counter()}
for k, r in enumerate(body):
    op = r[src].split()
    if stretch["first"] is None:
        stretch["first"] = r[addr] if addr is not None else k
    stretch["n"] += 1
    stretch["mma"] += any(w.startswith(("HMMA", "HGMMA")) for w in op[:2])
    stretch["samples"] += num(r[samp])
    if execd is not None and op:
        opcode = (op[1] if op[0].startswith("@") and len(op) > 1 else op[0]).split(".")[0]
        stretch["ops"][opcode] += num(r[execd])
    if any(w.startswith("BAR.SYNC") for w in op[:2]) or k == len(body) - 1:
        if stretch["samples"] >= 0.005 * total:
            executed = sum(stretch["ops"].values())
            common = ", ".join("%s %.0f%%" % (o, 100 * v / executed)
                               for o, v in stretch["ops"].most_common(4)) if executed else ""
            print("  %s  %5d instr  %4d mma  %5.1f%%  %8.3f M  %s" % (
                stretch["first"], stretch["n"], stretch["mma"], 100 * stretch["samples"] / total,
                executed / 1e6, common))
        stretch = {"first": None, "n": 0, "mma": 0, "samples": 0.0, "ops": collections.Counter()}

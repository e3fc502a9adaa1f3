#!/usr/bin/env python3
"""Spills and registers of every CUDA kernel, from a build log compiled with `-Xptxas -v`.

usage: scripts/spill_report.py BUILD_LOG [--baseline FILE] [--write-baseline FILE] [--top N]

Prints how many kernels ptxas reported, how many spill, and the N that spill the most (bytes of
spill stores / loads, registers, the demangled name shortened). With --baseline (a file written
by --write-baseline from an earlier build of the same architecture list) it also lists every
kernel that spills more than it did there, or spills and was not there: the check a kernel
change needs before it is timed, since a spill inside a key loop costs more than most of what
the change could gain. The baseline is keyed by architecture and the kernel's demangled name
without its parameter list (c++filt; the mangled name where it is missing), with the per-file
hash of anonymous namespaces removed (it changes between builds). Spill bytes that
fell are listed too (so the baseline can be refreshed), but only growth is called out.
Always exits 0 when the log parses: it reports, it does not judge.
"""

import argparse
import re
import shutil
import subprocess
import sys

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGS = re.compile(r"Used (\d+) registers")
# nvcc names an anonymous namespace after the file and a hash that differs between builds.
ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+")


def normalize(mangled):
    return ANON.sub("_GLOBAL__N_", mangled)


def parse(lines):
    """{(arch, mangled): [stores, loads, stack, registers, mangled]} of the kernels in the log."""
    kernels, current = {}, None
    for line in lines:
        m = ENTRY.search(line)
        if m:
            current = (m.group(2), m.group(1))
            kernels[current] = [0, 0, 0, 0, m.group(1)]
            continue
        if current is None:
            continue
        m = SPILLS.search(line)
        if m:
            kernels[current][2], kernels[current][0], kernels[current][1] = (int(g) for g in m.groups())
            continue
        m = REGS.search(line)
        if m:
            kernels[current][3] = int(m.group(1))
            current = None  # the entry's last line
    return kernels


def keyed(kernels):
    """The same kernels keyed by (arch, name): the demangled name without its parameter list where
    c++filt is present (a kernel whose parameters changed type is still the same kernel), else the
    mangled one; either way without the anonymous namespaces' per-build hashes."""
    entries = list(kernels.items())
    names = demangle([normalize(k[1]) for k, _ in entries])
    out = {}
    for ((arch, _), v), name in zip(entries, names):
        out[(arch, re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", name).strip())] = v
    return out


def demangle(names):
    tool = shutil.which("c++filt")
    if not tool or not names:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else list(names)


def shorten(name, width=150):
    for a, b in (("flashcore::cuda::", ""), ("flashcore::", ""), ("__nv_bfloat16", "bf16"), ("__half", "f16"),
                 ("ForwardTraits", "FwdT"), ("BackwardTraits", "BwdT"), ("(ForwardKernelArgs)", "")):
        name = name.replace(a, b)
    name = re.sub(r"\(.*\)$", "", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def read_baseline(path):
    base = {}
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            arch, stores, loads, key = line.split(maxsplit=3)
            base[(arch, key.strip())] = (int(stores), int(loads))
    return base


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--baseline")
    ap.add_argument("--write-baseline")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    with open(a.log, errors="replace") as f:
        kernels = keyed(parse(f))
    if not kernels:
        print(f"no ptxas -v output in {a.log}")
        return 1
    spilling = sorted(((v[0] + v[1], k) for k, v in kernels.items() if v[0] + v[1] > 0), reverse=True)
    print(f"kernels: {len(kernels)}, with spills: {len(spilling)}")
    top = spilling[: a.top]
    names = demangle([kernels[k][4] for _, k in top])
    for (_, k), name in zip(top, names):
        stores, loads, _, regs, _ = kernels[k]
        print(f"  {stores:4d} / {loads:4d} B spill st / ld, {regs:3d} regs  {k[0]}  {shorten(name)}")
    if a.baseline:
        base = read_baseline(a.baseline)
        grown, fell = [], []
        for k, v in kernels.items():
            was = base.get(k, (0, 0))
            if v[0] + v[1] > was[0] + was[1]:
                grown.append(k)
            elif v[0] + v[1] < was[0] + was[1]:
                fell.append(k)
        print(f"against {a.baseline}: {len(grown)} kernels spill more, {len(fell)} less")
        for label, keys in (("MORE", grown), ("less", fell)):
            names = demangle([kernels[k][4] for k in keys])
            for k, name in zip(keys, names):
                was = base.get(k, (0, 0))
                print(f"  {label}: {was[0]} / {was[1]} -> {kernels[k][0]} / {kernels[k][1]} B  {k[0]}  {shorten(name)}")
    if a.write_baseline:
        with open(a.write_baseline, "w") as f:
            f.write("# scripts/spill_report.py --write-baseline: arch, spill stores, spill loads, kernel (demangled,\n"
                    "# without parameters and anonymous-namespace hashes); only kernels that spill.\n")
            for k in sorted(k for k, v in kernels.items() if v[0] + v[1] > 0):
                f.write(f"{k[0]} {kernels[k][0]} {kernels[k][1]} {k[1]}\n")
        print(f"baseline written: {a.write_baseline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

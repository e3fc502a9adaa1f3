#!/usr/bin/env python3
"""Where a kernel's spills sit: in its loops or outside them, from the SASS of a cubin.

usage: dev/sass_spills.py FILE.cubin|FILE.sass [--all] [--nvdisasm PATH]

ptxas -v reports a kernel's spill bytes, not where the local loads and stores land. One LDL
reloaded per key block costs a loop its latency every iteration; the same bytes spilled around
the prologue cost nothing measurable. For every kernel with local-memory instructions (or every
kernel with --all) this prints: instructions, loops (a backward branch's target to the branch),
LDL / STL in all and inside the loops, and the smallest four loops with spills inside them (all
loops with --all).

A cubin is disassembled with nvdisasm (on the GPU machine: the CUDA toolkit's; elsewhere pip's
`nvidia-cuda-nvdisasm` wheel carries one: `pip download --no-deps nvidia-cuda-nvdisasm`, unzip,
and pass nvidia/cu13/bin/nvdisasm). Make the cubin with the unit's nvcc command from the build
(`ninja -t commands`), `-cubin -arch=sm_90a` (or sm_90 for the sm80 kernels' Hopper build) in
place of `-c` and the -gencode options: dev/sass_here.sh does all of it for one unit and runs
this on the result. A .sass file (`nvdisasm -c` or `cuobjdump -sass` output) is read as it is.
"""
import argparse
import re
import shutil
import subprocess
import sys

SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
CUOBJ_FUNC = re.compile(r"^\s*Function : (\S+)")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
INST = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+|0x[0-9a-f]+)")
LOCAL = re.compile(r"\b(LDL|STL)(\.[A-Z0-9.]+)?\b")


def kernels_of(lines):
    """{name: [(address, text)], labels} per function of nvdisasm -c or cuobjdump -sass output."""
    funcs, name, pending = {}, None, []
    for line in lines:
        m = SECTION.match(line) or CUOBJ_FUNC.match(line)
        if m:
            name, pending = m.group(1), []
            funcs[name] = ([], {})
            continue
        if name is None:
            continue
        insts, labels = funcs[name]
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))  # placed at the next instruction's address
            continue
        m = INST.search(line)
        if m:
            addr = int(m.group(1), 16)
            for label in pending:
                labels[label] = addr
            pending = []
            insts.append((addr, m.group(2)))
    return funcs


def analyse(insts, labels):
    loops = []
    for addr, text in insts:
        m = BRANCH.search(text)
        if not m:
            continue
        target = labels.get(m.group(1)) if m.group(1).startswith(".L") else int(m.group(1), 16)
        if target is not None and target <= addr:
            loops.append((target, addr))
    local = [(a, LOCAL.search(t).group(1)) for a, t in insts if LOCAL.search(t)]
    inside = {a for a, _ in local for s, e in loops if s <= a <= e}
    return loops, local, inside


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    a = ap.parse_args()
    if a.file.endswith(".cubin"):
        text = subprocess.run([a.nvdisasm, "-c", a.file], capture_output=True, text=True, check=True).stdout
    else:
        text = open(a.file, errors="replace").read()
    demangle = shutil.which("c++filt")
    for name, (insts, labels) in sorted(kernels_of(text.splitlines()).items()):
        loops, local, inside = analyse(insts, labels)
        if not local and not a.all:
            continue
        title = name
        if demangle:
            title = subprocess.run([demangle, name], capture_output=True, text=True).stdout.strip() or name
        lds = sum(1 for _, k in local if k == "LDL")
        print(f"{title[:200]}\n  {len(insts)} instructions, {len(loops)} loops; LDL {lds}, STL {len(local) - lds}, "
              f"{len(inside)} of them inside loops")
        # Innermost first: a persistent kernel's tile loop holds everything, so the smallest loops
        # with spills in them are the ones that say which iteration pays.
        sized = sorted((sum(1 for x, _ in insts if s <= x <= e), s, e) for s, e in loops)
        listed = 0
        for n, s, e in sized:
            k = sum(1 for x, _ in local if s <= x <= e)
            if (k or a.all) and (a.all or listed < 4):
                print(f"    loop {s:#x}-{e:#x}: {n} instructions, {k} LDL / STL")
                listed += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

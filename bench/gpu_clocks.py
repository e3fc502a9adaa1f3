"""The GPU's SM clock and power while something runs, sampled by nvidia-smi (bench/peers.py and
dev/power_probe.py).

Why: on an H200 every long forward runs at the 700 W power limit, and the SM clock then follows
the energy per FLOP of the kernel (docs/PERF.md, session 43): two kernels compared in one cell
may run at clocks 10-15% apart. A rate next to the clock it ran at says which kind of gain is
left (fewer cycles or less energy).

One `nvidia-smi -lms 50` process feeds a reader thread; `window(t0, t1)` summarizes the samples
taken between two time.time() stamps. Without nvidia-smi (or when it fails) the sampler is off
and `window` returns None.
"""
import datetime
import os
import shutil
import statistics
import subprocess
import threading

QUERY = "timestamp,power.draw,clocks.sm,temperature.gpu,clocks_event_reasons.active"
POWER_CAP_REASON = 0x4  # clocks_event_reasons: software power cap


def _visible_index():
    """nvidia-smi's index of the GPU torch calls 0 (the first of CUDA_VISIBLE_DEVICES)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return first if first else "0"


class ClockSampler:
    def __init__(self, period_ms=50):
        self.samples = []  # (time, watts, sm_mhz, temperature, reasons)
        self._proc = None
        if shutil.which("nvidia-smi") is None:
            return
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(period_ms),
                 "-i", _visible_index()],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self._proc.stdout:
            sample = parse(line)
            if sample is not None:
                self.samples.append(sample)

    def window(self, t0, t1):
        """Median SM clock (MHz), power (W) and temperature, and the share of samples with the power cap
        active, over the samples taken in [t0, t1]; None without samples there."""
        sel = [s for s in list(self.samples) if t0 <= s[0] <= t1]
        if not sel:
            return None
        return dict(sm_mhz=statistics.median(s[2] for s in sel), watts=statistics.median(s[1] for s in sel),
                    temperature=statistics.median(s[3] for s in sel),
                    power_capped=sum(1 for s in sel if s[4] & POWER_CAP_REASON) / len(sel), samples=len(sel))

    def stop(self):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None


def parse(line):
    """One CSV line of QUERY as (epoch seconds, W, MHz, degrees C, reasons bits); None if it is not one."""
    f = [x.strip() for x in line.split(",")]
    if len(f) < 5:
        return None
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return (t, float(f[1]), float(f[2]), float(f[3]), int(f[4], 16))
    except ValueError:
        return None

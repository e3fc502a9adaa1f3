"""The varlen forward (and forward + backward) against PyTorch's FlashAttention-2 varlen kernel in
the same process: flash_attn_varlen_func over ~16k tokens in sequences of uneven lengths (uniform
in [mean / 2, 3 mean / 2), odd, so every sequence ends in partial blocks), heads 2048 / d, bf16,
next to the peer on the same sequences (peer_calls). Two more lines per cell: the same call with
every sequence `mean` long (varlen bookkeeping without uneven lengths) and flash_attn_func on that
fixed-length batch. TFLOP/s count each sequence's own n^2 (causal: half), so padding inside a
block is a loss. `--flashcore-only` skips the peer (base-vs-new runs in alternating processes).

usage: PYTHONPATH=<a built flashcore package> python3 dev/varlen_peers.py [--no-backward] [--flashcore-only]"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch

import flashcore
from timing import events_rate, training_rates

BACKWARD = "--no-backward" not in sys.argv
PEERS = "--flashcore-only" not in sys.argv


def uneven_lengths(mean, tokens=16384):
    lengths = []
    while sum(lengths) < tokens - mean:
        lengths.append(int(torch.randint(mean // 2, 3 * mean // 2, ()).item()) | 1)
    return lengths


def rates(fwd, flop):
    return training_rates(fwd, flop, BACKWARD)


def cell(lengths, d, causal, rows):
    h = 2048 // d
    total = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flop = sum(4.0 * h * n * n * d for n in lengths) / (2 if causal else 1)
    mx = max(lengths)
    rows["flashcore varlen"] = rates(
        lambda: flashcore.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal), flop)
    for name, (fwd, fwd_bwd) in (peer_calls(q, k, v, cu, mx, causal) if PEERS else {}).items():
        try:
            with torch.no_grad():
                torch.testing.assert_close(fwd().float(), flashcore.flash_attn_varlen_func(
                    q, k, v, cu, cu, mx, mx, causal=causal).float(), atol=2e-2, rtol=0)
                f = events_rate(fwd, flop)
        except Exception as e:  # a peer this torch lacks, or one that refuses this shape
            rows[name] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
            continue
        try:
            rows[name] = (f, events_rate(fwd_bwd, 3.5 * flop) if BACKWARD else None)
        except Exception as e:
            rows[name] = f"fwd {f:6.1f}  fwd+bwd n/a ({type(e).__name__}: {str(e).splitlines()[0][:100]})"


def peer_calls(q, k, v, cu, mx, causal):
    """PyTorch's varlen kernel called as its jagged-tensor SDPA calls it, without the nested
    tensor's per-call host work (jagged SDPA itself read 1-90 TFLOP/s here): FlashAttention-2's
    varlen forward / backward (aten._flash_attention_forward / _backward). cuDNN's ragged entry
    (aten._cudnn_attention_forward with cum_seq_q / cum_seq_k) read 0.6-7 TFLOP/s in torch 2.11
    on the H100 (docs/PERF.md, session 30), so it is not a peer here."""
    aten = torch.ops.aten
    qd, kd, vd = (t.detach() for t in (q, k, v))
    dout = torch.randn_like(qd)
    calls = {}

    def fa2_fwd():
        return aten._flash_attention_forward(qd, kd, vd, cu, cu, mx, mx, 0.0, causal, False)

    def fa2_fwd_bwd():
        out, lse, rng, unused, _ = fa2_fwd()
        return aten._flash_attention_backward(dout, qd, kd, vd, out, lse, cu, cu, mx, mx, 0.0, causal, rng, unused)

    calls["sdpa flash (FA2 varlen)"] = (lambda: fa2_fwd()[0], fa2_fwd_bwd)
    return calls


def main():
    aten = torch.ops.aten
    for op in ("_flash_attention_forward", "_flash_attention_backward"):
        print(op, getattr(aten, op).default._schema if hasattr(aten, op) else "absent")
    torch.manual_seed(0)
    for mean in (512, 2048):
        lengths = uneven_lengths(mean)
        for d in (64, 128):
            for causal in (False, True):
                rows = {}
                cell(lengths, d, causal, rows)
                # Equal lengths: the varlen path's own cost next to flash_attn_func.
                h, n, b = 2048 // d, mean, 16384 // mean
                cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device="cuda")
                q, k, v = (torch.randn(b * n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                flop = 4.0 * h * b * n * n * d / (2 if causal else 1)
                rows["flashcore varlen, equal lengths"] = rates(
                    lambda: flashcore.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=causal), flop)
                rows["flashcore fixed (flash_attn_func)"] = rates(
                    lambda: flashcore.flash_attn_func(*(t.view(b, n, h, d) for t in (q, k, v)), causal=causal), flop)
                print(f"== mean {mean} ({len(lengths)} seqs) d{d} {'causal' if causal else 'full'}", flush=True)
                for name, r in rows.items():
                    if isinstance(r, str):
                        print(f"  {name:36s} {r}")
                    else:
                        fb = f"  fwd+bwd {r[1]:6.1f}" if r[1] is not None else ""
                        print(f"  {name:36s} fwd {r[0]:6.1f}{fb}", flush=True)


if __name__ == "__main__":
    main()

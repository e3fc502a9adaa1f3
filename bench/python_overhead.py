"""Host overhead per call of flashcore's Python entry points vs PyTorch SDPA, same process.

On a tiny problem the GPU work is a few microseconds, so the time the host spends per call
(argument handling, DLPack export, custom-op dispatch, allocation, launch) is what limits a
loop of calls. For each entry point this script times `iters` back-to-back calls: "host" is
the time to issue them (perf_counter, no synchronization inside the loop), "total" includes
waiting for the device at the end. Layers measured, from the outside in:
  fa_api        flashcore.flash_attn_func (custom op, allocates out/lse)
  fa_api+bwd    the same with autograd backward
  custom_op     torch.ops.flashcore.fwd directly (the path torch.compile sees; eager calls of
                flash_attn_func on plain tensors bypass the op dispatcher)
  dlpack_api    flashcore.attention_forward with preallocated out (no custom op)
  ext_dlpack    flashcore._C.forward on torch tensors (DLPack import), everything preallocated
  ext_raw       flashcore._C.forward on raw descriptors (what flashcore._torch passes)
  ext_raw_bwd   flashcore._C.backward on raw descriptors, preallocated (binding + library)
  ext_validate  flashcore._C.forward_workspace on raw descriptors: validation only, no launch
  dlpack_export q.__dlpack__() alone: torch's cost of exporting one tensor
  kvcache       flashcore.flash_attn_with_kvcache: one query token per sequence against a cache
                of seqlen keys (cache_seqlens given), the decoding step of eager inference
  sdpa          torch.nn.functional.scaled_dot_product_attention (same shape, BHSD view)
  sdpa+bwd      the same with autograd backward
Usage: python bench/python_overhead.py [--device cuda|cpu] [--iters N] [--shape B,S,H,D]
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F

import flashcore
from flashcore import _C
from flashcore._torch import _describe

DEFAULT_SHAPE = (1, 128, 4, 64)  # batch, seqlen, heads, head_dim: tiny on purpose
DEFAULT_ITERS = 2000
WARMUP_ITERS = 50


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, device, iters):
    for _ in range(WARMUP_ITERS):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    issued = time.perf_counter()
    synchronize(device)
    done = time.perf_counter()
    return (issued - start) / iters * 1e6, (done - start) / iters * 1e6


def build_calls(device, shape, dtype):
    batch, seqlen, heads, head_dim = shape
    make = lambda: torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype)
    q, k, v = make(), make(), make()
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen, device=device, dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    options = _C.Options(stream=stream, num_threads=0 if device == "cuda" else torch.get_num_threads())
    workspace_bytes = _C.forward_workspace(q, k, v, None, None, options)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
    raw = {name: _describe(t, name) for name, t in
           (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", dout))}
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    raw_grads = [_describe(t, "grad") for t in (dq, dk, dv)]
    # Raw descriptors do not own memory: the tensors they describe must outlive every call.
    keep_alive = (q, k, v, out, lse, dout, dq, dk, dv)
    bwd_bytes = _C.backward_workspace(raw["q"], raw["k"], raw["v"], None, None, options)
    bwd_buffer = torch.empty(max(bwd_bytes, 1), dtype=torch.uint8, device=device)
    fc_device = _C.DEVICE_CUDA if device == "cuda" else _C.DEVICE_CPU
    bwd_workspace = (bwd_buffer.data_ptr(), bwd_bytes, fc_device, bwd_buffer.device.index or 0, bwd_buffer)
    q1 = q[:, -1:].contiguous()
    cache_seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    qg_t, kg_t, vg_t = (x.transpose(1, 2) for x in (qg, kg, vg))

    def fa_bwd():
        torch.autograd.grad(flashcore.flash_attn_func(qg, kg, vg), (qg, kg, vg), dout)

    def sdpa_bwd():
        out_t = F.scaled_dot_product_attention(qg_t, kg_t, vg_t)
        torch.autograd.grad(out_t, (qg, kg, vg), dout.transpose(1, 2))

    calls = {
        "fa_api": lambda: flashcore.flash_attn_func(q, k, v),
        "fa_api+bwd": fa_bwd,
        "custom_op": lambda: torch.ops.flashcore.fwd(q, k, v, None, None, None, 0, 0, 0.0, False, -1,
                                                     -1, 0.0, 0, False),
        "dlpack_api": lambda: flashcore.attention_forward(q, k, v, out=out, stream=stream),
        "ext_dlpack": lambda: _C.forward(q, k, v, out, lse, None, None, workspace, options),
        "ext_raw": lambda: _C.forward(raw["q"], raw["k"], raw["v"], raw["out"], raw["lse"], None,
                                      None, workspace, options),
        "ext_raw_bwd": lambda: _C.backward(raw["dout"], raw["q"], raw["k"], raw["v"], raw["out"],
                                           raw["lse"], *raw_grads, None, None, bwd_workspace, options),
        "ext_validate": lambda: _C.forward_workspace(raw["q"], raw["k"], raw["v"], None, None, options),
        "dlpack_export": lambda: q.__dlpack__(),
        "kvcache": lambda: flashcore.flash_attn_with_kvcache(q1, k, v, cache_seqlens=cache_seqlens),
        "sdpa": lambda: F.scaled_dot_product_attention(q_t, k_t, v_t),
        "sdpa+bwd": sdpa_bwd,
    }
    return calls, keep_alive


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=DEFAULT_ITERS)
    parser.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)))
    parser.add_argument("--dtype", default=None, help="float16 (CUDA default) or float32 (CPU default)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--only", help="comma-separated entry points to time (default: all)")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    dtype_name = args.dtype or ("float16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)

    calls, _keep_alive = build_calls(args.device, shape, dtype)
    if args.only:
        calls = {name: calls[name] for name in args.only.split(",")}
    rows = []
    print(f"flashcore {flashcore.__version__}, torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f", shape B,S,H,D={shape} {dtype_name}, {args.iters} calls each")
    print(f"{'entry point':<14}{'host us/call':>14}{'total us/call':>15}")
    for name, fn in calls.items():
        host_us, total_us = time_calls(fn, args.device, args.iters)
        rows.append({"name": name, "host_us": round(host_us, 2), "total_us": round(total_us, 2)})
        print(f"{name:<14}{host_us:>14.2f}{total_us:>15.2f}")
    by_name = {row["name"]: row for row in rows}
    if "fa_api" in by_name and "sdpa" in by_name:
        ratio = by_name["fa_api"]["host_us"] / by_name["sdpa"]["host_us"]
        print(f"summary: flash_attn_func host overhead = {ratio:.2f}x SDPA's "
              f"({by_name['fa_api']['host_us']:.1f} vs {by_name['sdpa']['host_us']:.1f} us/call)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "shape": shape, "dtype": dtype_name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

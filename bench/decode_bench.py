#!/usr/bin/env python3
"""Decode benchmark: flashcore's KV-cache attention vs PyTorch SDPA (cuDNN, flash) in one process.

Cells of TARGETS.md: one query token per sequence, GQA 32 q / 8 kv heads, head_dim 128, bf16,
(batch x kv_len) 1x65536, 16x8192, 64x2048; flashcore contiguous and paged (page 16 and 256).
Metric: K+V bytes / time (TB/s), timed with CUDA events around many calls issued back to back
(median of repeats). flashcore is called through ctypes on the built libflashcore.so.

The read ceiling (sum of a 4 GiB bf16 tensor) is measured in the same run; the target is every
flashcore cell >= cuDNN and >= 95% of that ceiling. --sweep also times explicit split counts
(num_splits) per cell, to tune the split heuristic; --profile splits each flashcore cell's time
into its kernels (torch.profiler: attention vs combine, and the launch gaps); --base-lib times
another build of the library (e.g. the last commit's) on every flashcore cell in the same process;
--ordered-pages also times the paged layouts with the pages in cache order (the contiguous
addresses through the paged code path: what the random page order itself costs); --alibi also
times every flashcore cell with ALiBi slopes (the decode kernel's ALiBi instantiation) beside it.

Usage: python bench/decode_bench.py [--lib build-gpu/libflashcore.so] [--iters 50] [--repeats 5] [--sweep]
                                    [--profile] [--base-lib OTHER/libflashcore.so] [--ordered-pages] [--alibi]
"""
import argparse
import os
import ctypes
import sys
import statistics

import torch
import torch.nn.functional as F
from timing import events_rate

FC_DTYPE_F32 = 0
FC_DTYPE_BF16 = 2
FC_DTYPE_I32 = 3
FC_DEVICE_CUDA = 1
MAX_DIMS = 4
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
CELLS = [(1, 65536), (16, 8192), (64, 2048)]
LAYOUTS = [("contiguous", 0), ("paged16", 16), ("paged256", 256)]


class FcTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.c_int64 * MAX_DIMS), ("strides", ctypes.c_int64 * MAX_DIMS)]


class FcOptions(ctypes.Structure):
    _fields_ = [("softmax_scale", ctypes.c_double), ("causal", ctypes.c_int32), ("window_left", ctypes.c_int32),
                ("window_right", ctypes.c_int32), ("has_window", ctypes.c_int32), ("softcap", ctypes.c_double),
                ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p),
                ("max_seqlen_q", ctypes.c_int64), ("max_seqlen_k", ctypes.c_int64), ("backend", ctypes.c_int32),
                ("deterministic", ctypes.c_int32), ("stream", ctypes.c_void_p), ("num_threads", ctypes.c_int32),
                ("check_cu_seqlens", ctypes.c_int32), ("error_flag", ctypes.c_void_p),
                ("reserved", ctypes.c_int32 * 4), ("block_table", ctypes.c_void_p),  # FC_ABI_VERSION 2
                ("alibi_slopes", ctypes.c_void_p),  # FC_ABI_VERSION 3
                ("sm_margin", ctypes.c_int32),  # FC_ABI_VERSION 4
                ("dropout_p", ctypes.c_double), ("dropout_seed", ctypes.c_uint64),  # FC_ABI_VERSION 5
                ("dropout_offset", ctypes.c_uint64)]


class FcKvArgs(ctypes.Structure):
    _fields_ = [("q", ctypes.POINTER(FcTensor)), ("k_cache", ctypes.POINTER(FcTensor)),
                ("v_cache", ctypes.POINTER(FcTensor)), ("cache_seqlens", ctypes.POINTER(FcTensor)),
                ("block_table", ctypes.POINTER(FcTensor)), ("cache_batch_idx", ctypes.POINTER(FcTensor)),
                ("k_new", ctypes.POINTER(FcTensor)), ("v_new", ctypes.POINTER(FcTensor)),
                ("out", ctypes.POINTER(FcTensor)), ("lse", ctypes.POINTER(FcTensor)),
                ("num_splits", ctypes.c_int32), ("error_flag", ctypes.POINTER(ctypes.c_int32)),
                # FC_ABI_VERSION 2
                ("rotary_cos", ctypes.POINTER(FcTensor)), ("rotary_sin", ctypes.POINTER(FcTensor)),
                ("rotary_interleaved", ctypes.c_int32), ("cache_leftpad", ctypes.POINTER(FcTensor))]
FC_ABI_VERSION = 5  # the C ABI these structures mirror


def fc_tensor(t):
    x = FcTensor()
    x.data = t.data_ptr()
    x.dtype = {torch.float32: FC_DTYPE_F32, torch.bfloat16: FC_DTYPE_BF16, torch.int32: FC_DTYPE_I32}[t.dtype]
    x.device_type = FC_DEVICE_CUDA
    x.device_id = t.device.index or 0
    x.ndim = t.dim()
    for i in range(t.dim()):
        x.shape[i] = t.shape[i]
        x.strides[i] = t.stride(i)
    return x


def flashcore_call(lib, batch, kv_len, page, q, k, v, out, keep, num_splits=0, info=None, ordered=False,
                   alibi=False):
    """Builds the ctypes arguments once; returns a closure that issues one call (with ALiBi slopes
    2^(-8 (h + 1) / heads) when `alibi`)."""
    lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    tensors = {"q": fc_tensor(q), "out": fc_tensor(out), "lens": fc_tensor(lens)}
    if alibi:
        slopes = torch.exp2(-8.0 * torch.arange(1, HEADS_Q + 1, device="cuda", dtype=torch.float32) / HEADS_Q)
        tensors["slopes"] = fc_tensor(slopes)
        keep += [slopes]
    if page:
        pages_per_seq = kv_len // page
        perm = (torch.arange(batch * pages_per_seq, device="cuda") if ordered
                else torch.randperm(batch * pages_per_seq, device="cuda")).to(torch.int32)
        table = perm.view(batch, pages_per_seq).contiguous()
        kp = k.view(batch * pages_per_seq, page, HEADS_KV, HEAD_DIM)
        vp = v.view(batch * pages_per_seq, page, HEADS_KV, HEAD_DIM)
        tensors.update(k=fc_tensor(kp), v=fc_tensor(vp), table=fc_tensor(table))
        keep += [table]
    else:
        tensors.update(k=fc_tensor(k), v=fc_tensor(v))
    keep += [lens, tensors]
    args = FcKvArgs()
    args.q = ctypes.pointer(tensors["q"])
    args.k_cache = ctypes.pointer(tensors["k"])
    args.v_cache = ctypes.pointer(tensors["v"])
    args.cache_seqlens = ctypes.pointer(tensors["lens"])
    if page:
        args.block_table = ctypes.pointer(tensors["table"])
    args.out = ctypes.pointer(tensors["out"])
    args.num_splits = num_splits
    opts = FcOptions()
    opts.stream = torch.cuda.current_stream().cuda_stream
    if alibi:
        opts.alibi_slopes = ctypes.addressof(tensors["slopes"])
    ws = ctypes.c_size_t(0)
    if lib.fc_attention_kvcache_workspace(ctypes.byref(args), ctypes.byref(opts), ctypes.byref(ws)) != 0:
        raise RuntimeError(lib.fc_last_error().decode())
    workspace = torch.empty(max(ws.value, 1), dtype=torch.uint8, device="cuda")
    keep += [args, opts, workspace]
    if info is not None:  # split count the heuristic chose, read back from the workspace size
        per_split = batch * HEADS_Q * HEAD_DIM * 4
        info["splits"] = ws.value // per_split if ws.value else 1
    wptr, wbytes = ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(ws.value)

    def call():
        if lib.fc_attention_kvcache(ctypes.byref(args), ctypes.byref(opts), wptr, wbytes) != 0:
            raise RuntimeError(lib.fc_last_error().decode())
    return call


def kernel_breakdown(fn, calls=20):
    """Per-call device time of each kernel of `fn` (us) and the wall time per call between the
    first kernel's start and the last one's end, from torch.profiler over `calls` calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    starts, ends = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.split("<")[0].split("(")[0].split("::")[-1]
        per_kernel[name] = per_kernel.get(name, 0.0) + e.device_time_total / calls
        starts.append(e.time_range.start)
        ends.append(e.time_range.end)
    span = (max(ends) - min(starts)) / calls if starts else 0.0
    return " ".join(f"{k} {v:.1f}us" for k, v in sorted(per_kernel.items())) + f" | span/call {span:.1f}us"


def sdpa_call(backend, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D) views

    def call():
        with sdpa_kernel(b):
            F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    return call


def read_ceiling(iters, repeats):
    """TB/s of summing a 4 GiB bf16 tensor (the measured read bandwidth)."""
    x = torch.randn(2 * 1024 ** 3, device="cuda", dtype=torch.bfloat16)
    rate = events_rate(lambda: x.sum(dtype=torch.float32), x.numel() * 2, repeats, max(1, iters // 5))
    del x
    torch.cuda.empty_cache()
    return rate


def target_verdict(rows, ceiling):
    """How many flashcore cells (row[3:-1], TB/s) are >= cuDNN (row[1]) and >= 95% of the read ceiling."""
    met = total = 0
    misses = []
    for row in rows:
        try:
            cudnn = float(row[1])
        except ValueError:  # cuDNN refused the shape: no target to compare with
            continue
        for name, value in zip([n for n, _ in LAYOUTS], row[3:3 + len(LAYOUTS)]):
            total += 1
            rate = float(value)
            if rate >= cudnn and rate >= 0.95 * ceiling:
                met += 1
            else:
                misses.append(f"{row[0]} {name} {rate:.2f} ({rate / cudnn:.2f}x cuDNN, {rate / ceiling:.0%} of the read)")
    line = f"decode vs target: {met} of {total} cells >= cuDNN and >= 95% of the read bandwidth"
    return line + ("; below: " + ", ".join(misses) if misses else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build-gpu/libflashcore.so")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also time explicit num_splits values")
    ap.add_argument("--profile", action="store_true", help="also print each flashcore cell's kernel times")
    ap.add_argument("--ordered-pages", action="store_true",
                    help="also time the paged layouts with pages in cache order (block table = identity): "
                         "the same addresses as contiguous through the paged code path")
    ap.add_argument("--alibi", action="store_true",
                    help="also time every flashcore cell with ALiBi slopes, interleaved with the plain call")
    ap.add_argument("--base-lib", default="",
                    help="another build of libflashcore.so (e.g. the last commit's) timed on every flashcore cell too")
    ap.add_argument("--env-variants", default="",
                    help="NAME=V1,V2,...: also time every flashcore cell with the environment variable NAME set "
                         "to each value in turn, in interleaved rounds (for a library that reads NAME per call)")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.lib)
    lib.fc_last_error.restype = ctypes.c_char_p
    if lib.fc_abi_version() != FC_ABI_VERSION:
        sys.exit(f"{a.lib}: C ABI version {lib.fc_abi_version()}, this script mirrors version {FC_ABI_VERSION}")
    base_lib = None
    if a.base_lib:  # an older library reads only the fields it knows (appended fields are zero here)
        base_lib = ctypes.CDLL(a.base_lib)
        base_lib.fc_last_error.restype = ctypes.c_char_p
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    ceiling = read_ceiling(a.iters, a.repeats)
    header = ["batch x kv_len", "cuDNN", "flash"] + [f"flashcore {n}" for n, _ in LAYOUTS] + ["splits"]
    rows = []
    sweep_lines = []
    profile_lines = []
    compare_lines = []  # --ordered-pages and --base-lib timings
    for batch, kv_len in CELLS:
        q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_len, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        nbytes = 2 * k.numel() * k.element_size()  # K + V read once
        row = [f"{batch} x {kv_len}"]
        for backend in ("cudnn", "flash"):
            try:
                row.append(f"{events_rate(sdpa_call(backend, q, k, v), nbytes, a.repeats, a.iters):.2f}")
            except Exception as e:  # a backend that refuses the shape
                row.append(f"n/a ({type(e).__name__})")
        info = {}
        for name, page in LAYOUTS:
            keep = []
            call = flashcore_call(lib, batch, kv_len, page, q, k, v, out, keep, info=info)
            row.append(f"{events_rate(call, nbytes, a.repeats, a.iters):.2f}")
            if a.profile:
                profile_lines.append(f"profile {batch}x{kv_len} {name} (splits {info.get('splits')}): "
                                     + kernel_breakdown(call))
                print(profile_lines[-1], flush=True)
            if a.ordered_pages and page:
                ordered_call = flashcore_call(lib, batch, kv_len, page, q, k, v, out, keep, ordered=True)
                compare_lines.append(f"ordered pages {batch}x{kv_len} {name}: "
                                  f"{events_rate(ordered_call, nbytes, a.repeats, a.iters):.2f}")
                print(compare_lines[-1], flush=True)
            if a.alibi:  # interleaved rounds: the plain call and the ALiBi one
                alibi_call = flashcore_call(lib, batch, kv_len, page, q, k, v, out, keep, alibi=True)
                plain, biased = [], []
                for _ in range(a.repeats):
                    plain.append(events_rate(call, nbytes, 1, a.iters))
                    biased.append(events_rate(alibi_call, nbytes, 1, a.iters))
                compare_lines.append(f"alibi {batch}x{kv_len} {name}: plain {statistics.median(plain):.2f}, "
                                     f"alibi {statistics.median(biased):.2f} TB/s")
                print(compare_lines[-1], flush=True)
            if base_lib:
                base_call = flashcore_call(base_lib, batch, kv_len, page, q, k, v, out, keep)
                compare_lines.append(f"base-lib {batch}x{kv_len} {name}: "
                                  f"{events_rate(base_call, nbytes, a.repeats, a.iters):.2f}")
                print(compare_lines[-1], flush=True)
            if a.env_variants:
                name_env, values = a.env_variants.split("=", 1)
                values = values.split(",")
                rates = {val: [] for val in values}
                for _ in range(a.repeats):
                    for val in values:
                        os.environ[name_env] = val
                        rates[val].append(events_rate(call, nbytes, 1, a.iters))
                os.environ.pop(name_env, None)
                compare_lines.append(f"{name_env} {batch}x{kv_len} {name}: " + " ".join(
                    f"{val}:{statistics.median(r):.3f}" for val, r in rates.items()))
                print(compare_lines[-1], flush=True)
            if a.sweep:
                rates = []
                for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 48, 66):
                    if s > max(1, kv_len // 256):
                        continue
                    keep = []
                    call = flashcore_call(lib, batch, kv_len, page, q, k, v, out, keep, num_splits=s)
                    rates.append(f"{s}:{events_rate(call, nbytes, a.repeats, a.iters):.2f}")
                sweep_lines.append(f"sweep {batch}x{kv_len} {name}: " + " ".join(rates))
                print(sweep_lines[-1], flush=True)
        row.append(str(info.get("splits", "?")))
        rows.append(row)
        del q, k, v, out
        torch.cuda.empty_cache()
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    for line in profile_lines + sweep_lines + compare_lines:
        print(line)
    print(f"read ceiling (sum of 4 GiB bf16, same run): {ceiling:.2f} TB/s; 95% = {0.95 * ceiling:.2f} TB/s")
    print("TB/s = K+V bytes / time; target: every flashcore cell >= cuDNN and >= 95% of the read bandwidth")
    print(target_verdict(rows, ceiling))


if __name__ == "__main__":
    main()

"""Decoding through flash_attn_varlen_func (one query token per sequence, as an engine batches its
sequences, or a few for speculative decoding): AUTO (which hands these calls to the decode kernel, api/kvcache_forward_view.hpp's
varlen_forward_as_kvcache), the forward kernels (the backend named), the same keys in pages of 16
and 256 through block_table (AUTO), the decode kernel on a dense copy of the keys
(flash_attn_with_kvcache) and SDPA cuDNN on that dense copy (unmasked: its causal mask is
top-left aligned). Every sequence has the same length, so the dense peers read the same bytes.
bf16, causal, device time per call under CUDA-graph replay, K+V bytes / time in TB/s.

    PYTHONPATH=<package>:bench python3 dev/varlen_decode_probe.py [--tokens 1,4] [--ragged]

--ragged adds, per shape, one batch of uneven lengths (uniform in [keys / 8, keys], the same total
bytes' order of magnitude; an engine's batch): AUTO against the forward kernels, packed K/V.
"""
import argparse
import warnings

import torch

import flashcore

from timing import graph_replay_us, sdpa_graph_replay_us  # bench/timing.py (PYTHONPATH=bench)

warnings.filterwarnings("ignore")

SHAPES = (  # batch, keys per sequence, heads q, heads kv, head dim
    (1, 65536, 32, 8, 128),
    (16, 8192, 32, 8, 128),
    (64, 2048, 32, 8, 128),
    (32, 2048, 16, 16, 64),
    (4, 8192, 16, 16, 256),
)


def paged(k, v, batch, keys, page):
    """k / v (batch x keys packed) as shuffled pages of `page` keys and their block table."""
    per_seq = keys // page
    perm = torch.randperm(batch * per_seq, device=k.device)
    table = perm.view(batch, per_seq).to(torch.int32)
    kp = torch.empty(batch * per_seq, page, *k.shape[1:], device=k.device, dtype=k.dtype)
    vp = torch.empty_like(kp)
    kp[perm] = k.view(batch * per_seq, page, *k.shape[1:])
    vp[perm] = v.view(batch * per_seq, page, *v.shape[1:])
    return kp, vp, table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4", help="query tokens per sequence")
    ap.add_argument("--ragged", action="store_true", help="also a batch of uneven lengths per shape")
    a = ap.parse_args()
    kernels = "cuda_sm90" if torch.cuda.get_device_capability() == (9, 0) else "cuda_sm80"
    print("bf16, causal, K+V TB/s (graph replay)")
    print(f"batch x tokens x keys, heads q/kv, d | varlen AUTO | varlen {kernels} | varlen paged 16 | "
          "varlen paged 256 | with_kvcache (dense) | SDPA cuDNN (dense)")
    for batch, keys, hq, hkv, d in SHAPES:
        k = torch.randn(batch * keys, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_bytes = 2 * k.numel() * k.element_size()
        rate = lambda us: kv_bytes / (us * 1e-6) / 1e12
        cu_k = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * keys
        pages = {page: paged(k, v, batch, keys, page) for page in (16, 256)}
        for tokens in (int(t) for t in a.tokens.split(",")):
            q = torch.randn(batch * tokens, hq, d, device="cuda", dtype=torch.bfloat16)
            cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * tokens
            varlen = lambda kk, vv, table=None: flashcore.flash_attn_varlen_func(
                q, kk, vv, cu_q, cu_k, tokens, keys, causal=True, block_table=table)
            row = []
            expected = varlen(k, v)
            for backend in ("auto", kernels):
                flashcore.set_default_backend(backend)
                row.append(rate(graph_replay_us(lambda: varlen(k, v), 50)))
            flashcore.set_default_backend("auto")
            for page, (kp, vp, table) in pages.items():
                err = (varlen(kp, vp, table).float() - expected.float()).abs().max().item()
                if err != 0:
                    print(f"  (paged {page}: max difference {err} from packed)")
                row.append(rate(graph_replay_us(lambda: varlen(kp, vp, table), 50)))
            kd, vd = k.view(batch, keys, hkv, d), v.view(batch, keys, hkv, d)
            qd = q.view(batch, tokens, hq, d)
            dense = flashcore.flash_attn_with_kvcache(qd, kd, vd, causal=True)
            if not (dense.view_as(expected) == expected).all():
                print("  (the varlen route and the KV-cache call differ)")
            row.append(rate(graph_replay_us(lambda: flashcore.flash_attn_with_kvcache(qd, kd, vd, causal=True), 50)))
            row.append(rate(sdpa_graph_replay_us(torch.nn.attention.SDPBackend.CUDNN_ATTENTION, qd, kd, vd)))
            print(f"{batch} x {tokens} x {keys}, {hq}/{hkv}, d{d} | " + " | ".join(f"{x:.2f}" for x in row),
                  flush=True)
        del pages
        if a.ragged and batch > 1:
            ragged(batch, keys, hq, hkv, d, kernels)


def ragged(batch, keys, hq, hkv, d, kernels):
    """One token per sequence, lengths uniform in [keys / 8, keys]: AUTO and the forward kernels."""
    gen = torch.Generator().manual_seed(batch * keys)
    lengths = torch.randint(keys // 8, keys + 1, (batch,), generator=gen)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32)
    cu_k[1:] = lengths.cumsum(0)
    cu_k = cu_k.cuda()
    total = int(cu_k[-1])
    k = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    rate = lambda us: 2 * k.numel() * k.element_size() / (us * 1e-6) / 1e12
    call = lambda: flashcore.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, int(lengths.max()), causal=True)
    row = []
    for backend in ("auto", kernels):
        flashcore.set_default_backend(backend)
        row.append(rate(graph_replay_us(call, 50)))
    flashcore.set_default_backend("auto")
    print(f"{batch} x 1 x ragged {keys // 8}..{keys} (mean {int(lengths.float().mean())}), {hq}/{hkv}, d{d} | "
          f"{row[0]:.2f} | {row[1]:.2f}", flush=True)


if __name__ == "__main__":
    main()

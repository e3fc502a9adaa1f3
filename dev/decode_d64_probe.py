"""Why the decode kernel reads d64 caches slower than d128 ones: the same bytes through
flash_attn_with_kvcache in three layouts, with SDPA cuDNN beside them.

- `heads inner`: the usual (batch, keys, heads_kv, 64) cache: one head's key row is 128 contiguous
  bytes, its next key 128 x heads_kv bytes further on.
- `heads outer`: the same logical tensor stored (batch, heads_kv, keys, 64) (strides permuted): one
  head's keys are one contiguous run.
- `head pairs`: the usual cache viewed as (batch, keys, heads_kv / 2, 128), the query heads of the
  two KV heads of a pair given block-diagonal 128-wide rows ([q, 0] and [0, q]): the d128 kernel's
  scores are the d64 ones exactly, and each head's output is its half of the d128 output. Checked
  against the plain call before it is timed.
bf16, one query token, device time per call under CUDA-graph replay, K+V bytes / time in TB/s.

    PYTHONPATH=<package>:bench python3 dev/decode_d64_probe.py
"""
import warnings

import torch

import flashcore

from timing import graph_replay_us, sdpa_graph_replay_us  # bench/timing.py (PYTHONPATH=bench)

warnings.filterwarnings("ignore")

SHAPES = (  # batch, keys, heads q, heads kv
    (32, 2048, 16, 16),
    (8, 8192, 32, 32),
    (16, 8192, 32, 8),
    (64, 2048, 32, 8),
    (1, 65536, 32, 8),
)


def pair_view(q, k, v, hq, hkv):
    """q', k', v' of the head-pair view (see the module docstring)."""
    b, s, _, d = k.shape
    group = hq // hkv
    kp = k.view(b, s, hkv // 2, 2 * d)
    vp = v.view(b, s, hkv // 2, 2 * d)
    qp = torch.zeros(q.shape[0], q.shape[1], hq, 2 * d, device=q.device, dtype=q.dtype)
    # query head h belongs to KV head h // group = 2 * pair + side.
    for h in range(hq):
        side = (h // group) % 2
        qp[:, :, h, side * d:(side + 1) * d] = q[:, :, h]
    return qp, kp, vp


def pair_out(op, hq, hkv, d):
    group = hq // hkv
    out = torch.empty(op.shape[0], op.shape[1], hq, d, device=op.device, dtype=op.dtype)
    for h in range(hq):
        side = (h // group) % 2
        out[:, :, h] = op[:, :, h, side * d:(side + 1) * d]
    return out


def main():
    d = 64
    scale = d ** -0.5
    print("batch x keys, heads q / kv (d64, 1 token) | heads inner | heads outer | head pairs (d128 kernel) | "
          "d128 same bytes | SDPA cuDNN")
    for batch, keys, hq, hkv in SHAPES:
        k = torch.randn(batch, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kv_bytes = 2 * k.numel() * k.element_size()
        rate = lambda us: kv_bytes / (us * 1e-6) / 1e12
        row = []
        ref = flashcore.flash_attn_with_kvcache(q, k, v, softmax_scale=scale)
        row.append(rate(graph_replay_us(lambda: flashcore.flash_attn_with_kvcache(q, k, v, softmax_scale=scale), 50)))
        ko = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        vo = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        row.append(rate(graph_replay_us(lambda: flashcore.flash_attn_with_kvcache(q, ko, vo, softmax_scale=scale), 50)))
        qp, kp, vp = pair_view(q, k, v, hq, hkv)
        got = pair_out(flashcore.flash_attn_with_kvcache(qp, kp, vp, softmax_scale=scale), hq, hkv, d)
        err = (got.float() - ref.float()).abs().max().item()
        row.append(rate(graph_replay_us(lambda: flashcore.flash_attn_with_kvcache(qp, kp, vp, softmax_scale=scale), 50)))
        k2 = torch.randn(batch, keys, hkv // 2, 2 * d, device="cuda", dtype=torch.bfloat16)
        v2 = torch.randn_like(k2)
        q2 = torch.randn(batch, 1, hq // 2 if hq == hkv else hq, 2 * d, device="cuda", dtype=torch.bfloat16)
        row.append(rate(graph_replay_us(lambda: flashcore.flash_attn_with_kvcache(q2, k2, v2), 50)))
        row.append(rate(sdpa_graph_replay_us(torch.nn.attention.SDPBackend.CUDNN_ATTENTION, q, k, v)))
        print(f"{batch} x {keys}, {hq} / {hkv} | " + " | ".join(f"{x:.2f}" for x in row) + f"   (pair max err {err:.2e})",
              flush=True)


if __name__ == "__main__":
    main()

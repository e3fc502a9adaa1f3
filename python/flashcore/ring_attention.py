"""Ring attention: exact attention over a sequence split across the ranks of a process group
(context parallelism), forward and backward, with torch.distributed point-to-point messages
(NCCL between GPUs, gloo between CPU processes).

Each rank holds one contiguous shard of the sequence: rank r of W has tokens
[r * L, (r + 1) * L) of q, k and v, every rank the same L. The K/V shards travel around the ring
(rank r sends to r + 1 and receives from r - 1); at each of the W steps a rank runs flashcore's
attention of its queries against the shard it holds and folds the partial result into its running
(out, lse) in fp32, the merge that flashcore.merge_partials exposes. The next shard is already in
flight while a step computes. With ``causal=True`` (queries and keys both split this way) a rank
skips the shards of later ranks and runs its own shard with the causal mask. The backward runs the
same ring: dq stays with its queries, while the dk / dv of a shard travel with it and reach their
owner after the last step; every step calls flashcore's backward with the final out and lse, which
is what makes the sum of the steps the exact gradient.

Under a causal mask the work is uneven (rank W - 1 computes W shards, rank 0 one): a layout that
gives every rank an early and a late chunk (zigzag) would balance it and is not implemented.

Usage (every rank calls it with its own shards and the same group):

    from flashcore.ring_attention import ring_flash_attn_func
    out = ring_flash_attn_func(q_shard, k_shard, v_shard, causal=True)   # autograd works
"""

import torch
import torch.distributed as dist

from ._dlpack_api import backend_id, resolve_scale
from ._torch import _backward_impl, _forward_impl, _last_dim_contiguous

__all__ = ["ring_flash_attn_func", "merge_into"]


def merge_into(out_acc, lse_acc, out, lse):
    """Folds a partial result over other keys, (out, lse), into the running fp32 (out_acc,
    lse_acc) in place. out (batch, seq, heads, dim), lse (batch, heads, seq). Rows without keys in
    both (lse = -inf) stay out = 0, lse = -inf."""
    new_lse = torch.logaddexp(lse_acc, lse)
    empty = torch.isneginf(new_lse)
    safe = torch.where(empty, torch.zeros_like(new_lse), new_lse)
    w_acc = torch.where(empty, torch.zeros_like(new_lse), torch.exp(lse_acc - safe))
    w_new = torch.where(empty, torch.zeros_like(new_lse), torch.exp(lse - safe))
    # (batch, heads, seq) weights -> (batch, seq, heads, 1) against out's layout
    out_acc.mul_(w_acc.transpose(1, 2).unsqueeze(-1)).add_(out.float() * w_new.transpose(1, 2).unsqueeze(-1))
    lse_acc.copy_(new_lse)


class _Ring:
    """This rank's neighbours in the group, and one ring step of messages."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group else (self.rank - 1) % self.world

    def shift(self, tensors):
        """Sends `tensors` to the next rank and receives the previous rank's into new buffers;
        returns (buffers, requests). Wait on the requests before reading the buffers or writing
        the sent tensors."""
        sent = [t.contiguous() for t in tensors]  # messages are dense buffers
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return received, (dist.batch_isend_irecv(ops), sent)


def _wait(requests):
    works, _sent = requests  # the sent buffers stay referenced until their sends complete
    for work in works:
        work.wait()


def _check(q, k, v, causal):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D torch tensor (batch, seqlen_shard, heads, head_dim)")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"k: shape {tuple(k.shape)} does not match q's {tuple(q.shape)} in batch or head_dim")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"k: a causal ring needs query and key shards of one length, got "
                         f"{q.shape[1]} and {k.shape[1]}")


def _ring_forward(q, k, v, ring, scale, causal, backend, deterministic):
    batch, seqlen, heads, dim = q.shape
    out_acc = torch.zeros(batch, seqlen, heads, dim, dtype=torch.float32, device=q.device)
    lse_acc = torch.full((batch, heads, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(ring.world):
        pending = ring.shift(kv) if step + 1 < ring.world else None
        source = (ring.rank - step) % ring.world
        if not causal or source <= ring.rank:
            out, lse = _forward_impl(q, kv[0], kv[1], None, None, 0, 0, scale, causal and source == ring.rank,
                                     -1, -1, 0.0, backend, deterministic)
            merge_into(out_acc, lse_acc, out, lse)
        if pending is not None:
            kv, requests = pending
            _wait(requests)
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(dout, q, k, v, out, lse, ring, scale, causal, backend, deterministic):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k, v)
    dkv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
           torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    for step in range(ring.world):
        # K / V do not change: the next shard is requested before this step computes. Its dk / dv
        # are complete only after the step, so they travel behind it.
        pending_kv = ring.shift(kv) if step + 1 < ring.world else None
        source = (ring.rank - step) % ring.world
        if not causal or source <= ring.rank:
            dq_s, dk_s, dv_s = _backward_impl(dout, q, kv[0], kv[1], out, lse, None, None, 0, 0, scale,
                                              causal and source == ring.rank, -1, -1, 0.0, backend, deterministic)
            dq.add_(dq_s.float())
            dkv[0].add_(dk_s.float())
            dkv[1].add_(dv_s.float())
        # After the last step this rank holds the shard of rank + 1: one more hop brings every
        # dk / dv home (alone, a rank keeps its own).
        if ring.world > 1:
            dkv, requests = ring.shift(dkv)
            _wait(requests)
        if pending_kv is not None:
            kv, requests = pending_kv
            _wait(requests)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale, causal, backend, deterministic):
        out, lse = _ring_forward(q, k, v, ring, scale, causal, backend, deterministic)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (ring, scale, causal, backend, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else _last_dim_contiguous(dout)
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None


def ring_flash_attn_func(q, k, v, group=None, softmax_scale=None, causal=False, deterministic=False,
                         return_lse=False, backend="auto"):
    """Exact attention over a sequence whose shards live on the ranks of `group` (default: the
    default process group), differentiable in q, k, v.

    q (batch, seqlen_shard, heads_q, head_dim) and k / v (batch, seqlen_shard_k, heads_kv,
    head_dim) are this rank's contiguous shards (rank r holds tokens r * seqlen_shard ...); every
    rank must pass shards of the same shapes. GQA / MQA as in flash_attn_func. ``causal`` masks
    across the whole sequence (query and key shards of one length). Returns this rank's out
    (the shape and dtype of q), and with ``return_lse`` also its lse (batch, heads_q,
    seqlen_shard) in float32 over the whole sequence's keys. Softcap and sliding windows are not
    supported here."""
    if not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized (init_process_group first)")
    _check(q, k, v, causal)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    ring = _Ring(group)
    out, lse = _RingAttention.apply(q, k, v, ring, resolve_scale(softmax_scale), bool(causal),
                                    backend_id(backend), bool(deterministic))
    return (out, lse) if return_lse else out

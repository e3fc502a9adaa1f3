"""Ring attention: exact attention over a sequence split across the ranks of a process group
(context parallelism), forward and backward, with torch.distributed point-to-point messages
(NCCL between GPUs, gloo between CPU processes).

Each rank holds a shard of the sequence, every rank the same length L: contiguous (rank r of W
has tokens [r * L, (r + 1) * L)) or zigzag (chunks r and 2W - 1 - r of 2W, zigzag_shard). The
K/V shards travel around the ring (rank r sends to r + 1 and receives from r - 1); at each of the
W steps a rank runs flashcore's attention of its queries against the shard it holds and folds the
partial result into its running (out, lse) in fp32, the merge that flashcore.merge_partials
exposes. The next shard is already in flight while a step computes. Under a causal mask a step
computes only the blocks the mask leaves visible (_step_blocks): with contiguous shards rank
W - 1 computes W shards' worth and rank 0 one, with zigzag shards every rank the same. The
backward runs the same ring: dq stays with its queries, while the dk / dv of a shard travel with
it and reach their owner after the last step; every step calls flashcore's backward with the
final out and lse, which is what makes the sum of the steps the exact gradient.

Usage (every rank calls it with its own shards and the same group):

    from flashcore.ring_attention import ring_flash_attn_func, zigzag_shard
    q_shard, k_shard, v_shard = (zigzag_shard(x, rank, world) for x in (q, k, v))
    out = ring_flash_attn_func(q_shard, k_shard, v_shard, causal=True, layout="zigzag")  # autograd works
"""

import numbers

import torch
import torch.distributed as dist

from ._dlpack_api import backend_id, resolve_scale
from ._torch import _backward_impl, _forward_impl, _last_dim_contiguous

__all__ = ["ring_flash_attn_func", "merge_into", "zigzag_shard", "zigzag_unshard"]


def merge_into(out_acc, lse_acc, out, lse):
    """Folds a partial result over other keys, (out, lse), into the running fp32 (out_acc,
    lse_acc) in place. out (batch, seq, heads, dim), lse (batch, heads, seq). Rows without keys in
    both (lse = -inf) stay out = 0, lse = -inf."""
    new_lse = torch.logaddexp(lse_acc, lse)
    # The weights exp(lse_acc - new_lse) and w = exp(lse - new_lse) sum to 1, so the merge is one
    # lerp of the rows towards out (half the memory traffic of scaling both and adding); w = 0 where
    # neither side saw keys, and a NaN lse stays NaN.
    w = torch.exp(lse - new_lse).masked_fill_(torch.isneginf(new_lse), 0.0)
    # (batch, heads, seq) weights -> (batch, seq, heads, 1) against out's layout
    out_acc.lerp_(out.float(), w.transpose(1, 2).unsqueeze(-1))
    lse_acc.copy_(new_lse)


class _Ring:
    """This rank's neighbours in the group, and one ring step of messages."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # P2P messages address global ranks
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = peer((self.rank + 1) % self.world)
        self.prev = peer((self.rank - 1) % self.world)

    def shift(self, tensors):
        """Sends `tensors` to the next rank and receives the previous rank's into new buffers;
        returns (buffers, requests). Wait on the requests before reading the buffers or writing
        the sent tensors."""
        sent, received = _message_buffers(tensors)
        return self._start(sent, received)

    def _start(self, sent, received):
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return received, (dist.batch_isend_irecv(ops), sent)

    def shift_after_next_launch(self, tensors):
        """shift(tensors), ready now and started by the returned function, which the caller calls
        right after launching the step's first attention: on a GPU torch.distributed holds the host
        ~0.3 ms launching the messages, and launched first they left the GPU idle for that time
        (docs/PERF.md, session 41). The messages run on a side stream
        that has waited for everything before the attention (torch makes a message's stream wait
        for the stream it is launched from, so launched from the compute stream they would wait for
        the attention too)."""
        if not tensors[0].is_cuda:  # CPU attention blocks the host: the messages go first
            pending = self.shift(tensors)
            return lambda: pending
        side = _side_stream(tensors[0].device)
        sent, received = _message_buffers(tensors)  # on the compute stream, which reads `received`
        # the messages' inputs are ready there, the attention not yet launched
        side.wait_stream(torch.cuda.current_stream(tensors[0].device))

        def launch():
            with torch.cuda.stream(side):
                return self._start(sent, received)

        return launch


def _message_buffers(tensors):
    """The dense buffers a shift sends, and new ones of their shapes to receive into."""
    sent = [t.contiguous() for t in tensors]
    return sent, [torch.empty_like(t) for t in sent]


_SIDE_STREAMS = {}


def _side_stream(device):
    """One stream per device for the ring's messages, created once."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def _wait(requests):
    works, _sent = requests  # the sent buffers stay referenced until their sends complete
    for work in works:
        work.wait()


NO_WINDOW = (-1, -1)  # window_size's "unbounded on both sides"


def _check(q, k, v, causal, layout="contiguous", window=NO_WINDOW, softcap=0.0):
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
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout: expected 'contiguous' or 'zigzag', got {layout!r}")
    if layout == "zigzag" and (q.shape[1] != k.shape[1] or q.shape[1] % 2 != 0):
        raise ValueError(f"layout: zigzag needs query and key shards of one even length, got "
                         f"{q.shape[1]} and {k.shape[1]}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2 or
            any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1 for w in window)):
        raise ValueError(f"window_size: expected (left, right) ints >= -1 (-1: unbounded), got {window!r}")
    if tuple(window) != NO_WINDOW and q.shape[1] != k.shape[1]:
        raise ValueError(f"k: a ring with a sliding window needs query and key shards of one length, got "
                         f"{q.shape[1]} and {k.shape[1]}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 <= softcap < float("inf"):
        raise ValueError(f"softcap: expected a finite float >= 0 (0: none), got {softcap!r}")


def _step_blocks(layout, causal, rank, source, q_len, k_len):
    """What one step computes without a window: [(query rows, key rows, causal, NO_WINDOW)] of
    this rank's shard against the shard of rank `source`. Zigzag shards are chunks (rank, 2W - 1 - rank) of 2W: against an
    earlier rank's shard only its first chunk is visible (to every query), against a later one
    only the late query chunk sees anything (all of it), and the own shard is causal as one
    sequence; so every step but the first costs the same on every rank."""
    everything = slice(None)
    if not causal:
        return [(everything, everything, False, NO_WINDOW)]
    if source == rank:
        return [(everything, everything, True, NO_WINDOW)]
    if layout == "contiguous":
        return [(everything, everything, False, NO_WINDOW)] if source < rank else []
    if source < rank:
        return [(everything, slice(0, k_len // 2), False, NO_WINDOW)]
    return [(slice(q_len // 2, None), everything, False, NO_WINDOW)]


def _segments(layout, rank, world, length):
    """A shard's runs of consecutive tokens: [(first local row, first global position, length)]."""
    if layout == "contiguous":
        return [(0, rank * length, length)]
    chunk = length // 2
    return [(0, rank * chunk, chunk), (chunk, (2 * world - 1 - rank) * chunk, chunk)]


def _window_blocks(layout, rank, source, world, length, window):
    """_step_blocks for a ring with a sliding window (causal included as its right side 0), where
    the shard-local mask is not the global one: [(query rows, key rows, False, (left, right))] per
    pair of runs of consecutive tokens that sees anything. Global: key position - query position
    in [-left, right]. A run pair trimmed to the rows that see some key and the keys some row sees
    has the window (left + e, right - e) in the kernel's bottom-right-aligned mask, e = the key
    run's end - the query run's end (both >= 0 after the trim; -1 stays unbounded)."""
    INF = float("inf")
    # A side as long as the whole sequence masks nothing: unbounded (the kernel window, side + e with
    # |e| up to the sequence, then stays far inside the C ABI's int32).
    left, right = (INF if w < 0 or w >= world * length else w for w in window)
    blocks = []
    for q_row, q0, q_len in _segments(layout, rank, world, length):
        for k_row, k0, k_len in _segments(layout, source, world, length):
            q1, k1 = q0 + q_len, k0 + k_len
            # keys no query sees, queries that see no key (before either trim: the two are independent)
            ks, ke = max(k0, q0 - left), min(k1, q1 + right)
            qs, qe = max(q0, k0 - right), min(q1, k1 + left)
            if ks >= ke or qs >= qe:
                continue
            e = ke - qe
            kernel_window = (-1 if left == INF else int(left + e), -1 if right == INF else int(right - e))
            rows = slice(q_row + int(qs - q0), q_row + int(qe - q0))
            keys = slice(k_row + int(ks - k0), k_row + int(ke - k0))
            blocks.append((rows, keys, False, kernel_window))
    return blocks


def _blocks(layout, causal, window, rank, source, world, q_len, k_len):
    """What a step computes, [(query rows, key rows, causal, (window left, right))]; window is the
    (left, right) tuple ring_flash_attn_func normalized."""
    if window == NO_WINDOW:
        return _step_blocks(layout, causal, rank, source, q_len, k_len)
    return _window_blocks(layout, rank, source, world, q_len, (window[0], 0 if causal else window[1]))


def _ring_forward(q, k, v, ring, scale, causal, layout, backend, deterministic, sm_margin, window, softcap):
    out_acc = lse_acc = None
    if window != NO_WINDOW:  # the steps' blocks need not cover every row: start from "no keys"
        out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32,
                             device=q.device)
    kv = (k, v)
    for step in range(ring.world):
        launch = ring.shift_after_next_launch(kv) if step + 1 < ring.world else None
        pending = None
        source = (ring.rank - step) % ring.world
        for rows, keys, block_causal, (left, right) in _blocks(layout, causal, window, ring.rank, source, ring.world,
                                                               q.shape[1], k.shape[1]):
            out, lse = _forward_impl(q[:, rows], kv[0][:, keys], kv[1][:, keys], None, None, None, 0, 0, scale,
                                     block_causal, left, right, softcap, backend, deterministic,
                                     sm_margin=sm_margin)
            if launch is not None and pending is None:
                pending = launch()
            if out_acc is None:  # the first step (the own shard) covers every row: nothing to merge with
                out_acc, lse_acc = out.float(), lse
            else:
                merge_into(out_acc[:, rows], lse_acc[:, :, rows], out, lse)
        if launch is not None and pending is None:  # a step without visible blocks
            pending = launch()
        if pending is not None:
            kv, requests = pending
            _wait(requests)
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(dout, q, k, v, out, lse, ring, scale, causal, layout, backend, deterministic, sm_margin,
                   window, softcap):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k, v)
    dkv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
           torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    for step in range(ring.world):
        # K / V do not change: the next shard travels while this step computes (sent once its
        # first backward is launched). Its dk / dv are complete only after the step, so they travel
        # behind it.
        launch_kv = ring.shift_after_next_launch(kv) if step + 1 < ring.world else None
        pending_kv = None
        source = (ring.rank - step) % ring.world
        for rows, keys, block_causal, (left, right) in _blocks(layout, causal, window, ring.rank, source,
                                                               ring.world, q.shape[1], k.shape[1]):
            dq_s, dk_s, dv_s = _backward_impl(dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys],
                                              out[:, rows], lse[:, :, rows].contiguous(), None, None, None, 0, 0,
                                              scale, block_causal, left, right, softcap, backend, deterministic,
                                              sm_margin=sm_margin)
            if launch_kv is not None and pending_kv is None:
                pending_kv = launch_kv()
            dq[:, rows] += dq_s.float()
            dkv[0][:, keys] += dk_s.float()
            dkv[1][:, keys] += dv_s.float()
        if launch_kv is not None and pending_kv is None:  # a step without visible blocks
            pending_kv = launch_kv()
        # After the last step this rank holds the shard of rank + 1: one more hop brings every
        # dk / dv home (alone, a rank keeps its own).
        if ring.world > 1:
            dkv, requests = ring.shift(dkv)
            _wait(requests)
        if pending_kv is not None:
            kv, requests = pending_kv
            _wait(requests)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


# SMs each attention call of a GPU ring leaves to the NCCL kernel moving the next shard (see
# ring_flash_attn_func's sm_margin). Margins of 8-32 measured no faster with the messages launched
# before the attention (docs/PERF.md, session 41), nor 8-16 with them running under it (session 42).
DEFAULT_SM_MARGIN = 0


def _check_sm_margin(sm_margin):
    if sm_margin is not None and (isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or
                                  not 0 <= sm_margin < 2**31):
        raise ValueError(f"sm_margin: expected an int in [0, 2^31) or None, got {sm_margin!r}")


def _sm_margin(sm_margin, q, ring):
    if sm_margin is None:
        return DEFAULT_SM_MARGIN if q.is_cuda and ring.world > 1 else 0
    return sm_margin


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale, causal, layout, backend, deterministic, sm_margin, window, softcap):
        out, lse = _ring_forward(q, k, v, ring, scale, causal, layout, backend, deterministic, sm_margin, window,
                                 softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (ring, scale, causal, layout, backend, deterministic, sm_margin, window, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else _last_dim_contiguous(dout)
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.settings)
        return (dq, dk, dv) + (None,) * len(ctx.settings)


def zigzag_shard(x, rank, world, dim=1):
    """Rank `rank`'s shard of x's sequence dimension in the zigzag layout: chunks rank and
    2 * world - 1 - rank of 2 * world equal chunks (the length must divide by 2 * world)."""
    if x.shape[dim] % (2 * world) != 0:
        raise ValueError(f"x: sequence length {x.shape[dim]} is not a multiple of 2 * world = {2 * world}")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards, dim=1):
    """The whole sequence from every rank's zigzag shard, in rank order (zigzag_shard's inverse)."""
    world = len(shards)
    halves = [shard.chunk(2, dim=dim) for shard in shards]
    return torch.cat([halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))], dim=dim)


def ring_flash_attn_func(q, k, v, group=None, softmax_scale=None, causal=False, deterministic=False,
                         return_lse=False, layout="contiguous", backend="auto", sm_margin=None,
                         window_size=(-1, -1), softcap=0.0):
    """Exact attention over a sequence whose shards live on the ranks of `group` (default: the
    default process group), differentiable in q, k, v.

    q (batch, seqlen_shard, heads_q, head_dim) and k / v (batch, seqlen_shard_k, heads_kv,
    head_dim) are this rank's shards; every rank must pass shards of the same shapes. With
    ``layout="contiguous"`` rank r holds tokens [r * seqlen_shard, (r + 1) * seqlen_shard);
    with ``layout="zigzag"`` it holds zigzag_shard(sequence, r, world) (two chunks, one early
    and one late), which gives every rank the same work under a causal mask. GQA / MQA as in
    flash_attn_func. ``causal`` masks across the whole sequence (query and key shards of one
    length). Returns this rank's out (the shape and dtype of q), and with ``return_lse`` also its
    lse (batch, heads_q, seqlen_shard) in float32 over the whole sequence's keys.
    ``window_size`` (left, right) and ``softcap`` as in flash_attn_func, over the whole sequence
    (a window needs query and key shards of one length; with ``causal`` its right side is 0): a
    step computes only the runs of tokens the window leaves visible, so a window shorter than a
    shard skips most steps' work. ALiBi is not supported here. ``sm_margin``: SMs each attention call
    leaves free for the communication running beside it (fc_attention_options.sm_margin; the
    Hopper kernels' grids hold one CTA per SM, and one that waits for an SM the NCCL kernel holds
    delays the whole call); None = DEFAULT_SM_MARGIN on GPUs with more than one rank, else 0."""
    _check_sm_margin(sm_margin)
    if not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized (init_process_group first)")
    _check(q, k, v, causal, layout, window_size, softcap)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    ring = _Ring(group)
    out, lse = _RingAttention.apply(q, k, v, ring, resolve_scale(softmax_scale), bool(causal), layout,
                                    backend_id(backend), bool(deterministic), _sm_margin(sm_margin, q, ring),
                                    tuple(int(w) for w in window_size), float(softcap))
    return (out, lse) if return_lse else out

"""Ring attention (flashcore.ring_attention) across processes: every rank's out, lse and
gradients against float64 torch math over the whole sequence.

CPU processes talk through gloo (any machine with torch); with as many CUDA devices as ranks the
same checks run on GPUs through NCCL. Skipped when torch is not installed (CI). float32 results
must be within a relative error of 1e-5 (TESTING.md); bf16 on the GPU is compared with flashcore's
own single-device call on the whole sequence (itself checked against the references elsewhere).
"""

import os
import queue
import socket
import threading

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

from attention_reference import allowed_keys  # noqa: E402  (the mask rule of every Python test)

FP32_RELATIVE_TOLERANCE = 1e-5
BF16_RELATIVE_TOLERANCE = 2e-2  # ring vs one call: merges in fp32, rounding of out once either way


def reference(q, k, v, causal, window=(-1, -1), softcap=0.0):
    """float64 dense attention over the whole sequence, differentiable; (out, lse). window
    (left, right) over positions of one sequence (query and key lengths equal), -1 unbounded;
    causal sets its right side to 0."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.double() for x in (q, k, v))
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    hidden = ~torch.from_numpy(allowed_keys(q.shape[1], k.shape[1], causal, window))
    if hidden.any():
        s = s.masked_fill(hidden.to(s.device), -1e30)
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v), torch.logsumexp(s, dim=-1)


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


# (causal, heads_q, heads_kv, shard length, head_dim, layout[, window_size, softcap])
CASES = [(False, 4, 4, 24, 32, "contiguous"), (True, 4, 4, 24, 32, "contiguous"), (True, 6, 2, 17, 64, "contiguous"),
         (False, 2, 1, 9, 64, "contiguous"), (True, 4, 4, 24, 32, "zigzag"), (True, 6, 2, 18, 64, "zigzag"),
         (False, 4, 2, 10, 32, "zigzag")]
# Sliding windows (shorter and longer than a shard, one-sided and two-sided, the diagonal and one
# key ahead, one side past int32 once shifted) and softcap: a window's steps compute trimmed runs of
# tokens whose local window differs from the global one.
WINDOW_CASES = [(True, 4, 4, 24, 32, "contiguous", (10, -1), 0.0), (True, 6, 2, 18, 64, "zigzag", (20, 0), 5.0),
                (False, 4, 2, 10, 32, "zigzag", (7, 3), 0.0), (False, 4, 4, 24, 32, "contiguous", (30, 50), 2.0),
                (True, 4, 4, 24, 32, "contiguous", (-1, -1), 3.0), (False, 2, 1, 9, 64, "contiguous", (0, 1), 0.0),
                (False, 4, 2, 12, 32, "zigzag", (-1, 4), 0.0), (True, 4, 4, 24, 32, "zigzag", (2**31 - 5, -1), 0.0)]


def expand(case):
    """A case with its window_size and softcap (none by default)."""
    return tuple(case) + ((-1, -1), 0.0)[len(case) - 6:]


def shard_of(x, rank, world, shard, layout, dim=1):
    """Rank `rank`'s shard of x's sequence dimension `dim` in the given layout."""
    from flashcore.ring_attention import zigzag_shard

    if layout == "zigzag":
        return zigzag_shard(x, rank, world, dim=dim)
    return x.narrow(dim, rank * shard, shard)


def _check_rank(rank, world, device, dtype, group=None, cases=CASES + WINDOW_CASES):
    from flashcore.ring_attention import ring_flash_attn_func

    import flashcore

    for causal, heads_q, heads_kv, shard, dim, layout, window, softcap in map(expand, cases):
        gen = torch.Generator().manual_seed(1000 + shard)  # the same tensors on every rank
        make = lambda heads: torch.randn(2, world * shard, heads, dim, generator=gen)
        q, k, v = make(heads_q), make(heads_kv), make(heads_kv)
        dout = torch.randn(q.shape, generator=gen)
        mine = lambda x, dim=1: shard_of(x, rank, world, shard, layout, dim)
        local = [mine(x).to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
        out, lse = ring_flash_attn_func(*local, group=group, causal=causal, return_lse=True, layout=layout,
                                        window_size=window, softcap=softcap)
        out.backward(mine(dout).to(device=device, dtype=dtype))
        what = (f"rank {rank}/{world} {layout} causal={causal} heads {heads_q}/{heads_kv} shard {shard} d {dim} "
                f"window {window} softcap {softcap}")
        if dtype == torch.float32:
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            ref_out, ref_lse = reference(*full, causal, window, softcap)
            ref_grads = torch.autograd.grad(ref_out, full, dout.double())
            checks = [("out", out, mine(ref_out)), ("lse", lse, mine(ref_lse, 2))]
            checks += [(name, t.grad, mine(g)) for name, t, g in zip(("dq", "dk", "dv"), local, ref_grads)]
            tolerance = FP32_RELATIVE_TOLERANCE
        else:
            full = [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
            ref_out = flashcore.flash_attn_func(*full, causal=causal, window_size=window, softcap=softcap)
            ref_grads = torch.autograd.grad(ref_out, full, dout.to(device=device, dtype=dtype))
            checks = [("out", out, mine(ref_out))]
            checks += [(name, t.grad, mine(g)) for name, t, g in zip(("dq", "dk", "dv"), local, ref_grads)]
            tolerance = BF16_RELATIVE_TOLERANCE
        for name, got, want in checks:
            assert got.shape == want.shape, f"{what}: {name} shape {tuple(got.shape)}, want {tuple(want.shape)}"
            err = relative_error(got.cpu(), want.cpu())
            assert err <= tolerance, f"{what}: {name} relative error {err:.3g} > {tolerance}"


def _worker(rank, world, port, backend, dtype_name):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        _check_rank(rank, world, device, getattr(torch, dtype_name))
        if world == 3:  # a ring over a subgroup: global ranks 1 and 2 are its ranks 0 and 1
            subgroup = dist.new_group([1, 2])
            if rank > 0:
                _check_rank(rank - 1, 2, device, getattr(torch, dtype_name), subgroup, CASES[1::4])
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ring_over_gloo_matches_float64_math(world):
    mp.spawn(_worker, args=(world, _free_port(), "gloo", "float32"), nprocs=world, join=True)


@pytest.mark.parametrize("dtype_name", ["bfloat16"])
def test_ring_over_nccl_matches_one_device(dtype_name):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs two CUDA devices and NCCL")
    world = torch.cuda.device_count()
    mp.spawn(_worker, args=(world, _free_port(), "nccl", dtype_name), nprocs=world, join=True)


class ThreadRing:
    """The ring's message passing between threads of one process (ranks as threads), so that the
    algorithm runs on one device: on a single GPU, the CUDA kernels and merges of every rank."""

    def __init__(self, rank, world, mailboxes):
        self.rank, self.world, self.mailboxes = rank, world, mailboxes

    def shift(self, tensors):
        self.mailboxes[(self.rank + 1) % self.world].put([t.clone() for t in tensors])
        return self.mailboxes[self.rank].get(timeout=60), ([], None)

    def shift_after_next_launch(self, tensors):
        return lambda: self.shift(tensors)


def _thread_ring(world, shards, dout, causal, layout, window=(-1, -1), softcap=0.0):
    """Runs every rank's forward and backward as threads; returns [(out, lse, dq, dk, dv)]."""
    from flashcore import ring_attention
    from flashcore._dlpack_api import backend_id

    mailboxes = [queue.Queue() for _ in range(world)]
    results, errors = [None] * world, []

    def rank_body(r):
        try:
            ring = ThreadRing(r, world, mailboxes)
            q, k, v = shards[r]
            # a GPU ring's calls leave SMs to its messages (sm_margin); the results must not change
            margin = 7 if q.is_cuda else 0
            settings = (0.0, causal, layout, backend_id("auto"), False, margin)
            out, lse = ring_attention._ring_forward(q, k, v, ring, *settings, window, softcap)
            results[r] = (out, lse) + ring_attention._ring_backward(dout[r], q, k, v, out, lse, ring, *settings,
                                                                   window, softcap)
        except Exception as e:  # re-raised by the caller
            errors.append(e)

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("world", [2, 3])
def test_ring_steps_in_threads(device, world):
    # float32 against float64 math on the CPU; bf16 against one flashcore call on the whole
    # sequence on a GPU (where several processes would need several GPUs).
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import flashcore

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    from flashcore.ring_attention import zigzag_unshard

    extra = [(True, 8, 2, 130, 128, "zigzag"), (True, 8, 2, 130, 128, "zigzag", (100, 0), 10.0)]
    for causal, heads_q, heads_kv, shard, dim, layout, window, softcap in map(expand, CASES + WINDOW_CASES + extra):
        gen = torch.Generator().manual_seed(2000 + shard)
        make = lambda heads: torch.randn(2, world * shard, heads, dim, generator=gen)
        q, k, v = make(heads_q), make(heads_kv), make(heads_kv)
        dout = torch.randn(q.shape, generator=gen)
        cut = lambda x, r: shard_of(x, r, world, shard, layout).to(device=device, dtype=dtype)
        shards = [tuple(cut(x, r) for x in (q, k, v)) for r in range(world)]
        results = _thread_ring(world, shards, [cut(dout, r) for r in range(world)], causal, layout, window, softcap)
        whole = zigzag_unshard if layout == "zigzag" else (lambda parts, dim: torch.cat(parts, dim=dim))
        got = [whole([res[i].float().cpu() for res in results], dim=2 if i == 1 else 1) for i in range(5)]
        if dtype == torch.float32:
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            ref_out, ref_lse = reference(*full, causal, window, softcap)
            want = [ref_out, ref_lse, *torch.autograd.grad(ref_out, full, dout.double())]
            tolerance = FP32_RELATIVE_TOLERANCE
        else:
            full = [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
            ref_out, ref_lse = flashcore.flash_attn_func(*full, causal=causal, window_size=window, softcap=softcap,
                                                         return_attn_probs=True)[:2]
            want = [ref_out, ref_lse, *torch.autograd.grad(ref_out, full, dout.to(device=device, dtype=dtype))]
            tolerance = BF16_RELATIVE_TOLERANCE
        what = (f"{world} threads on {device}, {layout} causal={causal} heads {heads_q}/{heads_kv} shard {shard} d {dim} "
                f"window {window} softcap {softcap}")
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            err = relative_error(g, w.cpu())
            assert err <= tolerance, f"{what}: {name} relative error {err:.3g} > {tolerance}"


def test_zigzag_shards_round_trip():
    from flashcore.ring_attention import zigzag_shard, zigzag_unshard

    x = torch.arange(2 * 12 * 3).reshape(2, 12, 3)
    shards = [zigzag_shard(x, r, 3) for r in range(3)]
    assert shards[0][0, :, 0].tolist() == [0, 3, 30, 33]  # chunks 0 and 5 of 6 (rows 0-1, 10-11)
    assert torch.equal(zigzag_unshard(shards), x)


def test_errors_name_the_argument():
    from flashcore.ring_attention import _check, ring_flash_attn_func

    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="^group: torch.distributed is not initialized"):
            ring_flash_attn_func(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8))

    for bad in (-1, 2.5, True, 2**31):
        with pytest.raises(ValueError, match=r"^sm_margin: expected an int in \[0, 2\^31\) or None"):
            ring_flash_attn_func(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8),
                                 sm_margin=bad)
    with pytest.raises(ValueError, match="^k: a causal ring"):
        _check(torch.zeros(1, 4, 2, 8), torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8), True)
    with pytest.raises(ValueError, match="^layout: zigzag needs"):
        _check(torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8), True, "zigzag")
    with pytest.raises(ValueError, match="^layout: expected"):
        _check(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), True, "striped")
    with pytest.raises(ValueError, match=r"^window_size: expected \(left, right\) ints >= -1"):
        _check(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), False, window=(-2, 0))
    with pytest.raises(ValueError, match="^k: a ring with a sliding window needs"):
        _check(torch.zeros(1, 4, 2, 8), torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8), False, window=(3, 3))
    for bad in (-1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="^softcap: expected a finite float"):
            _check(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), False, softcap=bad)
    with pytest.raises(ValueError, match="^v: shape"):
        _check(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 1, 8), False)

"""flashcore with torch CUDA tensors on a GPU other than the current one (multi-GPU processes).

Every entry point must run on its tensors' device and on that device's current stream, whichever
device is current, and leave the current device as it was. Each call runs on cuda:0 and on cuda:1
(cuda:0 current) with the same inputs: the GPUs are one model here, so the results must be the
same bits (the forward, the merge and the deterministic backward are run-to-run exact; the
references elsewhere check those results' accuracy). Skipped with fewer than two CUDA devices.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import flashcore  # noqa: E402

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)
if flashcore.cuda_device_count() < 2 or not any(
    flashcore.backend_available(name) for name in ("cuda_sm80", "cuda_sm90")
):
    pytest.skip("flashcore was built without a CUDA backend for these GPUs", allow_module_level=True)

SAME_MODEL = torch.cuda.get_device_properties(0).name == torch.cuda.get_device_properties(1).name


@pytest.fixture(autouse=True)
def current_device_zero():
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    yield
    torch.cuda.set_device(0)


def on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def assert_same(got, expected, name):
    """got (on cuda:1) against expected (cuda:0): the same bits on one GPU model."""
    assert got.device == torch.device("cuda:1"), f"{name}: on {got.device}"
    got, expected = got.cpu(), expected.cpu()
    if SAME_MODEL:
        assert torch.equal(got, expected), f"{name}: cuda:1 differs from cuda:0"
    else:
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2, msg=name)


def run_both(fn, *tensors):
    """fn on copies of tensors on cuda:0, then on cuda:1 with cuda:0 current."""
    expected = fn(*on("cuda:0", *tensors))
    torch.cuda.synchronize(0)
    got = fn(*on("cuda:1", *tensors))
    assert torch.cuda.current_device() == 0, "the call changed the current device"
    torch.cuda.synchronize(1)
    return got, expected


@pytest.mark.parametrize("case", [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal)
    (2, 333, 333, 8, 2, 128, True),
    (1, 1024, 1024, 4, 4, 64, False),
    (2, 129, 517, 4, 1, 256, True),
    (4, 1, 4096, 32, 8, 128, False),  # AUTO's decode route (one token per sequence)
])
def test_forward_backward_on_the_tensors_device(case):
    batch, sq, sk, hq, hkv, d, causal = case
    q = torch.randn(batch, sq, hq, d, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, sk, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)

    def call(q, k, v, dout):
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out, lse, _ = flashcore.flash_attn_func(q, k, v, causal=causal, deterministic=True,
                                                return_attn_probs=True)
        return (out, lse) + torch.autograd.grad(out, (q, k, v), dout)

    got, expected = run_both(call, q, k, v, dout)
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert not torch.isnan(g).any(), f"{name}: NaN"
        assert_same(g, e, name)


def test_varlen_forward_backward_on_the_tensors_device():
    lengths = [37, 500, 1, 260]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, 4, 128, dtype=torch.float16) for _ in range(3))
    dout = torch.randn_like(q)

    def call(q, k, v, dout, cu):
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = flashcore.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                               causal=True, deterministic=True)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    got, expected = run_both(call, q, k, v, dout, cu)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        assert_same(g, e, name)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_with_append_on_the_tensors_device(paged):
    """Decode with split-KV (one long sequence) and two new tokens appended in place: out, lse and
    the caches on cuda:1 as on cuda:0."""
    batch, capacity, heads_q, heads_kv, d, page = 2, 8192, 16, 4, 128, 256
    lengths = torch.tensor([8000, 1500], dtype=torch.int32)
    q = torch.randn(batch, 2, heads_q, d, dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(batch, 2, heads_kv, d, dtype=torch.bfloat16) for _ in range(2))
    if paged:
        pages = batch * capacity // page
        k_cache, v_cache = (torch.randn(pages, page, heads_kv, d, dtype=torch.bfloat16) for _ in range(2))
        table = torch.randperm(pages, dtype=torch.int32).reshape(batch, -1)
    else:
        k_cache, v_cache = (torch.randn(batch, capacity, heads_kv, d, dtype=torch.bfloat16) for _ in range(2))
        table = None

    def call(q, k_cache, v_cache, k_new, v_new, lengths, table):
        out, lse = flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                                     block_table=table, causal=True, return_softmax_lse=True)
        return out, lse, k_cache, v_cache

    got, expected = run_both(call, q, k_cache, v_cache, k_new, v_new, lengths, table)
    for name, g, e in zip(("out", "lse", "k_cache", "v_cache"), got, expected):
        assert not torch.isnan(g).any(), f"{name}: NaN"
        assert_same(g, e, name)


def test_merge_partials_on_the_tensors_device():
    parts, batch, sq, heads, d = 20, 2, 3, 8, 128
    out_parts = torch.randn(parts, batch, sq, heads, d)
    lse_parts = torch.randn(parts, batch, heads, sq)
    lse_parts[3] = float("-inf")  # a part that saw no keys
    got, expected = run_both(lambda o, l: flashcore.merge_partials(o, l), out_parts, lse_parts)
    for name, g, e in zip(("out", "lse"), got, expected):
        assert_same(g, e, name)


def test_runs_on_the_tensors_devices_current_stream():
    """With a side stream current on cuda:1, the call is ordered on it: the inputs written on that
    stream just before are the ones read (no device-wide synchronization in between)."""
    q, k, v = (torch.randn(2, 512, 8, 64, dtype=torch.float16) for _ in range(3))
    expected = flashcore.flash_attn_func(*on("cuda:0", q, k, v), causal=True)
    q1, k1, v1 = (torch.zeros(2, 512, 8, 64, dtype=torch.float16, device="cuda:1") for _ in range(3))
    torch.cuda.synchronize(1)
    side = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.stream(side):
        for dst, src in zip((q1, k1, v1), (q, k, v)):
            torch.cuda._sleep(1_000_000)  # the copies land late unless the call waits for them
            dst.copy_(src.pin_memory(), non_blocking=True)
        got = flashcore.flash_attn_func(q1, k1, v1, causal=True)
    side.synchronize()
    assert torch.cuda.current_device() == 0
    assert_same(got, expected, "out")


def test_tensors_on_two_devices_are_refused():
    q = torch.randn(1, 64, 4, 64, dtype=torch.float16, device="cuda:0")
    k = torch.randn(1, 64, 4, 64, dtype=torch.float16, device="cuda:1")
    v = torch.randn(1, 64, 4, 64, dtype=torch.float16, device="cuda:0")
    with pytest.raises(ValueError, match=r"^k: is on cuda:1 but q is on cuda:0"):
        flashcore.flash_attn_func(q, k, v)

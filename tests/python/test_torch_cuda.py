"""flashcore with PyTorch CUDA tensors: the seed example, accuracy against torch math, CUDA
graphs, streams and torch.compile. Skipped without torch, a GPU, or flashcore's CUDA backend.

Accuracy follows TESTING.md: against an fp64 torch-math reference, the error must stay within
2x (forward) / 3x (gradients) the error of plain torch math run in the input dtype, plus the
rounding of one add at the reference's magnitude.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import flashcore  # noqa: E402
import flashcore as flash_attn  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)
if flashcore.cuda_device_count() == 0 or not any(
    flashcore.backend_available(name) for name in ("cuda_sm80", "cuda_sm90")
):
    pytest.skip("flashcore was built without a CUDA backend for this GPU", allow_module_level=True)

DEVICE = "cuda"
FWD_FACTOR = 2
BWD_FACTOR = 3
NO_KEY_SCORE = -1e30


def reference_attention(q, k, v, causal=False, window=(-1, -1), softcap=0.0, dtype=torch.float64,
                        alibi_slopes=None, dropout=None):
    """Plain torch math in `dtype` (float64: the truth; the input dtype: the naive
    same-precision result). Rows without keys give 0. alibi_slopes (heads,) or (batch, heads):
    flash_attn's bias -slope * |i + sk - sq - j| after the softcap. dropout: (p, keep), keep a
    (batch, heads, sq, sk) bool tensor; kept probabilities are scaled by 1 / (1 - p)."""
    scale = q.shape[-1] ** -0.5
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    s = torch.einsum("bihd,bjhd->bhij", q, k).to(accumulate) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(accumulate)
        slopes = slopes[None] if slopes.dim() == 1 else slopes
        rows = torch.arange(q.shape[1], device=q.device)[:, None]
        keys = torch.arange(k.shape[1], device=q.device)[None, :]
        distance = (rows + k.shape[1] - q.shape[1] - keys).abs().to(accumulate)
        s = s - slopes[:, :, None, None] * distance
    left, right = window
    right = 0 if causal else right
    rows = torch.arange(q.shape[1], device=q.device)[:, None]
    keys = torch.arange(k.shape[1], device=q.device)[None, :]
    diagonal = rows + k.shape[1] - q.shape[1]
    allowed = torch.ones_like(rows + keys, dtype=torch.bool)
    if left >= 0:
        allowed &= keys >= diagonal - left
    if right >= 0:
        allowed &= keys <= diagonal + right
    s = s.masked_fill(~allowed, NO_KEY_SCORE)
    p = torch.softmax(s, dim=-1) * allowed.any(-1, keepdim=True)
    if dropout is not None:
        p = p * dropout[1] / (1.0 - dropout[0])
    return torch.einsum("bhij,bjhd->bihd", p.to(dtype), v)


def max_error(x, ref):
    return (x.double() - ref.double()).abs().max().item()


def rounding_atol(ref, dtype):
    r = ref.to(dtype)
    return 2 * (r + 0.3 - 0.3 - r).abs().max().item()


def assert_within_rule(got, ref, same, dtype, factor, name):
    assert not torch.isnan(got).any(), f"{name}: NaN"
    error, same_error = max_error(got, ref), max_error(same, ref)
    atol = rounding_atol(ref, dtype)
    assert error <= factor * same_error + atol, f"{name}: {error:.3g} > {factor}x{same_error:.3g}+{atol:.3g}"


def forward_backward(fn, inputs, dout):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    return (out,) + torch.autograd.grad(out, inputs, dout)


def assert_step_within_rule(got, inputs, dout, label="", **mask):
    """got = (out, dq, dk, dv) of a forward + backward step on `inputs`: each within the rule
    against the fp64 reference, with plain torch math in the inputs' dtype as the same-precision
    result (messages prefixed with `label`)."""
    dtype = inputs[0].dtype
    ref = forward_backward(lambda *x: reference_attention(*x, **mask), inputs, dout)
    same = forward_backward(lambda *x: reference_attention(*x, **mask, dtype=dtype), inputs, dout)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        factor = FWD_FACTOR if name == "out" else BWD_FACTOR
        assert_within_rule(got[i], ref[i], same[i], dtype, factor, f"{label} {name}" if label else name)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def test_seed_example():
    q = torch.randn(2, 1024, 12, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 1024, 12, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(2, 1024, 12, 64, device="cuda", dtype=torch.float16)
    out = flash_attn.flash_attn_func(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    ref = reference_attention(q, k, v)
    assert_within_rule(out, ref, sdpa, torch.float16, FWD_FACTOR, "out")


CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, mask)
    (2, 128, 128, 4, 4, 64, dict()),
    (2, 113, 203, 8, 2, 64, dict(causal=True)),
    (1, 239, 128, 4, 1, 128, dict(causal=True)),
    (2, 256, 512, 4, 2, 128, dict(window=(64, 16))),
    (1, 200, 300, 2, 2, 256, dict(softcap=20.0, causal=True)),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_forward_backward_vs_torch_math(dtype, case):
    batch, sq, sk, hq, hkv, d, mask = case
    q = torch.randn(batch, sq, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(batch, sk, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    fa = lambda q, k, v: flash_attn.flash_attn_func(
        q, k, v, causal=mask.get("causal", False), window_size=mask.get("window", (-1, -1)),
        softcap=mask.get("softcap", 0.0))
    got = forward_backward(fa, (q, k, v), dout)
    assert all(g.dtype == dtype for g in got)
    assert_step_within_rule(got, (q, k, v), dout, **mask)


@pytest.mark.parametrize("backend", ["cuda_sm80", "cuda_sm90"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_forward_on_each_cuda_backend(backend, case):
    """AUTO picks one backend per call; each one forced must meet the same rule."""
    if not flashcore.backend_available(backend):
        pytest.skip(f"{backend} is not available on this GPU / build")
    batch, sq, sk, hq, hkv, d, mask = case
    q = torch.randn(batch, sq, hq, d, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, sk, hkv, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    flashcore.set_default_backend(backend)
    try:
        out = flash_attn.flash_attn_func(
            q, k, v, causal=mask.get("causal", False), window_size=mask.get("window", (-1, -1)),
            softcap=mask.get("softcap", 0.0))
    finally:
        flashcore.set_default_backend("auto")
    ref = reference_attention(q, k, v, **mask)
    same = reference_attention(q, k, v, **mask, dtype=torch.bfloat16)
    assert_within_rule(out, ref, same, torch.bfloat16, FWD_FACTOR, f"{backend} out")


@pytest.mark.parametrize("backend", ["auto", "cuda_sm80", "cuda_sm90"])
@pytest.mark.parametrize("d", [64, 128])
def test_heads_major_inputs_give_heads_major_outputs(backend, d):
    """q, k, v viewed (batch, seqlen, heads, d) from (batch, heads, seqlen, d) storage: out takes
    q's layout (torch.empty_like, as flash_attn), which the kernels store to, and the result and
    the gradients meet the accuracy rule (the gradients take their inputs' layouts too)."""
    if backend != "auto" and not flashcore.backend_available(backend):
        pytest.skip(f"{backend} is not available on this GPU / build")
    q, k, v = (torch.randn(2, 4, 300, d, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    dout = torch.randn(2, 300, 4, d, device=DEVICE, dtype=torch.bfloat16)
    flashcore.set_default_backend(backend)
    try:
        got = forward_backward(lambda *x: flash_attn.flash_attn_func(*x, causal=True), (q, k, v), dout)
    finally:
        flashcore.set_default_backend("auto")
    assert got[0].stride() == q.stride()
    assert [g.stride() for g in got[1:]] == [x.stride() for x in (q, k, v)]
    assert_step_within_rule(got, (q, k, v), dout, backend, causal=True)


@pytest.mark.parametrize("backend", ["auto", "cuda_sm80", "cuda_sm90"])
@pytest.mark.parametrize("d", [36, 60, 100])
def test_head_dim_not_a_multiple_of_8_is_padded(backend, d):
    """flash_attn pads such a head_dim to the next multiple of 8 for its kernels and cuts the
    output back; so does flashcore's Python API (the default scale stays 1/sqrt(d))."""
    if backend != "auto" and not flashcore.backend_available(backend):
        pytest.skip(f"{backend} is not available on this GPU / build")
    q = torch.randn(2, 200, 4, d, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 230, 2, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    flashcore.set_default_backend(backend)
    try:
        got = forward_backward(lambda *x: flash_attn.flash_attn_func(*x, causal=True), (q, k, v), dout)
    finally:
        flashcore.set_default_backend("auto")
    assert got[0].shape == q.shape and [g.shape for g in got[1:]] == [x.shape for x in (q, k, v)]
    assert_step_within_rule(got, (q, k, v), dout, f"{backend} d{d}", causal=True)


@pytest.mark.parametrize("backend", ["cuda_sm80", "cuda_sm90"])
@pytest.mark.parametrize("case", [(2, 300, 300, 4, 2, 64, dict(causal=True)),
                                  (1, 200, 333, 4, 1, 128, dict(window=(50, 10), softcap=20.0)),
                                  (2, 190, 260, 4, 2, 256, dict(causal=True, softcap=30.0)),
                                  (1, 257, 129, 2, 2, 200, dict(window=(40, 70)))],
                         ids=["d64_causal_gqa", "d128_window_softcap", "d256_causal_softcap_gqa",
                              "d200_padded_window"])
def test_backward_on_each_cuda_backend(backend, case):
    """Each CUDA backward forced must meet the rule (AUTO uses sm90 for every head dim on Hopper)."""
    if not flashcore.backend_available(backend):
        pytest.skip(f"{backend} is not available on this GPU / build")
    batch, sq, sk, hq, hkv, d, mask = case
    dtype = torch.bfloat16
    q = torch.randn(batch, sq, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(batch, sk, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    fa = lambda q, k, v: flash_attn.flash_attn_func(
        q, k, v, causal=mask.get("causal", False), window_size=mask.get("window", (-1, -1)),
        softcap=mask.get("softcap", 0.0))
    flashcore.set_default_backend(backend)
    try:
        got = forward_backward(fa, (q, k, v), dout)
    finally:
        flashcore.set_default_backend("auto")
    assert_step_within_rule(got, (q, k, v), dout, backend, **mask)


def test_backward_with_a_dout_broadcast_over_the_sequence():
    """dout with stride 0 along the sequence (the gradient of (out * w).sum() for w (b, 1, h, d)):
    the Hopper backward's TMA cannot read it, so AUTO runs the sm80 backward there, in the
    workspace the query sized before dout was known (the sm80 size, the larger since its tiled
    dQ accumulator)."""
    batch, sq, hq, d = 2, 200, 4, 128
    dtype = torch.bfloat16
    q, k, v = (torch.randn(batch, sq, hq, d, device=DEVICE, dtype=dtype) for _ in range(3))
    dout = torch.randn(batch, 1, hq, d, device=DEVICE, dtype=dtype).expand(batch, sq, hq, d)
    assert dout.stride(1) == 0 and dout.stride(-1) == 1
    fa = lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=True)
    got = forward_backward(fa, (q, k, v), dout)
    assert_step_within_rule(got, (q, k, v), dout, causal=True)


def test_varlen_matches_dense_per_sequence():
    lengths = [100, 1, 0, 257]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)
    total = sum(lengths)
    q, k, v = (torch.randn(total, 4, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        start += length
        if length == 0:
            continue
        dense = flash_attn.flash_attn_func(q[None, rows], k[None, rows], v[None, rows], causal=True)
        torch.testing.assert_close(out[rows], dense[0], rtol=0, atol=2e-2)


@pytest.mark.parametrize("backend", ["cuda_sm80", "cuda_sm90"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_nan_past_the_sequences_reaches_nothing(backend, d):
    """Packed buffers longer than the sequences with NaN in the rest (a preallocated buffer):
    out and the gradients of the sequences' rows are those of a clean buffer (the rows past them
    are not written, as in flash_attn; the C++ tests check that on poisoned outputs)."""
    if not flashcore.backend_available(backend):
        pytest.skip(f"{backend} is not available on this GPU / build")
    lengths, tail = [100, 37, 129], 64
    used = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)
    base = [torch.randn(used + tail, 4, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]

    def run(poison):
        q, k, v, dout = (t.clone() for t in base)
        if poison:
            for t in (q, k, v, dout):
                t[used:] = float("nan")
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        out.backward(dout)
        return out, q.grad, k.grad, v.grad

    flashcore.set_default_backend(backend)
    try:
        clean, dirty = run(False), run(True)
    finally:
        flashcore.set_default_backend("auto")
    for name, a, b in zip(("out", "dq", "dk", "dv"), clean, dirty):
        assert not b[:used].isnan().any(), f"{backend} {name}: NaN past the sequences reached their rows"
        # dq is accumulated with atomics: its rounding order may differ between the two runs.
        torch.testing.assert_close(b[:used], a[:used], rtol=0, atol=0 if name != "dq" else 2e-2)


@pytest.mark.parametrize("backend", ["auto", "cuda_sm80"])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("page_size", [16, 256, 512])
def test_varlen_paged_kv_matches_packed(page_size, alibi, backend):
    # flash_attn_varlen_func with block_table (forward only), with and without ALiBi slopes: the
    # bias counts keys inside each sequence, whichever page holds them. Any page size on every GPU
    # backend (cuda_sm80 gathers pages of other than a multiple of 256 keys into packed rows).
    if backend != "auto" and not flashcore.backend_available(backend):
        pytest.skip(f"{backend} is not available")
    flashcore.set_default_backend(backend)
    try:
        _paged_matches_packed(page_size, alibi)
    finally:
        flashcore.set_default_backend("auto")


def _paged_matches_packed(page_size, alibi):
    lengths_q, lengths_k = [100, 1, 700], [1000, 300, 700]
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lengths_q), 8, 128, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths_k), 2, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    per_seq = max((n + page_size - 1) // page_size for n in lengths_k)
    pages = len(lengths_k) * per_seq + 2
    table = torch.randperm(pages, device=DEVICE)[: len(lengths_k) * per_seq].view(len(lengths_k), per_seq)
    k_pages, v_pages = (torch.randn(pages, page_size, 2, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    for b, n in enumerate(lengths_k):
        for c in range(per_seq):
            rows = slice(c * page_size, min(n, (c + 1) * page_size))
            if rows.start >= n:
                break
            start = int(cu_k[b])
            k_pages[table[b, c], : rows.stop - rows.start] = k[start + rows.start: start + rows.stop]
            v_pages[table[b, c], : rows.stop - rows.start] = v[start + rows.start: start + rows.stop]
    slopes = torch.rand(len(lengths_k), 8, device=DEVICE) * 0.2 if alibi else None
    out = flash_attn.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                            causal=True, block_table=table.to(torch.int32), alibi_slopes=slopes)
    packed = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                               alibi_slopes=slopes)
    assert not alibi or not torch.equal(out, flash_attn.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, block_table=table)), \
        "the slopes changed nothing"
    torch.testing.assert_close(out, packed, rtol=0, atol=2e-2)
    with pytest.raises(NotImplementedError, match=r"^block_table: paged K/V is forward only"):
        flash_attn.flash_attn_varlen_func(q.requires_grad_(), k_pages, v_pages, cu_q, cu_k, max(lengths_q),
                                          max(lengths_k), block_table=table)


@pytest.mark.parametrize("page_size", [0, 16])
def test_varlen_decode_one_token_per_sequence(page_size):
    """flash_attn_varlen_func decoding (at most one query token per sequence, as an engine batches
    its sequences), which AUTO runs on the decode kernel: against the fp64 reference per sequence,
    packed and in pages of 16 keys, a sequence without a query and one without keys, split-KV over
    the long ones; and the same call captured in a CUDA graph and replayed on new queries."""
    lengths_q, lengths_k = [1, 0, 1, 1], [5000, 40, 0, 20000]
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lengths_q), hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(sum(lengths_k), hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
    table = None
    k_in, v_in = k, v
    if page_size:
        per_seq = max((n + page_size - 1) // page_size for n in lengths_k)
        pages = len(lengths_k) * per_seq + 3
        table = torch.randperm(pages, device=DEVICE)[: len(lengths_k) * per_seq].view(len(lengths_k), per_seq)
        k_in, v_in = (torch.randn(pages, page_size, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
        for b, n in enumerate(lengths_k):
            start = int(cu_k[b])
            for c in range((n + page_size - 1) // page_size):
                rows = min(n, (c + 1) * page_size) - c * page_size
                k_in[table[b, c], :rows] = k[start + c * page_size: start + c * page_size + rows]
                v_in[table[b, c], :rows] = v[start + c * page_size: start + c * page_size + rows]
        table = table.to(torch.int32)

    def call(queries):
        return flash_attn.flash_attn_varlen_func(queries, k_in, v_in, cu_q, cu_k, 1, max(lengths_k), causal=True,
                                                 block_table=table, return_attn_probs=True)

    out, lse, _ = call(q)
    for b in range(len(lengths_q)):
        if lengths_q[b] == 0:
            continue
        row = slice(int(cu_q[b]), int(cu_q[b]) + 1)
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lengths_k[b] == 0:
            assert (out[row] == 0).all() and torch.isneginf(lse[:, row]).all()
            continue
        args = (q[None, row], k[None, keys], v[None, keys])
        ref = reference_attention(*args, causal=True)
        same = reference_attention(*args, causal=True, dtype=dtype)
        assert_within_rule(out[row], ref[0], same[0], dtype, FWD_FACTOR, f"sequence {b}")
        # lse (heads, total_q): one token sees every key of its sequence under the causal mask
        scores = torch.einsum("hd,jhd->hj", q[row][0].double(), k[keys].double().repeat_interleave(hq // hkv, dim=1))
        ref_lse = torch.logsumexp(scores * d ** -0.5, dim=-1)
        torch.testing.assert_close(lse[:, row][:, 0].double(), ref_lse, rtol=0, atol=1e-3)

    graph_q = q.clone()
    call(graph_q)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, _, _ = call(graph_q)
    fresh = torch.randn_like(q)
    graph_q.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(graph_out, call(fresh)[0], rtol=0, atol=0)


@pytest.mark.parametrize("case", [(16, 32, 8, 128), (32, 16, 16, 64)], ids=["gqa_d128", "mha_d64"])
def test_few_tokens_against_long_keys(case):
    """A few query tokens of one sequence against a long context (speculative decoding, chunked
    prefill), which the Hopper forward splits over the idle SMs (split-KV, fp32 partials in the
    workspace the Python layer allocates from the query): forward and backward against the fp64
    reference, the KV-cache call over the same tensors with the same bits (on Hopper both run the
    split forward), and a CUDA-graph replay on new queries."""
    tokens, hq, hkv, d = case
    dtype = torch.bfloat16
    q = torch.randn(1, tokens, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(1, 8192, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    fa = lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=True)
    got = forward_backward(fa, (q, k, v), dout)
    assert_step_within_rule(got, (q, k, v), dout, causal=True)
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    cached, cached_lse = flash_attn.flash_attn_with_kvcache(q, k, v, causal=True, return_softmax_lse=True)
    if torch.cuda.get_device_capability() == (9, 0):
        torch.testing.assert_close(cached, out, rtol=0, atol=0)
        torch.testing.assert_close(cached_lse, lse, rtol=0, atol=0)
    graph_q = q.clone()
    fa(graph_q, k, v)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = fa(graph_q, k, v)
    fresh = torch.randn_like(q)
    graph_q.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(graph_out, fa(fresh, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["plain", "softcap"])
def test_kvcache_forward_route_splits_and_full_caches(softcap):
    """32 tokens of one sequence against 8192 cached keys (GQA 32 / 8, d128): the KV-cache call's
    forward route. Full caches without cache_seqlens run as a dense forward, with them through the
    route's varlen view (on Hopper the same kernels: the same bits); the caller's num_splits sets
    how that forward splits (1: whole, 3 parts), not which kernels take the call; softcap calls
    split on the score-transform kernels. Each against the fp64 reference."""
    dtype = torch.bfloat16
    q = torch.randn(1, 32, 32, 128, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(1, 8192, 8, 128, device=DEVICE, dtype=dtype) for _ in range(2))
    ref = reference_attention(q, k, v, causal=True, softcap=softcap)
    same = reference_attention(q, k, v, causal=True, softcap=softcap, dtype=dtype)
    lengths = torch.full((1,), 8192, dtype=torch.int32, device=DEVICE)
    dense = flash_attn.flash_attn_with_kvcache(q, k, v, causal=True, softcap=softcap)
    assert_within_rule(dense, ref, same, dtype, FWD_FACTOR, "full caches")
    with_lengths = flash_attn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True, softcap=softcap)
    assert_within_rule(with_lengths, ref, same, dtype, FWD_FACTOR, "cache_seqlens")
    if torch.cuda.get_device_capability() == (9, 0):
        torch.testing.assert_close(with_lengths, dense, rtol=0, atol=0)
    for splits in (1, 3):
        out = flash_attn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True, softcap=softcap,
                                                 num_splits=splits)
        assert_within_rule(out, ref, same, dtype, FWD_FACTOR, f"num_splits={splits}")


def test_kvcache_portable_backend_takes_the_route():
    """Many query rows per KV head with backend cuda_sm80: the KV-cache call's route runs sm80's
    forward (auto takes the Hopper forward on Hopper), here with ALiBi and cache_leftpad. Both
    against the fp64 reference on each sequence's keys from its left padding on. The shape takes
    the route (prefill_route.cu: 1024 rows per KV head, 2 x 4 x 16 x 2 query blocks >= the SMs);
    CudaKvCache.PortableKernelsOnRequest checks from the workspace which kernels took a call."""
    dtype = torch.bfloat16
    q = torch.randn(4, 256, 16, 128, device=DEVICE, dtype=dtype)
    k_cache, v_cache = (torch.randn(4, 1024, 4, 128, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths, pads = [600, 1000, 800, 1024], [7, 0, 3, 100]
    slopes = torch.rand(16, device=DEVICE) * 0.2
    for backend in ("cuda_sm80", "auto"):
        flashcore.set_default_backend(backend)
        try:
            out = flash_attn.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
                cache_leftpad=torch.tensor(pads, dtype=torch.int32, device=DEVICE), causal=True,
                alibi_slopes=slopes)
        finally:
            flashcore.set_default_backend("auto")
        for b in range(4):
            keys = slice(pads[b], lengths[b])
            args = (q[b:b + 1], k_cache[b:b + 1, keys], v_cache[b:b + 1, keys])
            ref = reference_attention(*args, causal=True, alibi_slopes=slopes)
            same = reference_attention(*args, causal=True, alibi_slopes=slopes, dtype=dtype)
            assert_within_rule(out[b:b + 1], ref, same, dtype, FWD_FACTOR, f"{backend}, sequence {b}")


def test_cuda_graph_capture_and_replay():
    shape = (2, 256, 4, 64)
    static = [torch.randn(shape, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    dout = torch.randn(shape, device=DEVICE, dtype=torch.float16)

    def step():
        out = flash_attn.flash_attn_func(*static, causal=True)
        return (out,) + torch.autograd.grad(out, static, dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (lazy module loading, allocator)
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):  # new data in the static inputs, then replay
        with torch.no_grad():
            for x in static:
                x.copy_(torch.randn_like(x))
            dout.copy_(torch.randn_like(dout))
        graph.replay()
        expected = step()
        for got, want in zip(captured, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_runs_on_the_current_stream():
    q, k, v = (torch.randn(1, 512, 8, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    expected = flash_attn.flash_attn_func(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = flash_attn.flash_attn_func(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_torch_compile_fullgraph_cuda():
    q, k, v = (torch.randn(2, 128, 4, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
               for _ in range(3))

    def step(q, k, v):
        return flash_attn.flash_attn_func(q, k, v, causal=True).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(step(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_error_device_mismatch():
    q = torch.randn(1, 8, 2, 64, device=DEVICE, dtype=torch.float16)
    k = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^k: "):
        flash_attn.flash_attn_func(q, k, k.to(DEVICE))
    with pytest.raises(ValueError, match=r"^alibi_slopes: is on cpu"):
        flash_attn.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("per_batch", [False, True], ids=["heads", "batch_heads"])
def test_alibi_forward_backward_vs_torch_math(dtype, per_batch):
    """ALiBi through the default backend (cuda_sm90 on Hopper, cuda_sm80 elsewhere): causal GQA
    with seqlen_q != seqlen_k, slopes per head or per (sequence, head)."""
    batch, sq, sk, hq, hkv, d = 2, 113, 203, 8, 2, 64
    q = torch.randn(batch, sq, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(batch, sk, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    slopes = torch.rand((batch, hq) if per_batch else (hq,), device=DEVICE) * 0.5 + 0.01
    mask = dict(causal=True, alibi_slopes=slopes)
    fa = lambda q, k, v: flash_attn.flash_attn_func(q, k, v, **mask)
    got = forward_backward(fa, (q, k, v), dout)
    assert_step_within_rule(got, (q, k, v), dout, **mask)


def test_dlpack_api_with_explicit_stream():
    q, k, v = (torch.randn(1, 64, 2, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    stream = torch.cuda.current_stream().cuda_stream
    out = flashcore.attention_forward(q, k, v, stream=stream)
    torch.testing.assert_close(out, flash_attn.flash_attn_func(q, k, v), rtol=0, atol=0)


def test_misaligned_workspace_is_a_clear_error():
    """A workspace given to a CUDA call must be 16-byte aligned: a slice of a buffer 4 bytes in is
    refused, naming the workspace, and out is left as it was; the aligned buffer runs."""
    q, k, v = (torch.randn(1, 64, 2, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    buffer = torch.empty(4096 + 16, device=DEVICE, dtype=torch.uint8)
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match=r"^workspace: its address must be 16-byte aligned"):
        flashcore.attention_forward(q, k, v, out=out, workspace=buffer[4:4100], backend="cuda_sm80")
    torch.cuda.synchronize()
    assert bool((out == 7.0).all()), "a rejected call wrote its output"
    flashcore.attention_forward(q, k, v, out=out, workspace=buffer[:4096], backend="cuda_sm80")
    torch.testing.assert_close(out, flashcore.attention_forward(q, k, v, backend="cuda_sm80"), rtol=0, atol=0)


def test_cuda_cu_seqlens_checked_on_request(monkeypatch):
    """CUDA cu_seqlens are trusted unless asked: with check_cu_seqlens (or the environment
    switch) bad values raise the CPU path's ValueError and nothing is written."""
    q = torch.ones(10, 2, 64, device=DEVICE, dtype=torch.float16)
    k = torch.ones(12, 2, 64, device=DEVICE, dtype=torch.float16)
    cu_q = torch.tensor([0, 6, 4], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], device=DEVICE, dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q: decreases at index 2"):
        flashcore.attention_forward(q, k, k, out=out, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                                    max_seqlen_k=7, check_cu_seqlens=True)
    monkeypatch.setenv("FLASHCORE_CHECK_CU_SEQLENS", "1")
    with pytest.raises(ValueError, match=r"cu_seqlens_q: decreases at index 2"):
        flashcore.attention_forward(q, k, k, out=out, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                                    max_seqlen_k=7)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all()), "a rejected call wrote its output"
    monkeypatch.delenv("FLASHCORE_CHECK_CU_SEQLENS")
    good = torch.tensor([0, 4, 10], device=DEVICE, dtype=torch.int32)
    flashcore.attention_forward(q, k, k, out=out, cu_seqlens_q=good, cu_seqlens_k=cu_k, max_seqlen_q=6,
                                max_seqlen_k=7, check_cu_seqlens=True)
    torch.cuda.synchronize()
    assert bool((out == 1.0).all())
    # Without the host check: the device-side check raises the caller's flag, no synchronization.
    flag = torch.zeros(1, device=DEVICE, dtype=torch.int32)
    flashcore.attention_forward(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=7,
                                error_flag=flag)
    assert int(flag.item()) == 1
    flag.zero_()
    flashcore.attention_forward(q, k, k, cu_seqlens_q=good, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=7,
                                error_flag=flag)
    assert int(flag.item()) == 0


# ---- dropout (AUTO: the Hopper kernels where they run, forward and backward) ---------------------

import numpy as np  # noqa: E402
from attention_reference import dropout_keep_mask  # noqa: E402


def drawn_seed(seed):
    """The mask seed a flashcore call draws right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64))


def keep_masks(p, mask_seed, batch, heads, seqlen_q, seqlen_k):
    """(batch, heads, seqlen_q, seqlen_k) bool keep mask of a dense call, on the GPU (from the
    numpy replica of the library's rule)."""
    masks = np.stack([np.stack([dropout_keep_mask(p, mask_seed, 0, b * heads + h, seqlen_q, seqlen_k)
                                for h in range(heads)]) for b in range(batch)])
    return torch.from_numpy(masks).to(DEVICE)


DROPOUT_CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, mask, p)
    (2, 128, 128, 4, 4, 64, dict(), 0.17),
    (2, 113, 203, 8, 2, 64, dict(causal=True), 0.5),
    (1, 239, 128, 4, 1, 128, dict(causal=True), 0.1),
    (2, 256, 300, 4, 2, 128, dict(window=(64, 16)), 0.3),
    (1, 200, 300, 2, 2, 256, dict(softcap=20.0, causal=True), 0.5),
    (1, 96, 160, 2, 1, 72, dict(), 0.25),
]


@pytest.mark.parametrize("backend", ["auto", "cuda_sm80"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=[f"case{i}" for i in range(len(DROPOUT_CASES))])
def test_dropout_forward_backward(backend, dtype, case):
    if backend != "auto" and not flashcore.backend_available(backend):
        pytest.skip(f"{backend} is not available on this GPU / build")
    batch, sq, sk, hq, hkv, d, mask, p = case
    inputs = [torch.randn(batch, s, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
              for s, h in ((sq, hq), (sk, hkv), (sk, hkv))]
    dout = torch.randn(batch, sq, hq, d, device=DEVICE, dtype=dtype)
    flashcore.set_default_backend(backend)
    try:
        torch.manual_seed(21)
        out = flash_attn.flash_attn_func(
            *inputs, dropout_p=p, causal=mask.get("causal", False), window_size=mask.get("window", (-1, -1)),
            softcap=mask.get("softcap", 0.0))
        grads = torch.autograd.grad(out, inputs, dout)
    finally:
        flashcore.set_default_backend("auto")
    keep = keep_masks(p, drawn_seed(21), batch, hq, sq, sk)
    assert_step_within_rule((out,) + grads, inputs, dout, f"{backend} dropout", **mask, dropout=(p, keep))
    plain = reference_attention(*inputs, **mask)
    assert max_error(out, plain) > 0.05  # the dropped entries moved the output


def test_dropout_repeats_and_seeds():
    q, k, v = (torch.randn(2, 200, 4, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    torch.manual_seed(4)
    first = flash_attn.flash_attn_func(q, k, v, dropout_p=0.3)
    second = flash_attn.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(4)
    assert torch.equal(first, flash_attn.flash_attn_func(q, k, v, dropout_p=0.3))
    assert not torch.equal(first, second)
    # The CPU backends draw the same mask from the same seed: the GPU's result within the rule
    # of the CPU's fp32 result on the same inputs.
    torch.manual_seed(4)
    on_cpu = flash_attn.flash_attn_func(q.cpu().float(), k.cpu().float(), v.cpu().float(), dropout_p=0.3)
    assert max_error(first, on_cpu.to(DEVICE)) < 0.05


def test_dropout_hopper_kernels_match_sm80_and_no_capture():
    q, k, v = (torch.randn(1, 64, 2, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    if flashcore.backend_available("cuda_sm90"):
        outs = []
        for backend in ("cuda_sm90", "cuda_sm80"):  # the same seed: the same mask on both
            flashcore.set_default_backend(backend)
            try:
                torch.manual_seed(9)
                outs.append(flash_attn.flash_attn_func(q, k, v, dropout_p=0.1))
            finally:
                flashcore.set_default_backend("auto")
        assert max_error(outs[0], outs[1]) < 1e-2
        grads = []
        for backend in ("cuda_sm90", "cuda_sm80"):  # the Hopper backward draws the same mask
            flashcore.set_default_backend(backend)
            try:
                leaf = q.clone().requires_grad_()
                torch.manual_seed(9)
                flash_attn.flash_attn_func(leaf, k, v, dropout_p=0.1).sum().backward()
                grads.append(leaf.grad)
            finally:
                flashcore.set_default_backend("auto")
        assert max_error(grads[0], grads[1]) < 2e-2
    flash_attn.flash_attn_func(q, k, v, dropout_p=0.1)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(NotImplementedError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            flash_attn.flash_attn_func(q, k, v, dropout_p=0.1)

"""flashcore with PyTorch CPU tensors: the flash_attn API, autograd, custom ops, torch.compile.

Skipped when torch is not installed (CI). Results are compared with plain torch math run in
float64 on the same inputs (forward and gradients through torch autograd); float32 results
must be within a relative error of 1e-5 (TESTING.md), low precision within the tolerance rule.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import flashcore  # noqa: E402  (after torch, so the custom ops register at import)
import flashcore as flash_attn  # noqa: E402

FP32_RELATIVE_TOLERANCE = 1e-5
NO_KEY_SCORE = -1e30  # finite stand-in for -inf in the reference, so autograd stays finite


# ---- torch math reference (float64) ------------------------------------------------------------


def allowed_keys(seqlen_q, seqlen_k, causal, window, device="cpu"):
    left, right = window
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None]
    keys = torch.arange(seqlen_k, device=device)[None, :]
    diagonal = rows + seqlen_k - seqlen_q
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= keys >= diagonal - left
    if right >= 0:
        allowed &= keys <= diagonal + right
    return allowed


def alibi_bias(seqlen_q, seqlen_k, slopes, dtype):
    """(batch or 1, heads, sq, sk) ALiBi bias: -slope * |i + sk - sq - j| (flash_attn's), for
    slopes (heads,) or (batch, heads)."""
    rows = torch.arange(seqlen_q)[:, None]
    keys = torch.arange(seqlen_k)[None, :]
    distance = (rows + seqlen_k - seqlen_q - keys).abs().to(dtype)
    slopes = slopes.detach().to(dtype)
    slopes = slopes[None] if slopes.dim() == 1 else slopes
    return -slopes[:, :, None, None] * distance


def reference_attention(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None,
                        dtype=torch.float64, alibi_slopes=None, dropout=None):
    """Dense (batch, seq, heads, dim) attention in plain torch ops, differentiable; rows
    without keys give 0. dropout: (p, keep) with keep a (batch, heads, sq, sk) bool tensor, the
    kept probabilities scaled by 1 / (1 - p) (lse is unaffected). Returns (out, lse) in `dtype`."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(q.shape[1], k.shape[1], alibi_slopes, dtype)
    allowed = allowed_keys(q.shape[1], k.shape[1], causal, window, q.device)
    s = s.masked_fill(~allowed, NO_KEY_SCORE)
    has_key = allowed.any(dim=-1)[:, None]  # (sq, 1)
    p = torch.softmax(s, dim=-1) * has_key
    lse = torch.logsumexp(s, dim=-1).masked_fill(~has_key[:, 0], float("-inf"))
    if dropout is not None:
        p = p * dropout[1].to(dtype) / (1.0 - dropout[0])
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def make_qkv(shape_q, shape_kv, dtype=torch.float32, requires_grad=False, device="cpu"):
    make = lambda shape: torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
    return make(shape_q), make(shape_kv), make(shape_kv)


def grads_of(fn, inputs, dout):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, dout)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


# ---- forward --------------------------------------------------------------------------------


def test_seed_example_shape_runs_unchanged_on_cpu():
    # The seed's call, on CPU tensors and a shorter sequence so that it stays quick.
    q = torch.randn(2, 256, 12, 64, dtype=torch.float16)
    k = torch.randn(2, 256, 12, 64, dtype=torch.float16)
    v = torch.randn(2, 256, 12, 64, dtype=torch.float16)
    out = flash_attn.flash_attn_func(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.float16 and out.device == q.device
    ref, _ = reference_attention(q, k, v)
    same, _ = reference_attention(q, k, v, dtype=torch.float32)
    same_error = (same.half().double() - ref).abs().max().item()
    atol = 2 * (ref.half() + 0.3 - 0.3 - ref.half()).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * same_error + atol


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 33), (45, 45), (70, 31), (31, 70)])
def test_forward_fp32_matches_torch_math(causal, seqlen_q, seqlen_k):
    q, k, v = make_qkv((2, seqlen_q, 4, 32), (2, seqlen_k, 2, 32))
    out, lse, probs = flash_attn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    # As flash_attn without dropout: an empty S_dmask of out's dtype and device.
    assert probs.shape == (0,) and probs.dtype == out.dtype and probs.device == out.device
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, seqlen_q)
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
    assert relative_error(out, ref_out) < FP32_RELATIVE_TOLERANCE
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert relative_error(lse[finite], ref_lse[finite]) < FP32_RELATIVE_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_low_precision(dtype):
    q, k, v = make_qkv((1, 64, 2, 64), (1, 96, 2, 64), dtype)
    out = flash_attn.flash_attn_func(q, k, v, causal=True)
    assert out.dtype == dtype
    ref, _ = reference_attention(q, k, v, causal=True)
    same, _ = reference_attention(q, k, v, causal=True, dtype=torch.float32)
    same_error = (same.to(dtype).double() - ref).abs().max().item()
    atol = 2 * (ref.to(dtype) + 0.3 - 0.3 - ref.to(dtype)).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * same_error + atol


def test_non_contiguous_inputs_and_int64_cu_seqlens():
    base = torch.randn(1, 20, 2, 16, 2)
    q = base[..., 0]  # head_dim stride 2: copied, as flash_attn does
    out = flash_attn.flash_attn_func(q, q, q)
    torch.testing.assert_close(out, flash_attn.flash_attn_func(*(q.contiguous(),) * 3))
    cu = torch.tensor([0, 7, 20])  # int64, converted
    q3 = q.contiguous()[0]
    out_varlen = flash_attn.flash_attn_varlen_func(q3, q3, q3, cu, cu, 13, 13)
    expected = flash_attn.flash_attn_func(q3[None, :7], q3[None, :7], q3[None, :7])[0]
    torch.testing.assert_close(out_varlen[:7], expected)


def test_heads_major_inputs_give_heads_major_outputs():
    # q, k, v viewed (batch, seqlen, heads, d) from (batch, heads, seqlen, d) storage, as models that
    # keep heads outermost pass them: out takes q's layout (torch.empty_like, as flash_attn), the
    # gradients their inputs' layouts, and every value matches float64 math.
    q, k, v = (torch.randn(2, 3, 37, 16).transpose(1, 2).requires_grad_() for _ in range(3))
    dout = torch.randn(2, 37, 3, 16)
    out, grads = grads_of(lambda *x: flash_attn.flash_attn_func(*x, causal=True), (q, k, v), dout)
    assert out.stride() == q.stride()
    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = grads_of(lambda *x: reference_attention(*x, causal=True)[0], inputs64,
                                  dout.double())
    assert relative_error(out, ref_out) < FP32_RELATIVE_TOLERANCE
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert got.stride() == x.stride(), name
        assert relative_error(got, want) < FP32_RELATIVE_TOLERANCE, name


def test_overlapping_inputs_give_outputs_with_a_contiguous_last_dimension():
    # Overlapping rows (an unfold's sliding windows): torch.empty_like would put another stride-1
    # dimension last, which no backend takes; the results are allocated contiguous instead.
    q = torch.randn(2, 5, 10).unfold(2, 8, 1).requires_grad_()  # (2, 5, 3, 8), strides (50, 10, 1, 1)
    assert torch.empty_like(q).stride(-1) != 1  # what the rule guards against
    k, v = make_qkv((2, 5, 3, 8), (2, 5, 3, 8), requires_grad=True)[1:]
    dout = torch.randn(2, 5, 3, 8)
    out, grads = grads_of(lambda *x: flash_attn.flash_attn_func(*x), (q, k, v), dout)
    assert out.stride(-1) == 1 and grads[0].stride(-1) == 1
    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = grads_of(lambda *x: reference_attention(*x)[0], inputs64, dout.double())
    assert relative_error(out, ref_out) < FP32_RELATIVE_TOLERANCE
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert relative_error(got, want) < FP32_RELATIVE_TOLERANCE, name
    cache = torch.randn(2, 12, 3, 8)
    out_kv = flash_attn.flash_attn_with_kvcache(q.detach()[:, :1], cache, cache,
                                                cache_seqlens=torch.tensor([12, 7], dtype=torch.int32))
    assert out_kv.stride(-1) == 1


# ---- autograd -------------------------------------------------------------------------------

MASKS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(5, 2)),
    "softcap": dict(softcap=3.0, causal=True),
}


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(29, 47), (47, 29)])
@pytest.mark.parametrize("heads_q,heads_kv", [(4, 4), (4, 2), (3, 1)])
def test_autograd_fp32_matches_float64_math(mask, seqlen_q, seqlen_k, heads_q, heads_kv):
    options = MASKS[mask]
    q, k, v = make_qkv((2, seqlen_q, heads_q, 32), (2, seqlen_k, heads_kv, 32), requires_grad=True)
    dout = torch.randn(q.shape)
    fa = lambda q, k, v: flash_attn.flash_attn_func(
        q, k, v, causal=options.get("causal", False), window_size=options.get("window", (-1, -1)),
        softcap=options.get("softcap", 0.0))
    out, grads = grads_of(fa, (q, k, v), dout)
    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = lambda q, k, v: reference_attention(q, k, v, **options)[0]
    ref_out, ref_grads = grads_of(ref, inputs64, dout.double())
    assert relative_error(out, ref_out) < FP32_RELATIVE_TOLERANCE
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.shape == want.shape and got.dtype == torch.float32
        assert relative_error(got, want) < FP32_RELATIVE_TOLERANCE, name


def test_autograd_varlen_with_empty_sequences():
    lengths_q, lengths_k = [5, 0, 9, 3], [6, 4, 0, 3]
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32)
    q, k, v = make_qkv((int(cu_q[-1]), 4, 16), (int(cu_k[-1]), 2, 16), requires_grad=True)
    dout = torch.randn(q.shape)
    out, lse, _ = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q),
                                                    max(lengths_k), causal=True,
                                                    return_attn_probs=True)
    assert lse.shape == (4, int(cu_q[-1]))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lengths_q)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        inputs64 = [x.detach()[r][None].double().requires_grad_() for x, r in ((q, rq), (k, rk), (v, rk))]
        if lengths_q[b] == 0:
            continue
        ref_out, ref_grads = grads_of(lambda *x: reference_attention(*x, causal=True)[0],
                                      inputs64, dout[rq][None].double())
        torch.testing.assert_close(out[rq][None].double(), ref_out, rtol=1e-5, atol=1e-6)
        for got, want, rows in zip(grads, ref_grads, (rq, rk, rk)):
            torch.testing.assert_close(got[rows][None].double(), want, rtol=1e-5, atol=1e-6)


@pytest.fixture
def pad_head_dims_on_cpu(monkeypatch):
    """The GPU's head_dim padding (flash_attn_interface._head_dim_padding) applied to CPU tensors,
    so that its pad / cut and its scale are checked here against the unpadded CPU call."""
    from flashcore import flash_attn_interface

    monkeypatch.setattr(flash_attn_interface, "_head_dim_padding", lambda q: -q.shape[-1] % 8)


@pytest.mark.parametrize("head_dim", [20, 37, 60])
@pytest.mark.parametrize("softmax_scale", [None, 0.3], ids=["default_scale", "given_scale"])
def test_head_dim_padding_matches_the_unpadded_call(pad_head_dims_on_cpu, head_dim, softmax_scale):
    q, k, v = make_qkv((2, 21, 4, head_dim), (2, 33, 2, head_dim), requires_grad=True)
    dout = torch.randn(q.shape)
    fa = lambda q, k, v: flash_attn.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=True,
                                                    softcap=5.0, return_attn_probs=True)
    out, lse, _ = fa(q, k, v)
    assert out.shape == q.shape and lse.shape == (2, 4, 21)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = lambda q, k, v: reference_attention(q, k, v, causal=True, softcap=5.0, scale=softmax_scale)
    ref_out, ref_grads = grads_of(lambda *x: ref(*x)[0], inputs64, dout.double())
    assert relative_error(out, ref_out) < FP32_RELATIVE_TOLERANCE
    torch.testing.assert_close(lse.double(), ref(*inputs64)[1].detach(), rtol=1e-5, atol=1e-5)
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert got.shape == x.shape
        assert relative_error(got, want) < FP32_RELATIVE_TOLERANCE, name


def test_head_dim_padding_varlen_and_compiled(pad_head_dims_on_cpu):
    lengths = [7, 0, 12]
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
    q, k, v = make_qkv((19, 4, 36), (19, 2, 36), requires_grad=True)
    dout = torch.randn(q.shape)
    fa = lambda q, k, v: flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                           causal=True)
    out, grads = grads_of(fa, (q, k, v), dout)
    assert out.shape == q.shape
    for b in (0, 2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        inputs64 = [x.detach()[rows][None].double().requires_grad_() for x in (q, k, v)]
        ref_out, ref_grads = grads_of(lambda *x: reference_attention(*x, causal=True)[0], inputs64,
                                      dout[rows][None].double())
        torch.testing.assert_close(out[rows][None].double(), ref_out, rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got[rows][None].double(), want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=True),
                             backend="aot_eager", fullgraph=True)
    q4, k4, v4 = (x.detach()[None] for x in (q, k, v))
    torch.testing.assert_close(compiled(q4, k4, v4), flash_attn.flash_attn_func(q4, k4, v4, causal=True))


def test_autograd_packed_forms():
    qkv = torch.randn(2, 19, 3, 2, 16, requires_grad=True)
    dout = torch.randn(2, 19, 2, 16)
    (dqkv,) = torch.autograd.grad(flash_attn.flash_attn_qkvpacked_func(qkv, causal=True), qkv, dout)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    grads = torch.autograd.grad(flash_attn.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    torch.testing.assert_close(dqkv, torch.stack(grads, dim=2))
    kv = qkv.detach()[:, :, 1:].clone().requires_grad_()
    (dkv,) = torch.autograd.grad(flash_attn.flash_attn_kvpacked_func(q, kv, causal=True), kv, dout)
    torch.testing.assert_close(dkv, torch.stack(grads[1:], dim=2))


def test_lse_is_not_differentiable_and_grads_flow_from_out():
    q, k, v = make_qkv((1, 8, 2, 16), (1, 8, 2, 16), requires_grad=True)
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad
    out.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_deterministic_backward_is_bitwise_repeatable():
    q, k, v = make_qkv((1, 40, 4, 32), (1, 40, 2, 32), requires_grad=True)
    dout = torch.randn(q.shape)
    fa = lambda *x: flash_attn.flash_attn_func(*x, causal=True, deterministic=True)
    first = grads_of(fa, (q, k, v), dout)[1]
    second = grads_of(fa, (q, k, v), dout)[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ---- custom ops and torch.compile -------------------------------------------------------------


# flashcore::fwd's arguments after q, k, v: dense, no ALiBi, no dropout seed, default scale,
# causal, no window/softcap, automatic backend, non-deterministic, no dropout.
OP_SETTINGS = (None, None, None, None, 0, 0, 0.0, True, -1, -1, 0.0, 0, False, 0.0)


def test_custom_op_opcheck():
    from torch.library import opcheck

    q, k, v = make_qkv((1, 12, 2, 16), (1, 10, 1, 16), requires_grad=True)
    opcheck(torch.ops.flashcore.fwd.default, (q, k, v) + OP_SETTINGS)
    # Heads-major q: the fake's output strides must be the real op's (both take q's layout).
    q_heads_major = torch.randn(1, 2, 12, 16).transpose(1, 2).requires_grad_()
    opcheck(torch.ops.flashcore.fwd.default, (q_heads_major, k, v) + OP_SETTINGS)
    q, k, v = (x.detach() for x in (q, k, v))
    out, lse = torch.ops.flashcore.fwd(q, k, v, *OP_SETTINGS)
    opcheck(torch.ops.flashcore.bwd.default, (torch.randn_like(out), q, k, v, out, lse) + OP_SETTINGS)


def test_eager_fast_path_matches_custom_op():
    # Eager calls on plain tensors skip the op dispatcher; both paths must agree bit for bit.
    from flashcore import _torch

    q, k, v = make_qkv((2, 21, 4, 32), (2, 27, 2, 32), requires_grad=True)
    dout = torch.randn(q.shape)
    settings = (None, None, None, None, 0, 0, 0.0, True, 3, -1, 2.0, 0, False, 0.0)
    fast = lambda *x: flash_attn.flash_attn_func(*x, causal=True, window_size=(3, -1), softcap=2.0)
    via_op = lambda *x: _torch._fwd(*x, *settings)[0]
    assert _torch._eager_fast_path_ok((q, k, v))
    out_fast, grads_fast = grads_of(fast, (q, k, v), dout)
    out_op, grads_op = grads_of(via_op, (q, k, v), dout)
    assert torch.equal(out_fast, out_op)
    for a, b in zip(grads_fast, grads_op):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(fast(q, k, v), out_fast)


def test_dispatch_modes_see_the_custom_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = make_qkv((1, 8, 2, 16), (1, 8, 2, 16))
    graph = make_fx(lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=True))(q, k, v)
    assert "flashcore.fwd" in str(graph.graph)


def _compile_and_compare(backend):
    q, k, v = make_qkv((2, 24, 4, 32), (2, 30, 2, 32), requires_grad=True)
    dout = torch.randn(q.shape)

    def step(q, k, v):
        out = flash_attn.flash_attn_func(q, k, v, causal=True, window_size=(6, -1), softcap=4.0)
        return out * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    out, grads = grads_of(compiled, (q, k, v), dout)
    ref_out, ref_grads = grads_of(step, (q, k, v), dout)
    torch.testing.assert_close(out, ref_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_torch_compile_fullgraph_aot_eager():
    _compile_and_compare("aot_eager")


def test_torch_compile_fullgraph_inductor():
    try:
        _compile_and_compare("inductor")
    except Exception as error:  # noqa: BLE001 - only toolchain problems are skipped
        text = f"{type(error).__name__}: {error}"
        if any(word in text for word in ("CppCompileError", "InvalidCxxCompiler", "compiler",
                                         "Python.h", "cannot find -l")):
            pytest.skip(f"torch.compile toolchain unavailable: {text[:200]}")
        raise


def test_torch_compile_varlen_fullgraph():
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    q, k, v = make_qkv((16, 2, 16), (16, 2, 16), requires_grad=True)

    def step(q, k, v):
        return flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))


def test_paged_kv_block_table_eager_and_compiled():
    # flash_attn_varlen_func's block_table on the CPU: the same bits as the packed call; the
    # custom op under torch.compile too.
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    q, k, v = make_qkv((16, 2, 16), (16, 2, 16))
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    k_pages, v_pages = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    for b, (start, stop) in enumerate(((0, 5), (5, 16))):
        for j in range(stop - start):
            k_pages[table[b, j // 8], j % 8] = k[start + j]
            v_pages[table[b, j // 8], j % 8] = v[start + j]
    packed = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True)

    def step(q, k_pages, v_pages):
        return flash_attn.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, 11, 11, causal=True, block_table=table)

    assert torch.equal(step(q, k_pages, v_pages), packed)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k_pages, v_pages), packed)
    with pytest.raises(NotImplementedError, match=r"^block_table: paged K/V is forward only"):
        step(q.requires_grad_(), k_pages, v_pages)


# ---- ALiBi ---------------------------------------------------------------------------------------
# "auto" is the default backend (cpu_flash on a CPU); cpu_reference is the fp64 oracle.

ALIBI_BACKENDS = ["auto", "cpu_reference"]


@pytest.fixture(params=ALIBI_BACKENDS)
def fa_backend(request):
    """The flash_attn_* calls of the test run on this backend."""
    flash_attn.set_default_backend(request.param)
    yield request.param
    flash_attn.set_default_backend("auto")


def alibi_slopes(batch, heads, per_batch):
    """float32 slopes (batch, heads) or (heads,), large enough to reorder the softmax over a few
    dozen positions."""
    return torch.rand((batch, heads) if per_batch else (heads,)) * 0.95 + 0.05


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("per_batch", [False, True], ids=["heads", "batch_heads"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(29, 47), (47, 29)])
def test_alibi_autograd_fp32_matches_float64_math(fa_backend, mask, per_batch, seqlen_q, seqlen_k):
    # GQA: 4 query heads on 2 KV heads.
    options = MASKS[mask]
    q, k, v = make_qkv((2, seqlen_q, 4, 32), (2, seqlen_k, 2, 32), requires_grad=True)
    dout = torch.randn(q.shape)
    slopes = alibi_slopes(2, 4, per_batch)
    out, lse, _ = flash_attn.flash_attn_func(
        q, k, v, causal=options.get("causal", False), window_size=options.get("window", (-1, -1)),
        softcap=options.get("softcap", 0.0), alibi_slopes=slopes, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_attention(*inputs64, alibi_slopes=slopes, **options)
    ref_grads = torch.autograd.grad(ref_out, inputs64, dout.double())
    assert relative_error(out, ref_out) < FP32_RELATIVE_TOLERANCE
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert relative_error(lse[finite], ref_lse[finite]) < FP32_RELATIVE_TOLERANCE
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.shape == want.shape and got.dtype == torch.float32
        assert relative_error(got, want) < FP32_RELATIVE_TOLERANCE, name


def test_alibi_autograd_varlen_with_empty_sequences(fa_backend):
    # Positions count inside each sequence; sequence 1 has no queries, sequence 2 no keys.
    lengths_q, lengths_k = [5, 0, 9, 3], [6, 4, 0, 3]
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32)
    q, k, v = make_qkv((int(cu_q[-1]), 4, 16), (int(cu_k[-1]), 2, 16), requires_grad=True)
    dout = torch.randn(q.shape)
    slopes = alibi_slopes(len(lengths_q), 4, per_batch=True)
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                            causal=True, alibi_slopes=slopes)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lengths_q)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lengths_q[b] == 0:
            continue
        inputs64 = [x.detach()[r][None].double().requires_grad_() for x, r in ((q, rq), (k, rk), (v, rk))]
        reference = lambda *x: reference_attention(*x, causal=True, alibi_slopes=slopes[b])[0]
        ref_out, ref_grads = grads_of(reference, inputs64, dout[rq][None].double())
        torch.testing.assert_close(out[rq][None].double(), ref_out, rtol=1e-5, atol=1e-6)
        for got, want, rows in zip(grads, ref_grads, (rq, rk, rk)):
            torch.testing.assert_close(got[rows][None].double(), want, rtol=1e-5, atol=1e-6)
    # Sequence 2 (no keys): out 0 and no gradient reaches its queries.
    no_keys = slice(int(cu_q[2]), int(cu_q[3]))
    assert torch.all(out[no_keys] == 0) and torch.all(grads[0][no_keys] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_alibi_forward_low_precision(fa_backend, dtype):
    q, k, v = make_qkv((1, 64, 2, 64), (1, 96, 2, 64), dtype)
    slopes = alibi_slopes(1, 2, per_batch=False)
    out = flash_attn.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    assert out.dtype == dtype
    ref, _ = reference_attention(q, k, v, causal=True, alibi_slopes=slopes)
    same, _ = reference_attention(q, k, v, causal=True, alibi_slopes=slopes, dtype=torch.float32)
    same_error = (same.to(dtype).double() - ref).abs().max().item()
    atol = 2 * (ref.to(dtype) + 0.3 - 0.3 - ref.to(dtype)).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * same_error + atol


def test_alibi_slopes_get_no_gradient(fa_backend):
    # As in flash_attn: slopes that require grad are read, never differentiated (eager path and
    # custom op alike).
    from flashcore import _torch

    q, k, v = make_qkv((1, 12, 2, 16), (1, 15, 2, 16), requires_grad=True)
    slopes = alibi_slopes(1, 2, per_batch=False).requires_grad_()
    out = flash_attn.flash_attn_func(q, k, v, alibi_slopes=slopes)
    out.sum().backward()
    assert slopes.grad is None and all(x.grad is not None for x in (q, k, v))
    settings = (None, None, slopes, None, 0, 0, 0.0, False, -1, -1, 0.0, _torch.backend_id(fa_backend), False, 0.0)
    out_op = _torch._fwd(q, k, v, *settings)[0]
    assert torch.equal(out_op, out)
    grads = torch.autograd.grad(out_op.sum(), (q, k, v, slopes), allow_unused=True)
    assert grads[3] is None
    assert all(torch.equal(g, x.grad) for g, x in zip(grads, (q, k, v)))


@pytest.mark.parametrize("backend", ALIBI_BACKENDS)
def test_alibi_custom_op_opcheck(backend):
    from torch.library import opcheck

    from flashcore import _torch

    q, k, v = make_qkv((2, 12, 2, 16), (2, 10, 1, 16), requires_grad=True)
    settings = (None, None, alibi_slopes(2, 2, per_batch=True), None, 0, 0, 0.0, True, -1, -1, 0.0,
                _torch.backend_id(backend), False, 0.0)
    opcheck(torch.ops.flashcore.fwd.default, (q, k, v) + settings)
    q, k, v = (x.detach() for x in (q, k, v))
    out, lse = torch.ops.flashcore.fwd(q, k, v, *settings)
    opcheck(torch.ops.flashcore.bwd.default, (torch.randn_like(out), q, k, v, out, lse) + settings)


def test_alibi_torch_compile_fullgraph(fa_backend):
    q, k, v = make_qkv((2, 24, 4, 32), (2, 30, 2, 32), requires_grad=True)
    dout = torch.randn(q.shape)
    slopes = alibi_slopes(2, 4, per_batch=True)

    def step(q, k, v, slopes):
        return flash_attn.flash_attn_func(q, k, v, causal=True, softcap=4.0, alibi_slopes=slopes) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out, grads = grads_of(lambda *x: compiled(*x, slopes), (q, k, v), dout)
    ref_out, ref_grads = grads_of(lambda *x: step(*x, slopes), (q, k, v), dout)
    torch.testing.assert_close(out, ref_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_alibi_dlpack_api_with_torch_tensors():
    q, k, v = make_qkv((1, 9, 2, 16), (1, 11, 2, 16))
    slopes = alibi_slopes(1, 2, per_batch=True)
    options = dict(causal=True, alibi_slopes=slopes, backend="cpu_reference")
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, **options)
    inputs64 = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*inputs64, causal=True, alibi_slopes=slopes)
    assert relative_error(out, ref) < FP32_RELATIVE_TOLERANCE
    dout = torch.randn(q.shape)
    grads = flashcore.attention_backward(dout, q, k, v, out, lse, **options)
    for got, want in zip(grads, torch.autograd.grad(ref, inputs64, dout.double())):
        assert relative_error(got, want) < FP32_RELATIVE_TOLERANCE


# ---- errors ------------------------------------------------------------------------------------


def test_error_float64_names_q():
    q, k, v = make_qkv((1, 4, 2, 16), (1, 4, 2, 16), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^q: "):
        flash_attn.flash_attn_func(q, k, v)


def test_error_mismatched_shapes_name_the_argument():
    q, k, v = make_qkv((1, 4, 2, 16), (1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"^k: head_dim"):
        flash_attn.flash_attn_func(q, k, v)
    q, k, v = make_qkv((1, 4, 3, 16), (1, 4, 2, 16))
    with pytest.raises(ValueError, match=r"^k: "):
        flash_attn.flash_attn_func(q, k, v)


def test_error_unsupported_features():
    q, k, v = make_qkv((1, 4, 2, 16), (1, 4, 2, 16))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="dropout_p: not supported with a block_table"):
        flash_attn.flash_attn_varlen_func(q[0], k, v, cu, cu, 4, 4, dropout_p=0.5, block_table=table)
    with pytest.raises(ValueError, match=r"dropout_p: 1.000000 is outside \[0, 1\)"):
        flash_attn.flash_attn_func(q, k, v, dropout_p=1.0)


@pytest.mark.parametrize(
    "slopes,error,message",
    [
        (torch.ones(2, dtype=torch.float16), ValueError, r"^alibi_slopes: dtype float16 .*float32"),
        (torch.ones(2, dtype=torch.float64), ValueError, r"^alibi_slopes: dtype torch.float64"),
        (torch.ones(3), ValueError, r"^alibi_slopes: shape"),  # heads_q is 2
        (torch.ones(3, 2), ValueError, r"^alibi_slopes: shape"),  # batch is 1
        (torch.ones(1, 4)[:, ::2], ValueError, r"^alibi_slopes: .*stride"),
        (torch.ones(2, device="meta"), ValueError, r"^alibi_slopes: device meta"),
        ([0.5, 0.25], TypeError, r"^alibi_slopes: expected a torch.Tensor"),
    ],
    ids=["float16", "float64", "heads", "batch", "strided", "meta", "list"],
)
def test_error_bad_alibi_slopes(slopes, error, message):
    # flash_attn takes float32 slopes only; nothing is converted, the call names the argument.
    q, k, v = make_qkv((1, 4, 2, 16), (1, 4, 2, 16), requires_grad=True)
    for backend in ALIBI_BACKENDS:
        flash_attn.set_default_backend(backend)
        try:
            with pytest.raises(error, match=message):
                flash_attn.flash_attn_func(q, k, v, alibi_slopes=slopes)
        finally:
            flash_attn.set_default_backend("auto")


def test_error_float_cu_seqlens():
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0.0, 8.0])
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_attn.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)


# ---- framework-neutral layer with torch tensors -----------------------------------------------


def test_dlpack_api_accepts_torch_tensors_requiring_grad():
    q, k, v = make_qkv((1, 9, 2, 16), (1, 11, 2, 16), requires_grad=True)
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and lse.shape == (1, 2, 9)
    ref, _ = reference_attention(q.detach(), k.detach(), v.detach(), causal=True)
    assert relative_error(out, ref) < FP32_RELATIVE_TOLERANCE
    dq, dk, dv = flashcore.attention_backward(torch.ones_like(out), q, k, v, out, lse, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_varlen_heads_major_q_gives_out_in_its_layout():
    # Packed varlen q viewed (total, heads, d) from (heads, total, d) storage: out takes q's layout
    # and the values, lse and gradients of the same call on a contiguous q.
    cu = torch.tensor([0, 13, 13, 40], dtype=torch.int32)
    q = torch.randn(3, 40, 16).transpose(0, 1)
    k, v = torch.randn(40, 3, 16), torch.randn(40, 3, 16)
    dout = torch.randn(40, 3, 16)
    results = []
    for query in (q.contiguous(), q):
        inputs = [x.detach().clone().requires_grad_() for x in (query, k, v)]
        out, lse, _ = flash_attn.flash_attn_varlen_func(*inputs, cu, cu, 27, 27, causal=True,
                                                         return_attn_probs=True)
        grads = torch.autograd.grad(out, inputs, dout)
        assert out.stride() == query.stride() and grads[0].stride() == query.stride()
        results.append((out, lse) + grads)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


# ---- dropout ------------------------------------------------------------------------------------
# The mask comes from an independent numpy replica of the library's rule (attention_reference's
# dropout_keep_mask) and the seed the call draws from torch's generator: the library, its
# autograd and its seed plumbing are all checked against plain torch math.

import numpy as np  # noqa: E402
from attention_reference import dropout_keep_mask  # noqa: E402


def drawn_seed(seed):
    """The mask seed a flashcore call draws right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64))


def keep_masks(p, mask_seed, batch, heads, seqlen_q, seqlen_k):
    """(batch, heads, seqlen_q, seqlen_k) bool keep mask of a dense call."""
    return torch.from_numpy(np.stack([
        np.stack([dropout_keep_mask(p, mask_seed, 0, b * heads + h, seqlen_q, seqlen_k) for h in range(heads)])
        for b in range(batch)]))


@pytest.mark.parametrize("backend", ["auto", "cpu_reference"])
@pytest.mark.parametrize("mask,p", [(dict(), 0.17), (dict(causal=True), 0.5), (dict(window=(20, 5), softcap=5.0), 0.3)],
                         ids=["plain", "causal", "window_softcap"])
def test_dropout_forward_and_autograd_match_torch_math(backend, mask, p):
    q, k, v = make_qkv((2, 70, 4, 16), (2, 90, 2, 16), requires_grad=True)
    dout = torch.randn_like(q)
    flash_attn.set_default_backend(backend)
    try:
        torch.manual_seed(11)
        out = flash_attn.flash_attn_func(q, k, v, dropout_p=p, **{"window_size" if key == "window" else key: value
                                                                  for key, value in mask.items()})
        grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        flash_attn.set_default_backend("auto")
    keep = keep_masks(p, drawn_seed(11), 2, 4, 70, 90)
    ref_out, ref_grads = grads_of(lambda *x: reference_attention(*x, **mask, dropout=(p, keep))[0], (q, k, v), dout)
    assert relative_error(out, ref_out) < FP32_RELATIVE_TOLERANCE
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert relative_error(got, want) < FP32_RELATIVE_TOLERANCE, name
    # The mask really drops about p of the entries, and dropping them moved the output.
    assert abs((~keep).float().mean().item() - p) < 0.05
    plain = reference_attention(q, k, v, **mask)[0]
    assert relative_error(out, plain) > 0.05


def test_dropout_seed_follows_torch_manual_seed():
    q, k, v = make_qkv((1, 40, 2, 16), (1, 40, 2, 16))
    torch.manual_seed(3)
    first = flash_attn.flash_attn_func(q, k, v, dropout_p=0.4)
    second = flash_attn.flash_attn_func(q, k, v, dropout_p=0.4)
    torch.manual_seed(3)
    again = flash_attn.flash_attn_func(q, k, v, dropout_p=0.4)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)  # each call draws a fresh mask
    assert torch.equal(flash_attn.flash_attn_func(q, k, v, dropout_p=0.0), flash_attn.flash_attn_func(q, k, v))


def test_dropout_varlen_and_packed_forms():
    q, k, v = make_qkv((50, 4, 16), (80, 2, 16), requires_grad=True)
    cu_q = torch.tensor([0, 20, 20, 50], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 45, 80], dtype=torch.int32)
    torch.manual_seed(5)
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 35, dropout_p=0.25, causal=True)
    mask_seed = drawn_seed(5)
    for b in range(3):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        sq, sk = rows.stop - rows.start, keys.stop - keys.start
        if sq == 0:
            continue
        keep = torch.from_numpy(np.stack([dropout_keep_mask(0.25, mask_seed, 0, b * 4 + h, sq, sk)
                                          for h in range(4)]))[None]  # problem b * heads_q + h
        ref = reference_attention(q[None, rows], k[None, keys], v[None, keys], causal=True, dropout=(0.25, keep))[0]
        assert relative_error(out[None, rows], ref) < FP32_RELATIVE_TOLERANCE, b
    # The varlen backward drops what the forward dropped: out is linear in v for a fixed mask, so
    # dv . direction is exactly the change of sum(out * dout) along it (the same seed again).
    dout = torch.randn_like(out)
    out.backward(dout)
    direction = torch.randn_like(v)
    torch.manual_seed(5)
    moved = flash_attn.flash_attn_varlen_func(q.detach(), k.detach(), (v + direction).detach(), cu_q, cu_k, 30, 35,
                                              dropout_p=0.25, causal=True)
    expected = ((moved - out.detach()) * dout).double().sum()
    assert abs((v.grad * direction).double().sum() - expected) < 1e-3 * (1 + abs(expected))
    qkv = torch.randn(1, 30, 3, 2, 16)
    torch.manual_seed(6)
    packed = flash_attn.flash_attn_qkvpacked_func(qkv, dropout_p=0.5)
    torch.manual_seed(6)
    unpacked = flash_attn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p=0.5)
    assert torch.equal(packed, unpacked)


def test_dropout_custom_op_and_compile():
    from torch.library import opcheck

    q, k, v = make_qkv((1, 12, 2, 16), (1, 10, 1, 16), requires_grad=True)
    settings = (None, None, None, torch.tensor([1234]), 0, 0, 0.0, True, -1, -1, 0.0, 0, False, 0.3)
    opcheck(torch.ops.flashcore.fwd.default, (q, k, v) + settings)
    q0, k0, v0 = (x.detach() for x in (q, k, v))
    out, lse = torch.ops.flashcore.fwd(q0, k0, v0, *settings)
    opcheck(torch.ops.flashcore.bwd.default, (torch.randn_like(out), q0, k0, v0, out, lse) + settings)

    compiled = torch.compile(lambda q, k, v: flash_attn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True),
                             fullgraph=True)
    out = compiled(q, k, v)
    out.sum().backward()
    plain = flash_attn.flash_attn_func(q0, k0, v0, causal=True)
    assert torch.isfinite(out).all() and relative_error(out, plain) > 0.05
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    # The compiled op with a fixed seed tensor: its forward and its backward give eager's bits, so the
    # compiled backward draws the forward's mask.
    seed = torch.tensor([99])
    op = lambda q, k, v: torch.ops.flashcore.fwd(q, k, v, None, None, None, seed, 0, 0, 0.0, True, -1, -1, 0.0, 0,
                                                 True, 0.3)[0]
    leaves = [x.detach().clone().requires_grad_() for x in (q0, k0, v0)]
    dout = torch.randn_like(q0)
    eager_out, eager_grads = grads_of(op, leaves, dout)
    compiled_out, compiled_grads = grads_of(torch.compile(op, fullgraph=True), leaves, dout)
    assert torch.equal(eager_out, compiled_out)
    assert all(torch.equal(a, b) for a, b in zip(eager_grads, compiled_grads))
    with pytest.raises(ValueError, match="dropout_seed: a one-element integer tensor"):
        torch.ops.flashcore.fwd(q0, k0, v0, None, None, None, None, 0, 0, 0.0, True, -1, -1, 0.0, 0, False, 0.3)

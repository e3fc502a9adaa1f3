"""flashcore's Python package on numpy arrays (CPU backends): runs in CI without GPU or torch.

Every result is checked against an fp64 numpy reference written here (bottom-right aligned
causal/window masks, softcap, ALiBi, GQA, varlen), with TESTING.md's tolerance rule for float16 and
bfloat16 (error <= 2x the error of a naive implementation in the same precision + one rounding)
and a relative error below 1e-5 for float32. Outputs are poisoned with NaN first so that an
element left unwritten fails. Bad inputs must raise ValueError/TypeError naming the argument.
"""

import zlib

import numpy as np
import pytest

import flashcore
import flashcore.flash_attn_interface as fai
from attention_reference import allowed_keys, alibi_bias, scores as _scores, sequence_forward as _sequence_forward

CPU_BACKENDS = ["cpu_flash", "cpu_reference"]
FP32_RELATIVE_TOLERANCE = 1e-5
LOW_PRECISION_FACTOR_FWD = 2  # TESTING.md: 2x the same-precision error for O and LSE
LOW_PRECISION_FACTOR_BWD = 3  # and 3x for gradients
ROUNDING_PROBE = 0.3  # FA3's atol: the rounding of one add at the reference's magnitude

try:
    import ml_dtypes

    BFLOAT16 = ml_dtypes.bfloat16
except ImportError:  # optional
    BFLOAT16 = None


# ---- fp64 reference -----------------------------------------------------------------------------


def _sequence_backward(q, k, v, dout, scale, causal, window, softcap, compute_dtype, round_dtype,
                       stored_out=None, slopes=None):
    """Gradients of one sequence: dq (sq, hq, d), dk/dv (sk, hkv, d). compute_dtype float64 is
    the truth; float32 with round_dtype = the input dtype is the naive same-precision backward
    (P and dS rounded to the dtype before their products, as tensor-core kernels do), whose
    D = rowsum(dO * O) reads `stored_out` (the O the backend's forward stored, as the backend's
    backward does) when given. slopes (hq,): ALiBi, a constant bias of the scores, so it enters
    only P (the softcap's derivative reads the capped scores without it)."""
    heads_kv = k.shape[1]
    group = q.shape[1] // heads_kv
    q, k, v, dout = (x.astype(compute_dtype) for x in (q, k, v, dout))
    kx, vx = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    out, lse = _sequence_forward(q, k, v, scale, causal, window, softcap, compute_dtype, round_dtype, slopes)
    if stored_out is not None:
        out = stored_out.astype(compute_dtype)
    rounded = lambda x: x.astype(round_dtype).astype(compute_dtype)
    s = _scores(q, kx, scale, softcap)
    biased = s + alibi_bias(q.shape[0], k.shape[0], slopes, compute_dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(np.isfinite(lse)[..., None], np.exp(biased - lse[..., None]), 0)
    p = np.where(allowed_keys(q.shape[0], k.shape[0], causal, window)[None], p, 0)
    dp = np.einsum("ihd,jhd->hij", dout, vx)
    delta = np.einsum("ihd,ihd->hi", dout, rounded(out))[..., None]
    ds = p * (dp - delta)
    if softcap > 0:
        ds = ds * (1 - (s / softcap) ** 2)
    ds, p = rounded(ds), rounded(p)
    dq = scale * np.einsum("hij,jhd->ihd", ds, kx)
    dkx = scale * np.einsum("hij,ihd->jhd", ds, q)
    dvx = np.einsum("hij,ihd->jhd", p, dout)
    fold = lambda x: x.reshape(x.shape[0], heads_kv, group, x.shape[-1]).sum(axis=2)
    return dq, fold(dkx), fold(dvx)


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k):
    """(q rows, k rows) index pairs per sequence, for dense (4-D) or varlen (3-D) inputs."""
    if cu_seqlens_q is None:
        return [((b,), (b,)) for b in range(q.shape[0])]
    return [
        ((slice(cu_seqlens_q[b], cu_seqlens_q[b + 1]),), (slice(cu_seqlens_k[b], cu_seqlens_k[b + 1]),))
        for b in range(len(cu_seqlens_q) - 1)
    ]


def _sequence_slopes(alibi, b):
    """Sequence b's ALiBi slopes (hq,) from slopes (hq,) or (batch, hq); None without ALiBi."""
    if alibi is None:
        return None
    return alibi[b] if alibi.ndim == 2 else alibi


def reference_forward(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                      cu_seqlens_q=None, cu_seqlens_k=None, same_precision=False, alibi=None):
    """out and lse in the C ABI layouts; fp64 truth, or the naive same-precision result."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute, p_dtype = (np.float32, q.dtype) if same_precision else (np.float64, np.float64)
    out = np.zeros(q.shape, dtype=compute)
    varlen = cu_seqlens_q is not None
    lse = np.zeros((q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1]))
    for b, (qi, ki) in enumerate(_sequences(q, k, cu_seqlens_q, cu_seqlens_k)):
        o, l = _sequence_forward(q[qi], k[ki], v[ki], scale, causal, window, softcap, compute, p_dtype,
                                 _sequence_slopes(alibi, b))
        out[qi] = o
        if varlen:
            lse[:, qi[0]] = l
        else:
            lse[qi] = l
    if same_precision:
        out = out.astype(q.dtype)
    return out, lse


def reference_backward(q, k, v, dout, *, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                       cu_seqlens_q=None, cu_seqlens_k=None, same_precision=False, stored_out=None,
                       alibi=None):
    """dq, dk, dv; fp64 truth, or the naive same-precision result (in q's dtype), which takes D
    from `stored_out` (the backend's O) when given."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute, round_dtype = (np.float32, q.dtype) if same_precision else (np.float64, np.float64)
    dq, dk, dv = (np.zeros(x.shape, compute) for x in (q, k, v))
    for b, (qi, ki) in enumerate(_sequences(q, k, cu_seqlens_q, cu_seqlens_k)):
        out_i = None if stored_out is None or not same_precision else stored_out[qi]
        dq[qi], dk[ki], dv[ki] = _sequence_backward(q[qi], k[ki], v[ki], dout[qi], scale, causal,
                                                    window, softcap, compute, round_dtype, out_i,
                                                    _sequence_slopes(alibi, b))
    if same_precision:
        return tuple(x.astype(q.dtype) for x in (dq, dk, dv))
    return dq, dk, dv


# ---- comparison rules ------------------------------------------------------------------------


def assert_fp32_close(actual, expected, name):
    actual = np.asarray(actual, dtype=np.float64)
    assert not np.isnan(actual).any(), f"{name}: NaN in result"
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(actual[~finite], expected[~finite], err_msg=f"{name}: -inf rows")
    norm = np.linalg.norm(expected[finite])
    error = np.linalg.norm(actual[finite] - expected[finite])
    assert error <= FP32_RELATIVE_TOLERANCE * max(norm, 1e-30), f"{name}: relative error {error / norm:.3g}"


def rounding_atol(expected, dtype):
    x = expected.astype(dtype)
    probe = np.asarray(ROUNDING_PROBE, dtype=dtype)
    return 2 * float(np.max(np.abs(((x + probe) - probe).astype(np.float64) - x.astype(np.float64)),
                            initial=0.0))


def assert_low_precision_close(actual, expected, same, dtype, name, factor=LOW_PRECISION_FACTOR_FWD):
    """TESTING.md: max|X - ref| <= factor * max|X_same - ref| + atol; NaN never passes."""
    actual = np.asarray(actual).astype(np.float64)
    same = np.asarray(same).astype(np.float64)
    assert not np.isnan(actual).any(), f"{name}: NaN in result"
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(actual[~finite], expected[~finite], err_msg=f"{name}: -inf rows")
    error = np.max(np.abs(actual[finite] - expected[finite]), initial=0.0)
    same_error = np.max(np.abs(same[finite] - expected[finite]), initial=0.0)
    atol = rounding_atol(expected[finite], dtype)
    assert error <= factor * same_error + atol, (
        f"{name}: max error {error:.3g} > {factor} x {same_error:.3g} + {atol:.3g}")


def random_inputs(rng, dtype, q_shape, kv_shape):
    make = lambda shape: rng.standard_normal(shape).astype(np.float32).astype(dtype)
    return make(q_shape), make(kv_shape), make(kv_shape)


def poisoned_like(x, shape=None, dtype=None):
    return np.full(x.shape if shape is None else shape, np.nan, dtype=x.dtype if dtype is None else dtype)


def check_forward(q, k, v, out, lse, **mask):
    """Compares out/lse with the reference by q's dtype."""
    ref_out, ref_lse = reference_forward(q, k, v, **mask)
    if q.dtype == np.float32:
        assert_fp32_close(out, ref_out, "out")
        assert_fp32_close(lse, ref_lse, "lse")
    else:
        same_out, same_lse = reference_forward(q, k, v, same_precision=True, **mask)
        assert_low_precision_close(out, ref_out, same_out, q.dtype, "out")
        assert_low_precision_close(lse, ref_lse, same_lse, np.float32, "lse")


@pytest.fixture
def rng(request):
    # Fresh inputs per case, reproducible per test id.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ---- package basics ----------------------------------------------------------------------------


def test_package_info():
    assert flashcore.__version__ == flashcore._C.version()
    assert flashcore.__version__.count(".") == 2
    assert isinstance(flashcore.build_info(), str) and flashcore.build_info()
    assert set(CPU_BACKENDS) <= set(flashcore.backends())
    for backend in CPU_BACKENDS:
        assert flashcore.backend_available(backend)
    assert flashcore.cuda_device_count() >= 0
    for device_id in range(flashcore.cuda_device_count()):
        assert " SMs, " in flashcore.cuda_device_description(device_id)
    with pytest.raises(ValueError, match="device_id: -1 is not a visible CUDA device"):
        flashcore.cuda_device_description(-1)
    with pytest.raises(ValueError, match="is not a visible CUDA device"):
        flashcore.cuda_device_description(flashcore.cuda_device_count())
    # flash_attn's names are importable from the package and from flash_attn_interface.
    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func"):
        assert getattr(flashcore, name) is getattr(fai, name)


# ---- forward through each CPU backend ----------------------------------------------------------

SEQLEN_PAIRS = [(1, 1), (1, 37), (3, 50), (37, 1), (64, 64), (113, 203), (203, 113)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_fp32(rng, backend, seqlen_q, seqlen_k, causal):
    q, k, v = random_inputs(rng, np.float32, (2, seqlen_q, 3, 40), (2, seqlen_k, 3, 40))
    out, lse = poisoned_like(q), poisoned_like(q, (2, 3, seqlen_q), np.float32)
    result = flashcore.attention_forward(q, k, v, out=out, lse=lse, return_lse=True,
                                         causal=causal, backend=backend)
    assert result[0] is out and result[1] is lse
    check_forward(q, k, v, out, lse, causal=causal)


LOW_PRECISION = [np.float16] + ([BFLOAT16] if BFLOAT16 is not None else [])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 37), (64, 64), (113, 203), (203, 113)])
def test_forward_low_precision(rng, backend, dtype, seqlen_q, seqlen_k):
    q, k, v = random_inputs(rng, dtype, (2, seqlen_q, 4, 64), (2, seqlen_k, 2, 64))
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, causal=True, backend=backend)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    check_forward(q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (6, 1), (4, 4)])
def test_gqa_mqa(rng, heads_q, heads_kv):
    q, k, v = random_inputs(rng, np.float32, (2, 33, heads_q, 32), (2, 47, heads_kv, 32))
    out, lse, probs = flashcore.flash_attn_func(q, k, v, return_attn_probs=True)
    assert probs.shape == (0,) and probs.dtype == out.dtype  # flash_attn's empty S_dmask
    check_forward(q, k, v, out, lse)


@pytest.mark.parametrize("window", [(5, -1), (-1, 3), (4, 2), (0, 0)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(40, 40), (17, 60), (60, 17)])
def test_sliding_window(rng, window, seqlen_q, seqlen_k):
    q, k, v = random_inputs(rng, np.float32, (1, seqlen_q, 2, 24), (1, seqlen_k, 2, 24))
    out, lse, _ = flashcore.flash_attn_func(q, k, v, window_size=window, return_attn_probs=True)
    check_forward(q, k, v, out, lse, window=window)


def test_window_with_causal(rng):
    q, k, v = random_inputs(rng, np.float32, (1, 30, 2, 16), (1, 50, 2, 16))
    out, lse, _ = flashcore.flash_attn_func(q, k, v, causal=True, window_size=(7, 5),
                                            return_attn_probs=True)
    check_forward(q, k, v, out, lse, causal=True, window=(7, 0))


def test_fully_masked_rows_give_zero_and_minus_inf(rng):
    # Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    q, k, v = random_inputs(rng, np.float32, (1, 9, 2, 16), (1, 4, 2, 16))
    out, lse, _ = flashcore.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert np.all(out[0, :5] == 0)
    assert np.all(lse[0, :, :5] == -np.inf)
    assert np.all(np.isfinite(lse[0, :, 5:]))
    check_forward(q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
def test_softcap(rng, softcap):
    q, k, v = random_inputs(rng, np.float32, (2, 31, 2, 32), (2, 45, 2, 32))
    q *= 4  # large scores so that the cap matters
    out, lse, _ = flashcore.flash_attn_func(q, k, v, softcap=softcap, causal=True,
                                            return_attn_probs=True)
    check_forward(q, k, v, out, lse, softcap=softcap, causal=True)


@pytest.mark.parametrize("scale", [0.05, 1.0, -0.3, 0.0])
def test_softmax_scale(rng, scale):
    q, k, v = random_inputs(rng, np.float32, (1, 20, 2, 16), (1, 30, 2, 16))
    out, lse, _ = flashcore.flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)
    # 0.0 is taken literally, as flash_attn does (uniform attention), not as "the default".
    check_forward(q, k, v, out, lse, scale=scale)


def test_large_logits_do_not_overflow(rng):
    q, k, v = random_inputs(rng, np.float32, (1, 16, 1, 32), (1, 24, 1, 32))
    q *= 300.0  # scores around 1e4
    out, lse, _ = flashcore.flash_attn_func(q, k, v, return_attn_probs=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    check_forward(q, k, v, out, lse)


# ---- varlen ------------------------------------------------------------------------------------


def varlen_case(rng, dtype, lengths_q, lengths_k, heads_q=4, heads_kv=2, head_dim=32):
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q, k, v = random_inputs(rng, dtype, (cu_q[-1], heads_q, head_dim), (cu_k[-1], heads_kv, head_dim))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_empty_sequences(rng, backend, causal):
    # Sequence 1 has no queries, sequence 2 no keys (its rows: out 0, lse -inf).
    lengths_q, lengths_k = [5, 0, 7, 33, 1], [9, 4, 0, 20, 1]
    q, k, v, cu_q, cu_k = varlen_case(rng, np.float32, lengths_q, lengths_k)
    out, lse = flashcore.attention_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                           max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k),
                                           return_lse=True, causal=causal, backend=backend)
    assert lse.shape == (4, cu_q[-1])
    no_keys = slice(cu_q[2], cu_q[3])
    assert np.all(out[no_keys] == 0) and np.all(lse[:, no_keys] == -np.inf)
    check_forward(q, k, v, out, lse, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_varlen_fa_api_int64_cu_seqlens_and_fp16(rng):
    lengths_q, lengths_k = [17, 3, 40], [17, 30, 2]
    q, k, v, cu_q, cu_k = varlen_case(rng, np.float16, lengths_q, lengths_k)
    out, lse, _ = flashcore.flash_attn_varlen_func(
        q, k, v, cu_q.astype(np.int64), cu_k.astype(np.int64), max(lengths_q), max(lengths_k),
        causal=True, window_size=(8, -1), return_attn_probs=True)
    check_forward(q, k, v, out, lse, causal=True, window=(8, -1), cu_seqlens_q=cu_q,
                  cu_seqlens_k=cu_k)


def test_varlen_matches_dense_per_sequence(rng):
    lengths = [12, 30, 1]
    q, k, v, cu_q, _ = varlen_case(rng, np.float32, lengths, lengths)
    out = flashcore.flash_attn_varlen_func(q, k, v, cu_q, cu_q, max(lengths), max(lengths), causal=True)
    for b, length in enumerate(lengths):
        rows = slice(cu_q[b], cu_q[b + 1])
        dense = flashcore.flash_attn_func(q[None, rows], k[None, rows], v[None, rows], causal=True)
        np.testing.assert_allclose(out[rows], dense[0], rtol=1e-6, atol=1e-6)


def paged_copy(rng, k, cu_k, page_size, spare=3):
    """k (total_k, heads, d) as shuffled pages (num_pages, page_size, heads, d) of random data
    plus the int32 block table placing each sequence's keys."""
    lengths = np.diff(cu_k)
    per_seq = max(1, int(max((n + page_size - 1) // page_size for n in lengths)))
    pages = len(lengths) * per_seq + spare
    paged = rng.standard_normal((pages, page_size) + k.shape[1:]).astype(k.dtype)
    table = rng.permutation(pages)[: len(lengths) * per_seq].reshape(len(lengths), per_seq).astype(np.int32)
    for b, n in enumerate(lengths):
        for j in range(n):
            paged[table[b, j // page_size], j % page_size] = k[cu_k[b] + j]
    return paged, table


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged_kv_block_table(rng, page_size, causal):
    lengths_q, lengths_k = [5, 0, 40], [300, 4, 41]
    q, k, v, cu_q, cu_k = varlen_case(rng, np.float32, lengths_q, lengths_k)
    k_pages, table = paged_copy(rng, k, cu_k, page_size)
    v_pages = np.zeros_like(k_pages)
    v_pages[...] = rng.standard_normal(v_pages.shape)
    for b, n in enumerate(np.diff(cu_k)):
        for j in range(n):
            v_pages[table[b, j // page_size], j % page_size] = v[cu_k[b] + j]
    out, lse, _ = flashcore.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                   causal=True if causal else False, block_table=table,
                                                   return_attn_probs=True)
    check_forward(q, k, v, out, lse, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    packed = flashcore.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal)
    np.testing.assert_array_equal(out, packed)  # same kernel, same tiles: the same bits


def test_varlen_paged_kv_errors(rng):
    q, k, v, cu_q, cu_k = varlen_case(rng, np.float32, [3, 4], [10, 20])
    k_pages, table = paged_copy(rng, k, cu_k, 8)
    args = (q, k_pages, k_pages, cu_q, cu_k, 4, 20)
    bad = table.copy()
    bad[1, 2] = 99
    with pytest.raises(ValueError, match=r"^block_table: entry \[1, 2\] is page 99"):
        flashcore.flash_attn_varlen_func(*args, block_table=bad)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: sequence 0 has 10 keys, more than its 1 pages of 8"):
        flashcore.flash_attn_varlen_func(*args, block_table=table[:, :1])
    with pytest.raises(ValueError, match=r"^k: has 3 dimensions, expected 4"):
        flashcore.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 20, block_table=table)


# ---- packed forms --------------------------------------------------------------------------------


def test_packed_forms_match_unpacked(rng):
    qkv = rng.standard_normal((2, 25, 3, 4, 32)).astype(np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    expected = flashcore.flash_attn_func(q, k, v, causal=True)
    np.testing.assert_array_equal(flashcore.flash_attn_qkvpacked_func(qkv, causal=True), expected)
    kv = np.ascontiguousarray(qkv[:, :, 1:])
    np.testing.assert_array_equal(flashcore.flash_attn_kvpacked_func(q, kv, causal=True), expected)
    check_forward(q, k, v, expected, reference_forward(q, k, v, causal=True)[1], causal=True)


def test_varlen_packed_forms_match_unpacked(rng):
    lengths = [7, 0, 19]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    qkv = rng.standard_normal((cu[-1], 3, 2, 16)).astype(np.float32)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    expected = flashcore.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19)
    got = flashcore.flash_attn_varlen_qkvpacked_func(qkv, cu, 19)
    np.testing.assert_array_equal(got, expected)
    got = flashcore.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, 19, 19)
    np.testing.assert_array_equal(got, expected)
    ref, _ = reference_forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert_fp32_close(expected, ref, "out")


# ---- layouts and inputs --------------------------------------------------------------------------


def test_strided_and_readonly_inputs(rng):
    big = rng.standard_normal((2, 40, 6, 32)).astype(np.float32)
    q = big[:, ::2, 1:5]  # rows and heads strided, head_dim contiguous
    k = big[:, 1:31, ::3]
    v = big[:, 5:35, 4:6]
    for x in (q, k, v):
        x.flags.writeable = False
    out, lse, _ = flashcore.flash_attn_func(q, k, v, return_attn_probs=True)
    check_forward(q, k, v, out, lse)


def test_non_contiguous_head_dim_is_copied_by_fa_api(rng):
    base = rng.standard_normal((1, 10, 2, 16, 2)).astype(np.float32)
    q = base[..., 0]  # head_dim stride 2
    k = np.ascontiguousarray(q)
    out = flashcore.flash_attn_func(q, k, k)
    np.testing.assert_allclose(out, flashcore.flash_attn_func(k, k, k), rtol=1e-6, atol=1e-7)


def test_default_backend_switch(rng):
    q, k, v = random_inputs(rng, np.float32, (1, 20, 2, 16), (1, 20, 2, 16))
    try:
        flashcore.set_default_backend("cpu_reference")
        ref_out = flashcore.flash_attn_func(q, k, v)
    finally:
        flashcore.set_default_backend("auto")
    np.testing.assert_allclose(flashcore.flash_attn_func(q, k, v), ref_out, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="backend"):
        flashcore.set_default_backend("no_such_backend")


# ---- backward through the public API -------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "mask",
    [dict(), dict(causal=True), dict(window=(6, 3)), dict(softcap=2.0, causal=True)],
    ids=["full", "causal", "window", "softcap"],
)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(23, 41), (41, 23)])
def test_backward_fp32(rng, backend, mask, seqlen_q, seqlen_k):
    q, k, v = random_inputs(rng, np.float32, (2, seqlen_q, 4, 32), (2, seqlen_k, 2, 32))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    options = dict(causal=mask.get("causal", False), window_size=mask.get("window", (-1, -1)),
                   softcap=mask.get("softcap", 0.0), backend=backend)
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, **options)
    dq, dk, dv = (poisoned_like(x) for x in (q, k, v))
    result = flashcore.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **options)
    assert result[0] is dq and result[1] is dk and result[2] is dv
    expected = reference_backward(q, k, v, dout, **mask)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        assert_fp32_close(got, want, name)


def test_backward_varlen_with_empty_sequences(rng):
    lengths_q, lengths_k = [6, 0, 11, 4], [8, 5, 0, 4]
    q, k, v, cu_q, cu_k = varlen_case(rng, np.float32, lengths_q, lengths_k)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    common = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, **common)
    grads = flashcore.attention_backward(dout, q, k, v, out, lse, **common)
    expected = reference_backward(q, k, v, dout, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_fp32_close(got, want, name)


def test_backward_fp16(rng):
    q, k, v = random_inputs(rng, np.float16, (1, 37, 4, 64), (1, 53, 2, 64))
    dout = rng.standard_normal(q.shape).astype(np.float16)
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, causal=True)
    grads = flashcore.attention_backward(dout, q, k, v, out, lse, causal=True)
    expected = reference_backward(q, k, v, dout, causal=True)
    same = reference_backward(q, k, v, dout, causal=True, same_precision=True, stored_out=out)
    for name, got, want, naive in zip(("dq", "dk", "dv"), grads, expected, same):
        assert got.dtype == np.float16
        assert_low_precision_close(got, want, naive, np.float16, name, LOW_PRECISION_FACTOR_BWD)


# ---- ALiBi ---------------------------------------------------------------------------------------
# "auto" is the backend a caller gets by default (cpu_flash on a CPU); cpu_reference is the fp64
# oracle. Both must match the reference above, which adds -slope * |i + sk - sq - j| per sequence.

ALIBI_BACKENDS = ["auto", "cpu_reference"]


@pytest.fixture(params=ALIBI_BACKENDS)
def fa_backend(request):
    """The flash_attn_* calls of the test run on this backend."""
    flashcore.set_default_backend(request.param)
    yield request.param
    flashcore.set_default_backend("auto")


def alibi_slopes(rng, batch, heads, per_batch):
    """Slopes (batch, heads) or (heads,), float32, drawn large enough that the bias reorders the
    softmax over a few dozen positions (flash_attn's tests draw them uniformly as well)."""
    return rng.uniform(0.05, 1.0, (batch, heads) if per_batch else (heads,)).astype(np.float32)


@pytest.mark.parametrize("per_batch", [False, True], ids=["heads", "batch_heads"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 37), (23, 41), (41, 23)])
def test_alibi_forward(rng, fa_backend, per_batch, causal, seqlen_q, seqlen_k):
    # GQA: 4 query heads on 2 KV heads; the slopes belong to the query heads.
    q, k, v = random_inputs(rng, np.float32, (2, seqlen_q, 4, 32), (2, seqlen_k, 2, 32))
    slopes = alibi_slopes(rng, 2, 4, per_batch)
    out, lse, _ = flashcore.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                            return_attn_probs=True)
    check_forward(q, k, v, out, lse, causal=causal, alibi=slopes)
    # The bias is large enough here that ignoring it would fail the check above.
    assert not np.allclose(out, reference_forward(q, k, v, causal=causal)[0], atol=1e-3)


@pytest.mark.parametrize(
    "mask",
    [dict(softcap=2.0), dict(softcap=5.0, causal=True), dict(window=(6, 3)), dict(window=(8, 2), causal=True)],
    ids=["softcap", "softcap_causal", "window", "window_causal"],
)
def test_alibi_with_softcap_and_window(rng, fa_backend, mask):
    q, k, v = random_inputs(rng, np.float32, (2, 30, 4, 32), (2, 45, 2, 32))
    q *= 4  # large scores so that the cap matters
    slopes = alibi_slopes(rng, 2, 4, per_batch=True)
    out, lse, _ = flashcore.flash_attn_func(
        q, k, v, causal=mask.get("causal", False), window_size=mask.get("window", (-1, -1)),
        softcap=mask.get("softcap", 0.0), alibi_slopes=slopes, return_attn_probs=True)
    if mask.get("causal"):
        mask = dict(mask, window=(mask.get("window", (-1, -1))[0], 0))
    check_forward(q, k, v, out, lse, alibi=slopes, **mask)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=lambda d: np.dtype(d).name)
def test_alibi_forward_low_precision(rng, fa_backend, dtype):
    q, k, v = random_inputs(rng, dtype, (2, 64, 4, 64), (2, 96, 2, 64))
    slopes = alibi_slopes(rng, 2, 4, per_batch=False)
    out, lse, _ = flashcore.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    assert out.dtype == q.dtype
    check_forward(q, k, v, out, lse, causal=True, alibi=slopes)


@pytest.mark.parametrize("per_batch", [False, True], ids=["heads", "batch_heads"])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_varlen_with_empty_sequences(rng, fa_backend, per_batch, causal):
    # Positions count inside each sequence. Sequence 1 has no queries, sequence 2 no keys.
    lengths_q, lengths_k = [5, 0, 7, 33, 1], [9, 4, 0, 20, 1]
    q, k, v, cu_q, cu_k = varlen_case(rng, np.float32, lengths_q, lengths_k)
    slopes = alibi_slopes(rng, len(lengths_q), 4, per_batch)
    out, lse, _ = flashcore.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                   causal=causal, alibi_slopes=slopes, return_attn_probs=True)
    no_keys = slice(cu_q[2], cu_q[3])
    assert np.all(out[no_keys] == 0) and np.all(lse[:, no_keys] == -np.inf)
    check_forward(q, k, v, out, lse, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi=slopes)


def test_alibi_packed_forms_match_unpacked(rng, fa_backend):
    qkv = rng.standard_normal((2, 25, 3, 4, 32)).astype(np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    slopes = alibi_slopes(rng, 2, 4, per_batch=True)
    expected = flashcore.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    assert_fp32_close(expected, reference_forward(q, k, v, causal=True, alibi=slopes)[0], "out")
    np.testing.assert_array_equal(flashcore.flash_attn_qkvpacked_func(qkv, causal=True, alibi_slopes=slopes),
                                  expected)
    kv = np.ascontiguousarray(qkv[:, :, 1:])
    np.testing.assert_array_equal(flashcore.flash_attn_kvpacked_func(q, kv, causal=True, alibi_slopes=slopes),
                                  expected)

    lengths = [7, 0, 19]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    qkv = rng.standard_normal((cu[-1], 3, 4, 16)).astype(np.float32)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    slopes = alibi_slopes(rng, len(lengths), 4, per_batch=True)
    expected = flashcore.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, alibi_slopes=slopes)
    assert_fp32_close(expected, reference_forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, alibi=slopes)[0],
                      "out")
    np.testing.assert_array_equal(flashcore.flash_attn_varlen_qkvpacked_func(qkv, cu, 19, alibi_slopes=slopes),
                                  expected)
    got = flashcore.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, 19, 19, alibi_slopes=slopes)
    np.testing.assert_array_equal(got, expected)


def test_alibi_paged_kv_is_served_or_declined(rng, fa_backend):
    # A block_table call takes ALiBi where its backend serves it (cpu_reference does): then the
    # result is the packed call's. A backend that does not says so; it never ignores the slopes.
    lengths_q, lengths_k = [5, 12], [20, 37]
    q, k, v, cu_q, cu_k = varlen_case(rng, np.float32, lengths_q, lengths_k)
    k_pages, table = paged_copy(rng, k, cu_k, 16)
    v_pages = rng.standard_normal(k_pages.shape).astype(np.float32)
    for b, n in enumerate(np.diff(cu_k)):
        for j in range(n):
            v_pages[table[b, j // 16], j % 16] = v[cu_k[b] + j]
    slopes = alibi_slopes(rng, 2, 4, per_batch=True)
    call = lambda k, v, **paged: flashcore.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, alibi_slopes=slopes, **paged)
    try:
        out = call(k_pages, v_pages, block_table=table)
    except NotImplementedError as error:
        assert fa_backend != "cpu_reference"
        assert str(error).startswith("alibi_slopes: ")
        return
    np.testing.assert_array_equal(out, call(k, v))
    check_forward(q, k, v, out, reference_forward(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                  alibi=slopes)[1], causal=True, cu_seqlens_q=cu_q,
                  cu_seqlens_k=cu_k, alibi=slopes)


@pytest.mark.parametrize("backend", ALIBI_BACKENDS)
@pytest.mark.parametrize("per_batch", [False, True], ids=["heads", "batch_heads"])
@pytest.mark.parametrize(
    "mask",
    [dict(), dict(causal=True), dict(window=(6, 3)), dict(softcap=2.0, causal=True)],
    ids=["full", "causal", "window", "softcap"],
)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(23, 41), (41, 23)])
def test_alibi_backward_fp32(rng, backend, per_batch, mask, seqlen_q, seqlen_k):
    q, k, v = random_inputs(rng, np.float32, (2, seqlen_q, 4, 32), (2, seqlen_k, 2, 32))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    slopes = alibi_slopes(rng, 2, 4, per_batch)
    options = dict(causal=mask.get("causal", False), window_size=mask.get("window", (-1, -1)),
                   softcap=mask.get("softcap", 0.0), alibi_slopes=slopes, backend=backend)
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, **options)
    check_forward(q, k, v, out, lse, alibi=slopes, **mask)
    dq, dk, dv = (poisoned_like(x) for x in (q, k, v))
    flashcore.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **options)
    expected = reference_backward(q, k, v, dout, alibi=slopes, **mask)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        assert_fp32_close(got, want, name)


@pytest.mark.parametrize("backend", ALIBI_BACKENDS)
def test_alibi_backward_varlen_with_empty_sequences(rng, backend):
    lengths_q, lengths_k = [6, 0, 11, 4], [8, 5, 0, 4]
    q, k, v, cu_q, cu_k = varlen_case(rng, np.float32, lengths_q, lengths_k)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    slopes = alibi_slopes(rng, len(lengths_q), 4, per_batch=True)
    common = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    options = dict(common, alibi_slopes=slopes, backend=backend)
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, **options)
    grads = flashcore.attention_backward(dout, q, k, v, out, lse, **options)
    expected = reference_backward(q, k, v, dout, alibi=slopes, **common)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_fp32_close(got, want, name)


@pytest.mark.parametrize("backend", ALIBI_BACKENDS)
def test_alibi_backward_fp16(rng, backend):
    q, k, v = random_inputs(rng, np.float16, (1, 37, 4, 64), (1, 53, 2, 64))
    dout = rng.standard_normal(q.shape).astype(np.float16)
    slopes = alibi_slopes(rng, 1, 4, per_batch=False)
    options = dict(causal=True, alibi_slopes=slopes, backend=backend)
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, **options)
    grads = flashcore.attention_backward(dout, q, k, v, out, lse, **options)
    expected = reference_backward(q, k, v, dout, causal=True, alibi=slopes)
    same = reference_backward(q, k, v, dout, causal=True, alibi=slopes, same_precision=True, stored_out=out)
    for name, got, want, naive in zip(("dq", "dk", "dv"), grads, expected, same):
        assert got.dtype == np.float16
        assert_low_precision_close(got, want, naive, np.float16, name, LOW_PRECISION_FACTOR_BWD)


@pytest.mark.parametrize(
    "slopes,message",
    [
        (np.ones(2, np.float16), r"^alibi_slopes: dtype float16 .*float32"),
        (np.ones(2, np.float64), r"^alibi_slopes: dtype float64 .*float32"),
        (np.ones(3, np.float32), r"^alibi_slopes: shape"),  # heads_q is 2
        (np.ones((2, 2), np.float32), r"^alibi_slopes: shape"),  # batch is 1
        (np.ones((1, 1, 2), np.float32), r"^alibi_slopes: has 3 dimensions"),
        (np.ones((1, 4), np.float32)[:, ::2], r"^alibi_slopes: .*stride"),
        (np.array([0.5, np.inf], np.float32), r"^alibi_slopes: entry \[1\] is not finite"),
    ],
    ids=["float16", "float64", "heads", "batch", "ndim", "strided", "inf"],
)
def test_error_bad_alibi_slopes(rng, slopes, message):
    # Checked before any backend is chosen: the same error on every backend, nothing written.
    q, k, v = valid_inputs(rng)
    out = poisoned_like(q)
    for backend in ALIBI_BACKENDS:
        with pytest.raises(ValueError, match=message):
            flashcore.attention_forward(q, k, v, out=out, alibi_slopes=slopes, backend=backend)
        assert np.isnan(out).all()
    with pytest.raises(ValueError, match=message):
        flashcore.flash_attn_func(q, k, v, alibi_slopes=slopes)


def test_error_alibi_slopes_not_an_array_or_on_another_device(rng):
    q, k, v = valid_inputs(rng)
    with pytest.raises(TypeError, match=r"^alibi_slopes: "):
        flashcore.flash_attn_func(q, k, v, alibi_slopes=[0.5, 0.25])
    if BFLOAT16 is not None:
        with pytest.raises(ValueError, match=r"^alibi_slopes: dtype bfloat16"):
            flashcore.flash_attn_func(q, k, v, alibi_slopes=np.ones(2, BFLOAT16))
    # A raw descriptor of device memory with CPU q: refused before anything reads the slopes.
    slopes = np.ones(2, np.float32)
    on_gpu = (slopes.ctypes.data, flashcore._C.DTYPE_F32, flashcore._C.DEVICE_CUDA, 0, (2,), (1,))
    with pytest.raises(ValueError, match=r"^alibi_slopes: is on cuda:0 but q is on cpu"):
        flashcore.attention_forward(q, k, v, alibi_slopes=on_gpu)


def test_alibi_reaches_the_workspace_queries(rng):
    # With ALiBi a call may run on another backend than without, so the queries must see the
    # slopes: bad ones are refused there as in the call itself.
    q, k, v = valid_inputs(rng)
    options = flashcore._C.Options(backend=flashcore._dlpack_api.backend_id("cpu_reference"))
    slopes = np.ones(2, np.float32)
    assert flashcore._C.forward_workspace(q, k, v, None, None, options, alibi_slopes=slopes) >= 0
    assert flashcore._C.backward_workspace(q, k, v, None, None, options, alibi_slopes=slopes) >= 0
    for query in (flashcore._C.forward_workspace, flashcore._C.backward_workspace):
        with pytest.raises(ValueError, match=r"^alibi_slopes: shape"):
            query(q, k, v, None, None, options, alibi_slopes=np.ones(3, np.float32))
    # The paged forward's query takes its block table too (k / v are pages then).
    q, k, v, cu_q, cu_k = varlen_case(rng, np.float32, [3, 4], [10, 20])
    k_pages, table = paged_copy(rng, k, cu_k, 16)
    options.max_seqlen_q, options.max_seqlen_k = 4, 20
    assert flashcore._C.forward_workspace(q, k_pages, k_pages, cu_q, cu_k, options, block_table=table) >= 0
    with pytest.raises(ValueError, match=r"^k: "):
        flashcore._C.forward_workspace(q, k_pages, k_pages, cu_q, cu_k, options)


# ---- bad input: a clear error naming the argument, outputs untouched -----------------------------


def valid_inputs(rng, dtype=np.float32):
    return random_inputs(rng, dtype, (1, 8, 2, 16), (1, 8, 2, 16))


def test_error_wrong_dtype_names_q(rng):
    q, k, v = valid_inputs(rng, np.float64)
    with pytest.raises(ValueError, match=r"^q: .*float64"):
        flashcore.flash_attn_func(q, k, v)


def test_error_mismatched_dtype_names_k(rng):
    q, k, v = valid_inputs(rng)
    with pytest.raises(ValueError, match=r"^k: "):
        flashcore.flash_attn_func(q, k.astype(np.float16), v)


def test_error_head_dim_mismatch_names_k(rng):
    q, _, v = valid_inputs(rng)
    k = rng.standard_normal((1, 8, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^k: head_dim"):
        flashcore.flash_attn_func(q, k, v)


def test_error_heads_not_multiple_names_k(rng):
    q = rng.standard_normal((1, 8, 3, 16)).astype(np.float32)
    k = v = rng.standard_normal((1, 8, 2, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^k: "):
        flashcore.flash_attn_func(q, k, v)


def test_error_batch_mismatch(rng):
    q, k, v = valid_inputs(rng)
    with pytest.raises(ValueError, match=r"^[kv]: "):
        flashcore.flash_attn_func(q, np.concatenate([k, k]), np.concatenate([v, v]))


def test_error_wrong_ndim_names_q(rng):
    q, k, v = valid_inputs(rng)
    with pytest.raises(ValueError, match=r"^q: "):
        flashcore.flash_attn_func(q[0], k, v)


def test_error_head_dim_too_large(rng):
    q = k = v = rng.standard_normal((1, 2, 1, 512)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^q: head_dim"):
        flashcore.flash_attn_func(q, k, v)


def test_error_non_contiguous_head_dim_low_level_names_q(rng):
    _, k, v = valid_inputs(rng)
    q = rng.standard_normal((1, 8, 2, 32)).astype(np.float32)[..., ::2]
    with pytest.raises(ValueError, match=r"^q: .*stride"):
        flashcore.attention_forward(q, k, v)


def test_error_not_an_array_is_type_error():
    with pytest.raises(TypeError, match=r"^q: "):
        flashcore.flash_attn_func([[1.0]], [[1.0]], [[1.0]])


def test_error_readonly_output(rng):
    q, k, v = valid_inputs(rng)
    out = np.empty_like(q)
    out.flags.writeable = False
    with pytest.raises(TypeError, match=r"^out: "):
        flashcore.attention_forward(q, k, v, out=out)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(window_size=(-2, -1)), "window_left"),
        (dict(window_size=(-1, -5)), "window_right"),
        (dict(softcap=-1.0), "softcap"),
        (dict(softcap=float("nan")), "softcap"),
        (dict(softmax_scale=float("nan")), "softmax_scale"),
        (dict(softmax_scale=float("inf")), "softmax_scale"),
        (dict(window_size=(1, 2, 3)), "window_size"),
    ],
)
def test_error_bad_options(rng, kwargs, argument):
    q, k, v = valid_inputs(rng)
    with pytest.raises(ValueError, match=rf"^{argument}: "):
        flashcore.flash_attn_func(q, k, v, **kwargs)


def test_error_unsupported_features(rng):
    q, k, v = valid_inputs(rng)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flashcore.flash_attn_func(q, k, v, dropout_p=0.1)


@pytest.mark.parametrize(
    "cu_q,argument",
    [
        ([1, 4, 8], "cu_seqlens_q"),  # does not start at 0
        ([0, 6, 4], "cu_seqlens_q"),  # decreases
        ([0, 4, 9], "cu_seqlens_q"),  # beyond the tensor
    ],
)
def test_error_bad_cu_seqlens_leaves_output_untouched(rng, cu_q, argument):
    q, k, v = random_inputs(rng, np.float32, (8, 2, 16), (8, 2, 16))
    cu_q = np.array(cu_q, np.int32)
    cu_k = np.array([0, 4, 8], np.int32)
    out = poisoned_like(q)
    with pytest.raises(ValueError, match=rf"^{argument}: "):
        flashcore.attention_forward(q, k, v, out=out, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    max_seqlen_q=8, max_seqlen_k=8)
    assert np.isnan(out).all()


def test_error_max_seqlen_too_small(rng):
    q, k, v = random_inputs(rng, np.float32, (8, 2, 16), (8, 2, 16))
    cu = np.array([0, 3, 8], np.int32)
    with pytest.raises(ValueError, match=r"^max_seqlen_q: "):
        flashcore.flash_attn_varlen_func(q, k, v, cu, cu, 2, 5)


def test_error_float_cu_seqlens(rng):
    q, k, v = random_inputs(rng, np.float32, (8, 2, 16), (8, 2, 16))
    cu = np.array([0, 3, 8], np.float32)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: "):
        flashcore.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)


def test_error_out_shape_mismatch_leaves_out_untouched(rng):
    q, k, v = valid_inputs(rng)
    out = np.full((1, 8, 2, 8), np.nan, np.float32)
    with pytest.raises(ValueError, match=r"^out: "):
        flashcore.attention_forward(q, k, v, out=out)
    assert np.isnan(out).all()


def test_error_backward_missing_lse_shape(rng):
    q, k, v = valid_inputs(rng)
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"^lse: "):
        flashcore.attention_backward(q, q, k, v, out, lse[:, :1])


def test_error_unknown_backend(rng):
    q, k, v = valid_inputs(rng)
    with pytest.raises(ValueError, match=r"^backend: "):
        flashcore.attention_forward(q, k, v, backend="tpu")
    with pytest.raises(ValueError, match=r"^backend: "):
        flashcore.attention_forward(q, k, v, backend=99)


def test_error_cuda_backend_on_cpu_arrays(rng):
    q, k, v = valid_inputs(rng, np.float16)
    with pytest.raises((ValueError, NotImplementedError), match=r"^(q|backend): "):
        flashcore.attention_forward(q, k, v, backend="cuda_sm80")


def test_workspace_argument_checks(rng):
    q, k, v = valid_inputs(rng)
    with pytest.raises(ValueError, match=r"^workspace: "):
        flashcore.attention_forward(q, k, v, workspace=np.empty((2, 3), np.uint8))
    out = flashcore.attention_forward(q, k, v, workspace=np.empty(64, np.uint8))
    np.testing.assert_array_equal(out, flashcore.attention_forward(q, k, v))


# ---- raw descriptors (the torch fast path of the extension), exercised with numpy memory -------


def raw_descriptor(array):
    dtypes = {np.dtype(np.float32): flashcore._C.DTYPE_F32, np.dtype(np.float16): flashcore._C.DTYPE_F16,
              np.dtype(np.int32): flashcore._C.DTYPE_I32}
    strides = tuple(s // array.itemsize for s in array.strides)
    return (array.ctypes.data, dtypes[array.dtype], flashcore._C.DEVICE_CPU, 0, array.shape, strides)


def test_raw_descriptors_match_arrays(rng):
    q, k, v = random_inputs(rng, np.float32, (2, 9, 4, 16), (2, 13, 2, 16))
    out, lse = np.full_like(q, np.nan), np.full((2, 4, 9), np.nan, np.float32)
    options = flashcore._C.Options(causal=True)
    flashcore._C.forward(*(raw_descriptor(x) for x in (q, k, v, out, lse)), None, None, None, options)
    expected_out, expected_lse = flashcore.attention_forward(q, k, v, return_lse=True, causal=True)
    np.testing.assert_array_equal(out, expected_out)
    np.testing.assert_array_equal(lse, expected_lse)


def test_raw_descriptor_malformed_is_type_error(rng):
    q, k, v = valid_inputs(rng)
    options = flashcore._C.Options()
    with pytest.raises(TypeError, match=r"^q: "):
        flashcore._C.forward((1, 2, 3), k, v, np.empty_like(q), None, None, None, None, options)
    with pytest.raises(TypeError, match=r"^k: "):
        bad = raw_descriptor(k)[:4] + (("a", "b", "c", "d"), raw_descriptor(k)[5])
        flashcore._C.forward(q, bad, v, np.empty_like(q), None, None, None, None, options)
    with pytest.raises(TypeError, match=r"^out: "):
        flashcore._C.forward(q, k, v, None, None, None, None, None, options)


def test_check_cu_seqlens_option_reaches_the_library(rng):
    # CPU cu_seqlens are validated whatever the option says; the option itself must reach the C
    # options (CUDA cu_seqlens are checked only with it: tests/python/test_torch_cuda.py).
    assert flashcore._C.Options(check_cu_seqlens=True).check_cu_seqlens is True
    assert flashcore._C.Options().check_cu_seqlens is False
    q, k, v = random_inputs(rng, np.float32, (7, 2, 16), (9, 2, 16))
    good_q, good_k = np.array([0, 3, 7], np.int32), np.array([0, 4, 9], np.int32)
    for check in (False, True):
        out = flashcore.attention_forward(q, k, v, cu_seqlens_q=good_q, cu_seqlens_k=good_k, check_cu_seqlens=check)
        assert np.isfinite(out).all()
        with pytest.raises(ValueError, match=r"cu_seqlens_q: decreases at index 2"):
            flashcore.attention_forward(q, k, v, cu_seqlens_q=np.array([0, 5, 3], np.int32), cu_seqlens_k=good_k,
                                        max_seqlen_q=7, max_seqlen_k=9, check_cu_seqlens=check)


def test_error_flag_argument(rng):
    # CPU calls validate cu_seqlens on the host and leave the flag alone; a flag that is not int32
    # is refused before the call. (The device-side check: tests/python/test_torch_cuda.py.)
    q, k, v = random_inputs(rng, np.float32, (7, 2, 16), (9, 2, 16))
    cu_q, cu_k = np.array([0, 3, 7], np.int32), np.array([0, 4, 9], np.int32)
    flag = np.zeros(1, np.int32)
    flashcore.attention_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, error_flag=flag)
    assert flag[0] == 0
    with pytest.raises(ValueError, match=r"^error_flag: must be an int32 array"):
        flashcore.attention_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, error_flag=np.zeros(1, np.float32))


# ---- dropout with an explicit seed (attention_forward / attention_backward) ----------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_with_an_explicit_seed(rng, backend, causal):
    from attention_reference import dropout_keep_mask

    p, seed, offset = 0.3, 2**40 + 12345, 7 << 33
    q = rng.standard_normal((2, 50, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 70, 2, 16)).astype(np.float32) for _ in range(2))
    out, lse = flashcore.attention_forward(q, k, v, return_lse=True, causal=causal, backend=backend,
                                           dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    plain, plain_lse = flashcore.attention_forward(q, k, v, return_lse=True, causal=causal, backend=backend)
    np.testing.assert_array_equal(lse, plain_lse)  # the lse ignores dropout
    window = (-1, -1)
    for b in range(2):
        ref, _ = _sequence_forward(q[b], k[b], v[b], 16 ** -0.5, causal, window, 0.0, np.float64, np.float64)
        # Dropout on top of the reference: P's kept entries / (1 - p), recomputed from the lse.
        kx, vx = np.repeat(k[b], 2, axis=1).astype(np.float64), np.repeat(v[b], 2, axis=1).astype(np.float64)
        s = _scores(q[b].astype(np.float64), kx, 16 ** -0.5, 0.0)
        s = np.where(allowed_keys(50, 70, causal, window)[None], s, -np.inf)
        probs = np.exp(s - plain_lse[b][..., None].astype(np.float64))
        keep = np.stack([dropout_keep_mask(p, seed, offset, b * 4 + h, 50, 70) for h in range(4)])
        ref = np.einsum("hij,jhd->ihd", probs * keep / (1 - p), vx)
        assert np.abs(out[b] - ref).max() / np.abs(ref).max() < 1e-5
    assert np.abs(out - plain).max() > 0.05
    # The backward with the same seed against finite differences of the forward in dv's direction:
    # L = sum(out * dout) is linear in v, so dL/dv is exact for any step.
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dq, dk, dv = flashcore.attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend,
                                              dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    direction = rng.standard_normal(v.shape).astype(np.float32)
    moved = flashcore.attention_forward(q, k, v + direction, causal=causal, backend=backend,
                                        dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    expected = float(((moved - out) * dout).astype(np.float64).sum())
    assert abs(float((dv * direction).astype(np.float64).sum()) - expected) < 1e-3 * (1 + abs(expected))
    with pytest.raises(ValueError, match="dropout_seed"):
        flashcore.attention_forward(q, k, v, dropout_p=p, dropout_seed=-1)

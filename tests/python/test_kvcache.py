"""flashcore.flash_attn_with_kvcache and flashcore.merge_partials: numpy (CPU backend, runs in CI
without GPU or torch) and torch CPU tensors (those tests skip when torch is not installed).

Every result is checked against an fp64 numpy reference written here: the reference appends the
new keys/values into copies of the caches (contiguous, cache_batch_idx rows, or pages through a
block_table), then attends with bottom-right aligned causal/window masks, softcap and GQA. float32
must match within a relative error of 1e-5; float16 within TESTING.md's rule (2x the error of a
naive same-precision implementation + one rounding). The appended caches must equal the
reference's bit for bit. Bad cache indices must raise ValueError naming the argument and leave
the caches untouched. Rotary embedding (rotary_cos / rotary_sin) is checked against a pair-by-pair
fp64 rotation of q and the new keys followed by the same reference.
"""

import zlib

import numpy as np
import pytest

import flashcore
from attention_reference import allowed_keys, sequence_forward as attend

FP32_RELATIVE_TOLERANCE = 1e-5
LOW_PRECISION_FACTOR = 2  # TESTING.md: 2x the same-precision error for O and LSE
ROUNDING_PROBE = 0.3  # the rounding of one add at the reference's magnitude
HEAD_DIM = 16
SPLIT_COUNTS = [1, 3]
PAGE_SIZES = [1, 16, 256]

try:
    import ml_dtypes

    BFLOAT16 = ml_dtypes.bfloat16
except ImportError:  # optional
    BFLOAT16 = None


@pytest.fixture
def rng(request):
    # Fresh inputs per case, reproducible per test id.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ---- fp64 reference ---------------------------------------------------------------------------


def cache_slot(b, token, page_size, block_table, cache_batch_idx):
    """(cache row or page, slot inside it) holding token `token` of sequence b."""
    if block_table is not None:
        return int(block_table[b, token // page_size]), token % page_size
    return (b if cache_batch_idx is None else int(cache_batch_idx[b])), token


def append_reference(k_cache, v_cache, cache_seqlens, k, v, block_table=None,
                     cache_batch_idx=None):
    """Copies of the caches with k/v written at cache_seqlens[b] ... (what the call must do)."""
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    if k is None:
        return k_cache, v_cache
    page_size = k_cache.shape[1]
    for b in range(k.shape[0]):
        for t in range(k.shape[1]):
            row, slot = cache_slot(b, int(cache_seqlens[b]) + t, page_size, block_table,
                                   cache_batch_idx)
            k_cache[row, slot] = k[b, t]
            v_cache[row, slot] = v[b, t]
    return k_cache, v_cache


def gather_sequence(cache, b, length, block_table, cache_batch_idx):
    """(length, heads_kv, head_dim): the tokens of sequence b, in order."""
    slots = [cache_slot(b, t, cache.shape[1], block_table, cache_batch_idx) for t in range(length)]
    return np.stack([cache[row, slot] for row, slot in slots]) if slots else cache[0, :0]


def reference_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None,
                      cache_batch_idx=None, scale=None, causal=False, window=(-1, -1),
                      softcap=0.0, same_precision=False, alibi_slopes=None):
    """(out, lse (batch, heads_q, seqlen_q), k_cache after append, v_cache after append).
    alibi_slopes (heads_q) or (batch, heads_q): the bias over each sequence's keys after the
    append (attention_reference's ALiBi, bottom-right aligned like the masks)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute, p_dtype = (np.float32, q.dtype) if same_precision else (np.float64, np.float64)
    k_after, v_after = append_reference(k_cache, v_cache, cache_seqlens, k, v, block_table,
                                        cache_batch_idx)
    seqlen_new = 0 if k is None else k.shape[1]
    out = np.zeros(q.shape, dtype=compute)
    lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]))
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b]) + seqlen_new
        keys = gather_sequence(k_after, b, length, block_table, cache_batch_idx)
        values = gather_sequence(v_after, b, length, block_table, cache_batch_idx)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.ndim == 2 else alibi_slopes
        out[b], lse[b] = attend(q[b], keys, values, scale, causal, window, softcap, compute,
                                p_dtype, slopes)
    return out, lse, k_after, v_after


# ---- comparison rules --------------------------------------------------------------------------


def assert_fp32_close(actual, expected, name):
    actual = np.asarray(actual, dtype=np.float64)
    assert not np.isnan(actual).any(), f"{name}: NaN in result"
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(actual[~finite], expected[~finite], err_msg=f"{name}: -inf rows")
    norm = np.linalg.norm(expected[finite])
    error = np.linalg.norm(actual[finite] - expected[finite])
    assert error <= FP32_RELATIVE_TOLERANCE * max(norm, 1e-30), f"{name}: relative error {error / norm:.3g}"


def assert_low_precision_close(actual, expected, same, dtype, name):
    """TESTING.md: max|X - ref| <= 2 * max|X_same - ref| + atol; NaN never passes."""
    actual, same = (np.asarray(x).astype(np.float64) for x in (actual, same))
    assert not np.isnan(actual).any(), f"{name}: NaN in result"
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(actual[~finite], expected[~finite], err_msg=f"{name}: -inf rows")
    error = np.max(np.abs(actual[finite] - expected[finite]), initial=0.0)
    same_error = np.max(np.abs(same[finite] - expected[finite]), initial=0.0)
    x = expected[finite].astype(dtype)
    probe = np.asarray(ROUNDING_PROBE, dtype=dtype)
    atol = 2 * float(np.max(np.abs(((x + probe) - probe).astype(np.float64) - x.astype(np.float64)),
                            initial=0.0))
    assert error <= LOW_PRECISION_FACTOR * same_error + atol, (
        f"{name}: max error {error:.3g} > {LOW_PRECISION_FACTOR} x {same_error:.3g} + {atol:.3g}")


# ---- cases -------------------------------------------------------------------------------------


def make_case(rng, *, batch=3, seqlen_q=1, heads_q=4, heads_kv=2, capacity=40, seqlen_new=0,
              page_size=None, batch_cache=None, dtype=np.float32, lengths=None):
    """Inputs of one call as keyword arguments of flash_attn_with_kvcache. Paged caches get more
    pages than needed, handed out in shuffled order; cache_batch_idx (batch_cache given) picks
    distinct shuffled rows."""
    make = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(dtype)
    case = {"q": make(batch, seqlen_q, heads_q, HEAD_DIM)}
    if page_size is None:
        rows = batch if batch_cache is None else batch_cache
        cache_shape = (rows, capacity, heads_kv, HEAD_DIM)
        if batch_cache is not None:
            case["cache_batch_idx"] = rng.permutation(batch_cache)[:batch].astype(np.int32)
    else:
        pages_per_seq = -(-capacity // page_size)
        num_pages = batch * pages_per_seq + 2  # spare pages must stay untouched
        cache_shape = (num_pages, page_size, heads_kv, HEAD_DIM)
        table = rng.permutation(num_pages)[: batch * pages_per_seq]
        case["block_table"] = table.reshape(batch, pages_per_seq).astype(np.int32)
        capacity = pages_per_seq * page_size
    case["k_cache"], case["v_cache"] = make(*cache_shape), make(*cache_shape)
    if lengths is None:
        # Include an empty cache and a cache filled to capacity.
        most = capacity - seqlen_new
        lengths = np.concatenate([[0, most], rng.integers(0, most + 1, batch)])[:batch]
    case["cache_seqlens"] = np.asarray(lengths, dtype=np.int32)
    if seqlen_new:
        case["k"], case["v"] = make(batch, seqlen_new, heads_kv, HEAD_DIM), make(
            batch, seqlen_new, heads_kv, HEAD_DIM)
    return case


def run_and_check(case, *, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                  num_splits=0, alibi_slopes=None):
    """Calls flash_attn_with_kvcache on copies of the caches and compares out, lse and the
    caches with the reference."""
    k_cache, v_cache = case["k_cache"].copy(), case["v_cache"].copy()
    args = {key: value for key, value in case.items() if key not in ("q", "k_cache", "v_cache")}
    out, lse = flashcore.flash_attn_with_kvcache(
        case["q"], k_cache, v_cache, softmax_scale=scale, causal=causal, window_size=window,
        softcap=softcap, num_splits=num_splits, return_softmax_lse=True,
        alibi_slopes=alibi_slopes, **args)
    reference_args = dict(k=case.get("k"), v=case.get("v"), block_table=case.get("block_table"),
                          cache_batch_idx=case.get("cache_batch_idx"), scale=scale,
                          causal=causal, window=window, softcap=softcap,
                          alibi_slopes=alibi_slopes)
    ref_out, ref_lse, ref_k, ref_v = reference_kvcache(
        case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], **reference_args)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert lse.shape == (out.shape[0], out.shape[2], out.shape[1]) and lse.dtype == np.float32
    if case["q"].dtype == np.float32:
        assert_fp32_close(out, ref_out, "out")
        assert_fp32_close(lse, ref_lse, "lse")
    else:
        same_out, same_lse, _, _ = reference_kvcache(
            case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
            same_precision=True, **reference_args)
        assert_low_precision_close(out, ref_out, same_out.astype(out.dtype), out.dtype, "out")
        assert_low_precision_close(lse, ref_lse, same_lse, np.float32, "lse")
    np.testing.assert_array_equal(k_cache, ref_k, err_msg="k_cache after the call")
    np.testing.assert_array_equal(v_cache, ref_v, err_msg="v_cache after the call")
    return out, lse


# ---- numpy: correctness ------------------------------------------------------------------------


def test_package_exports():
    assert flashcore.flash_attn_with_kvcache is flashcore.flash_attn_interface.flash_attn_with_kvcache
    assert callable(flashcore.merge_partials)


@pytest.mark.parametrize("num_splits", SPLIT_COUNTS)
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (1, True), (4, False), (4, True)])
def test_contiguous_cache(rng, num_splits, seqlen_q, causal):
    run_and_check(make_case(rng, seqlen_q=seqlen_q, capacity=70), causal=causal,
                  num_splits=num_splits)


@pytest.mark.parametrize("num_splits", SPLIT_COUNTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_cache_with_append(rng, page_size, num_splits):
    case = make_case(rng, seqlen_q=2, capacity=300, seqlen_new=2, page_size=page_size)
    run_and_check(case, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_cache_without_append(rng, page_size):
    run_and_check(make_case(rng, capacity=260, page_size=page_size), num_splits=3)


@pytest.mark.parametrize("num_splits", SPLIT_COUNTS)
def test_cache_batch_idx_with_append(rng, num_splits):
    # Rows that no sequence uses must stay untouched (checked against the reference's copies).
    case = make_case(rng, batch=3, batch_cache=5, seqlen_q=3, seqlen_new=3, capacity=33)
    run_and_check(case, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("seqlen_new", [1, 5])
def test_append_contiguous_then_decode_next_step(rng, seqlen_new):
    # Two decode steps: the second sees what the first appended once cache_seqlens advances.
    case = make_case(rng, seqlen_q=seqlen_new, seqlen_new=seqlen_new, capacity=24,
                     lengths=[0, 7, 11])
    k_cache, v_cache = case["k_cache"], case["v_cache"]
    flashcore.flash_attn_with_kvcache(case["q"], k_cache, v_cache, case["k"], case["v"],
                                      cache_seqlens=case["cache_seqlens"], causal=True)
    advanced = case["cache_seqlens"] + seqlen_new
    out = flashcore.flash_attn_with_kvcache(case["q"], k_cache, v_cache, cache_seqlens=advanced)
    appended_k, appended_v = append_reference(case["k_cache"], case["v_cache"],
                                              case["cache_seqlens"], case["k"], case["v"])
    ref_out, _, _, _ = reference_kvcache(case["q"], appended_k, appended_v, advanced)
    assert_fp32_close(out, ref_out, "out")


@pytest.mark.parametrize("window", [(8, 0), (3, 2), (-1, 1), (0, -1)])
@pytest.mark.parametrize("num_splits", SPLIT_COUNTS)
def test_sliding_window(rng, window, num_splits):
    run_and_check(make_case(rng, seqlen_q=4, seqlen_new=4, capacity=64), window=window,
                  num_splits=num_splits)


@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap(rng, softcap):
    case = make_case(rng, seqlen_q=2, capacity=50)
    case["q"] *= 4  # large scores, so the cap matters
    run_and_check(case, softcap=softcap, causal=True, num_splits=3)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (8, 1), (3, 3)])
def test_gqa_mqa(rng, heads_q, heads_kv):
    run_and_check(make_case(rng, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=2, seqlen_new=1,
                            capacity=30), causal=True, num_splits=3)


@pytest.mark.parametrize("scale", [0.5, 0.0])
def test_softmax_scale(rng, scale):
    # 0.0 is flash_attn's literal zero scale (uniform attention), not "the default".
    run_and_check(make_case(rng, capacity=20), scale=scale)


def test_float16(rng):
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=80, page_size=16, dtype=np.float16)
    run_and_check(case, causal=True, num_splits=3)


def test_empty_sequence_gives_zero_and_minus_inf(rng):
    case = make_case(rng, lengths=[0, 5, 0])
    out, lse = run_and_check(case)
    assert np.all(out[[0, 2]] == 0) and np.all(np.isneginf(lse[[0, 2]]))


def test_return_convention_and_int_cache_seqlens(rng):
    case = make_case(rng, capacity=20)
    q, k_cache, v_cache = case["q"], case["k_cache"], case["v_cache"]
    out = flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=13)
    assert isinstance(out, np.ndarray) and out.shape == q.shape
    broadcast = np.full(q.shape[0], 13, dtype=np.int32)
    for seqlens in (broadcast, broadcast.astype(np.int64), np.int64(13)):
        same = flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
        np.testing.assert_array_equal(same, out)
    ref_out, _, _, _ = reference_kvcache(q, k_cache, v_cache, broadcast)
    assert_fp32_close(out, ref_out, "out")


@pytest.mark.skipif(BFLOAT16 is None, reason="ml_dtypes is not installed")
def test_bfloat16(rng):
    case = make_case(rng, seqlen_q=2, seqlen_new=1, capacity=40, dtype=BFLOAT16)
    run_and_check(case, causal=True, num_splits=3)


def test_workspace_query_binding(rng):
    # CPU calls need no scratch memory; the query validates like the call itself.
    case = make_case(rng, seqlen_new=1, capacity=20)
    options = flashcore._C.Options()
    out = np.empty_like(case["q"])
    tensors = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], None, None,
               case["k"], case["v"], out, None)
    assert flashcore._C.kvcache_workspace(*tensors, 0, options) == 0
    with pytest.raises(ValueError, match=r"^num_splits: "):
        flashcore._C.kvcache_workspace(*tensors, -1, options)


def test_no_cache_seqlens_means_the_whole_cache(rng):
    case = make_case(rng, capacity=48, page_size=16)
    q, k_cache, v_cache, table = case["q"], case["k_cache"], case["v_cache"], case["block_table"]
    out = flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table)
    full = np.full(q.shape[0], 48, dtype=np.int32)
    ref_out, _, _, _ = reference_kvcache(q, k_cache, v_cache, full, block_table=table)
    assert_fp32_close(out, ref_out, "out")


def test_torch_no_cache_seqlens_equals_the_full_lengths(rng, torch):
    """cache_seqlens=None travels as a null tensor (no lengths array is built): the same result as
    every length given as the capacity, contiguous and paged; with an append it is an error."""
    for page_size in (None, 16):
        case = make_case(rng, capacity=48, page_size=page_size)
        tcase = torch_case(torch, case)
        q, k_cache, v_cache = tcase["q"], tcase["k_cache"], tcase["v_cache"]
        table = tcase.get("block_table")
        out, lse = flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table,
                                                     return_softmax_lse=True)
        full = torch.full((q.shape[0],), 48, dtype=torch.int32)
        out_full, lse_full = flashcore.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=full, block_table=table, return_softmax_lse=True)
        assert torch.equal(out, out_full) and torch.equal(lse, lse_full)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, k=q[:, :, :2], v=q[:, :, :2],
                                          block_table=table)


def test_int64_indices_are_converted(rng):
    case = make_case(rng, seqlen_new=1, capacity=32, page_size=16)
    for key in ("cache_seqlens", "block_table"):
        case[key] = case[key].astype(np.int64)
    run_and_check(case)


def test_readonly_caches_serve_attention_without_append(rng):
    case = make_case(rng, capacity=20)
    for key in ("q", "k_cache", "v_cache", "cache_seqlens"):
        case[key].flags.writeable = False
    run_and_check(case)


def test_caches_as_strided_views(rng):
    """Caches that are (batch, heads_kv, seqlen, head_dim) storage viewed as (batch, seqlen,
    heads_kv, head_dim): a KV head's rows are contiguous and a token's heads lie far apart, the
    opposite of the layout the CPU path stages fastest; any strides must give the same result."""
    case = make_case(rng, seqlen_q=2, capacity=90, heads_q=8, heads_kv=2)
    views = {}
    for key in ("k_cache", "v_cache"):
        storage = np.ascontiguousarray(case[key].transpose(0, 2, 1, 3))
        views[key] = storage.transpose(0, 2, 1, 3)
        assert not views[key].flags.c_contiguous
    out, lse = flashcore.flash_attn_with_kvcache(case["q"], views["k_cache"], views["v_cache"],
                                                 cache_seqlens=case["cache_seqlens"], causal=True,
                                                 return_softmax_lse=True)
    ref_out, ref_lse, _, _ = reference_kvcache(case["q"], case["k_cache"], case["v_cache"],
                                               case["cache_seqlens"], causal=True)
    assert_fp32_close(out, ref_out, "out")
    assert_fp32_close(lse, ref_lse, "lse")


def test_non_contiguous_q_and_new_keys(rng):
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=20)
    for key in ("q", "k", "v"):  # head_dim stride != 1: the flash_attn API copies these
        case[key] = np.asfortranarray(case[key])
    run_and_check(case, causal=True)


# ---- numpy: bad inputs -------------------------------------------------------------------------


def call_expecting_error(case, error, pattern, **kwargs):
    """The call raises `error` matching `pattern`, and the caches are left as they were."""
    k_cache, v_cache = case["k_cache"].copy(), case["v_cache"].copy()
    args = {key: value for key, value in case.items() if key not in ("q", "k_cache", "v_cache")}
    with pytest.raises(error, match=pattern):
        flashcore.flash_attn_with_kvcache(case["q"], k_cache, v_cache, **args, **kwargs)
    np.testing.assert_array_equal(k_cache, case["k_cache"])
    np.testing.assert_array_equal(v_cache, case["v_cache"])


def test_error_block_table_page_out_of_range(rng):
    case = make_case(rng, seqlen_new=1, capacity=32, page_size=16, lengths=[3, 20, 31])
    case["block_table"][2, 1] = case["k_cache"].shape[0]  # one past the last page
    call_expecting_error(case, ValueError, r"^block_table: entry \[2, 1\]")
    case["block_table"][2, 1] = -1
    call_expecting_error(case, ValueError, r"^block_table: ")


def test_error_cache_seqlens_beyond_capacity(rng):
    case = make_case(rng, capacity=20, lengths=[3, 21, 4])
    call_expecting_error(case, ValueError, r"^cache_seqlens: entry 1 \(21\)")


def test_error_negative_cache_seqlens(rng):
    case = make_case(rng, capacity=20, lengths=[3, -1, 4])
    call_expecting_error(case, ValueError, r"^cache_seqlens: entry 1 is negative")


def test_error_append_overflows_the_cache(rng):
    case = make_case(rng, seqlen_new=3, capacity=20, lengths=[3, 18, 4])
    call_expecting_error(case, ValueError, r"^cache_seqlens: entry 1 \(18\) \+ seqlen_new 3")


def test_error_append_overflows_a_paged_cache(rng):
    case = make_case(rng, seqlen_new=2, capacity=32, page_size=16, lengths=[31, 0, 0])
    call_expecting_error(case, ValueError, r"^cache_seqlens: entry 0 ")


def test_error_cache_batch_idx_out_of_range(rng):
    case = make_case(rng, seqlen_new=1, batch_cache=4, capacity=20)
    case["cache_batch_idx"][1] = 4
    call_expecting_error(case, ValueError, r"^cache_batch_idx: entry 1")


def test_error_cache_seqlens_not_int32_representable(rng):
    case = make_case(rng, capacity=20)
    case["cache_seqlens"] = np.array([1, 2**40, 3], dtype=np.int64)
    call_expecting_error(case, ValueError, r"^cache_seqlens: ")
    case["cache_seqlens"] = 2**40
    call_expecting_error(case, ValueError, r"^cache_seqlens: ")
    case["cache_seqlens"] = np.array([1.0, 2.0, 3.0])
    call_expecting_error(case, ValueError, r"^cache_seqlens: ")
    case["cache_seqlens"] = 2.0
    call_expecting_error(case, TypeError, r"^cache_seqlens: ")


def test_error_wrong_cache_seqlens_length(rng):
    case = make_case(rng, capacity=20)
    case["cache_seqlens"] = case["cache_seqlens"][:2]
    call_expecting_error(case, ValueError, r"^cache_seqlens: ")


def test_error_cache_batch_idx_with_block_table(rng):
    case = make_case(rng, capacity=32, page_size=16)
    case["cache_batch_idx"] = np.arange(3, dtype=np.int32)
    call_expecting_error(case, ValueError, r"^cache_batch_idx: ")


def test_error_k_without_v_and_append_without_lengths(rng):
    case = make_case(rng, seqlen_new=1, capacity=20)
    v = case.pop("v")
    call_expecting_error(case, ValueError, r"^k, v: ")
    case["v"] = v
    case.pop("cache_seqlens")
    call_expecting_error(case, ValueError, r"^cache_seqlens: ")


def test_error_new_keys_shape_names_k(rng):
    """Errors about the appended tokens name `k`/`v`, this API's arguments (the ABI's k_new)."""
    case = make_case(rng, seqlen_new=2, capacity=20)
    case["k"] = case["k"][:, :, :1]  # heads_kv must match the cache
    call_expecting_error(case, ValueError, r"^k: ")


def test_error_cache_dtype_and_bad_options(rng):
    case = make_case(rng, capacity=20)
    with pytest.raises(ValueError, match=r"^k_cache: "):
        flashcore.flash_attn_with_kvcache(case["q"], case["k_cache"].astype(np.float16),
                                          case["v_cache"], cache_seqlens=case["cache_seqlens"])
    call_expecting_error(case, ValueError, r"^num_splits: ", num_splits=-1)
    call_expecting_error(case, ValueError, r"^window_left: ", window_size=(-2, 0))
    call_expecting_error(case, ValueError, r"^softcap: ", softcap=-1.0)


def test_error_readonly_cache_with_append(rng):
    case = make_case(rng, seqlen_new=1, capacity=20)
    k_cache = case["k_cache"].copy()
    k_cache.flags.writeable = False
    with pytest.raises(TypeError, match=r"^k_cache: "):
        flashcore.flash_attn_with_kvcache(case["q"], k_cache, case["v_cache"].copy(), case["k"],
                                          case["v"], cache_seqlens=case["cache_seqlens"])


def test_unsupported_features_raise_not_implemented(rng):
    call_expecting_error(make_case(rng, seqlen_new=1, capacity=32, page_size=16), NotImplementedError,
                         r"^cache_leftpad: not supported with a paged cache", cache_leftpad=np.zeros(3, np.int32))


# ---- ALiBi (alibi_slopes) -----------------------------------------------------------------------


def alibi_slopes_for(rng, batch, heads, per_batch):
    """Random slopes of several magnitudes, one negative: (heads) or (batch, heads) float32."""
    shape = (batch, heads) if per_batch else (heads,)
    slopes = np.exp2(rng.uniform(-6, 0, shape))
    slopes.flat[0] *= -0.1
    return slopes.astype(np.float32)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("num_splits", SPLIT_COUNTS)
def test_alibi(rng, per_batch, page_size, num_splits):
    # Appending, causal, queries of several tokens: the bias counts the appended keys.
    case = make_case(rng, seqlen_q=3, seqlen_new=3, capacity=90, page_size=page_size)
    run_and_check(case, causal=True, num_splits=num_splits,
                  alibi_slopes=alibi_slopes_for(rng, 3, 4, per_batch))


def test_alibi_with_window_softcap_and_low_precision(rng):
    case = make_case(rng, seqlen_q=2, seqlen_new=1, capacity=60, dtype=np.float16)
    run_and_check(case, window=(20, 0), softcap=15.0, num_splits=2,
                  alibi_slopes=alibi_slopes_for(rng, 3, 4, True))


def test_alibi_changes_the_result(rng):
    # The reference's bias is not vacuous: without it the same call differs.
    case = make_case(rng, seqlen_q=2, capacity=40, lengths=[30, 40, 25])
    slopes = alibi_slopes_for(rng, 3, 4, False)
    with_bias = run_and_check(case, alibi_slopes=slopes)[0]
    plain = flashcore.flash_attn_with_kvcache(case["q"], case["k_cache"], case["v_cache"],
                                              cache_seqlens=case["cache_seqlens"])
    assert np.max(np.abs(with_bias - plain)) > 1e-2


def test_alibi_bad_slopes_raise(rng):
    case = make_case(rng, seqlen_new=1, capacity=20)
    call_expecting_error(case, ValueError, r"^alibi_slopes: ", alibi_slopes=np.ones(3, np.float32))
    call_expecting_error(case, ValueError, r"^alibi_slopes: ", alibi_slopes=np.ones((2, 4), np.float32))
    call_expecting_error(case, ValueError, r"^alibi_slopes: ",
                         alibi_slopes=np.array([1, np.nan, 1, 1], np.float32))


# ---- left-padded caches (cache_leftpad) ---------------------------------------------------------


def leftpad_reference(case, leftpad, causal, same_precision=False):
    """(out, lse, caches after the call) for sequences that start at slot leftpad[b] of their rows:
    each sequence moved to start at slot 0 of a row of its own, then the reference above."""
    lengths, rows = case["cache_seqlens"], case.get("cache_batch_idx")
    k_after, v_after = append_reference(case["k_cache"], case["v_cache"], lengths, case.get("k"), case.get("v"),
                                        cache_batch_idx=rows)
    shifted = []
    for cache in (case["k_cache"], case["v_cache"]):
        moved = np.zeros((len(lengths),) + cache.shape[1:], dtype=cache.dtype)
        for b, pad in enumerate(leftpad):
            row = b if rows is None else rows[b]
            moved[b, :cache.shape[1] - pad] = cache[row, pad:]
        shifted.append(moved)
    out, lse, _, _ = reference_kvcache(case["q"], shifted[0], shifted[1], lengths - leftpad, k=case.get("k"),
                                       v=case.get("v"), causal=causal, same_precision=same_precision)
    return out, lse, k_after, v_after


@pytest.mark.parametrize("seqlen_new", [0, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch_cache", [None, 5])
def test_cache_leftpad(rng, seqlen_new, causal, batch_cache):
    lengths = [10, 40 - seqlen_new, 25]
    leftpad = np.array([3, 0, 25], np.int32)  # the last sequence has no cached token (empty without append)
    case = make_case(rng, seqlen_q=2, seqlen_new=seqlen_new, capacity=40, batch_cache=batch_cache, lengths=lengths)
    ref_out, ref_lse, ref_k, ref_v = leftpad_reference(case, leftpad, causal)
    k_cache, v_cache = case["k_cache"].copy(), case["v_cache"].copy()
    args = {key: value for key, value in case.items() if key not in ("q", "k_cache", "v_cache")}
    out, lse = flashcore.flash_attn_with_kvcache(case["q"], k_cache, v_cache, cache_leftpad=leftpad, causal=causal,
                                                 return_softmax_lse=True, **args)
    assert_fp32_close(out, ref_out, "out")
    assert_fp32_close(lse, ref_lse, "lse")
    np.testing.assert_array_equal(k_cache, ref_k, err_msg="k_cache after the call")
    np.testing.assert_array_equal(v_cache, ref_v, err_msg="v_cache after the call")


def test_cache_leftpad_errors(rng):
    case = make_case(rng, seqlen_new=2, capacity=20, lengths=[5, 18, 0])
    call_expecting_error(case, ValueError, r"^cache_leftpad: entry 0 is 6, outside 0..cache_seqlens\[0\] = 5",
                         cache_leftpad=np.array([6, 0, 0], np.int32))
    call_expecting_error(case, ValueError, r"^cache_leftpad: entry 2 is -1",
                         cache_leftpad=np.array([0, 0, -1], np.int32))
    too_long = dict(case, cache_seqlens=np.array([5, 19, 0], np.int32))
    call_expecting_error(too_long, ValueError, r"^cache_seqlens: entry 1 \(19\) \+ seqlen_new 2 exceeds",
                         cache_leftpad=np.array([1, 4, 0], np.int32))
    call_expecting_error(case, ValueError, r"^cache_leftpad: dtype float32", cache_leftpad=np.zeros(3, np.float32))
    call_expecting_error(case, ValueError, r"^cache_leftpad: shape", cache_leftpad=np.zeros(2, np.int32))


def test_cache_leftpad_on_strided_cache_views(rng):
    # rows of 12 of the 20 slots: any cache layout the plain call takes serves left padding too
    case = make_case(rng, seqlen_q=1, seqlen_new=1, capacity=20, lengths=[5, 11, 7])
    view = dict(case, k_cache=case["k_cache"][:, :12], v_cache=case["v_cache"][:, :12])
    leftpad = np.array([1, 4, 7], np.int32)
    ref_out, ref_lse, ref_k, ref_v = leftpad_reference(view, leftpad, False)
    k_cache, v_cache = case["k_cache"].copy(), case["v_cache"].copy()
    out, lse = flashcore.flash_attn_with_kvcache(view["q"], k_cache[:, :12], v_cache[:, :12], view["k"], view["v"],
                                                 cache_seqlens=view["cache_seqlens"], cache_leftpad=leftpad,
                                                 return_softmax_lse=True)
    assert_fp32_close(out, ref_out, "out")
    assert_fp32_close(lse, ref_lse, "lse")
    np.testing.assert_array_equal(k_cache[:, :12], ref_k)
    np.testing.assert_array_equal(k_cache[:, 12:], case["k_cache"][:, 12:], err_msg="slots past the view")


# ---- rotary embedding (rotary_cos / rotary_sin) -------------------------------------------------


def rotary_tables(rng, rows, half):
    angles = rng.uniform(0, 2 * np.pi, (rows, half))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotary_reference(x, cos, sin, positions, interleaved):
    """float64 x (batch, seq, heads, dim) with its first 2 * half features rotated, pair by pair,
    by the table rows at positions (batch, seq): GPT-J pairs (2i, 2i + 1) or GPT-NeoX (i, i + half)."""
    out = x.astype(np.float64).copy()
    half = cos.shape[1]
    for b, t in np.ndindex(*positions.shape):
        p = positions[b, t]
        for i in range(half):
            a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            x1, x2 = out[b, t, :, a].copy(), out[b, t, :, c].copy()
            out[b, t, :, a] = x1 * cos[p, i] - x2 * sin[p, i]
            out[b, t, :, c] = x1 * sin[p, i] + x2 * cos[p, i]
    return out


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 0))])
def test_rotary_embedding_of_q_and_appended_k(rng, interleaved, causal, window):
    case = make_case(rng, seqlen_q=3, seqlen_new=3, capacity=40)
    cos, sin = rotary_tables(rng, 44, HEAD_DIM // 4)  # rotary_dim 8 of 16: the rest stays as is
    lengths = case["cache_seqlens"].astype(np.int64)[:, None]
    positions_k = lengths + np.arange(3)[None]
    # flash_attn: per-token query positions under a causal mask or a window, else all at the
    # first new position.
    positions_q = positions_k if causal or window != (-1, -1) else np.repeat(lengths, 3, axis=1)
    q_rot = rotary_reference(case["q"], cos, sin, positions_q, interleaved).astype(np.float32)
    k_rot = rotary_reference(case["k"], cos, sin, positions_k, interleaved).astype(np.float32)
    ref_out, ref_lse, ref_k, ref_v = reference_kvcache(
        q_rot, case["k_cache"], case["v_cache"], case["cache_seqlens"], k=k_rot, v=case["v"],
        causal=causal, window=window)
    k_cache, v_cache = case["k_cache"].copy(), case["v_cache"].copy()
    out, lse = flashcore.flash_attn_with_kvcache(
        case["q"], k_cache, v_cache, case["k"], case["v"], rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=case["cache_seqlens"], causal=causal, window_size=window,
        rotary_interleaved=interleaved, return_softmax_lse=True)
    assert_fp32_close(out, ref_out, "out")
    assert_fp32_close(lse, ref_lse, "lse")
    np.testing.assert_allclose(k_cache, ref_k, rtol=1e-6, atol=1e-6, err_msg="k_cache: the rotated new keys")
    np.testing.assert_array_equal(v_cache, ref_v, err_msg="v_cache: values are not rotated")


def test_rotary_errors(rng):
    case = make_case(rng, seqlen_new=2, capacity=20, lengths=[0, 18, 5])
    cos, sin = rotary_tables(rng, 20, 4)
    call_expecting_error(case, ValueError, r"^rotary_cos, rotary_sin: give both", rotary_cos=cos)
    call_expecting_error(case, ValueError, r"^rotary_cos: has 19 rows, but .* position 19",
                         rotary_cos=cos[:19], rotary_sin=sin[:19])
    call_expecting_error(case, ValueError, r"^rotary_cos: shape", rotary_cos=np.ones((20, 9), np.float32),
                         rotary_sin=np.ones((20, 9), np.float32))
    call_expecting_error(case, ValueError, r"^rotary_sin: shape \[20, 2\]", rotary_cos=cos, rotary_sin=sin[:, :2])
    call_expecting_error(case, ValueError, r"^rotary_cos: dtype int32", rotary_cos=cos.astype(np.int32),
                         rotary_sin=sin.astype(np.int32))
    no_append = {key: value for key, value in case.items() if key not in ("k", "v")}
    call_expecting_error(no_append, ValueError, r"^rotary_cos: rotary embedding applies only",
                         rotary_cos=cos, rotary_sin=sin)


@pytest.mark.parametrize("causal", [False, True])
def test_rotary_with_cache_leftpad_uses_cache_slots(rng, causal):
    # flash_attn: rotary positions are cache slots (cache_seqlens counts the padding), while the
    # masks count from each sequence's first slot.
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=40, lengths=[10, 30, 25])
    leftpad = np.array([3, 0, 20], np.int32)
    cos, sin = rotary_tables(rng, 42, HEAD_DIM // 2)
    lengths = case["cache_seqlens"].astype(np.int64)[:, None]
    positions_k = lengths + np.arange(2)[None]
    positions_q = positions_k if causal else np.repeat(lengths, 2, axis=1)
    rotated = dict(case, q=rotary_reference(case["q"], cos, sin, positions_q, False).astype(np.float32),
                   k=rotary_reference(case["k"], cos, sin, positions_k, False).astype(np.float32))
    ref_out, ref_lse, ref_k, _ = leftpad_reference(rotated, leftpad, causal)
    k_cache, v_cache = case["k_cache"].copy(), case["v_cache"].copy()
    out, lse = flashcore.flash_attn_with_kvcache(
        case["q"], k_cache, v_cache, case["k"], case["v"], rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=case["cache_seqlens"], cache_leftpad=leftpad, causal=causal, rotary_interleaved=False,
        return_softmax_lse=True)
    assert_fp32_close(out, ref_out, "out")
    assert_fp32_close(lse, ref_lse, "lse")
    np.testing.assert_allclose(k_cache, ref_k, rtol=1e-6, atol=1e-6)


def test_rotary_tables_in_float64_are_taken(rng):
    # np.cos / np.sin give float64: converted to float32 for the library
    case = make_case(rng, seqlen_new=1, capacity=20)
    cos, sin = rotary_tables(rng, 21, 4)
    args = {key: value for key, value in case.items() if key not in ("q", "k_cache", "v_cache")}
    a = flashcore.flash_attn_with_kvcache(case["q"], case["k_cache"].copy(), case["v_cache"].copy(), rotary_cos=cos,
                                          rotary_sin=sin, **args)
    b = flashcore.flash_attn_with_kvcache(case["q"], case["k_cache"].copy(), case["v_cache"].copy(),
                                          rotary_cos=cos.astype(np.float64), rotary_sin=sin.astype(np.float64), **args)
    np.testing.assert_array_equal(a, b)


# ---- merge_partials ----------------------------------------------------------------------------


def partials_of(q, k, v, boundaries, causal=False):
    """Attention of each key range [boundaries[i], boundaries[i+1]) as float32 partials:
    out (parts, batch, seqlen_q, heads, head_dim), lse (parts, batch, heads, seqlen_q). The
    causal mask is that of the whole key set, so a range may see no key (lse -inf)."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    outs, lses = [], []
    for start, stop in zip(boundaries[:-1], boundaries[1:]):
        out = np.zeros(q.shape)
        lse = np.zeros((batch, heads, seqlen_q))
        for b in range(batch):
            mask = allowed_keys(seqlen_q, seqlen_k, causal, (-1, -1))[:, start:stop]
            q64, k64, v64 = (x[b].astype(np.float64) for x in (q, k[:, start:stop], v[:, start:stop]))
            s = np.einsum("ihd,jhd->hij", q64, k64) * q.shape[-1] ** -0.5
            s = np.where(mask[None], s, -np.inf)
            with np.errstate(divide="ignore", invalid="ignore"):
                row_max = np.where(mask.any(-1)[None, :, None], s.max(-1, keepdims=True, initial=-np.inf), 0)
                p = np.exp(s - row_max)
                total = p.sum(-1, keepdims=True)
                lse[b] = np.where(total[..., 0] > 0, np.log(total[..., 0]) + row_max[..., 0], -np.inf)
                out[b] = np.einsum("hij,jhd->ihd", np.where(total > 0, p / total, 0), v64)
        outs.append(out)
        lses.append(lse)
    return np.stack(outs).astype(np.float32), np.stack(lses).astype(np.float32)


@pytest.mark.parametrize("boundaries", [[0, 30], [0, 7, 19, 30], [0, 1, 2, 30]])
def test_merge_partials_equals_whole_attention(rng, boundaries):
    batch, seqlen_q, heads, seqlen_k = 2, 3, 4, 30
    q = rng.standard_normal((batch, seqlen_q, heads, HEAD_DIM)).astype(np.float32)
    k, v = (rng.standard_normal((batch, seqlen_k, heads, HEAD_DIM)).astype(np.float32)
            for _ in range(2))
    # Causal over the whole key set: early ranges are empty for no row, late ones for some.
    out_partials, lse_partials = partials_of(q, k, v, boundaries, causal=True)
    out, lse = flashcore.merge_partials(out_partials, lse_partials)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert lse.shape == (batch, heads, seqlen_q)
    whole_out, whole_lse = partials_of(q, k, v, [0, seqlen_k], causal=True)
    assert_fp32_close(out, whole_out[0].astype(np.float64), "out")
    assert_fp32_close(lse, whole_lse[0].astype(np.float64), "lse")


def test_merge_partials_into_given_outputs_and_empty_rows(rng):
    parts, batch, seqlen_q, heads = 3, 2, 2, 4
    out_partials = rng.standard_normal((parts, batch, seqlen_q, heads, HEAD_DIM)).astype(np.float32)
    lse_partials = rng.standard_normal((parts, batch, heads, seqlen_q)).astype(np.float32)
    lse_partials[1] = -np.inf  # a part that saw no key contributes nothing
    lse_partials[:, 1, 2, 0] = -np.inf  # a row no part saw: out 0, lse -inf
    out = np.full((batch, seqlen_q, heads, HEAD_DIM), np.nan, dtype=np.float16)
    lse = np.full((batch, heads, seqlen_q), np.nan, dtype=np.float32)
    result = flashcore.merge_partials(out_partials, lse_partials, out=out, lse=lse)
    assert result[0] is out and result[1] is lse
    with np.errstate(invalid="ignore"):  # -inf - -inf in the row no part saw
        weights = np.exp(lse_partials.astype(np.float64) - lse.astype(np.float64)[None])
    weights = np.where(np.isfinite(lse)[None], weights, 0)  # (parts, batch, heads, seqlen_q)
    expected = np.einsum("pbhi,pbihd->bihd", weights, out_partials.astype(np.float64))
    with np.errstate(divide="ignore"):
        expected_lse = np.log(np.exp(lse_partials.astype(np.float64)).sum(0))
    assert_fp32_close(lse, expected_lse, "lse")
    assert np.all(out[1, 0, 2] == 0) and np.isneginf(lse[1, 2, 0])
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2e-3, atol=2e-3)
    # The C ABI's 4-D layout (batch and seqlen_q merged) gives the same result.
    flat = out_partials.reshape(parts, batch * seqlen_q, heads, HEAD_DIM)
    out4, lse4 = flashcore.merge_partials(flat, lse_partials)
    np.testing.assert_array_equal(out4.astype(np.float16), out)
    np.testing.assert_array_equal(lse4, lse)


def test_merge_partials_errors(rng):
    out_partials = np.zeros((2, 1, 3, 4, HEAD_DIM), np.float32)
    lse_partials = np.zeros((2, 1, 4, 3), np.float32)
    with pytest.raises(ValueError, match=r"^lse_partials: "):
        flashcore.merge_partials(out_partials, lse_partials[:1])
    with pytest.raises(ValueError, match=r"^out_partials: "):
        flashcore.merge_partials(out_partials.astype(np.float16), lse_partials)
    with pytest.raises(ValueError, match=r"^lse_partials: "):
        flashcore.merge_partials(out_partials, lse_partials[..., :2])
    with pytest.raises(ValueError, match=r"^out_partials: "):
        flashcore.merge_partials(out_partials[:, 0, 0], lse_partials)  # 3-D
    with pytest.raises(ValueError, match=r"^out: "):
        flashcore.merge_partials(out_partials, lse_partials, out=np.zeros((1, 3, 4, HEAD_DIM), np.int32))


# ---- torch CPU ---------------------------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="torch is not installed")


def torch_case(torch, case):
    return {key: torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray)
            else value for key, value in case.items()}


def test_torch_cpu_alibi_matches_numpy(rng, torch):
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=48, page_size=16)
    slopes = alibi_slopes_for(rng, 3, 4, True)
    expected_out, expected_lse = run_and_check(case, causal=True, alibi_slopes=slopes)
    tcase = torch_case(torch, case)
    k_cache, v_cache = tcase.pop("k_cache"), tcase.pop("v_cache")
    out, lse = flashcore.flash_attn_with_kvcache(tcase.pop("q"), k_cache, v_cache, causal=True,
                                                 alibi_slopes=torch.from_numpy(slopes),
                                                 return_softmax_lse=True, **tcase)
    np.testing.assert_allclose(out.numpy(), expected_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), expected_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page_size", [None, 16])
def test_torch_cpu_matches_numpy_and_appends_in_place(rng, torch, page_size):
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=48, page_size=page_size)
    expected_out, expected_lse = run_and_check(case, causal=True, num_splits=3)
    tcase = torch_case(torch, case)
    tcase["cache_seqlens"] = tcase["cache_seqlens"].to(torch.int64)  # flash_attn users pass both
    k_cache, v_cache = tcase.pop("k_cache"), tcase.pop("v_cache")
    out, lse = flashcore.flash_attn_with_kvcache(tcase.pop("q"), k_cache, v_cache, causal=True,
                                                 num_splits=3, return_softmax_lse=True, **tcase)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), expected_out)
    np.testing.assert_array_equal(lse.numpy(), expected_lse)
    _, _, ref_k, ref_v = reference_kvcache(case["q"], case["k_cache"], case["v_cache"],
                                           case["cache_seqlens"], k=case["k"], v=case["v"],
                                           block_table=case.get("block_table"))
    np.testing.assert_array_equal(k_cache.numpy(), ref_k)
    np.testing.assert_array_equal(v_cache.numpy(), ref_v)


def test_torch_cpu_int_cache_seqlens_and_errors(rng, torch):
    case = torch_case(torch, make_case(rng, capacity=20, seqlen_new=1))
    q, k_cache, v_cache = case["q"], case["k_cache"], case["v_cache"]
    before = k_cache.clone()
    out = flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    with pytest.raises(ValueError, match=r"^cache_seqlens: "):
        flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, case["k"], case["v"],
                                          cache_seqlens=torch.tensor([1, 2**40, 3]))
    with pytest.raises(ValueError, match=r"^cache_seqlens: "):
        flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, case["k"], case["v"],
                                          cache_seqlens=torch.tensor([1, 20, 3], dtype=torch.int32))
    assert torch.equal(k_cache, before)
    with pytest.raises(ValueError, match=r"^alibi_slopes: "):
        flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5,
                                          alibi_slopes=torch.ones(3, dtype=torch.float32))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])  # q and k at the same positions (one pass) or not
def test_torch_cpu_rotary_matches_numpy(rng, torch, interleaved, causal):
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=30)
    cos, sin = rotary_tables(rng, 32, 6)
    k_np, v_np = case["k_cache"].copy(), case["v_cache"].copy()
    args = dict(rotary_cos=cos, rotary_sin=sin, causal=causal, rotary_interleaved=interleaved)
    expected = flashcore.flash_attn_with_kvcache(case["q"], k_np, v_np, case["k"], case["v"],
                                                 cache_seqlens=case["cache_seqlens"], **args)
    tcase = torch_case(torch, case)
    args.update(rotary_cos=torch.from_numpy(cos), rotary_sin=torch.from_numpy(sin))
    out = flashcore.flash_attn_with_kvcache(tcase["q"], tcase["k_cache"], tcase["v_cache"], tcase["k"],
                                            tcase["v"], cache_seqlens=tcase["cache_seqlens"], **args)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tcase["k_cache"].numpy(), k_np, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"^rotary_cos: has 20 rows"):
        flashcore.flash_attn_with_kvcache(tcase["q"], tcase["k_cache"], tcase["v_cache"], tcase["k"],
                                          tcase["v"], cache_seqlens=tcase["cache_seqlens"],
                                          rotary_cos=args["rotary_cos"][:20], rotary_sin=args["rotary_sin"][:20])


def test_torch_cpu_cache_leftpad_matches_numpy(rng, torch):
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=30, lengths=[7, 28, 12])
    leftpad = np.array([2, 9, 12], np.int32)
    k_np, v_np = case["k_cache"].copy(), case["v_cache"].copy()
    expected = flashcore.flash_attn_with_kvcache(case["q"], k_np, v_np, case["k"], case["v"], causal=True,
                                                 cache_seqlens=case["cache_seqlens"], cache_leftpad=leftpad)
    t = torch_case(torch, case)
    out = flashcore.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], causal=True,
                                            cache_seqlens=t["cache_seqlens"], cache_leftpad=torch.from_numpy(leftpad))
    np.testing.assert_array_equal(out.numpy(), expected)
    np.testing.assert_array_equal(t["k_cache"].numpy(), k_np)
    with pytest.raises(ValueError, match=r"^cache_leftpad: entry 0 is 8"):
        flashcore.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"],
                                          cache_seqlens=t["cache_seqlens"],
                                          cache_leftpad=torch.tensor([8, 0, 0], dtype=torch.int32))


def test_torch_cpu_custom_op_matches_eager(rng, torch):
    from flashcore import _torch

    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=48, page_size=16)
    eager, op = torch_case(torch, case), torch_case(torch, case)
    out_eager, lse_eager = flashcore.flash_attn_with_kvcache(
        eager["q"], eager["k_cache"], eager["v_cache"], eager["k"], eager["v"],
        cache_seqlens=eager["cache_seqlens"], block_table=eager["block_table"], causal=True,
        return_softmax_lse=True)
    out_op, lse_op = _torch._kvcache_op(
        op["q"], op["k_cache"], op["v_cache"], op["k"], op["v"], op["cache_seqlens"], None,
        op["block_table"], 0.0, True, -1, 0, 0.0, 0, 0, None, None, True, None, None)
    assert torch.equal(out_eager, out_op) and torch.equal(lse_eager, lse_op)
    assert torch.equal(eager["k_cache"], op["k_cache"])
    assert torch.equal(eager["v_cache"], op["v_cache"])


def test_torch_cpu_compile_sees_the_mutating_op(rng, torch):
    case = torch_case(torch, make_case(rng, seqlen_q=1, seqlen_new=1, capacity=32))
    reference_cache = case["k_cache"].clone()
    expected = flashcore.flash_attn_with_kvcache(case["q"], reference_cache,
                                                 case["v_cache"].clone(), case["k"], case["v"],
                                                 cache_seqlens=case["cache_seqlens"])

    def step(q, k_cache, v_cache, k, v, cache_seqlens):
        return flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                 cache_seqlens=cache_seqlens)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    k_cache = case["k_cache"].clone()
    out = compiled(case["q"], k_cache, case["v_cache"].clone(), case["k"], case["v"],
                   case["cache_seqlens"])
    assert torch.equal(out, expected)
    assert torch.equal(k_cache, reference_cache)  # the append is kept through functionalization


def test_torch_cpu_merge_partials(rng, torch):
    out_partials = rng.standard_normal((3, 2, 2, 4, HEAD_DIM)).astype(np.float32)
    lse_partials = rng.standard_normal((3, 2, 4, 2)).astype(np.float32)
    expected_out, expected_lse = flashcore.merge_partials(out_partials, lse_partials)
    out, lse = flashcore.merge_partials(torch.from_numpy(out_partials),
                                        torch.from_numpy(lse_partials))
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), expected_out)
    np.testing.assert_array_equal(lse.numpy(), expected_lse)


def test_torch_cpu_custom_op_opcheck(rng, torch):
    from flashcore import _torch

    case = torch_case(torch, make_case(rng, seqlen_q=2, seqlen_new=1, capacity=32, page_size=16))
    args = (case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"],
            case["cache_seqlens"], None, case["block_table"], 0.0, True, -1, 0, 0.0, 0, 0,
            None, None, True, None, None)
    torch.library.opcheck(_torch._kvcache_op, args)
    # with rotary tables and left padding (contiguous caches)
    case = torch_case(torch, make_case(rng, seqlen_q=2, seqlen_new=1, capacity=32, lengths=[4, 20, 9]))
    cos, sin = (torch.from_numpy(t) for t in rotary_tables(rng, 34, 4))
    args = (case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"],
            case["cache_seqlens"], None, None, 0.0, True, -1, 0, 0.0, 0, 0,
            cos, sin, False, torch.tensor([1, 0, 9], dtype=torch.int32), None)
    torch.library.opcheck(_torch._kvcache_op, args)
    # with ALiBi slopes, (batch, heads_q)
    case = torch_case(torch, make_case(rng, seqlen_q=2, seqlen_new=1, capacity=32))
    slopes = torch.from_numpy(alibi_slopes_for(rng, 3, 4, True))
    args = (case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"],
            case["cache_seqlens"], None, None, 0.0, True, -1, 0, 0.0, 0, 0,
            None, None, True, None, slopes)
    torch.library.opcheck(_torch._kvcache_op, args)


# ---- torch CUDA (skip without a GPU) -----------------------------------------------------------


@pytest.fixture
def cuda_torch(torch):
    if not torch.cuda.is_available() or flashcore.cuda_device_count() == 0:
        pytest.skip("no CUDA device (or flashcore built without CUDA)")
    return torch


@pytest.mark.parametrize("page_size", [None, 16])
def test_torch_cuda_matches_reference_and_appends(rng, cuda_torch, page_size):
    torch = cuda_torch
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=300, page_size=page_size,
                     dtype=np.float16)
    tcase = {key: value.cuda() for key, value in torch_case(torch, case).items()}
    out, lse = flashcore.flash_attn_with_kvcache(
        tcase["q"], tcase["k_cache"], tcase["v_cache"], tcase["k"], tcase["v"],
        cache_seqlens=tcase["cache_seqlens"].long(), block_table=tcase.get("block_table"),
        causal=True, return_softmax_lse=True)
    reference_args = dict(k=case["k"], v=case["v"], block_table=case.get("block_table"),
                          causal=True)
    ref_out, ref_lse, ref_k, ref_v = reference_kvcache(
        case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], **reference_args)
    same_out, same_lse, _, _ = reference_kvcache(
        case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], same_precision=True,
        **reference_args)
    assert_low_precision_close(out.cpu().numpy(), ref_out, same_out.astype(np.float16),
                               np.float16, "out")
    assert_low_precision_close(lse.cpu().numpy(), ref_lse, same_lse, np.float32, "lse")
    np.testing.assert_array_equal(tcase["k_cache"].cpu().numpy(), ref_k)
    np.testing.assert_array_equal(tcase["v_cache"].cpu().numpy(), ref_v)


def test_torch_cuda_decode_step_captured_in_a_cuda_graph(rng, cuda_torch):
    torch = cuda_torch
    case = make_case(rng, seqlen_q=1, seqlen_new=1, capacity=64, page_size=16, dtype=np.float16)
    t = {key: value.cuda() for key, value in torch_case(torch, case).items()}

    def step():
        return flashcore.flash_attn_with_kvcache(
            t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], cache_seqlens=t["cache_seqlens"],
            block_table=t["block_table"], causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch recommends
        eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()  # appends the same token at the same position again: idempotent
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)



@pytest.mark.parametrize("interleaved", [True, False])
def test_torch_cuda_rotary_matches_reference(rng, cuda_torch, interleaved):
    # The rotation runs on the device with the lengths read there (no host synchronization).
    torch = cuda_torch
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=300, page_size=16, dtype=np.float16)
    cos, sin = rotary_tables(rng, 320, 4)
    tcase = {key: value.cuda() for key, value in torch_case(torch, case).items()}
    out = flashcore.flash_attn_with_kvcache(
        tcase["q"], tcase["k_cache"], tcase["v_cache"], tcase["k"], tcase["v"],
        rotary_cos=torch.from_numpy(cos).cuda(), rotary_sin=torch.from_numpy(sin).cuda(),
        cache_seqlens=tcase["cache_seqlens"], block_table=tcase["block_table"], causal=True,
        rotary_interleaved=interleaved)
    positions = case["cache_seqlens"].astype(np.int64)[:, None] + np.arange(2)[None]
    q_rot, k_rot = (rotary_reference(case[name], cos, sin, positions, interleaved).astype(np.float16)
                    for name in ("q", "k"))
    reference_args = dict(k=k_rot, v=case["v"], block_table=case["block_table"], causal=True)
    ref_out, _, ref_k, _ = reference_kvcache(q_rot, case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                             **reference_args)
    same_out, _, _, _ = reference_kvcache(q_rot, case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                          same_precision=True, **reference_args)
    assert_low_precision_close(out.cpu().numpy(), ref_out, same_out.astype(np.float16), np.float16, "out")
    # the new keys rotated in fp32 and rounded once: within one fp16 rounding of the fp64 rotation
    np.testing.assert_allclose(tcase["k_cache"].cpu().numpy().astype(np.float32), ref_k.astype(np.float32),
                               rtol=2e-3, atol=2e-3)


def test_torch_cuda_cache_leftpad_matches_reference(rng, cuda_torch):
    torch = cuda_torch
    lengths = [10, 298, 150]
    leftpad = np.array([3, 0, 150], np.int32)
    case = make_case(rng, seqlen_q=2, seqlen_new=2, capacity=300, dtype=np.float16, lengths=lengths)
    ref_out, _, ref_k, ref_v = leftpad_reference(case, leftpad, True)
    t = {key: value.cuda() for key, value in torch_case(torch, case).items()}
    out = flashcore.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"],
                                            cache_seqlens=t["cache_seqlens"],
                                            cache_leftpad=torch.from_numpy(leftpad).cuda(), causal=True)
    same_out, _, _, _ = leftpad_reference(case, leftpad, True, same_precision=True)
    assert_low_precision_close(out.cpu().numpy(), ref_out, same_out.astype(np.float16), np.float16, "out")
    np.testing.assert_array_equal(t["k_cache"].cpu().numpy(), ref_k)
    np.testing.assert_array_equal(t["v_cache"].cpu().numpy(), ref_v)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_cuda_few_query_rows_take_the_decode_kernel(cuda_torch, causal):
    """flash_attn_func with a few query rows per KV head runs on the decode kernel (AUTO's decode
    route): the same bits as flash_attn_with_kvcache over the same tensors as a full cache, under
    autograd and in a CUDA graph too."""
    torch = cuda_torch
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 2, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 3000, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 3000, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse, _ = flashcore.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    cache_out, cache_lse = flashcore.flash_attn_with_kvcache(q, k, v, causal=causal, return_softmax_lse=True)
    assert torch.equal(out, cache_out)
    assert torch.equal(lse, cache_lse)
    qg = q.clone().requires_grad_()
    flashcore.flash_attn_func(qg, k, v, causal=causal).float().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashcore.flash_attn_func(q, k, v, causal=causal)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = flashcore.flash_attn_func(q, k, v, causal=causal)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.parametrize("layout", ["heads_inner", "heads_outer"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_torch_cuda_head_dim_64_layouts_match_reference(rng, cuda_torch, layout, num_splits):
    """Head dim 64 caches whose KV heads sit side by side are read two heads at a time on the GPU
    (cuda/decode/head_pairs.hpp); stored heads-outer (a strided view) one head at a time. Both
    match the fp64 reference, through flash_attn_with_kvcache and through flash_attn_func's
    decode route."""
    torch = cuda_torch
    batch, capacity, heads_q, heads_kv, dim = 3, 700, 16, 4, 64
    make = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(np.float16)
    q = make(batch, 1, heads_q, dim)
    k_cache, v_cache = make(batch, capacity, heads_kv, dim), make(batch, capacity, heads_kv, dim)
    lengths = np.asarray([capacity, 1, 333], dtype=np.int32)
    ref_out, ref_lse, _, _ = reference_kvcache(q, k_cache, v_cache, lengths)
    same_out, same_lse, _, _ = reference_kvcache(q, k_cache, v_cache, lengths, same_precision=True)

    def on_gpu(x):
        t = torch.from_numpy(x).cuda()
        if layout == "heads_outer":
            t = t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        return t

    tq, tk, tv = torch.from_numpy(q).cuda(), on_gpu(k_cache), on_gpu(v_cache)
    out, lse = flashcore.flash_attn_with_kvcache(
        tq, tk, tv, cache_seqlens=torch.from_numpy(lengths).cuda(), num_splits=num_splits,
        return_softmax_lse=True)
    assert_low_precision_close(out.cpu().numpy(), ref_out, same_out.astype(np.float16),
                               np.float16, "out")
    assert_low_precision_close(lse.cpu().numpy(), ref_lse, same_lse, np.float32, "lse")
    # The first sequence fills its cache: flash_attn_func over it is the same attention.
    full_out, full_lse, _ = flashcore.flash_attn_func(tq[:1], tk[:1], tv[:1], return_attn_probs=True)
    assert_low_precision_close(full_out.cpu().numpy(), ref_out[:1], same_out[:1].astype(np.float16),
                               np.float16, "flash_attn_func out")
    assert_low_precision_close(full_lse.cpu().numpy(), ref_lse[:1], same_lse[:1], np.float32,
                               "flash_attn_func lse")


def test_torch_cuda_head_pairs_keep_a_heads_non_finite_keys_to_itself(rng, cuda_torch):
    """A d64 cache read in head pairs (cuda/decode/head_pairs.hpp) scores each query row against
    its own KV head's half of the pair's 128-wide rows only: an inf in one head's keys and a NaN in
    another's values leave their partners' outputs exactly as the reference gives them."""
    torch = cuda_torch
    batch, capacity, heads_q, heads_kv, dim = 2, 300, 8, 4, 64
    make = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(np.float16)
    q = make(batch, 1, heads_q, dim)
    k_cache, v_cache = make(batch, capacity, heads_kv, dim), make(batch, capacity, heads_kv, dim)
    k_cache[:, 7, 1, 5] = np.inf  # KV head 1 (paired with 0)
    v_cache[:, 11, 2, :] = np.nan  # KV head 2 (paired with 3)
    lengths = np.asarray([capacity, 200], dtype=np.int32)
    ref_out, ref_lse, _, _ = reference_kvcache(q, k_cache, v_cache, lengths)
    same_out, same_lse, _, _ = reference_kvcache(q, k_cache, v_cache, lengths, same_precision=True)
    out, lse = flashcore.flash_attn_with_kvcache(
        torch.from_numpy(q).cuda(), torch.from_numpy(k_cache).cuda(), torch.from_numpy(v_cache).cuda(),
        cache_seqlens=torch.from_numpy(lengths).cuda(), return_softmax_lse=True)
    group = heads_q // heads_kv
    for kv_head in (0, 3):  # the partners of the heads holding inf / NaN
        heads = slice(kv_head * group, (kv_head + 1) * group)
        assert_low_precision_close(out.cpu().numpy()[:, :, heads], ref_out[:, :, heads],
                                   same_out[:, :, heads].astype(np.float16), np.float16,
                                   f"out of KV head {kv_head}")
        assert_low_precision_close(lse.cpu().numpy()[:, heads], ref_lse[:, heads], same_lse[:, heads],
                                   np.float32, f"lse of KV head {kv_head}")


def test_torch_heads_major_q_gives_out_in_its_layout(rng, torch):
    """q viewed (batch, seqlen_q, heads, d) from (batch, heads, seqlen_q, d) storage: out takes q's
    layout (as flash_attn allocates it) and holds the values of the same call on a contiguous q;
    with an append, the caches get the same rows either way."""
    case = make_case(rng, seqlen_q=3, seqlen_new=3, capacity=40)
    results = []
    for heads_major in (False, True):
        tcase = torch_case(torch, case)
        q = tcase.pop("q")
        if heads_major:
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k_cache, v_cache = tcase.pop("k_cache"), tcase.pop("v_cache")
        out, lse = flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True,
                                                     return_softmax_lse=True, **tcase)
        assert out.stride() == q.stride()
        results.append((out, lse, k_cache, v_cache))
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), *results):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

"""Framework-neutral attention calls: numpy arrays and any object exposing ``__dlpack__``.

This layer turns Python arguments into one call of the extension ``flashcore._C`` (the C ABI):
it allocates outputs with the input's own framework when the caller did not pass them (numpy
for numpy arrays, the array-API namespace for others such as cupy), passes the caller's CUDA
stream through as an integer, and leaves every rule about shapes, strides and dtypes to the
library, whose error messages name the offending argument. It has no autograd: PyTorch users
get that from ``flashcore._torch`` through the flash_attn-compatible functions.
"""

import sys

import numpy as np

from . import _C

# Names accepted for ``backend=``; integers are the C ABI's fc_backend values.
BACKENDS = dict(_C.backend_names())
BACKENDS["auto"] = _C.BACKEND_AUTO

# Number of dimensions of q/k/v in the two layouts (see include/flashcore/flashcore.h).
DENSE_NDIM = 4
VARLEN_NDIM = 3

# flash_attn computes with softmax_scale = 0.0 literally, while the C ABI reads 0.0 as "use
# 1/sqrt(head_dim)". The smallest normal double rounds to a 0.0f scale inside the library, which
# is FlashAttention's meaning (uniform attention over the allowed keys).
EXPLICIT_ZERO_SCALE = sys.float_info.min

INT32_MAX = np.iinfo(np.int32).max
INT32_MIN = np.iinfo(np.int32).min


def backend_id(backend):
    """The fc_backend value for a name ('auto', 'cpu_flash', ...) or an integer."""
    if isinstance(backend, str):
        try:
            return BACKENDS[backend]
        except KeyError:
            raise ValueError(
                f"backend: unknown backend {backend!r}; expected one of {sorted(BACKENDS)}"
            ) from None
    if isinstance(backend, (int, np.integer)) and not isinstance(backend, bool):
        return int(backend)
    raise TypeError(f"backend: expected a name or an integer, got {type(backend).__name__}")


def resolve_scale(softmax_scale):
    """The softmax_scale the C ABI should see: 0.0 means 1/sqrt(head_dim) there."""
    if softmax_scale is None:
        return 0.0
    scale = float(softmax_scale)
    return EXPLICIT_ZERO_SCALE if scale == 0.0 else scale


def resolve_window(window_size):
    """(left, right) from flash_attn's window_size, as Python ints (-1 = unbounded)."""
    try:
        left, right = window_size
        return int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size: expected a pair (left, right) of ints, got {window_size!r}"
        ) from None


def make_options(
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    max_seqlen_q=0,
    max_seqlen_k=0,
    backend="auto",
    deterministic=False,
    stream=None,
    num_threads=0,
    check_cu_seqlens=False,
    uint16_is_bfloat16=False,
    dropout_p=0.0,
    dropout_seed=0,
    dropout_offset=0,
):
    """A ``_C.Options`` from flash_attn-style arguments."""
    left, right = resolve_window(window_size)
    return _C.Options(
        softmax_scale=resolve_scale(softmax_scale),
        causal=bool(causal),
        window_left=left,
        window_right=right,
        softcap=float(softcap),
        max_seqlen_q=int(max_seqlen_q or 0),
        max_seqlen_k=int(max_seqlen_k or 0),
        backend=backend_id(backend),
        deterministic=bool(deterministic),
        stream=int(stream or 0),
        num_threads=int(num_threads),
        check_cu_seqlens=bool(check_cu_seqlens),
        uint16_is_bfloat16=uint16_is_bfloat16,
        dropout_p=float(dropout_p),
        dropout_seed=_uint64(dropout_seed, "dropout_seed"),
        dropout_offset=_uint64(dropout_offset, "dropout_offset"),
    )


def _uint64(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < 2**64:
        raise ValueError(f"{name}: expected an int in [0, 2^64), got {value!r}")
    return int(value)


def lse_shape(q_shape, is_varlen):
    """LSE layout of the C ABI: dense (batch, heads, seqlen_q); varlen (heads, total_q)."""
    if is_varlen:
        return (q_shape[1], q_shape[0])
    return (q_shape[0], q_shape[2], q_shape[1])


# ---- numpy specifics -------------------------------------------------------------------------


def _is_numpy_bfloat16(array):
    # ml_dtypes.bfloat16 (the usual numpy bfloat16) has no DLPack code of its own.
    return isinstance(array, np.ndarray) and array.dtype.name == "bfloat16"


def _as_bfloat16_bits(array):
    """numpy bfloat16 arrays travel as uint16 views (see _C.Options.uint16_is_bfloat16)."""
    if array is not None and _is_numpy_bfloat16(array):
        return array.view(np.uint16)
    return array


def _numpy_int32(values, name, lowest=INT32_MIN):
    """int32 from any integer numpy array whose values lie in [lowest, INT32_MAX]; other arrays
    are left to the library. Values in range but invalid (a negative length, a page id past the
    cache) are the library's to reject, with a message naming the entry."""
    if not isinstance(values, np.ndarray) or values.dtype == np.int32:
        return values
    if values.dtype.kind not in "iu":
        raise ValueError(f"{name}: dtype {values.dtype} is not supported; expected int32")
    if values.size and (values.min() < lowest or values.max() > INT32_MAX):
        raise ValueError(f"{name}: values do not fit in int32")
    return values.astype(np.int32)


def _numpy_cu_seqlens(cu_seqlens, name):
    """int32 prefix sums from any integer numpy array; others are left to the library."""
    return _numpy_int32(cu_seqlens, name, lowest=0)


def _numpy_alibi_slopes(slopes):
    """numpy slopes of a dtype the extension cannot hand to the library as a float (float64, what
    numpy arithmetic gives; ml_dtypes' bfloat16) are refused here with the library's rule; the
    library names every other wrong dtype itself."""
    if isinstance(slopes, np.ndarray) and slopes.dtype not in (np.float32, np.float16):
        raise ValueError(f"alibi_slopes: dtype {slopes.dtype} is not supported (ALiBi slopes are float32)")
    return slopes


def _numpy_max_seqlen(cu_seqlens):
    if isinstance(cu_seqlens, np.ndarray) and cu_seqlens.ndim == 1 and cu_seqlens.size > 1:
        return int(np.max(np.diff(cu_seqlens.astype(np.int64))))
    return 0


# ---- output allocation ------------------------------------------------------------------------


def _is_torch_tensor(x):
    # Checked by module name so that this layer never imports torch itself.
    return type(x).__module__.startswith("torch") and hasattr(x, "requires_grad")


def _allocator_for(like, name):
    """A function (shape, dtype=None) -> new uninitialized array in `like`'s framework and on
    its device; dtype None means like's dtype, otherwise a numpy dtype."""
    if isinstance(like, np.ndarray):
        return lambda shape, dtype=None: np.empty(shape, like.dtype if dtype is None else dtype)
    if _is_torch_tensor(like):
        torch = sys.modules["torch"]

        def allocate_torch(shape, dtype=None):
            torch_dtype = like.dtype if dtype is None else getattr(torch, np.dtype(dtype).name)
            return torch.empty(shape, dtype=torch_dtype, device=like.device)

        return allocate_torch
    namespace = getattr(like, "__array_namespace__", None)
    if namespace is not None:
        xp = namespace()

        def allocate_array_api(shape, dtype=None):
            xp_dtype = like.dtype if dtype is None else getattr(xp, np.dtype(dtype).name)
            return xp.empty(shape, dtype=xp_dtype, device=like.device)

        return allocate_array_api
    raise TypeError(
        f"{name}: cannot allocate outputs for {type(like).__name__}; pass them in "
        "(out=..., lse=...) or use numpy, torch or a framework with __array_namespace__"
    )


def _plain(x):
    """x ready for export through DLPack: torch refuses to export tensors requiring grad."""
    if _is_torch_tensor(x) and x.requires_grad:
        return x.detach()
    return x


def _workspace_allocator(like):
    """Callable(nbytes) -> uint8 array on `like`'s device, for the extension to call on demand."""
    allocate = _allocator_for(like, "workspace")
    return lambda nbytes: allocate((nbytes,), np.uint8)


def _check_array(x, name):
    if not (hasattr(x, "__dlpack__") or isinstance(x, np.ndarray)):
        raise TypeError(
            f"{name}: expected an array exposing __dlpack__ (numpy, torch, cupy, ...), "
            f"got {type(x).__name__}"
        )


# ---- public calls ------------------------------------------------------------------------------


def attention_forward(
    q,
    k,
    v,
    *,
    out=None,
    lse=None,
    return_lse=False,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    backend="auto",
    num_threads=0,
    stream=None,
    workspace=None,
    check_cu_seqlens=False,
    error_flag=None,
    block_table=None,
    alibi_slopes=None,
    dropout_p=0.0,
    dropout_seed=0,
    dropout_offset=0,
):
    """out = softmax(softmax_scale * q k^T + mask) v for numpy or DLPack arrays.

    Layouts as flash_attn: dense q (batch, seqlen_q, heads_q, head_dim) and k/v
    (batch, seqlen_k, heads_kv, head_dim); varlen (cu_seqlens_* given) q (total_q, heads_q,
    head_dim), k/v (total_k, heads_kv, head_dim) with int32 prefix sums cu_seqlens_q/k.
    ``out``/``lse`` may be passed in (they are written, never reallocated); otherwise they are
    allocated with q's framework. ``stream`` is the caller's cudaStream_t as an int (None: the
    legacy default stream); the call is asynchronous on it for CUDA arrays.
    Returns out, or (out, lse) when return_lse; lse is float32, dense (batch, heads_q,
    seqlen_q) or varlen (heads_q, total_q), natural-log, -inf for rows without keys.
    ``check_cu_seqlens``: CUDA cu_seqlens are trusted (as in flash_attn) unless this is set (or
    FLASHCORE_CHECK_CU_SEQLENS=1): then they are copied to the host and validated first, which
    synchronizes the stream. ``error_flag``: an int32 array on q's device (zero it first) that a
    device-side check sets to 1 when CUDA cu_seqlens break those rules, without a synchronization;
    such a call stays inside its tensors but its results are not meaningful. CPU cu_seqlens are
    always validated. ``block_table`` (varlen only, int32 (batch, max_pages_per_seq)): k / v are
    paged, (num_pages, page_size, heads_kv, head_dim); cu_seqlens_k then only gives the lengths.
    ``alibi_slopes`` (float32 (heads_q) or (batch, heads_q) on q's device): flash_attn's ALiBi,
    the score of query i and key j of a sequence gets -slope * |i + seqlen_k - seqlen_q - j|
    (after softmax_scale and softcap; lse includes it).
    ``dropout_p`` in [0, 1): dropout of the probabilities, each kept with probability 1 -
    dropout_p and scaled by 1 / (1 - dropout_p) (lse is the softmax's, without dropout). Which
    are kept is a pure function of ``dropout_seed``, ``dropout_offset`` (ints in [0, 2^64)) and
    the entry's sequence, query head, row and column, the same on every backend: pass the same
    three to attention_backward.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(x, name)
    is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    cu_seqlens_q = _numpy_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
    cu_seqlens_k = _numpy_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if is_varlen:
        max_seqlen_q = _numpy_max_seqlen(cu_seqlens_q) if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = _numpy_max_seqlen(cu_seqlens_k) if max_seqlen_k is None else max_seqlen_k
    if out is None:
        out = _allocator_for(q, "out")(tuple(q.shape))
    if lse is None and return_lse:
        lse = _allocator_for(q, "lse")(lse_shape(tuple(q.shape), is_varlen), np.float32)
    if workspace is None:
        workspace = _workspace_allocator(q)
    uses_bf16 = _is_numpy_bfloat16(q)
    options = make_options(
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        backend=backend,
        stream=stream,
        num_threads=num_threads,
        check_cu_seqlens=check_cu_seqlens,
        uint16_is_bfloat16=uses_bf16,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        dropout_offset=dropout_offset,
    )
    q_, k_, v_, out_ = (_as_bfloat16_bits(_plain(x)) for x in (q, k, v, out))
    _C.forward(q_, k_, v_, out_, _plain(lse), cu_seqlens_q, cu_seqlens_k, workspace, options,
               error_flag=_plain(error_flag), block_table=_numpy_int32(block_table, "block_table"),
               alibi_slopes=_plain(_numpy_alibi_slopes(alibi_slopes)))
    return (out, lse) if return_lse else out


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    dq=None,
    dk=None,
    dv=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    backend="auto",
    num_threads=0,
    stream=None,
    workspace=None,
    check_cu_seqlens=False,
    error_flag=None,
    alibi_slopes=None,
    dropout_p=0.0,
    dropout_seed=0,
    dropout_offset=0,
):
    """Gradients (dq, dk, dv) of attention_forward for the same arguments and options.

    ``out`` and ``lse`` must come from that forward. With GQA/MQA the gradients of the query
    heads sharing a KV head are summed into dk/dv. dq/dk/dv may be passed in; otherwise they
    are allocated like q/k/v with their framework. ``check_cu_seqlens``, ``error_flag`` and
    ``alibi_slopes`` (the forward's; the slopes get no gradient) as in attention_forward, and
    the forward's ``dropout_p``, ``dropout_seed`` and ``dropout_offset`` (the same entries are
    dropped).
    """
    for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        _check_array(x, name)
    is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    cu_seqlens_q = _numpy_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
    cu_seqlens_k = _numpy_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if is_varlen:
        max_seqlen_q = _numpy_max_seqlen(cu_seqlens_q) if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = _numpy_max_seqlen(cu_seqlens_k) if max_seqlen_k is None else max_seqlen_k
    dq = _allocator_for(q, "dq")(tuple(q.shape)) if dq is None else dq
    dk = _allocator_for(k, "dk")(tuple(k.shape)) if dk is None else dk
    dv = _allocator_for(v, "dv")(tuple(v.shape)) if dv is None else dv
    if workspace is None:
        workspace = _workspace_allocator(q)
    options = make_options(
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        backend=backend,
        deterministic=deterministic,
        stream=stream,
        num_threads=num_threads,
        check_cu_seqlens=check_cu_seqlens,
        uint16_is_bfloat16=_is_numpy_bfloat16(q),
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        dropout_offset=dropout_offset,
    )
    tensors = (_as_bfloat16_bits(_plain(x)) for x in (dout, q, k, v, out, lse, dq, dk, dv))
    _C.backward(*tensors, cu_seqlens_q, cu_seqlens_k, workspace, options, error_flag=_plain(error_flag),
                alibi_slopes=_plain(_numpy_alibi_slopes(alibi_slopes)))
    return dq, dk, dv


def kvcache_lse_shape(q_shape):
    """LSE layout of fc_attention_kvcache: (batch, heads_q, seqlen_q), like the dense forward."""
    return lse_shape(q_shape, is_varlen=False)


def cache_seqlens_from_int(cache_seqlens, name="cache_seqlens"):
    """flash_attn accepts one int for every sequence; it must fit the C ABI's int32."""
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, np.integer)):
        raise TypeError(f"{name}: expected an int or an int32 array like q, got "
                        f"{type(cache_seqlens).__name__}")
    value = int(cache_seqlens)
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"{name}: {value} does not fit in int32")
    return value


def _full_int32(like, length, value):
    """(length,) int32 array filled with value, in like's framework and on its device."""
    array = _allocator_for(like, "cache_seqlens")((length,), np.int32)
    array[...] = value
    return array


def attention_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    k=None,
    v=None,
    block_table=None,
    cache_batch_idx=None,
    out=None,
    lse=None,
    return_lse=False,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    num_splits=0,
    backend="auto",
    num_threads=0,
    stream=None,
    workspace=None,
    error_flag=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=True,
    cache_leftpad=None,
    alibi_slopes=None,
):
    """Attention of new queries against a KV cache (flash_attn_with_kvcache semantics) for numpy
    or DLPack arrays.

    q (batch, seqlen_q, heads_q, head_dim); k_cache/v_cache (batch_cache, seqlen_cache, heads_kv,
    head_dim), or paged (num_pages, page_size, heads_kv, head_dim) with block_table int32 (batch,
    pages_per_seq). cache_seqlens: int32 (batch,) tokens already cached, one int for all, or None
    (nothing appended): every sequence fills its cache.
    k/v (batch, seqlen_new, heads_kv, head_dim), when given, are written into the caches in place
    at positions cache_seqlens[b] ... before attending (cache_seqlens itself is not advanced).
    cache_batch_idx int32 (batch,) picks each sequence's cache row (contiguous caches only).
    Queries sit at the end of each sequence (causal/window bottom-right aligned). num_splits: 0 =
    heuristic, 1 = no split-KV. error_flag: optional int32 array on q's device that CUDA calls
    set to 1 (without synchronizing) when cache_seqlens / block_table values are out of range;
    on the CPU such values raise ValueError before anything is written. rotary_cos / rotary_sin
    (seqlen_ro, rotary_dim / 2), float32 or q's dtype, with k/v appended: rotary embedding of q and
    the appended k at their cache slots (rotary_interleaved: GPT-J pairs, else GPT-NeoX).
    cache_leftpad int32 (batch,), contiguous caches: sequence b starts at slot cache_leftpad[b].
    alibi_slopes float32 (heads_q) or (batch, heads_q): ALiBi as in attention_forward, key j of a
    sequence at distance |i + seqlen_k - seqlen_q - j| from query i, seqlen_k counting the
    appended keys.
    Returns out, or (out, lse) when return_lse, lse float32 (batch, heads_q, seqlen_q).
    """
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_array(x, name)
    if isinstance(cache_seqlens, (int, np.integer)):
        cache_seqlens = _full_int32(q, q.shape[0], cache_seqlens_from_int(cache_seqlens))
    cache_seqlens = _numpy_int32(cache_seqlens, "cache_seqlens")
    block_table = _numpy_int32(block_table, "block_table")
    cache_batch_idx = _numpy_int32(cache_batch_idx, "cache_batch_idx")
    cache_leftpad = _numpy_int32(cache_leftpad, "cache_leftpad")
    rotary_cos, rotary_sin = (_rotary_table(t, q) for t in (rotary_cos, rotary_sin))
    if out is None:
        out = _allocator_for(q, "out")(tuple(q.shape))
    if lse is None and return_lse:
        lse = _allocator_for(q, "lse")(kvcache_lse_shape(tuple(q.shape)), np.float32)
    if workspace is None:
        workspace = _workspace_allocator(q)
    options = make_options(
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        backend=backend,
        stream=stream,
        num_threads=num_threads,
        uint16_is_bfloat16=_is_numpy_bfloat16(q),
    )
    # The caches travel as views (never copies): appended tokens must land in the caller's arrays.
    q_, k_cache_, v_cache_, k_, v_, out_ = (
        _as_bfloat16_bits(_plain(x)) for x in (q, k_cache, v_cache, k, v, out)
    )
    _C.kvcache(q_, k_cache_, v_cache_, cache_seqlens, block_table, cache_batch_idx, k_, v_, out_,
               _plain(lse), error_flag, workspace, int(num_splits), options,
               rotary_cos=rotary_cos, rotary_sin=rotary_sin,
               rotary_interleaved=bool(rotary_interleaved), cache_leftpad=cache_leftpad,
               alibi_slopes=_plain(_numpy_alibi_slopes(alibi_slopes)))
    return (out, lse) if return_lse else out


def _rotary_table(table, q):
    """A numpy rotary table as the library takes it: float32 (numpy's float64 converted, so that
    np.cos / np.sin output serves) or q's bfloat16 as bits; other arrays as they are."""
    if not isinstance(table, np.ndarray):
        return _plain(table)
    if table.dtype == np.float64:
        table = table.astype(np.float32)
    return _as_bfloat16_bits(_plain(np.ascontiguousarray(table)))


def merge_partials_shapes(out_partials_shape, lse_partials_shape):
    """(out_partials as the C ABI's 4-D shape, out's shape, lse's shape) for out_partials given
    as (num_parts, batch, seqlen_q, heads, head_dim) or already merged to (num_parts,
    batch * seqlen_q, heads, head_dim), and lse_partials (num_parts, batch, heads, seqlen_q).
    The outputs take their sizes from the 5-D out_partials (from lse_partials for the 4-D form),
    so that the library's shape checks name the other argument when they disagree."""
    out_partials_shape = tuple(int(n) for n in out_partials_shape)
    lse_partials_shape = tuple(int(n) for n in lse_partials_shape)
    if len(out_partials_shape) == 5:
        parts, batch, seqlen_q, heads, head_dim = out_partials_shape
        merged = (parts, batch * seqlen_q, heads, head_dim)
    elif len(out_partials_shape) == 4 and len(lse_partials_shape) == 4:
        merged = out_partials_shape  # the library checks it as it is
        _, batch, heads, seqlen_q = lse_partials_shape
        head_dim = merged[-1]
    else:
        raise ValueError(f"out_partials: shape {out_partials_shape} is not (num_parts, batch, "
                         "seqlen_q, heads, head_dim)")
    return merged, (batch, seqlen_q, heads, head_dim), (batch, heads, seqlen_q)


def _reshape(x, shape):
    """x viewed (or copied, when its strides allow no view) with shape, in its own framework."""
    if hasattr(x, "reshape"):
        return x.reshape(shape)
    return x.__array_namespace__().reshape(x, shape)


def merge_partials(
    out_partials,
    lse_partials,
    out=None,
    lse=None,
    *,
    out_dtype=None,
    backend="auto",
    num_threads=0,
    stream=None,
):
    """Merges attention computed over disjoint key sets (split-KV, cascades, ring attention).

    out_partials float32 (num_parts, batch, seqlen_q, heads, head_dim) (or the C ABI's
    (num_parts, batch * seqlen_q, heads, head_dim)); lse_partials float32 (num_parts, batch,
    heads, seqlen_q), natural-log, -inf for parts without keys. out (batch, seqlen_q, heads,
    head_dim) and lse float32 (batch, heads, seqlen_q) may be passed in; otherwise they are
    allocated with out_partials' framework, out in out_dtype (a numpy dtype; default float32).
    A row whose parts are all -inf gives out 0 and lse -inf. Returns (out, lse).
    """
    _check_array(out_partials, "out_partials")
    _check_array(lse_partials, "lse_partials")
    merged_shape, out_shape, lse_out_shape = merge_partials_shapes(
        tuple(out_partials.shape), tuple(lse_partials.shape))
    if tuple(out_partials.shape) != merged_shape:
        out_partials = _reshape(out_partials, merged_shape)
    allocate = _allocator_for(out_partials, "out")
    if out is None:
        out = allocate(out_shape, np.float32 if out_dtype is None else out_dtype)
    if lse is None:
        lse = allocate(lse_out_shape, np.float32)
    options = make_options(backend=backend, stream=stream, num_threads=num_threads,
                           uint16_is_bfloat16=_is_numpy_bfloat16(out))
    _C.merge_partials(_plain(out_partials), _plain(lse_partials), _as_bfloat16_bits(_plain(out)),
                      _plain(lse), options)
    return out, lse

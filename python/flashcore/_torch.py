"""PyTorch integration: flashcore as torch.library custom ops with autograd, and the inference
calls (flash_attn_with_kvcache, merge_partials).

``flashcore::fwd`` and ``flashcore::bwd`` are registered with torch.library.custom_op, with
fake (meta) implementations so torch.compile(fullgraph=True) traces through them without a
graph break, and with register_autograd so backward calls the library's backward. The real
implementations allocate every tensor through PyTorch (out, dq, dk, dv in their input's layout
as flash_attn's torch.empty_like gives it, see _empty_like; lse with torch.empty; the workspace
as a uint8 tensor of the size the library reports), launch on the current CUDA stream and never synchronize or read device memory on the host, so they can
be captured in CUDA graphs. Tensors reach the extension as raw descriptors (pointer, dtype,
device, shape, strides), not through DLPack, to keep the host overhead per call low.
The KV-cache call (``flashcore::kvcache``, declared as mutating k_cache and v_cache, which it
appends into) has no autograd, as in flash_attn; int64 index tensors are narrowed to int32 on
their device with saturation, so out-of-range values reach the library as invalid (rejected on
the CPU, NaN output rows on the GPU) instead of wrapping, without a host synchronization.
Imported when the package is loaded after torch (__init__.py), or on the first call that
passes torch tensors (flash_attn_interface._load_torch_impl); numpy-only use never imports torch.
"""

import contextlib
from typing import Optional, Tuple

import torch

from . import _C
from ._dlpack_api import (
    INT32_MAX,
    INT32_MIN,
    backend_id,
    cache_seqlens_from_int,
    kvcache_lse_shape,
    lse_shape,
    merge_partials_shapes,
    resolve_scale,
    resolve_window,
)

Tensor = torch.Tensor

# Integer dtype the C ABI reads cu_seqlens in.
CU_SEQLENS_DTYPE = torch.int32

# torch dtypes the C ABI knows, as its fc_dtype codes.
_FC_DTYPES = {
    torch.float32: _C.DTYPE_F32,
    torch.float16: _C.DTYPE_F16,
    torch.bfloat16: _C.DTYPE_BF16,
    torch.int32: _C.DTYPE_I32,
}
_FC_DEVICES = {"cpu": _C.DEVICE_CPU, "cuda": _C.DEVICE_CUDA}


def _describe(t, name):
    """A raw descriptor of t for the extension (see RawTensorFields in python/src/ext.cpp).

    Exporting a torch tensor through __dlpack__ costs several microseconds of Python per tensor;
    these few attribute reads cost a fraction of that and need no detach(). The tensor object
    stays referenced by the caller for the duration of the call, which keeps its memory alive.
    (is_cuda / is_cpu / get_device instead of t.device: building a torch.device took a third of
    this function's time.)
    """
    if t is None:
        return None
    fc_dtype = _FC_DTYPES.get(t.dtype)
    if fc_dtype is None:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported (float32, float16, bfloat16)")
    if t.is_cuda:
        fc_device, index = _C.DEVICE_CUDA, t.get_device()
    elif t.is_cpu:
        fc_device, index = _C.DEVICE_CPU, 0
    else:
        raise ValueError(f"{name}: device {t.device} is not supported (cpu or cuda tensors only)")
    return (t.data_ptr(), fc_dtype, fc_device, index, t.shape, t.stride())


def _empty_like(t):
    """A tensor for a result shaped like t: t's layout where t is dense (torch.empty_like, as
    flash_attn allocates out), else contiguous. empty_like of a tensor whose rows overlap (an
    unfold, say) can put another stride-1 dimension last; the library needs the last one
    contiguous, so such a result is allocated contiguous instead."""
    out = torch.empty_like(t)
    if out.stride(-1) != 1 and out.shape[-1] > 1:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return out


def _empty_f32(like, shape):
    # torch.empty with the sizes as separate ints: ~0.4 us less per call than new_empty(shape).
    return torch.empty(*shape, dtype=torch.float32, device=like.device)


def _require_tensors(names, values, like="q"):
    """TypeError naming the first of values that is neither None nor a torch.Tensor."""
    for name, t in zip(names, values):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor like {like}, got {type(t).__name__}")


def _last_dim_contiguous(t):
    # flash_attn's rule: only the head_dim stride must be 1; other strides are accepted as is.
    return t if t.stride(-1) == 1 else t.contiguous()


def _options(like, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
             window_right, softcap, backend, deterministic, sm_margin=0, dropout_p=0.0,
             dropout_seed=None):
    if like.is_cuda:
        stream = _current_raw_stream(like.get_device())
        num_threads = 0
    else:
        stream = 0
        num_threads = torch.get_num_threads()  # honour torch.set_num_threads on CPU
    return _C.Options(
        softmax_scale=softmax_scale,
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        softcap=softcap,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        backend=backend,
        deterministic=deterministic,
        stream=stream,
        num_threads=num_threads,
        sm_margin=sm_margin,
        dropout_p=dropout_p,
        dropout_seed=_seed_value(dropout_p, dropout_seed),
    )


def _seed_value(dropout_p, dropout_seed):
    """The int seed in a dropout call's seed tensor (a CPU int64 drawn by _draw_dropout_seed:
    reading it does not synchronize a GPU); 0 without dropout."""
    if not dropout_p:
        return 0
    if (not isinstance(dropout_seed, Tensor) or dropout_seed.numel() != 1 or dropout_seed.is_floating_point()
            or dropout_seed.is_complex() or dropout_seed.dtype == torch.bool):
        raise ValueError("dropout_seed: a one-element integer tensor is required when dropout_p > 0, got "
                         f"{dropout_seed!r}")
    return int(dropout_seed) % 2**64


def _draw_dropout_seed():
    """A fresh mask seed from torch's default CPU generator, so torch.manual_seed makes dropout
    reproducible. A tensor, not an int: torch.compile traces the draw into its graph (an int read
    on the host would break it), and the op reads the value inside its implementation."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64)


def _check_dropout_capture(like, dropout_p):
    # The seed is drawn and read on the host: a CUDA graph would replay one mask forever.
    if dropout_p and like.is_cuda and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError("dropout_p: a call with dropout cannot be captured in a CUDA graph (its mask's "
                                  "seed is drawn on the host and would repeat on every replay)")


def _stream_of_device(index):
    return torch.cuda.current_stream(index).cuda_stream


# The current CUDA stream of a device as the integer handle the C ABI takes. torch's private
# getter returns it directly; torch.cuda.current_stream builds a Stream object first, several
# microseconds of host time per call. The public call stands in if a torch lacks the getter.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _stream_of_device)

# One allocator per device, made once (a closure per call cost ~0.4 us).
_allocators = {}


def _workspace_allocator(like):
    # Called by the extension only when the library needs scratch memory; returns a raw
    # workspace descriptor (data_ptr, nbytes, device type, device index, owning tensor).
    device = like.device
    allocate = _allocators.get(device)
    if allocate is None:
        fc_device = _FC_DEVICES.get(device.type)
        index = device.index or 0

        def allocate(nbytes):
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return (buffer.data_ptr(), nbytes, fc_device, index, buffer)

        _allocators[device] = allocate
    return allocate


_NO_GUARD = contextlib.nullcontext()


def _device_guard(like):
    """A context that makes like's CUDA device current for the call when it is not (multi-GPU
    processes); a shared no-op otherwise."""
    if like.is_cuda:
        index = like.get_device()
        if index != torch.cuda.current_device():
            return torch.cuda.device(index)
    return _NO_GUARD


# ---- implementations (shared by the custom ops and the eager fast path) -----------------------


def _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, window_left, window_right, softcap, backend, deterministic,
                  block_table=None, sm_margin=0, dropout_p=0.0, dropout_seed=None):
    _check_dropout_capture(q, dropout_p)
    out = _empty_like(q)
    lse = _empty_f32(q, lse_shape(q.shape, cu_seqlens_q is not None))
    options = _options(q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                       window_right, softcap, backend, deterministic, sm_margin, dropout_p, dropout_seed)
    with _device_guard(q):
        _C.forward(_describe(q, "q"), _describe(k, "k"), _describe(v, "v"), _describe(out, "out"),
                   _describe(lse, "lse"), _describe(cu_seqlens_q, "cu_seqlens_q"),
                   _describe(cu_seqlens_k, "cu_seqlens_k"), _workspace_allocator(q), options,
                   block_table=_describe(block_table, "block_table"),
                   alibi_slopes=_describe(alibi_slopes, "alibi_slopes"))
    return out, lse


def _backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                   max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                   softcap, backend, deterministic, sm_margin=0, dropout_p=0.0, dropout_seed=None):
    _check_dropout_capture(q, dropout_p)
    dq = _empty_like(q)
    dk = _empty_like(k)
    dv = _empty_like(v)
    options = _options(q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                       window_right, softcap, backend, deterministic, sm_margin, dropout_p, dropout_seed)
    with _device_guard(q):
        _C.backward(_describe(dout, "dout"), _describe(q, "q"), _describe(k, "k"),
                    _describe(v, "v"), _describe(out, "out"), _describe(lse, "lse"),
                    _describe(dq, "dq"), _describe(dk, "dk"), _describe(dv, "dv"),
                    _describe(cu_seqlens_q, "cu_seqlens_q"), _describe(cu_seqlens_k, "cu_seqlens_k"),
                    _workspace_allocator(q), options,
                    alibi_slopes=_describe(alibi_slopes, "alibi_slopes"))
    return dq, dk, dv


def _grad_output(dout, out):
    if dout is None:  # out did not reach the loss
        return torch.zeros_like(out)
    return _last_dim_contiguous(dout)


# ---- the custom ops (what torch.compile, export and dispatch modes see) -----------------------
# The optional tensors (cu_seqlens, alibi_slopes, the dropout seed) come before the scalar
# settings, so that autograd can save them with the other tensors and hand the settings on as
# one tuple. Dropout's probability is the last setting.


@torch.library.custom_op("flashcore::fwd", mutates_args=())
def _fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    dropout_seed: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    backend: int,
    deterministic: bool,
    dropout_p: float,
) -> Tuple[Tensor, Tensor]:
    return _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
                         max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                         backend, deterministic, dropout_p=dropout_p, dropout_seed=dropout_seed)


@_fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, backend,
              deterministic, dropout_p):
    out = _empty_like(q)
    lse = _empty_f32(q, lse_shape(q.shape, cu_seqlens_q is not None))
    return out, lse


@torch.library.custom_op("flashcore::bwd", mutates_args=())
def _bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    dropout_seed: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    backend: int,
    deterministic: bool,
    dropout_p: float,
) -> Tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                          max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                          window_right, softcap, backend, deterministic, dropout_p=dropout_p,
                          dropout_seed=dropout_seed)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed,
              max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
              backend, deterministic, dropout_p):
    return _empty_like(q), _empty_like(k), _empty_like(v)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, *settings) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed)
    ctx.settings = settings  # max_seqlen_q ... dropout_p, in _fwd's order
    # The library's backward takes no gradient for lse (as in flash_attn): lse is a constant.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed = ctx.saved_tensors
    dout = _grad_output(dout, out)
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                      dropout_seed, *ctx.settings)
    # No gradient for the cu_seqlens, the ALiBi slopes (as in flash_attn), the seed or the settings.
    no_grad_for_the_rest = (None,) * (len(ctx.settings) + 4)
    return (dq, dk, dv) + no_grad_for_the_rest


_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- eager fast path ---------------------------------------------------------------------------
# A call through torch.library's custom-op machinery costs tens of microseconds of host time in
# eager mode (dispatcher round trip, autograd wrapper, schema checks), several times the
# library's own launch cost. Plain eager calls on plain tensors therefore run the same
# implementations directly, under an ordinary autograd.Function; everything that needs to see
# an op - torch.compile/dynamo, FX tracing, export, tensor subclasses (FakeTensor, DTensor),
# dispatch modes - goes through flashcore::fwd / flashcore::bwd.


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, *settings):
        *settings, dropout_p = settings  # _fwd's order: dropout_p last
        out, lse = _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, *settings,
                                 dropout_p=dropout_p, dropout_seed=dropout_seed)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed)
        ctx.settings = settings
        ctx.dropout_p = dropout_p
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed = ctx.saved_tensors
        dq, dk, dv = _backward_impl(_grad_output(dout, out), q, k, v, out, lse, cu_seqlens_q,
                                    cu_seqlens_k, alibi_slopes, *ctx.settings, dropout_p=ctx.dropout_p,
                                    dropout_seed=dropout_seed)
        return (dq, dk, dv) + (None,) * (len(ctx.settings) + 5)


_dispatch_stack_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)


def _eager_fast_path_ok(tensors):
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            return False
    if torch.compiler.is_compiling():
        return False
    if _dispatch_stack_depth is None or _dispatch_stack_depth() != 0:
        return False  # a TorchDispatchMode (make_fx, FakeTensorMode, ...) is active
    # Every tensor is a plain torch.Tensor (above), so only an active TorchFunctionMode can make
    # this true, whichever tensor is asked about: q (tensors[0]) stands for all of them.
    return not torch.overrides.has_torch_function(tensors[:1])


# ---- the entry point used by flash_attn_interface -----------------------------------------------


def is_tensor(x):
    return isinstance(x, torch.Tensor)


def _cu_seqlens(t):
    # int64 prefix sums (torch's default integer) are converted on the tensor's device: a
    # kernel, no host read, so it stays CUDA-graph safe. Values above 2^31 cannot be valid
    # row offsets of a tensor the library accepts anyway.
    if t is None or t.dtype == CU_SEQLENS_DTYPE:
        return t
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"cu_seqlens: dtype {t.dtype} is not supported; expected torch.int32")
    return t.to(CU_SEQLENS_DTYPE)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_size, softcap, deterministic, backend, alibi_slopes=None, dropout_p=0.0):
    """(out, lse) for torch tensors, differentiable in q, k, v (flash_attn semantics; the
    alibi_slopes get no gradient). dropout_p > 0 draws the mask's seed from torch's default
    generator (torch.manual_seed reproduces it); the backward drops the same entries."""
    # The common call (plain k and v, no optional tensors) tests two types; the loop runs only
    # for the rest. Every line here is paid by every eager call: explicit statements instead of
    # generators save about a microsecond of the ~10 this entry costs on the host.
    if (type(k) is not Tensor or type(v) is not Tensor or cu_seqlens_q is not None or
            cu_seqlens_k is not None or alibi_slopes is not None):
        _require_tensors(("k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes"),
                         (k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes))
        cu_seqlens_q, cu_seqlens_k = _cu_seqlens(cu_seqlens_q), _cu_seqlens(cu_seqlens_k)
    window_left, window_right = resolve_window(window_size)
    q = _last_dim_contiguous(q)
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    dropout_p = float(dropout_p)
    dropout_seed = _draw_dropout_seed() if dropout_p else None
    args = (
        q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed,
        max_seqlen_q if cu_seqlens_q is not None else 0,
        max_seqlen_k if cu_seqlens_q is not None else 0,
        resolve_scale(softmax_scale), bool(causal), window_left, window_right, float(softcap),
        backend_id(backend), bool(deterministic), dropout_p,
    )
    if not _eager_fast_path_ok((q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)):
        return _fwd(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(*args)
    return _forward_impl(*args[:6], *args[7:-1], dropout_p=dropout_p, dropout_seed=dropout_seed)


# ---- paged K/V (flash_attn_varlen_func's block_table): forward only ------------------------------


@torch.library.custom_op("flashcore::paged_forward", mutates_args=())
def _paged_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: Tensor,
    alibi_slopes: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    backend: int,
) -> Tuple[Tensor, Tensor]:
    return _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, window_left, window_right, softcap, backend, False,
                         block_table)


@_paged_op.register_fake
def _paged_op_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                   alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, backend):
    return _empty_like(q), _empty_f32(q, lse_shape(q.shape, True))


def attention_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                    softmax_scale, causal, window_size, softcap, backend, alibi_slopes=None):
    """(out, lse) of a varlen forward over paged k / v (flash_attn_varlen_func's block_table).
    Forward only, as in flash_attn: inputs that require grad are an error. alibi_slopes reach
    the library, which serves them where the backend does (NotImplementedError elsewhere)."""
    for name, t in (("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor like q, got {type(t).__name__}")
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected a torch.Tensor like q, got {type(alibi_slopes).__name__}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("block_table: paged K/V is forward only (as in flash_attn); call it "
                                  "under torch.no_grad() or with inputs that do not require grad")
    window_left, window_right = resolve_window(window_size)
    q = _last_dim_contiguous(q)
    cu_seqlens_q, cu_seqlens_k = _cu_seqlens(cu_seqlens_q), _cu_seqlens(cu_seqlens_k)
    block_table = _index_tensor(block_table, "block_table")
    lengths = (int(max_seqlen_q), int(max_seqlen_k))
    options = (resolve_scale(softmax_scale), bool(causal), window_left, window_right, float(softcap),
               backend_id(backend))
    if _eager_fast_path_ok((q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes)):
        return _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, *lengths, *options, False,
                             block_table)
    return _paged_op(q, k, v, cu_seqlens_q, cu_seqlens_k, *lengths, block_table, alibi_slopes, *options)


# ---- inference: KV cache and merge of partial results -------------------------------------------


def _index_tensor(t, name):
    """int32 view of an integer index tensor (cache_seqlens, block_table, cache_batch_idx).

    Narrowing runs on the tensor's device without a host read (CUDA-graph safe); saturating first
    keeps values outside int32 invalid rather than letting them wrap into a plausible index.
    """
    if t is None or t.dtype == CU_SEQLENS_DTYPE:
        return t
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported; expected torch.int32")
    return t.clamp(INT32_MIN, INT32_MAX).to(CU_SEQLENS_DTYPE)


def _kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                  softmax_scale, causal, window_left, window_right, softcap, num_splits, backend,
                  rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad, alibi_slopes,
                  return_lse):
    out = _empty_like(q)
    lse = _empty_f32(q, kvcache_lse_shape(q.shape)) if return_lse else None
    options = _options(q, 0, 0, softmax_scale, causal, window_left, window_right, softcap,
                       backend, False)
    with _device_guard(q):
        _C.kvcache(_describe(q, "q"), _describe(k_cache, "k_cache"), _describe(v_cache, "v_cache"),
                   _describe(cache_seqlens, "cache_seqlens"), _describe(block_table, "block_table"),
                   _describe(cache_batch_idx, "cache_batch_idx"), _describe(k, "k"),
                   _describe(v, "v"), _describe(out, "out"), _describe(lse, "lse"), None,
                   _workspace_allocator(q), num_splits, options,
                   rotary_cos=_describe(rotary_cos, "rotary_cos"),
                   rotary_sin=_describe(rotary_sin, "rotary_sin"),
                   rotary_interleaved=rotary_interleaved,
                   cache_leftpad=_describe(cache_leftpad, "cache_leftpad"),
                   alibi_slopes=_describe(alibi_slopes, "alibi_slopes"))
    return out, lse


@torch.library.custom_op("flashcore::kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    cache_batch_idx: Optional[Tensor],
    block_table: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    backend: int,
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    rotary_interleaved: bool,
    cache_leftpad: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    # An op returns a fixed number of tensors, so lse is always computed here.
    return _kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                         softmax_scale, causal, window_left, window_right, softcap, num_splits,
                         backend, rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad,
                         alibi_slopes, return_lse=True)


@_kvcache_op.register_fake
def _kvcache_op_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                     softmax_scale, causal, window_left, window_right, softcap, num_splits,
                     backend, rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad,
                     alibi_slopes):
    return _empty_like(q), _empty_f32(q, kvcache_lse_shape(q.shape))


def cache_seqlens_tensor(cache_seqlens, q):
    """cache_seqlens (an int or an integer tensor) as the int32 (batch,) tensor the call reads;
    None stays None (every sequence fills its cache)."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, torch.Tensor):
        return _index_tensor(cache_seqlens, "cache_seqlens")
    return torch.full((q.shape[0],), cache_seqlens_from_int(cache_seqlens), dtype=CU_SEQLENS_DTYPE,
                      device=q.device)


_KVCACHE_TENSOR_NAMES = ("k_cache", "v_cache", "k", "v", "cache_batch_idx", "block_table",
                         "rotary_cos", "rotary_sin", "cache_leftpad", "alibi_slopes")


def attention_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                      softmax_scale, causal, window_size, softcap, num_splits, return_lse,
                      backend, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                      cache_leftpad=None, alibi_slopes=None):
    """flash_attn_with_kvcache for torch tensors: out, or (out, lse) when return_lse."""
    optional = (k_cache, v_cache, k, v, cache_batch_idx, block_table, rotary_cos, rotary_sin,
                cache_leftpad, alibi_slopes)
    for t in optional:  # one test per argument; the names are paired only for an error
        if t is not None and not isinstance(t, torch.Tensor):
            _require_tensors(_KVCACHE_TENSOR_NAMES, optional)
    window_left, window_right = resolve_window(window_size)
    # The caches are never copied: the appended tokens must land in the caller's tensors.
    q = _last_dim_contiguous(q)
    if k is not None:
        k = _last_dim_contiguous(k)
    if v is not None:
        v = _last_dim_contiguous(v)
    cache_seqlens = cache_seqlens_tensor(cache_seqlens, q)
    block_table = _index_tensor(block_table, "block_table")
    cache_batch_idx = _index_tensor(cache_batch_idx, "cache_batch_idx")
    cache_leftpad = _index_tensor(cache_leftpad, "cache_leftpad")
    args = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
            resolve_scale(softmax_scale), bool(causal), window_left, window_right,
            float(softcap), int(num_splits), backend_id(backend), rotary_cos, rotary_sin,
            bool(rotary_interleaved), cache_leftpad, alibi_slopes)
    tensors = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
               rotary_sin, cache_leftpad, alibi_slopes)
    if _eager_fast_path_ok(tensors):
        # No autograd to set up (as in flash_attn): the outputs are fresh tensors the library
        # writes through raw pointers, so they carry no graph.
        out, lse = _kvcache_impl(*args, return_lse=return_lse)
    else:
        out, lse = _kvcache_op(*args)
    return (out, lse) if return_lse else out


def merge_partials(out_partials, lse_partials, out, lse, backend):
    """flashcore.merge_partials for torch tensors: current stream, outputs allocated by torch."""
    _require_tensors(("lse_partials", "out", "lse"), (lse_partials, out, lse), like="out_partials")
    merged_shape, out_shape, lse_out_shape = merge_partials_shapes(out_partials.shape,
                                                                   lse_partials.shape)
    out_partials = _last_dim_contiguous(out_partials).reshape(merged_shape)
    if out is None:
        out = out_partials.new_empty(out_shape)
    if lse is None:
        lse = out_partials.new_empty(lse_out_shape, dtype=torch.float32)
    options = _options(out_partials, 0, 0, 0.0, False, -1, -1, 0.0, backend_id(backend), False)
    with _device_guard(out_partials):
        _C.merge_partials(_describe(out_partials, "out_partials"),
                          _describe(lse_partials, "lse_partials"), _describe(out, "out"),
                          _describe(lse, "lse"), options)
    return out, lse

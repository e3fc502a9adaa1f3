// flashcore._C: the nanobind binding of flashcore's C ABI (include/flashcore/flashcore.h).
//
// Tensors arrive as anything nanobind can import as an ndarray (objects with __dlpack__ such as
// numpy, torch, cupy and jax arrays, or the buffer protocol), or as raw descriptor tuples (the
// torch fast path, see RawTensorFields). Their dtype, device, shape and element strides are
// copied into fc_tensor views and handed to the C ABI as they are: every rule about shapes,
// strides and dtypes is checked by the library, which names the offending argument in its
// message; this file only rejects what cannot be expressed as an fc_tensor.
// The extension never allocates tensors: outputs come from the caller, and the workspace is
// either passed in or requested from a caller-supplied allocator (the Python layer allocates
// with the input's own framework, e.g. torch.empty, so CUDA graphs and caching allocators work).
// The GIL is released around the compute calls; the stream is a plain integer (cudaStream_t).
// Bound entry points: forward/backward (+ workspace queries), kvcache (flash_attn_with_kvcache:
// appends into caller-owned caches in place, + workspace query) and merge_partials.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "flashcore/flashcore.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Input views are read-only (so read-only numpy arrays and jax arrays are accepted); outputs
// must be writable.
using InputArray = nb::ndarray<nb::ro>;
using OutputArray = nb::ndarray<>;

/** Every backend the C ABI names, in enum order (fc_backend_name gives their names). */
constexpr std::array<fc_backend, 4> kNamedBackends = {
    FC_BACKEND_CPU_REFERENCE, FC_BACKEND_CPU_FLASH, FC_BACKEND_CUDA_SM80, FC_BACKEND_CUDA_SM90};

/** DLPack element types, as (type code, bits), that map onto fc_dtype. */
struct DTypeTraits {
  static constexpr uint8_t kFloat = static_cast<uint8_t>(nb::dlpack::dtype_code::Float);
  static constexpr uint8_t kBfloat = static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat);
  static constexpr uint8_t kInt = static_cast<uint8_t>(nb::dlpack::dtype_code::Int);
  static constexpr uint8_t kUInt = static_cast<uint8_t>(nb::dlpack::dtype_code::UInt);
  static constexpr uint8_t kBits16 = 16;
  static constexpr uint8_t kBits32 = 32;
};

/** Per-call settings shared by forward, backward and the workspace queries (mirrors
 *  fc_attention_options minus the tensors). Exposed to Python as flashcore._C.Options. */
struct CallOptions {
  double softmax_scale = 0.0;  // 0 = 1/sqrt(head_dim)
  bool causal = false;
  int32_t window_left = -1;
  int32_t window_right = -1;
  double softcap = 0.0;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
  int32_t backend = FC_BACKEND_AUTO;
  bool deterministic = false;
  uintptr_t stream = 0;  // cudaStream_t as an integer; 0 = legacy default stream
  int32_t num_threads = 0;
  bool check_cu_seqlens = false;  // CUDA varlen: validate cu_seqlens on the host (synchronizes)
  // numpy has no native bfloat16: the Python layer passes ml_dtypes bfloat16 arrays as uint16
  // views and sets this flag so that 16-bit unsigned integers are read as bfloat16.
  bool uint16_is_bfloat16 = false;
  int32_t sm_margin = 0;  // CUDA: SMs left to concurrent work (fc_attention_options.sm_margin)
  double dropout_p = 0.0;     // dropout of the probabilities (fc_attention_options.dropout_p)
  uint64_t dropout_seed = 0;  // the mask's Philox seed and offset
  uint64_t dropout_offset = 0;
};

std::string dtype_description(nb::dlpack::dtype dt) {
  const char* kind = "code";
  switch (dt.code) {
    case DTypeTraits::kFloat: kind = "float"; break;
    case DTypeTraits::kBfloat: kind = "bfloat"; break;
    case DTypeTraits::kInt: kind = "int"; break;
    case DTypeTraits::kUInt: kind = "uint"; break;
    default: return "code " + std::to_string(dt.code) + " with " + std::to_string(dt.bits) + " bits";
  }
  std::string text = std::string(kind) + std::to_string(dt.bits);
  if (dt.lanes != 1) text += "x" + std::to_string(dt.lanes);
  return text;
}

int32_t to_fc_dtype(nb::dlpack::dtype dt, const char* name, const CallOptions& options) {
  if (dt.lanes == 1) {
    if (dt.code == DTypeTraits::kFloat && dt.bits == DTypeTraits::kBits32) return FC_DTYPE_F32;
    if (dt.code == DTypeTraits::kFloat && dt.bits == DTypeTraits::kBits16) return FC_DTYPE_F16;
    if (dt.code == DTypeTraits::kBfloat && dt.bits == DTypeTraits::kBits16) return FC_DTYPE_BF16;
    if (dt.code == DTypeTraits::kInt && dt.bits == DTypeTraits::kBits32) return FC_DTYPE_I32;
    if (dt.code == DTypeTraits::kUInt && dt.bits == DTypeTraits::kBits16 &&
        options.uint16_is_bfloat16)
      return FC_DTYPE_BF16;
  }
  throw nb::value_error((std::string(name) + ": dtype " + dtype_description(dt) +
                         " is not supported (float32, float16, bfloat16; int32 for lengths and indices)")
                            .c_str());
}

int32_t to_fc_device(int dlpack_device_type, const char* name) {
  if (dlpack_device_type == nb::device::cpu::value) return FC_DEVICE_CPU;
  // Pinned host memory is ordinary host memory to the CPU backends.
  if (dlpack_device_type == nb::device::cuda_host::value) return FC_DEVICE_CPU;
  if (dlpack_device_type == nb::device::cuda::value) return FC_DEVICE_CUDA;
  throw nb::value_error((std::string(name) + ": DLPack device type " +
                         std::to_string(dlpack_device_type) +
                         " is not supported (CPU or CUDA memory only)")
                            .c_str());
}

/** Copies an imported ndarray's description into an fc_tensor (no data is touched). */
template <typename Array>
fc_tensor describe(const Array& array, const char* name, const CallOptions& options) {
  if (array.ndim() > FC_MAX_DIMS) {
    throw nb::value_error((std::string(name) + ": " + std::to_string(array.ndim()) +
                           " dimensions, at most " + std::to_string(FC_MAX_DIMS) + " are supported")
                              .c_str());
  }
  fc_tensor tensor{};
  tensor.data = const_cast<void*>(static_cast<const void*>(array.data()));
  tensor.dtype = to_fc_dtype(array.dtype(), name, options);
  tensor.device_type = to_fc_device(array.device_type(), name);
  tensor.device_id = tensor.device_type == FC_DEVICE_CUDA ? array.device_id() : 0;
  tensor.ndim = static_cast<int32_t>(array.ndim());
  for (size_t i = 0; i < array.ndim(); ++i) {
    tensor.shape[i] = array.shape(i);
    tensor.strides[i] = array.stride(i);  // nanobind reports strides in elements
  }
  // A dimension of length 1 is never stepped over, and frameworks report arbitrary strides for
  // it; the library requires the last (head_dim) stride to be 1, which is vacuous here.
  if (tensor.ndim > 0 && tensor.shape[tensor.ndim - 1] == 1) tensor.strides[tensor.ndim - 1] = 1;
  return tensor;
}

std::string type_name_of(nb::handle obj) { return nb::type_name(obj.type()).c_str(); }

/** Imports `obj` as an ndarray or raises TypeError naming the argument. */
template <typename Array>
Array import_array(nb::handle obj, const char* name, bool writable) {
  Array array;
  if (!nb::try_cast(obj, array, /*convert=*/false)) {
    throw nb::type_error((std::string(name) + ": expected a " + (writable ? "writable " : "") +
                          "array exposing __dlpack__ or the buffer protocol (numpy, torch, cupy, "
                          "...), got " + type_name_of(obj))
                             .c_str());
  }
  return array;
}

/** Raw descriptors: the torch integration passes tensors as plain tuples instead of DLPack
 *  objects, because exporting a torch tensor through __dlpack__ costs microseconds of Python per
 *  tensor. The caller keeps the memory alive for the call. Layouts (strides in elements):
 *    tensor    (data_ptr, fc_dtype, fc_device_type, device_id, shape, strides)
 *    workspace (data_ptr, nbytes, fc_device_type, device_id, owner)  owner: kept alive only */
struct RawTensorFields {
  static constexpr size_t kData = 0, kDType = 1, kDeviceType = 2, kDeviceId = 3, kShape = 4,
                          kStrides = 5, kCount = 6;
};
struct RawWorkspaceFields {
  static constexpr size_t kData = 0, kBytes = 1, kDeviceType = 2, kDeviceId = 3, kCount = 5;
};

bool is_raw_descriptor(nb::handle obj) { return PyTuple_Check(obj.ptr()) != 0; }

void check_raw_arity(nb::handle obj, size_t expected, const char* name) {
  if (nb::len(obj) != expected) {
    throw nb::type_error((std::string(name) + ": a raw descriptor tuple needs " +
                          std::to_string(expected) + " fields")
                             .c_str());
  }
}

fc_tensor describe_raw(nb::handle obj, const char* name) {
  using F = RawTensorFields;
  check_raw_arity(obj, F::kCount, name);
  nb::tuple fields = nb::borrow<nb::tuple>(obj);
  fc_tensor tensor{};
  try {
    tensor.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(fields[F::kData]));
    tensor.dtype = nb::cast<int32_t>(fields[F::kDType]);
    tensor.device_type = nb::cast<int32_t>(fields[F::kDeviceType]);
    tensor.device_id = nb::cast<int32_t>(fields[F::kDeviceId]);
    nb::handle shape = fields[F::kShape], strides = fields[F::kStrides];
    const size_t ndim = nb::len(shape);
    if (ndim > FC_MAX_DIMS || nb::len(strides) != ndim) {
      throw nb::value_error((std::string(name) + ": shape and strides must have the same length, "
                             "at most " + std::to_string(FC_MAX_DIMS))
                                .c_str());
    }
    tensor.ndim = static_cast<int32_t>(ndim);
    for (size_t i = 0; i < ndim; ++i) {
      tensor.shape[i] = nb::cast<int64_t>(shape[i]);
      tensor.strides[i] = nb::cast<int64_t>(strides[i]);
    }
  } catch (const nb::cast_error&) {
    throw nb::type_error((std::string(name) + ": malformed raw tensor descriptor").c_str());
  }
  if (tensor.ndim > 0 && tensor.shape[tensor.ndim - 1] == 1) tensor.strides[tensor.ndim - 1] = 1;
  return tensor;
}

/** One tensor argument (a DLPack/buffer object or a raw descriptor). Keeps an imported ndarray
 *  alive for the call. `required` arguments may not be None. */
template <typename Array>
struct TensorArg {
  Array array;
  fc_tensor tensor{};
  bool present = false;

  TensorArg(nb::handle obj, const char* name, const CallOptions& options, bool writable,
            bool required) {
    if (obj.is_none()) {
      if (required) throw nb::type_error((std::string(name) + ": is required, got None").c_str());
      return;
    }
    if (is_raw_descriptor(obj)) {
      tensor = describe_raw(obj, name);
    } else {
      array = import_array<Array>(obj, name, writable);
      tensor = describe(array, name, options);
    }
    present = true;
  }
  fc_tensor* get() { return present ? &tensor : nullptr; }
};

struct Input : TensorArg<InputArray> {
  Input(nb::handle obj, const char* name, const CallOptions& options)
      : TensorArg(obj, name, options, /*writable=*/false, /*required=*/true) {}
};
struct Output : TensorArg<OutputArray> {
  Output(nb::handle obj, const char* name, const CallOptions& options)
      : TensorArg(obj, name, options, /*writable=*/true, /*required=*/true) {}
};
struct OptionalInput : TensorArg<InputArray> {
  OptionalInput(nb::handle obj, const char* name, const CallOptions& options)
      : TensorArg(obj, name, options, /*writable=*/false, /*required=*/false) {}
};
struct OptionalOutput : TensorArg<OutputArray> {
  OptionalOutput(nb::handle obj, const char* name, const CallOptions& options)
      : TensorArg(obj, name, options, /*writable=*/true, /*required=*/false) {}
};

/** Raises the Python exception matching a failed status, carrying fc_last_error(). */
void raise_on_error(fc_status status) {
  if (status == FC_OK) return;
  PyObject* type = PyExc_RuntimeError;  // FC_ERROR_CUDA, FC_ERROR_INTERNAL
  if (status == FC_ERROR_INVALID_ARGUMENT) type = PyExc_ValueError;
  if (status == FC_ERROR_UNSUPPORTED) type = PyExc_NotImplementedError;
  PyErr_SetString(type, fc_last_error());
  throw nb::python_error();
}

/** fc_attention_options for one call; the cu_seqlens views (null when absent, as for the KV-cache
 *  and merge calls) must outlive its use. */
fc_attention_options make_options(const CallOptions& call, const fc_tensor* cu_seqlens_q,
                                   const fc_tensor* cu_seqlens_k) {
  fc_attention_options options{};
  options.softmax_scale = call.softmax_scale;
  options.causal = call.causal ? 1 : 0;
  options.window_left = call.window_left;
  options.window_right = call.window_right;
  options.has_window = 1;  // (-1, -1) means unbounded, so the fields are always meaningful
  options.softcap = call.softcap;
  options.cu_seqlens_q = cu_seqlens_q;
  options.cu_seqlens_k = cu_seqlens_k;
  options.max_seqlen_q = call.max_seqlen_q;
  options.max_seqlen_k = call.max_seqlen_k;
  options.backend = call.backend;
  options.deterministic = call.deterministic ? 1 : 0;
  options.stream = reinterpret_cast<void*>(call.stream);
  options.num_threads = call.num_threads;
  options.check_cu_seqlens = call.check_cu_seqlens ? 1 : 0;
  options.sm_margin = call.sm_margin;
  options.dropout_p = call.dropout_p;
  options.dropout_seed = call.dropout_seed;
  options.dropout_offset = call.dropout_offset;
  return options;
}

/** The workspace argument: None, a 1-D contiguous array of any dtype on the inputs' device, a
 *  raw workspace descriptor, or a callable allocator(nbytes) returning either, which is asked
 *  only when the library needs scratch memory. Holds what it got alive for the call. */
struct Workspace {
  nb::object allocated;  // keeps an allocator's result alive
  OutputArray array;
  void* data = nullptr;
  size_t bytes = 0;

  template <typename QueryFn>
  Workspace(nb::handle arg, const fc_tensor& like, QueryFn query_required_bytes) {
    if (arg.is_none()) return;
    nb::handle source = arg;
    if (PyCallable_Check(arg.ptr())) {  // arrays are not callable; allocators are
      size_t required = 0;
      raise_on_error(query_required_bytes(&required));
      if (required == 0) return;
      allocated = arg(required);
      source = allocated;
    }
    int32_t device_type = FC_DEVICE_CPU, device_id = 0;
    if (is_raw_descriptor(source)) {
      using F = RawWorkspaceFields;
      check_raw_arity(source, F::kCount, "workspace");
      nb::tuple fields = nb::borrow<nb::tuple>(source);
      try {
        data = reinterpret_cast<void*>(nb::cast<uintptr_t>(fields[F::kData]));
        bytes = nb::cast<size_t>(fields[F::kBytes]);
        device_type = nb::cast<int32_t>(fields[F::kDeviceType]);
        device_id = nb::cast<int32_t>(fields[F::kDeviceId]);
      } catch (const nb::cast_error&) {
        throw nb::type_error("workspace: malformed raw workspace descriptor");
      }
    } else {
      array = import_array<OutputArray>(source, "workspace", true);
      if (array.ndim() != 1 || (array.shape(0) > 1 && array.stride(0) != 1)) {
        throw nb::value_error("workspace: must be a 1-D contiguous array");
      }
      device_type = to_fc_device(array.device_type(), "workspace");
      device_id = device_type == FC_DEVICE_CUDA ? array.device_id() : 0;
      data = array.data();
      bytes = array.nbytes();
    }
    // The library only sees a pointer, so the device check has to happen here.
    if (device_type != like.device_type || device_id != like.device_id) {
      throw nb::value_error("workspace: must be on the same device as q");
    }
  }
};

/** error_flag: an int32 array of at least one element on q's device; the library only sees a
 *  pointer, so these rules are checked here. */
int32_t* error_flag_pointer(OptionalOutput& flag, const fc_tensor& like) {
  if (!flag.present) return nullptr;
  const fc_tensor& t = flag.tensor;
  int64_t elements = 1;
  for (int32_t i = 0; i < t.ndim; ++i) elements *= t.shape[i];
  if (t.dtype != FC_DTYPE_I32 || elements < 1) {
    throw nb::value_error("error_flag: must be an int32 array with at least one element");
  }
  if (t.device_type != like.device_type || t.device_id != like.device_id) {
    throw nb::value_error("error_flag: must be on the same device as q");
  }
  return static_cast<int32_t*>(t.data);
}

void forward(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
             nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle workspace,
             const CallOptions& call, nb::handle error_flag, nb::handle block_table,
             nb::handle alibi_slopes) {
  Input q_t(q, "q", call), k_t(k, "k", call), v_t(v, "v", call);
  Output out_t(out, "out", call);
  OptionalOutput lse_t(lse, "lse", call);
  OptionalInput cu_q(cu_seqlens_q, "cu_seqlens_q", call);
  OptionalInput cu_k(cu_seqlens_k, "cu_seqlens_k", call);
  OptionalOutput flag(error_flag, "error_flag", call);
  OptionalInput table(block_table, "block_table", call);
  OptionalInput slopes(alibi_slopes, "alibi_slopes", call);
  fc_attention_options options = make_options(call, cu_q.get(), cu_k.get());
  options.error_flag = error_flag_pointer(flag, q_t.tensor);
  options.block_table = table.get();
  options.alibi_slopes = slopes.get();
  Workspace ws(workspace, q_t.tensor, [&](size_t* bytes) {
    return fc_attention_forward_workspace(&q_t.tensor, &k_t.tensor, &v_t.tensor, &options, bytes);
  });
  fc_status status;
  {
    nb::gil_scoped_release release;
    status = fc_attention_forward(&q_t.tensor, &k_t.tensor, &v_t.tensor, &out_t.tensor,
                                  lse_t.get(), &options, ws.data, ws.bytes);
  }
  raise_on_error(status);
}

void backward(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
              nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv,
              nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle workspace,
              const CallOptions& call, nb::handle error_flag, nb::handle alibi_slopes) {
  Input dout_t(dout, "dout", call);
  Input q_t(q, "q", call), k_t(k, "k", call), v_t(v, "v", call);
  Input out_t(out, "out", call), lse_t(lse, "lse", call);
  Output dq_t(dq, "dq", call), dk_t(dk, "dk", call), dv_t(dv, "dv", call);
  OptionalInput cu_q(cu_seqlens_q, "cu_seqlens_q", call);
  OptionalInput cu_k(cu_seqlens_k, "cu_seqlens_k", call);
  OptionalOutput flag(error_flag, "error_flag", call);
  OptionalInput slopes(alibi_slopes, "alibi_slopes", call);
  fc_attention_options options = make_options(call, cu_q.get(), cu_k.get());
  options.error_flag = error_flag_pointer(flag, q_t.tensor);
  options.alibi_slopes = slopes.get();
  Workspace ws(workspace, q_t.tensor, [&](size_t* bytes) {
    return fc_attention_backward_workspace(&q_t.tensor, &k_t.tensor, &v_t.tensor, &options, bytes);
  });
  fc_status status;
  {
    nb::gil_scoped_release release;
    status = fc_attention_backward(&dout_t.tensor, &q_t.tensor, &k_t.tensor, &v_t.tensor,
                                   &out_t.tensor, &lse_t.tensor, &dq_t.tensor, &dk_t.tensor,
                                   &dv_t.tensor, &options, ws.data, ws.bytes);
  }
  raise_on_error(status);
}

/** The workspace queries take every argument that can change the backend or its scratch size:
 *  a call with ALiBi or paged K/V may be served by another backend than one without. */
template <typename WorkspaceFn>
size_t workspace_bytes(WorkspaceFn fn, nb::handle q, nb::handle k, nb::handle v,
                       nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
                       const CallOptions& call, nb::handle block_table, nb::handle alibi_slopes) {
  Input q_t(q, "q", call), k_t(k, "k", call), v_t(v, "v", call);
  OptionalInput cu_q(cu_seqlens_q, "cu_seqlens_q", call);
  OptionalInput cu_k(cu_seqlens_k, "cu_seqlens_k", call);
  OptionalInput table(block_table, "block_table", call);
  OptionalInput slopes(alibi_slopes, "alibi_slopes", call);
  fc_attention_options options = make_options(call, cu_q.get(), cu_k.get());
  options.block_table = table.get();
  options.alibi_slopes = slopes.get();
  size_t bytes = 0;
  raise_on_error(fn(&q_t.tensor, &k_t.tensor, &v_t.tensor, &options, &bytes));
  return bytes;
}

/** A KV cache: imported writable only when the call appends into it, so that read-only caches
 *  (a read-only numpy array, say) still serve attention without appending. */
struct CacheArg {
  std::optional<Input> read_only;
  std::optional<Output> written;

  CacheArg(nb::handle obj, const char* name, const CallOptions& call, bool appends) {
    if (appends) {
      written.emplace(obj, name, call);
    } else {
      read_only.emplace(obj, name, call);
    }
  }
  fc_tensor* get() { return written ? written->get() : read_only->get(); }
};

/** The imported arguments of one fc_attention_kvcache call (or of its workspace query, which
 *  validates the same arguments), kept alive together with the fc_kvcache_args pointing at them. */
struct KvCacheCall {
  Input q;
  CacheArg k_cache, v_cache;
  OptionalInput cache_seqlens;  // None: every sequence fills its cache (the library rejects it with k_new)
  OptionalInput block_table, cache_batch_idx, k_new, v_new, rotary_cos, rotary_sin, cache_leftpad, alibi_slopes;
  Output out;
  OptionalOutput lse, error_flag;
  fc_attention_options options;
  fc_kvcache_args args{};

  KvCacheCall(nb::handle q_obj, nb::handle k_cache_obj, nb::handle v_cache_obj,
              nb::handle cache_seqlens_obj, nb::handle block_table_obj,
              nb::handle cache_batch_idx_obj, nb::handle k_new_obj, nb::handle v_new_obj,
              nb::handle out_obj, nb::handle lse_obj, nb::handle error_flag_obj, int32_t num_splits,
              const CallOptions& call, nb::handle rotary_cos_obj, nb::handle rotary_sin_obj,
              bool rotary_interleaved, nb::handle cache_leftpad_obj, nb::handle alibi_slopes_obj)
      : q(q_obj, "q", call),
        k_cache(k_cache_obj, "k_cache", call, /*appends=*/!k_new_obj.is_none()),
        v_cache(v_cache_obj, "v_cache", call, /*appends=*/!k_new_obj.is_none()),
        cache_seqlens(cache_seqlens_obj, "cache_seqlens", call),
        block_table(block_table_obj, "block_table", call),
        cache_batch_idx(cache_batch_idx_obj, "cache_batch_idx", call),
        k_new(k_new_obj, "k_new", call),
        v_new(v_new_obj, "v_new", call),
        rotary_cos(rotary_cos_obj, "rotary_cos", call),
        rotary_sin(rotary_sin_obj, "rotary_sin", call),
        cache_leftpad(cache_leftpad_obj, "cache_leftpad", call),
        alibi_slopes(alibi_slopes_obj, "alibi_slopes", call),
        out(out_obj, "out", call),
        lse(lse_obj, "lse", call),
        error_flag(error_flag_obj, "error_flag", call),
        options(make_options(call, nullptr, nullptr)) {
    args.q = q.get();
    args.k_cache = k_cache.get();
    args.v_cache = v_cache.get();
    args.cache_seqlens = cache_seqlens.get();
    args.block_table = block_table.get();
    args.cache_batch_idx = cache_batch_idx.get();
    args.k_new = k_new.get();
    args.v_new = v_new.get();
    args.out = out.get();
    args.lse = lse.get();
    args.num_splits = num_splits;
    args.error_flag = error_flag_pointer(error_flag, q.tensor);
    args.rotary_cos = rotary_cos.get();
    args.rotary_sin = rotary_sin.get();
    args.rotary_interleaved = rotary_interleaved ? 1 : 0;
    args.cache_leftpad = cache_leftpad.get();
    options.alibi_slopes = alibi_slopes.get();
  }

  fc_status query_workspace(size_t* bytes) const {
    return fc_attention_kvcache_workspace(&args, &options, bytes);
  }
};

void kvcache(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle cache_seqlens,
             nb::handle block_table, nb::handle cache_batch_idx, nb::handle k_new,
             nb::handle v_new, nb::handle out, nb::handle lse, nb::handle error_flag,
             nb::handle workspace, int32_t num_splits, const CallOptions& call,
             nb::handle rotary_cos, nb::handle rotary_sin, bool rotary_interleaved,
             nb::handle cache_leftpad, nb::handle alibi_slopes) {
  KvCacheCall c(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new, v_new,
                out, lse, error_flag, num_splits, call, rotary_cos, rotary_sin, rotary_interleaved,
                cache_leftpad, alibi_slopes);
  Workspace ws(workspace, c.q.tensor, [&](size_t* bytes) { return c.query_workspace(bytes); });
  fc_status status;
  {
    nb::gil_scoped_release release;
    status = fc_attention_kvcache(&c.args, &c.options, ws.data, ws.bytes);
  }
  raise_on_error(status);
}

size_t kvcache_workspace(nb::handle q, nb::handle k_cache, nb::handle v_cache,
                         nb::handle cache_seqlens, nb::handle block_table,
                         nb::handle cache_batch_idx, nb::handle k_new, nb::handle v_new,
                         nb::handle out, nb::handle lse, int32_t num_splits,
                         const CallOptions& call, nb::handle rotary_cos, nb::handle rotary_sin,
                         bool rotary_interleaved, nb::handle cache_leftpad, nb::handle alibi_slopes) {
  KvCacheCall c(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new, v_new,
                out, lse, nb::none(), num_splits, call, rotary_cos, rotary_sin, rotary_interleaved,
                cache_leftpad, alibi_slopes);
  size_t bytes = 0;
  raise_on_error(c.query_workspace(&bytes));
  return bytes;
}

void merge_partials(nb::handle out_partials, nb::handle lse_partials, nb::handle out,
                    nb::handle lse, const CallOptions& call) {
  Input out_partials_t(out_partials, "out_partials", call);
  Input lse_partials_t(lse_partials, "lse_partials", call);
  Output out_t(out, "out", call);
  OptionalOutput lse_t(lse, "lse", call);
  const fc_attention_options options = make_options(call, nullptr, nullptr);
  fc_status status;
  {
    nb::gil_scoped_release release;
    status = fc_merge_partials(&out_partials_t.tensor, &lse_partials_t.tensor, &out_t.tensor,
                               lse_t.get(), &options);
  }
  raise_on_error(status);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "flashcore C ABI binding (use the flashcore package, not this module directly)";

  nb::class_<CallOptions>(m, "Options")
      .def(
          "__init__",
          [](CallOptions* self, double softmax_scale, bool causal, int32_t window_left,
             int32_t window_right, double softcap, int64_t max_seqlen_q, int64_t max_seqlen_k,
             int32_t backend, bool deterministic, uintptr_t stream, int32_t num_threads,
             bool check_cu_seqlens, bool uint16_is_bfloat16, int32_t sm_margin, double dropout_p,
             uint64_t dropout_seed, uint64_t dropout_offset) {
            new (self) CallOptions{softmax_scale, causal,      window_left,  window_right,
                                   softcap,       max_seqlen_q, max_seqlen_k, backend,
                                   deterministic, stream,      num_threads,  check_cu_seqlens,
                                   uint16_is_bfloat16, sm_margin, dropout_p, dropout_seed, dropout_offset};
          },
          nb::kw_only(), "softmax_scale"_a = 0.0, "causal"_a = false, "window_left"_a = -1,
          "window_right"_a = -1, "softcap"_a = 0.0, "max_seqlen_q"_a = 0, "max_seqlen_k"_a = 0,
          "backend"_a = static_cast<int32_t>(FC_BACKEND_AUTO), "deterministic"_a = false,
          "stream"_a = 0, "num_threads"_a = 0, "check_cu_seqlens"_a = false, "uint16_is_bfloat16"_a = false,
          "sm_margin"_a = 0, "dropout_p"_a = 0.0, "dropout_seed"_a = 0, "dropout_offset"_a = 0)
      .def_rw("softmax_scale", &CallOptions::softmax_scale)
      .def_rw("causal", &CallOptions::causal)
      .def_rw("window_left", &CallOptions::window_left)
      .def_rw("window_right", &CallOptions::window_right)
      .def_rw("softcap", &CallOptions::softcap)
      .def_rw("max_seqlen_q", &CallOptions::max_seqlen_q)
      .def_rw("max_seqlen_k", &CallOptions::max_seqlen_k)
      .def_rw("backend", &CallOptions::backend)
      .def_rw("deterministic", &CallOptions::deterministic)
      .def_rw("stream", &CallOptions::stream)
      .def_rw("num_threads", &CallOptions::num_threads)
      .def_rw("check_cu_seqlens", &CallOptions::check_cu_seqlens)
      .def_rw("uint16_is_bfloat16", &CallOptions::uint16_is_bfloat16)
      .def_rw("sm_margin", &CallOptions::sm_margin)
      .def_rw("dropout_p", &CallOptions::dropout_p)
      .def_rw("dropout_seed", &CallOptions::dropout_seed)
      .def_rw("dropout_offset", &CallOptions::dropout_offset);

  m.def("forward", &forward, "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse"_a.none(),
        "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(), "workspace"_a.none(), "options"_a,
        "error_flag"_a.none() = nb::none(), "block_table"_a.none() = nb::none(),
        "alibi_slopes"_a.none() = nb::none(),
        "out = attention(q, k, v); lse (optional) gets the log-sum-exp per row. workspace is "
        "None, an array, or a callable(nbytes) returning a uint8 array on the inputs' device. "
        "error_flag (CUDA varlen): an int32 array set to 1 on the device for bad cu_seqlens. "
        "block_table (varlen): k / v are pages (num_pages, page_size, heads_kv, head_dim). "
        "alibi_slopes: float32 (heads_q) or (batch, heads_q) on q's device, flash_attn's ALiBi.");
  m.def("backward", &backward, "dout"_a.none(), "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse"_a.none(), "dq"_a.none(), "dk"_a.none(),
        "dv"_a.none(), "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(), "workspace"_a.none(),
        "options"_a, "error_flag"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(),
        "Writes dq, dk, dv for the forward that produced out and lse (called with the same "
        "alibi_slopes); error_flag as for forward().");
  m.def(
      "forward_workspace",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle cu_q, nb::handle cu_k,
         const CallOptions& call, nb::handle block_table, nb::handle alibi_slopes) {
        return workspace_bytes(fc_attention_forward_workspace, q, k, v, cu_q, cu_k, call,
                               block_table, alibi_slopes);
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(), "options"_a,
      "block_table"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(),
      "Bytes of scratch memory forward() needs for these arguments.");
  m.def(
      "backward_workspace",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle cu_q, nb::handle cu_k,
         const CallOptions& call, nb::handle alibi_slopes) {
        return workspace_bytes(fc_attention_backward_workspace, q, k, v, cu_q, cu_k, call,
                               nb::none(), alibi_slopes);
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(), "options"_a,
      "alibi_slopes"_a.none() = nb::none(),
      "Bytes of scratch memory backward() needs for these arguments.");

  m.def("kvcache", &kvcache, "q"_a.none(), "k_cache"_a.none(), "v_cache"_a.none(),
        "cache_seqlens"_a.none(), "block_table"_a.none(), "cache_batch_idx"_a.none(),
        "k_new"_a.none(), "v_new"_a.none(), "out"_a.none(), "lse"_a.none(), "error_flag"_a.none(),
        "workspace"_a.none(), "num_splits"_a, "options"_a, "rotary_cos"_a.none() = nb::none(),
        "rotary_sin"_a.none() = nb::none(), "rotary_interleaved"_a = true,
        "cache_leftpad"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(),
        "Attention of q against a KV cache (flash_attn_with_kvcache); k_new/v_new, when given, "
        "are first written into the caches in place (k_new rotated by rotary_cos / rotary_sin "
        "when given, q too). workspace as for forward().");
  m.def("kvcache_workspace", &kvcache_workspace, "q"_a.none(), "k_cache"_a.none(),
        "v_cache"_a.none(), "cache_seqlens"_a.none(), "block_table"_a.none(),
        "cache_batch_idx"_a.none(), "k_new"_a.none(), "v_new"_a.none(), "out"_a.none(),
        "lse"_a.none(), "num_splits"_a, "options"_a, "rotary_cos"_a.none() = nb::none(),
        "rotary_sin"_a.none() = nb::none(), "rotary_interleaved"_a = true,
        "cache_leftpad"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(),
        "Bytes of scratch memory kvcache() needs for these arguments.");
  m.def("merge_partials", &merge_partials, "out_partials"_a.none(), "lse_partials"_a.none(),
        "out"_a.none(), "lse"_a.none(), "options"_a,
        "Merges attention over disjoint key sets: out_partials (num_parts, batch * seqlen_q, "
        "heads, head_dim) and lse_partials (num_parts, batch, heads, seqlen_q), float32.");

  m.def("version", [] { return fc_version(); });
  m.def("build_info", [] { return fc_build_info(); });
  m.def("cuda_device_count", [] { return fc_cuda_device_count(); });
  m.def(
      "cuda_device_description",
      [](int32_t device_id) {
        char line[256];
        raise_on_error(fc_cuda_device_describe(device_id, line, sizeof(line)));
        return nb::str(line);  // (a std::string would need nanobind's STL caster)
      },
      "device_id"_a = 0);
  m.def(
      "backend_available",
      [](int32_t backend, int32_t device_id) {
        return fc_backend_available(backend, device_id) != 0;
      },
      "backend"_a, "device_id"_a = 0);
  m.def("backend_names", [] {
    nb::dict names;  // name -> fc_backend value
    for (fc_backend backend : kNamedBackends) {
      names[fc_backend_name(backend)] = static_cast<int32_t>(backend);
    }
    return names;
  });
  m.attr("BACKEND_AUTO") = static_cast<int32_t>(FC_BACKEND_AUTO);
  // Codes of raw tensor descriptors (see RawTensorFields).
  m.attr("DTYPE_F32") = static_cast<int32_t>(FC_DTYPE_F32);
  m.attr("DTYPE_F16") = static_cast<int32_t>(FC_DTYPE_F16);
  m.attr("DTYPE_BF16") = static_cast<int32_t>(FC_DTYPE_BF16);
  m.attr("DTYPE_I32") = static_cast<int32_t>(FC_DTYPE_I32);
  m.attr("DEVICE_CPU") = static_cast<int32_t>(FC_DEVICE_CPU);
  m.attr("DEVICE_CUDA") = static_cast<int32_t>(FC_DEVICE_CUDA);
  m.attr("ABI_VERSION") = FC_ABI_VERSION;
}

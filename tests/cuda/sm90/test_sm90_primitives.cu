// Unit tests of the sm_90a primitives under src/cuda/ptx (mbarrier, TMA loads, stores and
// reductions, multicast loads across a cluster, wgmma, setmaxnreg, named barriers, stmatrix), of
// the forward epilogue's log2 and of the host tensor-map builder, each alone before any kernel
// relies on it.
//
// Every test is skipped unless a compute-capability 9.0 GPU is present (the binary holds sm_90a
// code only). Inputs are multiples of 1/4 in [-1, 1], exact in bf16 and fp16, so every product and
// every partial sum below is exact in fp32: results must equal the host matmul bit for bit, and any
// mismatch is a layout/descriptor error, not rounding.
//
// A note on what a test can see: when A and B are both staged with the same K-major layout, a
// mistake that permutes K identically in both leaves the product unchanged. The layouts are
// therefore also checked against independent definitions: the RS tests take A from registers in
// the ISA's fragment layout, the MN-major tests stage B transposed, and the TMA tests compare the
// swizzle formula with what the copy engine writes.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/l2_prefetch.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm80/tile_common.cuh"  // log2_positive
#include "cuda/sm90/attention_views.hpp"  // packed_group_view
#include "cuda/sm90/tensor_map.hpp"

namespace {

namespace ptx = flashcore::ptx;
namespace sm90 = flashcore::cuda::sm90;
using ptx::SmemSwizzle;

struct TestTraits {
  static constexpr uint32_t kWarpgroup = ptx::WarpgroupTraits::kThreads;
  static constexpr uint32_t kMaxWaitProbes = 1u << 24;  // a lost TMA fails the test, not hangs it
  static constexpr uint32_t kSmemAlign = 1024;          // the 128B swizzle period
  static constexpr int kValueLevels = 9;                // values (i - 4) / 4, i in [0, 9)
  static constexpr float kValueStep = 0.25f;
  static constexpr uint16_t kSentinel = 0x7E57;       // marks memory a kernel must not touch
  static constexpr float kStaleAccumulator = 1.0e6f;  // overwritten when scale-d is false
};

#define CUDA_ASSERT(expr)                                                      \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

#define STATUS_ASSERT(expr)                                   \
  do {                                                        \
    const flashcore::Status st_ = (expr);                     \
    ASSERT_TRUE(st_.is_ok()) << #expr << ": " << st_.message; \
  } while (0)

/** Empty when a CC 9.0 device is present, else why the test is skipped. */
std::string why_no_sm90() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return "no CUDA device";
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cannot query device 0";
  if (prop.major != 9 || prop.minor != 0)
    return "needs a compute capability 9.0 GPU (sm_90a code), found " + std::to_string(prop.major) +
           "." + std::to_string(prop.minor);
  return {};
}

#define SKIP_UNLESS_SM90()                                          \
  do {                                                              \
    const std::string why_ = why_no_sm90();                         \
    if (!why_.empty()) GTEST_SKIP() << "sm90 primitives: " << why_; \
  } while (0)

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (cudaMalloc(&ptr_, count * sizeof(T)) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  T* ptr_ = nullptr;
  size_t count_;
};

template <typename Elem>
uint16_t to_bits(float v);
template <>
uint16_t to_bits<__nv_bfloat16>(float v) {
  return __bfloat16_as_ushort(__float2bfloat16(v));
}
template <>
uint16_t to_bits<__half>(float v) {
  return __half_as_ushort(__float2half(v));
}

/** Values exact in bf16 and fp16 (see the file comment). */
std::vector<float> exact_values(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> level(0, TestTraits::kValueLevels - 1);
  std::vector<float> v(count);
  for (float& x : v) x = (level(rng) - TestTraits::kValueLevels / 2) * TestTraits::kValueStep;
  return v;
}

/** C(m x n) = A(m x k, row-major) * B(k x n, row-major), fp32. */
std::vector<float> host_matmul(const std::vector<float>& a, const std::vector<float>& b, int m,
                               int n, int k) {
  std::vector<float> c(size_t(m) * n, 0.0f);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int kk = 0; kk < k; ++kk) acc += a[size_t(i) * k + kk] * b[size_t(kk) * n + j];
      c[size_t(i) * n + j] = acc;
    }
  return c;
}

/** Host mirror of the device-side alignment: bytes the kernels skip to reach 1024-alignment. */
__host__ __device__ constexpr uint32_t round_up(uint32_t x, uint32_t to) {
  return (x + to - 1) / to * to;
}

__device__ uint8_t* align_smem(uint8_t* raw) {
  const uint32_t addr = ptx::smem_addr(raw);
  return raw + (round_up(addr, TestTraits::kSmemAlign) - addr);
}

/** try_wait loop with a bound, so a copy that never lands fails the test instead of hanging it. */
__device__ bool wait_bounded(uint64_t* bar, uint32_t parity) {
  for (uint32_t probe = 0; probe < TestTraits::kMaxWaitProbes; ++probe)
    if (ptx::mbarrier_try_wait_parity(bar, parity)) return true;
  return false;
}

constexpr sm90::TmaSwizzle to_tma_swizzle(SmemSwizzle s) {
  return s == SmemSwizzle::k128B  ? sm90::TmaSwizzle::k128B
         : s == SmemSwizzle::k64B ? sm90::TmaSwizzle::k64B
         : s == SmemSwizzle::k32B ? sm90::TmaSwizzle::k32B
                                  : sm90::TmaSwizzle::kNone;
}

/** A bf16 matrix of rows x cols (row_stride elements apart) at base, in boxes of box_rows x
 *  box_cols. */
sm90::TiledView2d bf16_view(const void* base, uint32_t rows, uint32_t cols, uint32_t row_stride, uint32_t box_rows,
                            uint32_t box_cols, sm90::TmaSwizzle swizzle) {
  sm90::TiledView2d view;
  view.element = sm90::TmaElement::kBf16;
  view.base = base;
  view.rows = rows;
  view.cols = cols;
  view.row_stride = row_stride;
  view.box_rows = box_rows;
  view.box_cols = box_cols;
  view.swizzle = swizzle;
  return view;
}

// =================================================================================================
// (0) Host-only checks of the layout helpers (no device needed): descriptor bits, tiles that map
//     every element to its own slot, fragments that cover the tile once.
// =================================================================================================

static_assert(ptx::make_smem_desc(0x1230, SmemSwizzle::k128B, 16, 1024) ==
                  (0x123ull | (1ull << 16) | (64ull << 32) | (1ull << 62)),
              "descriptor: addr>>4 at 0, LBO>>4 at 16, SBO>>4 at 32, swizzle at 62");
static_assert(ptx::apply_swizzle(SmemSwizzle::k128B, 3 * 128 + 16) == 3 * 128 + (1 ^ 3) * 16,
              "128B swizzle: chunk ^= row % 8");

template <typename Tile>
bool tile_is_bijective(const Tile& tile) {
  std::vector<int> hits(tile.bytes() / 2, 0);
  for (uint32_t mn = 0; mn < tile.mn_extent; ++mn)
    for (uint32_t k = 0; k < tile.k_extent; ++k) {
      const uint32_t off = tile.byte_offset(mn, k);
      if (off % 2 != 0 || off >= tile.bytes() || hits[off / 2]++ != 0) return false;
    }
  return true;
}

TEST(Sm90Layouts, TilesMapElementsToDistinctSlots) {
  for (SmemSwizzle s :
       {SmemSwizzle::kNone, SmemSwizzle::k32B, SmemSwizzle::k64B, SmemSwizzle::k128B})
    for (uint32_t mn : {64u, 128u, 256u})
      for (uint32_t k : {16u, 64u}) {
        EXPECT_TRUE(tile_is_bijective(ptx::KMajorTile{s, mn, k}))
            << int(s) << " " << mn << " " << k;
        EXPECT_TRUE(tile_is_bijective(ptx::MnMajorTile{s, mn, k}))
            << int(s) << " " << mn << " " << k;
      }
}

TEST(Sm90Layouts, FragmentsCoverTheTileOnce) {
  constexpr uint32_t kN = 64, kM = ptx::WgmmaTraits::kM, kK = ptx::WgmmaTraits::kK;
  std::vector<int> acc(kM * kN, 0), a(kM * kK, 0);
  for (uint32_t t = 0; t < TestTraits::kWarpgroup; ++t) {
    for (uint32_t i = 0; i < kN / 2; ++i) {
      const ptx::FragmentCoord c = ptx::accumulator_coord(t, i);
      ++acc[c.row * kN + c.col];
    }
    for (uint32_t r = 0; r < ptx::WgmmaTraits::kARegs; ++r) {
      const ptx::FragmentCoord c = ptx::a_fragment_coord(t, r);
      ++a[c.row * kK + c.col];
      ++a[c.row * kK + c.col + 1];
    }
  }
  for (int n : acc) EXPECT_EQ(n, 1);
  for (int n : a) EXPECT_EQ(n, 1);
}

// =================================================================================================
// (1) mbarrier + TMA: load a box into (swizzled) shared memory, read it back through the swizzle
//     formula, store it out with a TMA store; both copies must equal the source.
// =================================================================================================

struct TmaRoundTripTraits {
  static constexpr uint32_t kRows = 200;  // not a multiple of the box: partial tiles
  static constexpr uint32_t kCols = 136;
  static constexpr uint32_t kRowStride = 144;  // padded rows (288 bytes, a multiple of 16)
  static constexpr uint32_t kBoxRows = 64;
  static constexpr uint32_t kUnswizzledBoxCols = 64;
  static constexpr uint32_t kMaxBoxBytes = kBoxRows * kUnswizzledBoxCols * 2;
};

/** Box width: one swizzle span of elements, or 64 elements without swizzle. */
__host__ __device__ constexpr uint32_t round_trip_box_cols(SmemSwizzle s) {
  return s == SmemSwizzle::kNone ? TmaRoundTripTraits::kUnswizzledBoxCols
                                 : ptx::swizzle_span_bytes(s) / ptx::WgmmaTraits::kElemBytes;
}

template <SmemSwizzle kSwizzle>
__global__ void __launch_bounds__(TestTraits::kWarpgroup)
    tma_round_trip_kernel(const __grid_constant__ CUtensorMap in_map,
                          const __grid_constant__ CUtensorMap out_map, uint16_t* readback,
                          uint32_t* errors) {
  using T = TmaRoundTripTraits;
  constexpr uint32_t kBoxCols = round_trip_box_cols(kSwizzle);
  constexpr uint32_t kBoxBytes = T::kBoxRows * kBoxCols * ptx::WgmmaTraits::kElemBytes;
  __shared__ alignas(TestTraits::kSmemAlign) uint16_t tile[T::kMaxBoxBytes / 2];
  __shared__ uint64_t full;
  const int32_t col0 = blockIdx.x * kBoxCols;
  const int32_t row0 = blockIdx.y * T::kBoxRows;

  if (threadIdx.x == 0) {
    if (ptx::smem_addr(tile) % TestTraits::kSmemAlign != 0) atomicAdd(errors, 1);
    ptx::tma_prefetch_tensor_map(&in_map);
    ptx::mbarrier_init(&full, 1);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&full, kBoxBytes);  // the one arrival + the bytes to come
    ptx::tma_load_2d(tile, &in_map, &full, col0, row0);
  }
  if (!wait_bounded(&full, 0)) atomicAdd(errors, 1);

  for (uint32_t idx = threadIdx.x; idx < T::kBoxRows * kBoxCols; idx += blockDim.x) {
    const uint32_t r = idx / kBoxCols, c = idx % kBoxCols;
    const uint32_t byte =
        ptx::apply_swizzle(kSwizzle, (r * kBoxCols + c) * ptx::WgmmaTraits::kElemBytes);
    const uint16_t value = tile[byte / ptx::WgmmaTraits::kElemBytes];
    const uint32_t gr = row0 + r, gc = col0 + c;
    if (gr < T::kRows && gc < T::kCols)
      readback[gr * T::kRowStride + gc] = value;
    else if (value != 0)
      atomicAdd(errors, 1);  // out-of-bounds box elements must have been zero-filled
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The store reads what the async proxy wrote; only generic writes would need a proxy fence.
    ptx::tma_store_2d(&out_map, tile, col0, row0);
    ptx::tma_store_commit_group();
    ptx::tma_store_wait_group_read<0>();  // smem may be released...
    ptx::tma_store_wait_group<0>();       // ...and global writes are done
  }
}

template <SmemSwizzle kSwizzle>
void run_tma_round_trip() {
  using T = TmaRoundTripTraits;
  constexpr uint32_t kBoxCols = round_trip_box_cols(kSwizzle);
  const size_t elems = size_t(T::kRows) * T::kRowStride;
  const std::vector<float> values = exact_values(elems, 7);
  std::vector<uint16_t> src(elems, TestTraits::kSentinel);
  for (uint32_t r = 0; r < T::kRows; ++r)
    for (uint32_t c = 0; c < T::kCols; ++c)
      src[size_t(r) * T::kRowStride + c] =
          to_bits<__nv_bfloat16>(values[size_t(r) * T::kRowStride + c]);
  const std::vector<uint16_t> untouched(elems, TestTraits::kSentinel);

  DeviceBuffer<uint16_t> d_src(elems), d_out(elems), d_readback(elems);
  DeviceBuffer<uint32_t> d_errors(1);
  ASSERT_TRUE(d_src.get() && d_out.get() && d_readback.get() && d_errors.get());
  CUDA_ASSERT(cudaMemcpy(d_src.get(), src.data(), d_src.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(d_out.get(), untouched.data(), d_out.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(
      cudaMemcpy(d_readback.get(), untouched.data(), d_out.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_errors.get(), 0, d_errors.bytes()));

  sm90::TiledView2d view =
      bf16_view(d_src.get(), T::kRows, T::kCols, T::kRowStride, T::kBoxRows, kBoxCols, to_tma_swizzle(kSwizzle));
  CUtensorMap in_map{}, out_map{};
  STATUS_ASSERT(sm90::encode_tensor_map_2d(view, &in_map));
  view.base = d_out.get();
  STATUS_ASSERT(sm90::encode_tensor_map_2d(view, &out_map));

  const dim3 grid((T::kCols + kBoxCols - 1) / kBoxCols, (T::kRows + T::kBoxRows - 1) / T::kBoxRows);
  tma_round_trip_kernel<kSwizzle>
      <<<grid, TestTraits::kWarpgroup>>>(in_map, out_map, d_readback.get(), d_errors.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());

  std::vector<uint16_t> out(elems), readback(elems);
  uint32_t errors = 0;
  CUDA_ASSERT(cudaMemcpy(out.data(), d_out.get(), d_out.bytes(), cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(readback.data(), d_readback.get(), d_out.bytes(), cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(&errors, d_errors.get(), sizeof(errors), cudaMemcpyDeviceToHost));
  EXPECT_EQ(errors, 0u) << "misaligned tile, barrier timeout or non-zero out-of-bounds fill";
  size_t bad_store = 0, bad_readback = 0, bad_padding = 0;
  for (uint32_t r = 0; r < T::kRows; ++r)
    for (uint32_t c = 0; c < T::kRowStride; ++c) {
      const size_t i = size_t(r) * T::kRowStride + c;
      if (c >= T::kCols) {
        bad_padding += out[i] != TestTraits::kSentinel;  // the store must clip at cols
        continue;
      }
      if (out[i] != src[i] && bad_store++ < 4)
        ADD_FAILURE() << "TMA store mismatch at (" << r << ", " << c << ")";
      if (readback[i] != src[i] && bad_readback++ < 4)
        ADD_FAILURE() << "swizzle formula mismatch at (" << r << ", " << c << ")";
    }
  EXPECT_EQ(bad_store, 0u);
  EXPECT_EQ(bad_readback, 0u);
  EXPECT_EQ(bad_padding, 0u);
}

TEST(Sm90Tma, RoundTrip2dNoSwizzle) {
  SKIP_UNLESS_SM90();
  run_tma_round_trip<SmemSwizzle::kNone>();
}
TEST(Sm90Tma, RoundTrip2dSwizzle128B) {
  SKIP_UNLESS_SM90();
  run_tma_round_trip<SmemSwizzle::k128B>();
}
TEST(Sm90Tma, RoundTrip2dSwizzle64B) {
  SKIP_UNLESS_SM90();
  run_tma_round_trip<SmemSwizzle::k64B>();
}
TEST(Sm90Tma, RoundTrip2dSwizzle32B) {
  SKIP_UNLESS_SM90();
  run_tma_round_trip<SmemSwizzle::k32B>();
}

// ---- TMA reduce-add: fp32 boxes staged with the 128B swizzle, several CTAs into the same boxes --
struct TmaReduceTraits {
  static constexpr uint32_t kRows = 100;  // not a multiple of kBoxRows: the last box row is clipped
  static constexpr uint32_t kCols = 64;
  static constexpr uint32_t kGuardRows = 28;  // after the mapped rows: must stay untouched
  static constexpr uint32_t kBoxRows = 64;
  static constexpr uint32_t kBoxCols = 32;  // 128 bytes of fp32: the 128B swizzle span
  static constexpr uint32_t kAdders = 3;    // CTAs adding into each box
  static constexpr float kGuard = -7.5f;
};

/** What CTA `adder` adds at (row, col): small integers, so every sum is exact in fp32 whatever the
 *  order of the additions. */
__host__ __device__ inline float reduce_contribution(uint32_t row, uint32_t col, uint32_t adder) {
  return float(int((row * 7 + col * 3 + adder * 11) % 64) - 20);
}

__global__ void __launch_bounds__(TestTraits::kWarpgroup)
    tma_reduce_add_kernel(const __grid_constant__ CUtensorMap map, uint32_t* errors) {
  using T = TmaReduceTraits;
  __shared__ alignas(TestTraits::kSmemAlign) float box[T::kBoxRows * T::kBoxCols];
  const uint32_t col0 = blockIdx.x * T::kBoxCols, row0 = blockIdx.y * T::kBoxRows;
  if (threadIdx.x == 0 && ptx::smem_addr(box) % TestTraits::kSmemAlign != 0) atomicAdd(errors, 1);
  for (uint32_t idx = threadIdx.x; idx < T::kBoxRows * T::kBoxCols; idx += blockDim.x) {
    const uint32_t r = idx / T::kBoxCols, c = idx % T::kBoxCols;
    const uint32_t byte = ptx::apply_swizzle(SmemSwizzle::k128B, idx * uint32_t(sizeof(float)));
    box[byte / sizeof(float)] = reduce_contribution(row0 + r, col0 + c, blockIdx.z);
  }
  ptx::fence_proxy_async_shared_cta();  // generic stores -> the reduction's async-proxy reads
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::tma_reduce_add_2d(&map, box, int32_t(col0), int32_t(row0));
    ptx::tma_store_commit_group();
    ptx::tma_store_wait_group<0>();
  }
}

TEST(Sm90Tma, ReduceAdd2dFp32Swizzle128B) {
  SKIP_UNLESS_SM90();
  using T = TmaReduceTraits;
  const size_t mapped = size_t(T::kRows) * T::kCols, elems = size_t(T::kRows + T::kGuardRows) * T::kCols;
  const std::vector<float> start_values = exact_values(mapped, 11);
  std::vector<float> start(elems, T::kGuard);
  std::copy(start_values.begin(), start_values.end(), start.begin());
  DeviceBuffer<float> d_acc(elems);
  DeviceBuffer<uint32_t> d_errors(1);
  ASSERT_TRUE(d_acc.get() && d_errors.get());
  CUDA_ASSERT(cudaMemcpy(d_acc.get(), start.data(), d_acc.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_errors.get(), 0, d_errors.bytes()));

  sm90::TiledView2d view;
  view.base = d_acc.get();
  view.element = sm90::TmaElement::kFp32;
  view.rows = T::kRows;
  view.cols = T::kCols;
  view.row_stride = T::kCols;
  view.box_rows = T::kBoxRows;
  view.box_cols = T::kBoxCols;
  view.swizzle = sm90::TmaSwizzle::k128B;
  CUtensorMap map{};
  STATUS_ASSERT(sm90::encode_tensor_map_2d(view, &map));

  const dim3 grid(T::kCols / T::kBoxCols, (T::kRows + T::kBoxRows - 1) / T::kBoxRows, T::kAdders);
  tma_reduce_add_kernel<<<grid, TestTraits::kWarpgroup>>>(map, d_errors.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());

  std::vector<float> acc(elems);
  uint32_t errors = 0;
  CUDA_ASSERT(cudaMemcpy(acc.data(), d_acc.get(), d_acc.bytes(), cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(&errors, d_errors.get(), sizeof(errors), cudaMemcpyDeviceToHost));
  EXPECT_EQ(errors, 0u) << "misaligned staging box";
  size_t bad = 0, bad_guard = 0;
  for (uint32_t r = 0; r < T::kRows + T::kGuardRows; ++r)
    for (uint32_t c = 0; c < T::kCols; ++c) {
      const size_t i = size_t(r) * T::kCols + c;
      if (r >= T::kRows) {
        bad_guard += acc[i] != T::kGuard;  // past the map: the reduction must clip
        continue;
      }
      float want = start[i];
      for (uint32_t a = 0; a < T::kAdders; ++a) want += reduce_contribution(r, c, a);
      if (acc[i] != want && bad++ < 4)
        ADD_FAILURE() << "reduce-add mismatch at (" << r << ", " << c << "): " << acc[i] << ", want " << want;
    }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(bad_guard, 0u);
}

// 5-D boxes of packed GQA rows (ptx::tma_load_5d / tma_store_5d over sm90::packed_group_view, what
// the forward's pack-GQA kernels read Q and write O through): a (batch, tokens, heads_kv x group,
// d) tensor with padded rows; one CTA per (KV head, batch, block of tokens) loads a box of 64
// packed rows, whose row r must hold query head kv_head * group + r % group of token r / group
// (zeros past the tokens), and stores it into a second tensor, which must then equal the source
// and keep its padding.
struct PackedBoxTraits {
  static constexpr uint32_t kCols = 64, kGroup = 4, kHeadsKv = 3, kTokens = 21, kBatch = 2;
  static constexpr uint32_t kRowStride = kHeadsKv * kGroup * kCols + 8;  // padded rows
  static constexpr uint32_t kBatchStride = kTokens * kRowStride;
  static constexpr uint32_t kElems = kBatch * kBatchStride;
  static constexpr uint32_t kBoxRows = 64, kBoxTokens = kBoxRows / kGroup;
};

__global__ void __launch_bounds__(TestTraits::kWarpgroup)
    packed_box_kernel(const __grid_constant__ CUtensorMap in_map, const __grid_constant__ CUtensorMap out_map,
                      const uint16_t* src, uint32_t* errors) {
  using T = PackedBoxTraits;
  __shared__ alignas(TestTraits::kSmemAlign) uint16_t tile[T::kBoxRows * T::kCols];
  __shared__ uint64_t full;
  const int32_t kv_head = blockIdx.x, batch = blockIdx.y, token0 = blockIdx.z * T::kBoxTokens;
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&full, 1);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&full, sizeof(tile));
    ptx::tma_load_5d(tile, &in_map, &full, 0, 0, token0, kv_head, batch);
  }
  if (!wait_bounded(&full, 0)) atomicAdd(errors, 1);
  for (uint32_t idx = threadIdx.x; idx < T::kBoxRows * T::kCols; idx += blockDim.x) {
    const uint32_t r = idx / T::kCols, c = idx % T::kCols;
    const uint32_t byte = ptx::swizzled_box_offset(T::kBoxRows, 0, r, c / 8, 2 * (c % 8));
    const uint16_t got = tile[byte / 2];
    const uint32_t token = token0 + r / T::kGroup, head = kv_head * T::kGroup + r % T::kGroup;
    const uint16_t want = token < T::kTokens ? src[batch * T::kBatchStride + token * T::kRowStride + head * T::kCols + c] : 0;
    if (got != want) atomicAdd(errors, 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::tma_store_5d(&out_map, tile, 0, 0, token0, kv_head, batch);
    ptx::tma_store_commit_group();
    ptx::tma_store_wait_group<0>();
  }
}

TEST(Sm90Tma, PackedGqaBoxes5d) {
  SKIP_UNLESS_SM90();
  using T = PackedBoxTraits;
  const std::vector<float> values = exact_values(T::kElems, 11);
  std::vector<uint16_t> src(T::kElems);
  for (uint32_t i = 0; i < T::kElems; ++i) src[i] = to_bits<__nv_bfloat16>(values[i]);
  const std::vector<uint16_t> untouched(T::kElems, TestTraits::kSentinel);
  DeviceBuffer<uint16_t> d_src(T::kElems), d_out(T::kElems);
  DeviceBuffer<uint32_t> d_errors(1);
  ASSERT_TRUE(d_src.get() && d_out.get() && d_errors.get());
  CUDA_ASSERT(cudaMemcpy(d_src.get(), src.data(), d_src.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(d_out.get(), untouched.data(), d_out.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_errors.get(), 0, d_errors.bytes()));
  flashcore::TensorRef in{d_src.get(), T::kBatchStride, T::kRowStride, T::kCols};
  flashcore::TensorRef out{d_out.get(), T::kBatchStride, T::kRowStride, T::kCols};
  CUtensorMap in_map{}, out_map{};
  STATUS_ASSERT(sm90::encode_tensor_map_nd(sm90::packed_group_view(in, sm90::TmaElement::kBf16, T::kTokens, T::kHeadsKv,
                                                                   T::kGroup, T::kBatch, T::kCols, false, T::kBoxRows),
                                           &in_map));
  STATUS_ASSERT(sm90::encode_tensor_map_nd(sm90::packed_group_view(out, sm90::TmaElement::kBf16, T::kTokens,
                                                                   T::kHeadsKv, T::kGroup, T::kBatch, T::kCols, false,
                                                                   T::kBoxRows),
                                           &out_map));
  const dim3 grid(T::kHeadsKv, T::kBatch, (T::kTokens + T::kBoxTokens - 1) / T::kBoxTokens);
  packed_box_kernel<<<grid, TestTraits::kWarpgroup>>>(in_map, out_map, d_src.get(), d_errors.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  std::vector<uint16_t> got(T::kElems);
  uint32_t errors = 0;
  CUDA_ASSERT(cudaMemcpy(got.data(), d_out.get(), d_out.bytes(), cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(&errors, d_errors.get(), sizeof(errors), cudaMemcpyDeviceToHost));
  EXPECT_EQ(errors, 0u) << "shared-memory rows not in packed order, a barrier timeout or non-zero fill";
  size_t bad = 0, bad_padding = 0;
  for (uint32_t i = 0; i < T::kElems; ++i) {
    if (i % T::kRowStride >= T::kHeadsKv * T::kGroup * T::kCols) {
      bad_padding += got[i] != TestTraits::kSentinel;
    } else if (got[i] != src[i] && bad++ < 4) {
      ADD_FAILURE() << "5-D store mismatch at element " << i;
    }
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(bad_padding, 0u);
}

// L2 prefetches (ptx::tma_prefetch_l2_4d, ptx::prefetch_l2) and the early index read
// (ptx::load_unordered_s32) that the kernels issue before griddepcontrol.wait: boxes inside, partly
// outside and wholly outside the tensor must not fault, and lines prefetched before a write must
// not serve the old values to a later TMA load (L2 is the point of coherence).
struct L2PrefetchTraits {
  static constexpr uint32_t kCols = 64, kRows = 64, kHeads = 2, kBatch = 2;  // (d, rows, heads, batch)
  static constexpr uint32_t kElems = kCols * kRows * kHeads * kBatch;
  static constexpr uint32_t kProbeHead = 1, kProbeBatch = 1;  // the box prefetched, then reloaded
};

__global__ void l2_prefetch_kernel(const __grid_constant__ CUtensorMap map, const uint16_t* data, int32_t* word_out) {
  using T = L2PrefetchTraits;
  if (threadIdx.x != 0) return;
  ptx::tma_prefetch_l2_4d(&map, 0, 0, T::kProbeHead, T::kProbeBatch);  // inside
  ptx::tma_prefetch_l2_4d(&map, 0, 32, 0, 0);                          // rows 32..95: half outside
  ptx::tma_prefetch_l2_4d(&map, -64, -64, 0, 0);                       // wholly outside, negative
  ptx::tma_prefetch_l2_4d(&map, 0, 1000, 7, 9);                        // wholly outside, far
  for (uint32_t i = 0; i < T::kElems; i += 64) ptx::prefetch_l2(data + i);  // every 128-byte line
  *word_out = ptx::load_unordered_s32(reinterpret_cast<const int32_t*>(data) + 5);
}

__global__ void l2_reload_kernel(const __grid_constant__ CUtensorMap map, uint16_t* readback, uint32_t* errors) {
  using T = L2PrefetchTraits;
  __shared__ alignas(128) uint16_t tile[T::kRows * T::kCols];
  __shared__ uint64_t full;
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&full, 1);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&full, sizeof(tile));
    ptx::tma_load_4d(tile, &map, &full, 0, 0, T::kProbeHead, T::kProbeBatch);
  }
  if (!wait_bounded(&full, 0)) atomicAdd(errors, 1);
  for (uint32_t i = threadIdx.x; i < T::kRows * T::kCols; i += blockDim.x) readback[i] = tile[i];
}

TEST(Sm90Tma, L2PrefetchesNeitherFaultNorServeStaleLines) {
  SKIP_UNLESS_SM90();
  using T = L2PrefetchTraits;
  std::vector<uint16_t> before(T::kElems), after(T::kElems);
  const std::vector<float> a = exact_values(T::kElems, 21), b = exact_values(T::kElems, 22);
  for (uint32_t i = 0; i < T::kElems; ++i) {
    before[i] = to_bits<__nv_bfloat16>(a[i]);
    after[i] = static_cast<uint16_t>(to_bits<__nv_bfloat16>(b[i]) ^ 0x0001);  // differs from `before`
  }
  DeviceBuffer<uint16_t> d_data(T::kElems), d_readback(T::kRows * T::kCols);
  DeviceBuffer<int32_t> d_word(1);
  DeviceBuffer<uint32_t> d_errors(1);
  ASSERT_TRUE(d_data.get() && d_readback.get() && d_word.get() && d_errors.get());
  CUDA_ASSERT(cudaMemcpy(d_data.get(), before.data(), d_data.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_errors.get(), 0, d_errors.bytes()));

  sm90::TiledViewNd view;
  view.base = d_data.get();
  view.element = sm90::TmaElement::kBf16;
  view.rank = 4;
  const uint64_t dims[4] = {T::kCols, T::kRows, T::kHeads, T::kBatch};
  const uint64_t strides[4] = {1, T::kCols, uint64_t(T::kCols) * T::kRows, uint64_t(T::kCols) * T::kRows * T::kHeads};
  const uint32_t box[4] = {T::kCols, T::kRows, 1, 1};
  for (int d = 0; d < 4; ++d) {
    view.dims[d] = dims[d];
    view.strides[d] = strides[d];
    view.box[d] = box[d];
  }
  view.swizzle = sm90::TmaSwizzle::kNone;
  CUtensorMap map{};
  STATUS_ASSERT(sm90::encode_tensor_map_nd(view, &map));

  l2_prefetch_kernel<<<1, 32>>>(map, d_data.get(), d_word.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());  // a faulting prefetch would surface here
  CUDA_ASSERT(cudaMemcpy(d_data.get(), after.data(), d_data.bytes(), cudaMemcpyHostToDevice));
  l2_reload_kernel<<<1, TestTraits::kWarpgroup>>>(map, d_readback.get(), d_errors.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());

  int32_t word = 0;
  uint32_t errors = 0;
  std::vector<uint16_t> readback(T::kRows * T::kCols);
  CUDA_ASSERT(cudaMemcpy(&word, d_word.get(), sizeof(word), cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(&errors, d_errors.get(), sizeof(errors), cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(readback.data(), d_readback.get(), d_readback.bytes(), cudaMemcpyDeviceToHost));
  int32_t want_word = 0;
  std::memcpy(&want_word, before.data() + 10, sizeof(want_word));
  EXPECT_EQ(word, want_word) << "load_unordered_s32 read the wrong word";
  EXPECT_EQ(errors, 0u) << "the reload's TMA never landed";
  const size_t probe = (size_t(T::kProbeBatch) * T::kHeads + T::kProbeHead) * T::kRows * T::kCols;
  size_t stale = 0;
  for (size_t i = 0; i < readback.size(); ++i) stale += readback[i] != after[probe + i];
  EXPECT_EQ(stale, 0u) << "a load after the write returned values from before it";
}

// ---- clusters: multicast TMA loads and arrivals on a peer CTA's mbarrier ----------------------
struct ClusterTraits {
  static constexpr uint32_t kRanks = 2;  // CTAs per cluster
  static constexpr uint32_t kBoxRows = 64;
  static constexpr uint32_t kCols = 64;  // 128 bytes of bf16: one 128B-swizzled box per rank
  static constexpr uint32_t kBoxBytes = kBoxRows * kCols * 2;
  static constexpr uint32_t kRows = kRanks * kBoxRows;
};

/** Each CTA of a pair copies its rank's box of rows into slot `rank` of both CTAs' shared memory
 *  with one multicast load, and arrives once on the peer's `handed` barrier. Every CTA then waits
 *  for both boxes on its own barrier (armed for both) and for the peer's arrival, and reads both
 *  slots back: the peer's slot holds what only the peer copied. */
__global__ void __cluster_dims__(ClusterTraits::kRanks, 1, 1) __launch_bounds__(TestTraits::kWarpgroup)
    cluster_multicast_kernel(const __grid_constant__ CUtensorMap map, uint16_t* readback, uint32_t* errors) {
  using T = ClusterTraits;
  __shared__ alignas(TestTraits::kSmemAlign) uint16_t slots[T::kRanks][T::kBoxRows * T::kCols];
  __shared__ uint64_t full, handed;
  const uint32_t rank = ptx::cluster_ctarank();
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&full, 1);
    ptx::mbarrier_init(&handed, 1);
    ptx::fence_mbarrier_init();
  }
  ptx::cluster_sync();  // both CTAs' barriers are initialised before either is signalled
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&full, T::kRanks * T::kBoxBytes);
    ptx::tma_load_2d_multicast(slots[rank], &map, &full, 0, int32_t(rank * T::kBoxRows), (1u << T::kRanks) - 1);
    ptx::mbarrier_arrive_cluster(ptx::peer_shared_addr(ptx::smem_addr(&handed), rank ^ 1u));
  }
  if (!wait_bounded(&full, 0)) atomicAdd(&errors[0], 1);
  if (!wait_bounded(&handed, 0)) atomicAdd(&errors[1], 1);
  for (uint32_t idx = threadIdx.x; idx < T::kRows * T::kCols; idx += blockDim.x) {
    const uint32_t slot = idx / (T::kBoxRows * T::kCols), in_box = idx % (T::kBoxRows * T::kCols);
    const uint32_t byte = ptx::apply_swizzle(SmemSwizzle::k128B, in_box * 2);
    readback[rank * T::kRows * T::kCols + idx] = slots[slot][byte / 2];
  }
  ptx::cluster_sync();  // no CTA leaves while its peer may still signal it
}

TEST(Sm90Cluster, MulticastLoadFillsBothCtas) {
  SKIP_UNLESS_SM90();
  using T = ClusterTraits;
  const size_t elems = size_t(T::kRows) * T::kCols;
  const std::vector<float> values = exact_values(elems, 11);
  std::vector<uint16_t> src(elems);
  for (size_t i = 0; i < elems; ++i) src[i] = to_bits<__nv_bfloat16>(values[i]);
  const std::vector<uint16_t> poison(T::kRanks * elems, TestTraits::kSentinel);
  DeviceBuffer<uint16_t> d_src(elems), d_readback(T::kRanks * elems);
  DeviceBuffer<uint32_t> d_errors(2);
  ASSERT_TRUE(d_src.get() && d_readback.get() && d_errors.get());
  CUDA_ASSERT(cudaMemcpy(d_src.get(), src.data(), d_src.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(d_readback.get(), poison.data(), d_readback.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_errors.get(), 0, d_errors.bytes()));

  const sm90::TiledView2d view =
      bf16_view(d_src.get(), T::kRows, T::kCols, T::kCols, T::kBoxRows, T::kCols, sm90::TmaSwizzle::k128B);
  CUtensorMap map{};
  STATUS_ASSERT(sm90::encode_tensor_map_2d(view, &map));

  cluster_multicast_kernel<<<T::kRanks, TestTraits::kWarpgroup>>>(map, d_readback.get(), d_errors.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());

  std::vector<uint16_t> readback(T::kRanks * elems);
  uint32_t errors[2] = {0, 0};
  CUDA_ASSERT(cudaMemcpy(readback.data(), d_readback.get(), d_readback.bytes(), cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(errors, d_errors.get(), sizeof(errors), cudaMemcpyDeviceToHost));
  EXPECT_EQ(errors[0], 0u) << "threads timed out waiting for the two multicast boxes";
  EXPECT_EQ(errors[1], 0u) << "threads timed out waiting for the peer's arrival";
  for (uint32_t rank = 0; rank < T::kRanks; ++rank) {
    size_t bad = 0;
    for (size_t i = 0; i < elems; ++i) {
      if (readback[rank * elems + i] != src[i] && bad++ < 4)
        ADD_FAILURE() << "CTA " << rank << ": row " << i / T::kCols << " col " << i % T::kCols
                      << " differs from the source";
    }
    EXPECT_EQ(bad, 0u) << "CTA " << rank;
  }
}

TEST(Sm90TensorMap, RejectsWhatTmaCannotDescribe) {
  // Host-only checks: no device needed.
  alignas(16) static uint16_t storage[64 * 64];
  sm90::TiledView2d view;
  view.base = storage;
  view.rows = 64;
  view.cols = 64;
  view.row_stride = 64;
  view.box_rows = 64;
  view.box_cols = 64;
  view.swizzle = sm90::TmaSwizzle::k64B;  // 128-byte box rows exceed the 64-byte span
  CUtensorMap map{};
  EXPECT_EQ(sm90::encode_tensor_map_2d(view, &map).code, FC_ERROR_INVALID_ARGUMENT);
  view.swizzle = sm90::TmaSwizzle::k128B;
  view.row_stride = 68;  // 136 bytes: not a multiple of 16
  EXPECT_EQ(sm90::encode_tensor_map_2d(view, &map).code, FC_ERROR_INVALID_ARGUMENT);
  view.row_stride = 64;
  view.base = storage + 1;  // misaligned
  EXPECT_EQ(sm90::encode_tensor_map_2d(view, &map).code, FC_ERROR_INVALID_ARGUMENT);
}

// =================================================================================================
// (2) One wgmma m64nNk16: operands staged by ordinary stores in the layout the descriptor
//     describes (built on the host with KMajorTile / MnMajorTile), A from shared memory (SS) or
//     from registers (RS), compared with the host matmul.
// =================================================================================================

struct SingleWgmmaTraits {
  static constexpr uint32_t kM = ptx::WgmmaTraits::kM;
  static constexpr uint32_t kK = ptx::WgmmaTraits::kK;
};

template <int kN, SmemSwizzle kSwizzle, bool kBMnMajor>
struct SingleWgmmaLayout {
  // Functions, not static constexpr objects: device code may not odr-use host variables.
  __host__ __device__ static constexpr ptx::KMajorTile a() {
    return {kSwizzle, SingleWgmmaTraits::kM, SingleWgmmaTraits::kK};
  }
  __host__ __device__ static constexpr ptx::KMajorTile b_k() {
    return {kSwizzle, kN, SingleWgmmaTraits::kK};
  }
  __host__ __device__ static constexpr ptx::MnMajorTile b_mn() {
    return {kSwizzle, kN, SingleWgmmaTraits::kK};
  }
  static constexpr uint32_t a_bytes = round_up(a().bytes(), TestTraits::kSmemAlign);
  static constexpr uint32_t b_bytes = kBMnMajor ? b_mn().bytes() : b_k().bytes();
  static constexpr uint32_t smem_bytes = TestTraits::kSmemAlign + a_bytes + b_bytes;
  __host__ __device__ static constexpr uint32_t b_offset(uint32_t n, uint32_t k) {
    return kBMnMajor ? b_mn().byte_offset(n, k) : b_k().byte_offset(n, k);
  }
  __host__ __device__ static constexpr uint64_t b_desc(uint32_t base) {
    return kBMnMajor ? b_mn().desc(base, 0, 0) : b_k().desc(base, 0, 0);
  }
};

template <int kN, typename Elem, SmemSwizzle kSwizzle, bool kBMnMajor, bool kARegs>
__global__ void __launch_bounds__(TestTraits::kWarpgroup)
    single_wgmma_kernel(const uint4* a_image, const uint4* b_image, const uint16_t* a_rowmajor,
                        float* c) {
  using L = SingleWgmmaLayout<kN, kSwizzle, kBMnMajor>;
  extern __shared__ uint8_t raw_smem[];
  uint8_t* smem_a = align_smem(raw_smem);
  uint8_t* smem_b = smem_a + L::a_bytes;
  const uint32_t t = ptx::thread_in_warpgroup();
  // Ordinary 16-byte stores of the prepared images...
  for (uint32_t i = t; i < L::a_bytes / sizeof(uint4); i += blockDim.x)
    reinterpret_cast<uint4*>(smem_a)[i] = a_image[i];
  for (uint32_t i = t; i < L::b_bytes / sizeof(uint4); i += blockDim.x)
    reinterpret_cast<uint4*>(smem_b)[i] = b_image[i];
  // ...published to the async proxy that wgmma reads through.
  ptx::fence_proxy_async_shared_cta();
  __syncthreads();

  float d[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) d[i] = TestTraits::kStaleAccumulator;  // scale-d = 0 ignores it
  const uint64_t desc_b = L::b_desc(ptx::smem_addr(smem_b));
  constexpr int kTransB = kBMnMajor ? 1 : 0;
  if constexpr (kARegs) {
    uint32_t a[ptx::WgmmaTraits::kARegs];
#pragma unroll
    for (uint32_t r = 0; r < ptx::WgmmaTraits::kARegs; ++r) {
      const ptx::FragmentCoord at = ptx::a_fragment_coord(t, r);
      const uint32_t i = at.row * SingleWgmmaTraits::kK + at.col;
      a[r] = uint32_t(a_rowmajor[i]) | (uint32_t(a_rowmajor[i + 1]) << 16);
    }
    ptx::wgmma_fence();  // d and a were written by ordinary instructions
    ptx::wgmma_rs<kN, Elem, kTransB>(d, a, desc_b, /*accumulate=*/false);
  } else {
    const uint64_t desc_a = L::a().desc(ptx::smem_addr(smem_a), 0, 0);
    ptx::wgmma_fence();
    ptx::wgmma_ss<kN, Elem, 0, kTransB>(d, desc_a, desc_b, /*accumulate=*/false);
  }
  ptx::wgmma_commit_group();
  ptx::wgmma_wait_group<0>();
  ptx::wgmma_fence_operands(d);
#pragma unroll
  for (uint32_t i = 0; i < kN / 2; ++i) {
    const ptx::FragmentCoord at = ptx::accumulator_coord(t, i);
    c[at.row * kN + at.col] = d[i];
  }
}

template <int kN, typename Elem, SmemSwizzle kSwizzle, bool kBMnMajor, bool kARegs>
void run_single_wgmma() {
  using L = SingleWgmmaLayout<kN, kSwizzle, kBMnMajor>;
  constexpr int kM = SingleWgmmaTraits::kM, kK = SingleWgmmaTraits::kK;
  const std::vector<float> a = exact_values(size_t(kM) * kK, 11);
  const std::vector<float> b = exact_values(size_t(kK) * kN, 13);  // row-major K x N
  const std::vector<float> expected = host_matmul(a, b, kM, kN, kK);

  std::vector<uint16_t> a_rowmajor(a.size());
  for (size_t i = 0; i < a.size(); ++i) a_rowmajor[i] = to_bits<Elem>(a[i]);
  std::vector<uint8_t> a_image(L::a_bytes, 0), b_image(L::b_bytes, 0);
  for (int m = 0; m < kM; ++m)
    for (int k = 0; k < kK; ++k)
      std::memcpy(&a_image[L::a().byte_offset(m, k)], &a_rowmajor[size_t(m) * kK + k], 2);
  for (int k = 0; k < kK; ++k)
    for (int n = 0; n < kN; ++n) {
      const uint16_t bits = to_bits<Elem>(b[size_t(k) * kN + n]);
      std::memcpy(&b_image[L::b_offset(n, k)], &bits, 2);
    }

  DeviceBuffer<uint8_t> d_a_image(L::a_bytes), d_b_image(L::b_bytes);
  DeviceBuffer<uint16_t> d_a(a_rowmajor.size());
  DeviceBuffer<float> d_c(expected.size());
  ASSERT_TRUE(d_a_image.get() && d_b_image.get() && d_a.get() && d_c.get());
  CUDA_ASSERT(cudaMemcpy(d_a_image.get(), a_image.data(), L::a_bytes, cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(d_b_image.get(), b_image.data(), L::b_bytes, cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(d_a.get(), a_rowmajor.data(), d_a.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_c.get(), 0xFF, d_c.bytes()));  // NaN: unwritten outputs fail

  auto kernel = single_wgmma_kernel<kN, Elem, kSwizzle, kBMnMajor, kARegs>;
  CUDA_ASSERT(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::smem_bytes));
  kernel<<<1, TestTraits::kWarpgroup, L::smem_bytes>>>(
      reinterpret_cast<const uint4*>(d_a_image.get()),
      reinterpret_cast<const uint4*>(d_b_image.get()), d_a.get(), d_c.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());

  std::vector<float> c(expected.size());
  CUDA_ASSERT(cudaMemcpy(c.data(), d_c.get(), d_c.bytes(), cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (int m = 0; m < kM; ++m)
    for (int n = 0; n < kN; ++n) {
      const size_t i = size_t(m) * kN + n;
      if (c[i] != expected[i] && bad++ < 4)
        ADD_FAILURE() << "C(" << m << ", " << n << ") = " << c[i] << ", expected " << expected[i];
    }
  EXPECT_EQ(bad, 0u) << "mismatching outputs of " << kM * kN;
}

using bf16 = __nv_bfloat16;
using fp16 = __half;
constexpr bool kKMajorB = false, kMnMajorB = true, kSmemA = false, kRegsA = true;

#define SINGLE_WGMMA_TEST(name, N, ELEM, SWZ, B_MN, A_REGS)      \
  TEST(Sm90WgmmaSingle, name) {                                  \
    SKIP_UNLESS_SM90();                                          \
    run_single_wgmma<N, ELEM, SmemSwizzle::SWZ, B_MN, A_REGS>(); \
  }

// SS, bf16, N = 64: every swizzle mode, B K-major (trans-b 0) and MN-major (trans-b 1).
SINGLE_WGMMA_TEST(SsBf16N64KMajorNone, 64, bf16, kNone, kKMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsBf16N64KMajor32B, 64, bf16, k32B, kKMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsBf16N64KMajor64B, 64, bf16, k64B, kKMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsBf16N64KMajor128B, 64, bf16, k128B, kKMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsBf16N64MnMajorNone, 64, bf16, kNone, kMnMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsBf16N64MnMajor32B, 64, bf16, k32B, kMnMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsBf16N64MnMajor64B, 64, bf16, k64B, kMnMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsBf16N64MnMajor128B, 64, bf16, k128B, kMnMajorB, kSmemA)
// RS (A from registers), the O += P V form: B K-major and MN-major.
SINGLE_WGMMA_TEST(RsBf16N64KMajor128B, 64, bf16, k128B, kKMajorB, kRegsA)
SINGLE_WGMMA_TEST(RsBf16N64MnMajor128B, 64, bf16, k128B, kMnMajorB, kRegsA)
SINGLE_WGMMA_TEST(RsBf16N64MnMajorNone, 64, bf16, kNone, kMnMajorB, kRegsA)
SINGLE_WGMMA_TEST(RsFp16N128MnMajor128B, 128, fp16, k128B, kMnMajorB, kRegsA)  // 2 MN atoms: LBO
SINGLE_WGMMA_TEST(RsFp16N128KMajor128B, 128, fp16, k128B, kKMajorB, kRegsA)
// fp16 N = 128 and the N = 256 shapes.
SINGLE_WGMMA_TEST(SsFp16N128KMajor128B, 128, fp16, k128B, kKMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsFp16N128MnMajor128B, 128, fp16, k128B, kMnMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsBf16N256KMajor128B, 256, bf16, k128B, kKMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsFp16N256MnMajor64B, 256, fp16, k64B, kMnMajorB, kSmemA)
// N = 80: the d256 forward's Q K^T over 80-key tiles (K-major B, 10 core-matrix groups of rows).
SINGLE_WGMMA_TEST(SsBf16N80KMajor128B, 80, bf16, k128B, kKMajorB, kSmemA)
SINGLE_WGMMA_TEST(SsFp16N80KMajor128B, 80, fp16, k128B, kKMajorB, kSmemA)

// =================================================================================================
// (3) A K loop: C(64 x N) = A(64 x 256) * B(256 x N) in k = 64 tiles, TMA (128B swizzle) into a
//     2-stage ring completed on mbarriers, 4 wgmma k16 steps per tile (descriptor start address
//     advanced along K), commit per tile and wait<1> before a stage is refilled.
// =================================================================================================

struct KLoopTraits {
  static constexpr uint32_t kM = ptx::WgmmaTraits::kM;
  static constexpr uint32_t kK = 256;
  static constexpr uint32_t kKTile = 64;  // one 128-byte swizzle span of bf16
  static constexpr uint32_t kKTiles = kK / kKTile;
  static constexpr uint32_t kStages = 2;
  static constexpr uint32_t kRefillBarrier = ptx::WarpgroupTraits::kFirstFreeBarrierId;
  static constexpr SmemSwizzle kSwizzle = SmemSwizzle::k128B;
};

template <int kN, bool kBMnMajor>
struct KLoopLayout {
  using T = KLoopTraits;
  __host__ __device__ static constexpr ptx::KMajorTile a() {
    return {T::kSwizzle, T::kM, T::kKTile};
  }
  __host__ __device__ static constexpr ptx::KMajorTile b_k() {
    return {T::kSwizzle, kN, T::kKTile};
  }
  __host__ __device__ static constexpr ptx::MnMajorTile b_mn() {
    return {T::kSwizzle, kN, T::kKTile};
  }
  static constexpr uint32_t a_bytes = a().bytes();
  static constexpr uint32_t b_bytes = kBMnMajor ? b_mn().bytes() : b_k().bytes();
  static constexpr uint32_t stage_bytes = round_up(a_bytes + b_bytes, TestTraits::kSmemAlign);
  static constexpr uint32_t smem_bytes = TestTraits::kSmemAlign + T::kStages * stage_bytes;
  // An MN-major B stage is N / 64 boxes of [64 k rows][64 n], one per MN atom.
  static constexpr uint32_t b_boxes = kBMnMajor ? kN / b_mn().span_elems() : 1;
  static constexpr uint32_t b_box_bytes = b_bytes / b_boxes;
  static_assert(!kBMnMajor || b_box_bytes == b_mn().mn_atom_bytes(), "TMA boxes = MN atoms");
};

template <int kN, bool kBMnMajor>
__global__ void __launch_bounds__(TestTraits::kWarpgroup)
    k_loop_kernel(const __grid_constant__ CUtensorMap a_map,
                  const __grid_constant__ CUtensorMap b_map, float* c, uint32_t* errors) {
  using T = KLoopTraits;
  using L = KLoopLayout<kN, kBMnMajor>;
  extern __shared__ uint8_t raw_smem[];
  uint8_t* smem = align_smem(raw_smem);
  __shared__ uint64_t full[T::kStages];
  const uint32_t t = ptx::thread_in_warpgroup();
  const bool producer = t == 0;

  if (producer) {
    ptx::tma_prefetch_tensor_map(&a_map);
    ptx::tma_prefetch_tensor_map(&b_map);
    for (uint32_t s = 0; s < T::kStages; ++s) ptx::mbarrier_init(&full[s], 1);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();

  auto fill = [&](uint32_t tile) {
    const uint32_t s = tile % T::kStages;
    uint8_t* sa = smem + s * L::stage_bytes;
    uint8_t* sb = sa + L::a_bytes;
    const int32_t k0 = tile * T::kKTile;
    ptx::mbarrier_arrive_expect_tx(&full[s], L::a_bytes + L::b_bytes);
    ptx::tma_load_2d(sa, &a_map, &full[s], k0, 0);
    for (uint32_t box = 0; box < L::b_boxes; ++box) {
      if constexpr (kBMnMajor)  // global B is [K][N]: {n, k}
        ptx::tma_load_2d(sb + box * L::b_box_bytes, &b_map, &full[s], box * L::b_mn().span_elems(),
                         k0);
      else  // global B is [N][K]: {k, n}
        ptx::tma_load_2d(sb, &b_map, &full[s], k0, 0);
    }
  };
  if (producer) fill(0);

  float d[kN / 2];
  constexpr int kTransB = kBMnMajor ? 1 : 0;
  for (uint32_t tile = 0; tile < T::kKTiles; ++tile) {
    const uint32_t s = tile % T::kStages;
    if (!wait_bounded(&full[s], (tile / T::kStages) & 1)) atomicAdd(errors, 1);
    __syncwarp();  // lanes leave the wait loop (and lane 0 the fill) apart; wgmma is .aligned
    const uint32_t sa = ptx::smem_addr(smem + s * L::stage_bytes);
    const uint32_t sb = sa + L::a_bytes;
    ptx::wgmma_fence();
#pragma unroll
    for (uint32_t kk = 0; kk < T::kKTile / ptx::WgmmaTraits::kK; ++kk) {
      const uint32_t k0 = kk * ptx::WgmmaTraits::kK;
      const uint64_t desc_a = L::a().desc(sa, 0, k0);
      const uint64_t desc_b = kBMnMajor ? L::b_mn().desc(sb, 0, k0) : L::b_k().desc(sb, 0, k0);
      ptx::wgmma_ss<kN, __nv_bfloat16, 0, kTransB>(d, desc_a, desc_b, tile > 0 || kk > 0);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<1>();  // the previous tile's group is done: its stage may be refilled
    ptx::named_barrier_sync(T::kRefillBarrier, TestTraits::kWarpgroup);
    if (producer && tile + 1 < T::kKTiles) fill(tile + 1);
  }
  ptx::wgmma_wait_group<0>();
  ptx::wgmma_fence_operands(d);
#pragma unroll
  for (uint32_t i = 0; i < kN / 2; ++i) {
    const ptx::FragmentCoord at = ptx::accumulator_coord(t, i);
    c[at.row * kN + at.col] = d[i];
  }
}

template <int kN, bool kBMnMajor>
void run_k_loop() {
  using T = KLoopTraits;
  using L = KLoopLayout<kN, kBMnMajor>;
  const std::vector<float> a = exact_values(size_t(T::kM) * T::kK, 17);  // [M][K]
  const std::vector<float> b = exact_values(size_t(T::kK) * kN, 19);     // [K][N] logical
  const std::vector<float> expected = host_matmul(a, b, T::kM, kN, T::kK);
  std::vector<uint16_t> a_bits(a.size()), b_bits(b.size());
  for (size_t i = 0; i < a.size(); ++i) a_bits[i] = to_bits<__nv_bfloat16>(a[i]);
  for (uint32_t k = 0; k < T::kK; ++k)
    for (int n = 0; n < kN; ++n) {  // stored [K][N] (V-like) or [N][K] (K-like)
      const size_t dst = kBMnMajor ? size_t(k) * kN + n : size_t(n) * T::kK + k;
      b_bits[dst] = to_bits<__nv_bfloat16>(b[size_t(k) * kN + n]);
    }

  DeviceBuffer<uint16_t> d_a(a_bits.size()), d_b(b_bits.size());
  DeviceBuffer<float> d_c(expected.size());
  DeviceBuffer<uint32_t> d_errors(1);
  ASSERT_TRUE(d_a.get() && d_b.get() && d_c.get() && d_errors.get());
  CUDA_ASSERT(cudaMemcpy(d_a.get(), a_bits.data(), d_a.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(d_b.get(), b_bits.data(), d_b.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_c.get(), 0xFF, d_c.bytes()));
  CUDA_ASSERT(cudaMemset(d_errors.get(), 0, d_errors.bytes()));

  sm90::TiledView2d a_view;
  a_view.base = d_a.get();
  a_view.rows = T::kM;
  a_view.cols = T::kK;
  a_view.row_stride = T::kK;
  a_view.box_rows = T::kM;
  a_view.box_cols = T::kKTile;
  sm90::TiledView2d b_view = a_view;
  b_view.base = d_b.get();
  if (kBMnMajor) {
    b_view.rows = T::kK;
    b_view.cols = kN;
    b_view.row_stride = kN;
    b_view.box_rows = T::kKTile;
    b_view.box_cols = L::b_mn().span_elems();
  } else {
    b_view.rows = kN;
    b_view.box_rows = kN;
  }
  CUtensorMap a_map{}, b_map{};
  STATUS_ASSERT(sm90::encode_tensor_map_2d(a_view, &a_map));
  STATUS_ASSERT(sm90::encode_tensor_map_2d(b_view, &b_map));

  auto kernel = k_loop_kernel<kN, kBMnMajor>;
  CUDA_ASSERT(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::smem_bytes));
  kernel<<<1, TestTraits::kWarpgroup, L::smem_bytes>>>(a_map, b_map, d_c.get(), d_errors.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());

  std::vector<float> c(expected.size());
  uint32_t errors = 0;
  CUDA_ASSERT(cudaMemcpy(c.data(), d_c.get(), d_c.bytes(), cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(&errors, d_errors.get(), sizeof(errors), cudaMemcpyDeviceToHost));
  EXPECT_EQ(errors, 0u) << "an mbarrier wait timed out";
  size_t bad = 0;
  for (size_t i = 0; i < c.size(); ++i)
    if (c[i] != expected[i] && bad++ < 4)
      ADD_FAILURE() << "C(" << i / kN << ", " << i % kN << ") = " << c[i] << ", expected "
                    << expected[i];
  EXPECT_EQ(bad, 0u);
}

TEST(Sm90WgmmaKLoop, Bf16N64KMajorB) {
  SKIP_UNLESS_SM90();
  run_k_loop<64, false>();
}
TEST(Sm90WgmmaKLoop, Bf16N128KMajorB) {
  SKIP_UNLESS_SM90();
  run_k_loop<128, false>();
}
TEST(Sm90WgmmaKLoop, Bf16N64MnMajorB) {
  SKIP_UNLESS_SM90();
  run_k_loop<64, true>();
}
TEST(Sm90WgmmaKLoop, Bf16N128MnMajorB) {
  SKIP_UNLESS_SM90();
  run_k_loop<128, true>();
}

// =================================================================================================
// (4) setmaxnreg in a 2-warpgroup kernel: warpgroup 0 gives registers back and produces, warpgroup
//     1 takes more and consumes; the hand-over uses a named barrier (bar.arrive / bar.sync).
// =================================================================================================

struct RegisterSplitTraits {
  static constexpr uint32_t kWarpgroups = 2;
  static constexpr uint32_t kThreads = kWarpgroups * ptx::WarpgroupTraits::kThreads;
  static constexpr uint32_t kProducerRegisters = 40;
  static constexpr uint32_t kConsumerRegisters = 232;
  static constexpr uint32_t kHandoffBarrier = ptx::WarpgroupTraits::kFirstFreeBarrierId;
  static constexpr uint32_t kTerms = 32;  // live values per consumer thread
};

__global__ void __launch_bounds__(RegisterSplitTraits::kThreads, 1)
    register_split_kernel(const float* in, float* out) {
  using T = RegisterSplitTraits;
  constexpr uint32_t kWg = ptx::WarpgroupTraits::kThreads;
  __shared__ float handoff[kWg];
  const uint32_t t = ptx::thread_in_warpgroup();
  if (ptx::warpgroup_index() == 0) {
    ptx::setmaxnreg_dec<T::kProducerRegisters>();
    handoff[t] = in[t] * 2.0f;
    ptx::named_barrier_arrive(T::kHandoffBarrier, T::kThreads);  // producer does not wait
  } else {
    ptx::setmaxnreg_inc<T::kConsumerRegisters>();
    ptx::named_barrier_sync(T::kHandoffBarrier, T::kThreads);
    float terms[T::kTerms];
#pragma unroll
    for (uint32_t j = 0; j < T::kTerms; ++j) terms[j] = handoff[(t + j) % kWg] * float(j + 1);
    float sum = 0.0f;
#pragma unroll
    for (uint32_t j = 0; j < T::kTerms; ++j) sum += terms[j] * terms[T::kTerms - 1 - j];
    out[t] = sum;
  }
}

TEST(Sm90Warpgroup, SetmaxnregAndNamedBarrierHandoff) {
  SKIP_UNLESS_SM90();
  using T = RegisterSplitTraits;
  constexpr uint32_t kWg = ptx::WarpgroupTraits::kThreads;
  const std::vector<float> in = exact_values(kWg, 23);
  std::vector<float> expected(kWg);
  for (uint32_t t = 0; t < kWg; ++t) {
    float terms[T::kTerms];
    for (uint32_t j = 0; j < T::kTerms; ++j) terms[j] = in[(t + j) % kWg] * 2.0f * float(j + 1);
    float sum = 0.0f;
    for (uint32_t j = 0; j < T::kTerms; ++j) sum += terms[j] * terms[T::kTerms - 1 - j];
    expected[t] = sum;
  }
  DeviceBuffer<float> d_in(kWg), d_out(kWg);
  ASSERT_TRUE(d_in.get() && d_out.get());
  CUDA_ASSERT(cudaMemcpy(d_in.get(), in.data(), d_in.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_out.get(), 0xFF, d_out.bytes()));
  register_split_kernel<<<1, T::kThreads>>>(d_in.get(), d_out.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  std::vector<float> out(kWg);
  CUDA_ASSERT(cudaMemcpy(out.data(), d_out.get(), d_out.bytes(), cudaMemcpyDeviceToHost));
  for (uint32_t t = 0; t < kWg; ++t) EXPECT_EQ(out[t], expected[t]) << "thread " << t;
}

// Two roles meeting at barriers from different code, as the d256 backward's consumers do: role 0
// publishes `a` (barrier 1, arrive) and waits for `b` (barrier 2); role 1 waits for `a`, then
// publishes `b`. Role 0's lanes leave a data-dependent loop apart before they arrive.
__global__ void __launch_bounds__(2 * ptx::WarpgroupTraits::kThreads, 1)
    role_exchange_kernel(const float* in, float* out) {
  constexpr uint32_t kWg = ptx::WarpgroupTraits::kThreads;
  constexpr uint32_t kPublished = 1, kAnswered = 2;
  __shared__ float a[kWg], b[kWg];
  const uint32_t t = ptx::thread_in_warpgroup();
  if (ptx::warpgroup_index() == 0) {
    float x = in[t];
    for (uint32_t i = 0; i < t % 7; ++i) x += 1.0f;  // lanes diverge here
    a[t] = x - float(t % 7) + 1.0f;
    ptx::barrier_arrive_any(kPublished, 2 * kWg);
    ptx::barrier_sync_any(kAnswered, 2 * kWg);
    out[t] = b[(t + 5) % kWg];
  } else {
    ptx::barrier_sync_any(kPublished, 2 * kWg);
    b[t] = a[(t + 3) % kWg] * 2.0f;
    ptx::barrier_sync_any(kAnswered, 2 * kWg);
    out[kWg + t] = a[t];
  }
}

TEST(Sm90Warpgroup, BarrierAnyBetweenRoleBranches) {
  SKIP_UNLESS_SM90();
  constexpr uint32_t kWg = ptx::WarpgroupTraits::kThreads;
  const std::vector<float> in = exact_values(kWg, 29);
  DeviceBuffer<float> d_in(kWg), d_out(2 * kWg);
  ASSERT_TRUE(d_in.get() && d_out.get());
  CUDA_ASSERT(cudaMemcpy(d_in.get(), in.data(), d_in.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_out.get(), 0xFF, d_out.bytes()));
  role_exchange_kernel<<<1, 2 * kWg>>>(d_in.get(), d_out.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  std::vector<float> out(2 * kWg);
  CUDA_ASSERT(cudaMemcpy(out.data(), d_out.get(), d_out.bytes(), cudaMemcpyDeviceToHost));
  for (uint32_t t = 0; t < kWg; ++t) {
    EXPECT_EQ(out[t], (in[(t + 8) % kWg] + 1.0f) * 2.0f) << "role 0, thread " << t;
    EXPECT_EQ(out[kWg + t], in[t] + 1.0f) << "role 1, thread " << t;
  }
}

// ---- stmatrix: four 8x8 b16 matrices from fragments, each row at its own lane's address --------
struct StmatrixTraits {
  static constexpr uint32_t kRowBytes = 48;   // rows 48 bytes apart: the 16 stored bytes sit in the
  static constexpr uint32_t kRowOffset = 16;  // middle, so a wrong address shows up as a moved row
  static constexpr uint32_t kRows = 32;       // lane l supplies row l: matrix l / 8, row l % 8
};

/** The 16-bit code the test stores at (matrix, row, column): distinct for every element. */
__host__ __device__ inline uint16_t stmatrix_code(uint32_t matrix, uint32_t row, uint32_t col) {
  return static_cast<uint16_t>(0x100 + matrix * 64 + row * 8 + col);
}

__global__ void stmatrix_kernel(uint16_t* out) {
  using T = StmatrixTraits;
  __shared__ alignas(16) uint16_t rows[T::kRows * T::kRowBytes / 2];
  const uint32_t lane = threadIdx.x;
  for (uint32_t i = lane; i < T::kRows * T::kRowBytes / 2; i += 32) rows[i] = TestTraits::kSentinel;
  __syncwarp();
  uint32_t r[4];
  for (uint32_t m = 0; m < 4; ++m) {
    const uint32_t row = lane / 4, col = 2 * (lane % 4);
    r[m] = uint32_t(stmatrix_code(m, row, col)) | uint32_t(stmatrix_code(m, row, col + 1)) << 16;
  }
  ptx::stmatrix_x4(ptx::smem_addr(rows) + lane * T::kRowBytes + T::kRowOffset, r);
  __syncwarp();
  for (uint32_t i = lane; i < T::kRows * T::kRowBytes / 2; i += 32) out[i] = rows[i];
}

TEST(Sm90Stmatrix, FragmentsLandInTheirLanesRows) {
  SKIP_UNLESS_SM90();
  using T = StmatrixTraits;
  constexpr uint32_t kElems = T::kRows * T::kRowBytes / 2;
  DeviceBuffer<uint16_t> d_out(kElems);
  ASSERT_TRUE(d_out.get());
  CUDA_ASSERT(cudaMemset(d_out.get(), 0, d_out.bytes()));
  stmatrix_kernel<<<1, 32>>>(d_out.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  std::vector<uint16_t> out(kElems);
  CUDA_ASSERT(cudaMemcpy(out.data(), d_out.get(), d_out.bytes(), cudaMemcpyDeviceToHost));
  for (uint32_t l = 0; l < T::kRows; ++l) {
    for (uint32_t b = 0; b < T::kRowBytes; b += 2) {
      const uint16_t got = out[(l * T::kRowBytes + b) / 2];
      const bool stored = b >= T::kRowOffset && b < T::kRowOffset + 16;
      const uint16_t want = stored ? stmatrix_code(l / 8, l % 8, (b - T::kRowOffset) / 2) : TestTraits::kSentinel;
      EXPECT_EQ(got, want) << "row " << l << ", byte " << b;
    }
  }
}

// ---- log2_positive: the forward epilogue's lse, against log2 in double -------------------------
__global__ void log2_positive_kernel(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = flashcore::cuda::sm80::log2_positive(x[i]);
}

TEST(Sm90Epilogue, Log2PositiveWithin2PowMinus22) {
  SKIP_UNLESS_SM90();
  // Row sums: from 1 (one key) to far past any softmax sum, powers of two and their neighbours
  // (where the exponent split changes), and random values in between.
  std::vector<float> x;
  for (int e = -4; e <= 40; ++e) {
    const float p = std::ldexp(1.0f, e);
    x.insert(x.end(), {p, std::nextafter(p, 0.0f), std::nextafter(p, 2 * p), 1.5f * p});
  }
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(0, 40);
  for (int i = 0; i < 4096; ++i) x.push_back(std::ldexp(mantissa(rng), exponent(rng)));
  const int n = static_cast<int>(x.size());
  DeviceBuffer<float> d_x(n), d_y(n);
  ASSERT_TRUE(d_x.get() && d_y.get());
  CUDA_ASSERT(cudaMemcpy(d_x.get(), x.data(), d_x.bytes(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemset(d_y.get(), 0xFF, d_y.bytes()));  // NaN: an unwritten result fails
  log2_positive_kernel<<<(n + 255) / 256, 256>>>(d_x.get(), d_y.get(), n);
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  std::vector<float> y(n);
  CUDA_ASSERT(cudaMemcpy(y.data(), d_y.get(), d_y.bytes(), cudaMemcpyDeviceToHost));
  // lg2.approx's absolute error on [1, 2) is at most 2^-22; adding the exponent rounds once more
  // (half an ulp of a result below 41: 2^-19 at most, 2^-24 below 2).
  for (int i = 0; i < n; ++i) {
    const double want = std::log2(static_cast<double>(x[i]));
    const double ulp_half = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want), 1.0)) - 24);
    EXPECT_LE(std::fabs(static_cast<double>(y[i]) - want), std::ldexp(1.0, -22) + ulp_half)
        << "x = " << x[i];
  }
}

}  // namespace

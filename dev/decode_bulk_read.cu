// Does a bulk-copy ring (cp.async.bulk, the TMA unit's 1-D copies completing on an mbarrier) let
// one decode CTA read faster than the cp.async ring the attention kernel streams through?
//
// The question behind it (docs/PERF.md sessions 33 and 37): one 4-warp CTA per SM reads ~3.05
// TB/s on 128 SMs whatever its ring's depth, an 8-warp CTA ~4.2, and SDPA cuDNN reads 4.4-4.5 TB/s
// on the H200 where our attention reads 4.2-4.3. A per-warp limit that deeper rings do not lift
// points at the load path (each 16-byte cp.async is a load-store-unit request), which bulk copies
// bypass: a tile of 16 keys is 32 row copies of 256 B, one per lane.
//
// Only the K/V read of the decode benchmark's layout (GQA 32 / 8 heads, d = 128, bf16, contiguous
// cache: a key row of one KV head is 256 B at a 2 KB stride), no math: CTA = (split, KV head,
// sequence), warp w streams tiles w, w + W, ... of its key range through its own ring of S stages.
//   cpasync  16-byte cp.async.cg, lane copies keys lane/8 + 4i, chunks lane%8 + 8j (the kernel's).
//   bulk     lane l copies K row l (l < 16) or V row l - 16 with one cp.async.bulk of 256 B; lane 0
//            arms the stage's mbarrier with the tile's 8 KB first.
// Prints K+V TB/s per (cell, reader, warps, stages, CTAs) and a sum-read ceiling.
//
// Build and run (on the GPU machine):
//   nvcc -std=c++17 -O3 -arch=sm_90a -I include -I src -I dev dev/decode_bulk_read.cu -o /tmp/dbr && /tmp/dbr
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/ptx/mbarrier.cuh"
#include "cuda_tool.hpp"
#include "read_probe.cuh"

namespace {

constexpr int kHeads = 8, kRowBytes = 256, kTokenBytes = kHeads * kRowBytes;
constexpr int kTileKeys = 16, kHeadTileBytes = kTileKeys * kRowBytes, kStageBytes = 2 * kHeadTileBytes;

__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(saddr(bar))
               : "memory");
}

struct Problem {
  const char* k;   // (batch, seqlen, heads, 128) bf16
  const char* v;
  int seqlen;      // keys per sequence (a multiple of 16)
  int splits;
  unsigned* sink;  // keeps the reads observable
};

__device__ __forceinline__ void tile_range(const Problem& p, int& t0, int& t1) {
  const int tiles = p.seqlen / kTileKeys, per = (tiles + p.splits - 1) / p.splits;
  t0 = min(tiles, int(blockIdx.x) * per);
  t1 = min(tiles, t0 + per);
}
__device__ __forceinline__ const char* head_rows(const char* base, const Problem& p, int tile) {
  return base + (int64_t(blockIdx.z) * p.seqlen + int64_t(tile) * kTileKeys) * kTokenBytes + blockIdx.y * kRowBytes;
}

/** A warp's share of its CTA's tiles (first, first + kWarps, ...: n of them) and its ring of
 *  kStages stages in shared memory. */
struct WarpStream {
  int first, n;
  unsigned char* ring_ptr;
  uint32_t ring;
};
template <int kWarps, int kStages>
__device__ __forceinline__ WarpStream warp_stream(const Problem& p, unsigned char* smem, int warp) {
  int t0, t1;
  tile_range(p, t0, t1);
  WarpStream w;
  w.first = t0 + warp;
  w.n = w.first < t1 ? (t1 - w.first + kWarps - 1) / kWarps : 0;
  w.ring_ptr = smem + warp * kStages * kStageBytes;
  w.ring = saddr(w.ring_ptr);
  return w;
}

template <int kWarps, int kStages>
__global__ void __launch_bounds__(kWarps * 32) cpasync_reader(Problem p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const WarpStream ws = warp_stream<kWarps, kStages>(p, smem, warp);
  const int first = ws.first, n = ws.n;
  unsigned char* const ring_ptr = ws.ring_ptr;
  const uint32_t ring = ws.ring;
  auto copy = [&](int local) {
    const char* kp = head_rows(p.k, p, first + local * kWarps);
    const char* vp = head_rows(p.v, p, first + local * kWarps);
    const uint32_t stage = ring + (local % kStages) * kStageBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int key = (lane >> 3) + 4 * i, ch = (lane & 7) + 8 * j;
        cp_async16(stage + key * kRowBytes + ch * 16, kp + key * kTokenBytes + ch * 16);
        cp_async16(stage + kHeadTileBytes + key * kRowBytes + ch * 16, vp + key * kTokenBytes + ch * 16);
      }
  };
  unsigned acc = 0;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) copy(s);
    commit();
  }
  for (int t = 0; t < n; ++t) {
    wait_group<kStages - 2>();
    __syncwarp();
    if (t + kStages - 1 < n) copy(t + kStages - 1);
    commit();
    acc += reinterpret_cast<const unsigned*>(ring_ptr + (t % kStages) * kStageBytes)[lane];
  }
  wait_group<0>();
  if (acc == 0x12345678u) *p.sink = acc;
}

template <int kWarps, int kStages>
__global__ void __launch_bounds__(kWarps * 32) bulk_reader(Problem p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kWarps][kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const WarpStream ws = warp_stream<kWarps, kStages>(p, smem, warp);
  const int first = ws.first, n = ws.n;
  unsigned char* const ring_ptr = ws.ring_ptr;
  const uint32_t ring = ws.ring;
  if (lane < kStages) flashcore::ptx::mbarrier_init(&bars[warp][lane], 1);
  flashcore::ptx::fence_mbarrier_init();
  __syncwarp();
  auto copy = [&](int local) {
    const int s = local % kStages;
    uint64_t* bar = &bars[warp][s];
    if (lane == 0) flashcore::ptx::mbarrier_arrive_expect_tx(bar, kStageBytes);
    __syncwarp();
    const char* base = head_rows(lane < kTileKeys ? p.k : p.v, p, first + local * kWarps);
    bulk_copy(ring + s * kStageBytes + lane * kRowBytes, base + (lane % kTileKeys) * kTokenBytes, kRowBytes, bar);
  };
  unsigned acc = 0;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < n) copy(s);
  for (int t = 0; t < n; ++t) {
    if (t + kStages - 1 < n) copy(t + kStages - 1);  // its stage was read at t - 1 (synced below)
    flashcore::ptx::mbarrier_wait_parity(&bars[warp][t % kStages], (t / kStages) & 1);
    acc += reinterpret_cast<const unsigned*>(ring_ptr + (t % kStages) * kStageBytes)[lane];
    __syncwarp();
  }
  if (acc == 0x12345678u) *p.sink = acc;
}


struct Reader {
  const char* name;
  int warps, stages;
  void (*kernel)(Problem);
};

template <int W, int S>
Reader cpasync() { return {"cpasync", W, S, cpasync_reader<W, S>}; }
template <int W, int S>
Reader bulk() { return {"bulk", W, S, bulk_reader<W, S>}; }

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t tokens = 131072;  // 16 x 8192, 64 x 2048, 2 x 65536
  const int64_t bytes_each = tokens * kTokenBytes;
  char *k = nullptr, *v = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&k, bytes_each));
  CHECK(cudaMalloc(&v, bytes_each));
  CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  CHECK(cudaMemset(k, 1, bytes_each));
  CHECK(cudaMemset(v, 2, bytes_each));
  std::printf("sum-read ceiling (%.0f MB): %.3f TB/s\n", 2e-6 * bytes_each,
              tbps([&] {
                sum_read<<<sms * 8, 256>>>(reinterpret_cast<uint4*>(k), reinterpret_cast<uint4*>(v), bytes_each / 16, sink);
              }, 2.0 * bytes_each));

  const Reader readers[] = {cpasync<4, 3>(), cpasync<4, 6>(), cpasync<8, 3>(), bulk<4, 2>(), bulk<4, 3>(),
                            bulk<4, 6>(),    bulk<8, 2>(),    bulk<8, 3>(),    bulk<2, 6>(), bulk<1, 8>()};
  for (const Reader& r : readers)
    CHECK(cudaFuncSetAttribute(r.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, r.warps * r.stages * kStageBytes));

  struct Cell { int batch, seqlen; };
  const Cell cells[] = {{1, 65536}, {16, 8192}, {64, 2048}};
  for (const Cell& c : cells) {
    const double bytes = 2.0 * c.batch * c.seqlen * kTokenBytes;
    for (const Reader& r : readers) {
      const int smem = r.warps * r.stages * kStageBytes;
      int per_sm = 0;
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, r.kernel, r.warps * 32, smem));
      // Split counts that give about one and about two CTAs per SM (at least one split).
      for (int want : {sms, 2 * sms}) {
        Problem p{k, v, c.seqlen, std::max(1, want / (kHeads * c.batch)), sink};
        const dim3 grid(p.splits, kHeads, c.batch);
        const int ctas = p.splits * kHeads * c.batch;
        if (want == 2 * sms && p.splits == std::max(1, sms / (kHeads * c.batch))) continue;  // same as the first
        const double rate = tbps([&] { r.kernel<<<grid, r.warps * 32, smem>>>(p); }, bytes);
        std::printf("%2d x %5d  %-8s warps %d stages %d  %3d KB/CTA  %d/SM  CTAs %4d  %.3f TB/s\n", c.batch, c.seqlen,
                    r.name, r.warps, r.stages, smem / 1024, per_sm, ctas, rate);
      }
    }
  }
  return 0;
}

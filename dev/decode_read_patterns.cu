// Which way of reading a KV cache reaches the H100's read bandwidth? Decode attention is a read of
// K and V, so this tool times only that read, in the decode benchmark's layout (GQA 32 / 8 heads,
// d = 128, bf16: a key row of one KV head is 256 B, a token of all 8 heads 2 KB, a page of 16
// tokens 32 KB), without the math: cp.async rings in shared memory, as the attention kernel uses.
//
// Readers (each CTA takes a range of tiles of 16 keys in one sequence):
//   per_head   CTA = (split, KV head, sequence), 4 warps, warp w reads tiles w, w + 4, ... of its
//              head: 16 rows of 256 B at a 2 KB stride per tile (the shipped attention kernel).
//   all_heads  CTA = (split, sequence), 8 warps, warp w reads head w of every tile: the CTA reads
//              whole 32 KB pages, its 8 warps each taking one head's rows.
//   page_rows  CTA = (split, sequence), 8 warps sharing one ring of whole tiles (64 KB of K + V),
//              warp w copying the contiguous bytes [4w, 4w + 4) KB of the tile's K and V pages.
// Page orders: ordered (the contiguous cache's addresses), random (a permutation of all pages, as
// bench/decode_bench.py), local (random within each 2 MB block of 64 pages: the same DRAM and
// TLB footprint per tile as random, but a 2 MB region is finished before the next is entered).
//
// Build and run (on the GPU machine): nvcc -std=c++17 -O3 -arch=sm_90a -I include -I src -I dev
//   dev/decode_read_patterns.cu -o /tmp/drp && /tmp/drp
// Prints K+V bytes / time in TB/s per (cell, order, reader, splits) and the sum-read ceiling.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_tool.hpp"
#include "read_probe.cuh"

namespace {

constexpr int kHeads = 8, kRowBytes = 256, kTokenBytes = kHeads * kRowBytes, kPageTokens = 16;
constexpr int kPageBytes = kPageTokens * kTokenBytes;  // 32 KB
constexpr int kTileKeys = 16;                          // a tile is one page
constexpr int kHeadTileBytes = kTileKeys * kRowBytes;  // one head's K rows of a tile: 4 KB


struct Problem {
  const char* k;           // pool of pages, kPageBytes each
  const char* v;
  const int32_t* table;    // [batch][pages_per_seq]
  int pages_per_seq;       // tiles per sequence
  int splits;
  unsigned* sink;          // keeps the reads observable
};

__device__ __forceinline__ void split_range(const Problem& p, int split, int& t0, int& t1) {
  const int per = (p.pages_per_seq + p.splits - 1) / p.splits;
  t0 = min(p.pages_per_seq, split * per);
  t1 = min(p.pages_per_seq, t0 + per);
}

// One head's K and V rows of tile `tile` into `stage` (8 KB): lane copies keys lane/8 + 4i,
// 16-byte chunks lane%8 + 8j, as the attention kernel.
__device__ __forceinline__ void copy_head_tile(const Problem& p, int b, int tile, int head, uint32_t stage, int lane) {
  const int64_t page = p.table[int64_t(b) * p.pages_per_seq + tile];
  const char* kp = p.k + page * kPageBytes + head * kRowBytes;
  const char* vp = p.v + page * kPageBytes + head * kRowBytes;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int key = (lane >> 3) + 4 * i, ch = (lane & 7) + 8 * j;
      const uint32_t dst = stage + key * kRowBytes + ch * 16;
      cp_async16(dst, kp + key * kTokenBytes + ch * 16);
      cp_async16(dst + kHeadTileBytes, vp + key * kTokenBytes + ch * 16);
    }
}

// A warp's stream over tiles first, first + step, ... < end with a kStages ring at `ring`.
template <int kStages>
__device__ __forceinline__ unsigned stream_head(const Problem& p, int b, int first, int end, int step, int head,
                                                uint32_t ring, const unsigned char* ring_ptr, int lane) {
  constexpr int kStage = 2 * kHeadTileBytes;
  const int n = first < end ? (end - first + step - 1) / step : 0;
  unsigned acc = 0;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) copy_head_tile(p, b, first + s * step, head, ring + s * kStage, lane);
    commit();
  }
  for (int t = 0; t < n; ++t) {
    wait_group<kStages - 2>();
    __syncwarp();
    if (t + kStages - 1 < n)
      copy_head_tile(p, b, first + (t + kStages - 1) * step, head, ring + ((t + kStages - 1) % kStages) * kStage, lane);
    commit();
    acc += reinterpret_cast<const unsigned*>(ring_ptr + (t % kStages) * kStage)[lane];
  }
  wait_group<0>();
  return acc;
}

// kAllHeads = false: per_head (4 warps, warp w: tiles w, w + 4, ... of head blockIdx.y);
// true: all_heads (8 warps, warp w: every tile of head w).
template <int kStages, bool kAllHeads>
__global__ void __launch_bounds__(kAllHeads ? 256 : 128) head_rows(Problem p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int t0, t1;
  split_range(p, blockIdx.x, t0, t1);
  const int off = warp * kStages * 2 * kHeadTileBytes;
  const unsigned acc = stream_head<kStages>(p, blockIdx.z, kAllHeads ? t0 : t0 + warp, t1, kAllHeads ? 1 : 4,
                                            kAllHeads ? warp : static_cast<int>(blockIdx.y),
                                            static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + off, smem + off, lane);
  if (acc == 0x12345678u) *p.sink = acc;
}
template <int kStages>
constexpr auto per_head = head_rows<kStages, false>;
template <int kStages>
constexpr auto all_heads = head_rows<kStages, true>;

// Whole tiles through one CTA-wide ring; warp w copies bytes [4w, 4w + 4) KB of each page.
template <int kStages>
__global__ void __launch_bounds__(256) page_rows(Problem p) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kStage = 2 * kPageBytes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.z;
  int t0, t1;
  split_range(p, blockIdx.x, t0, t1);
  const int n = t1 - t0;
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  auto copy = [&](int tile, uint32_t stage) {
    const int64_t page = p.table[int64_t(b) * p.pages_per_seq + tile];
    const char* kp = p.k + page * kPageBytes + warp * 4096;
    const char* vp = p.v + page * kPageBytes + warp * 4096;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int byte = i * 512 + lane * 16;
      cp_async16(stage + warp * 4096 + byte, kp + byte);
      cp_async16(stage + kPageBytes + warp * 4096 + byte, vp + byte);
    }
  };
  unsigned acc = 0;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) copy(t0 + s, ring + s * kStage);
    commit();
  }
  for (int t = 0; t < n; ++t) {
    wait_group<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < n) copy(t0 + t + kStages - 1, ring + ((t + kStages - 1) % kStages) * kStage);
    commit();
    acc += reinterpret_cast<const unsigned*>(smem + (t % kStages) * kStage)[threadIdx.x];
  }
  wait_group<0>();
  if (acc == 0x12345678u) *p.sink = acc;
}


}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t max_pages = 131072 / kPageTokens;  // 16 x 8192 and 64 x 2048 tokens
  char *k = nullptr, *v = nullptr;
  int32_t* table = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&k, max_pages * kPageBytes));
  CHECK(cudaMalloc(&v, max_pages * kPageBytes));
  CHECK(cudaMalloc(&table, max_pages * sizeof(int32_t)));
  CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  CHECK(cudaMemset(k, 1, max_pages * kPageBytes));
  CHECK(cudaMemset(v, 2, max_pages * kPageBytes));
  {
    const int64_t n = max_pages * kPageBytes / 16;
    const double bytes = 2.0 * max_pages * kPageBytes;
    std::printf("sum-read ceiling (%.0f MB): %.3f TB/s\n", bytes / 1e6,
                tbps([&] { sum_read<<<sms * 8, 256>>>(reinterpret_cast<uint4*>(k), reinterpret_cast<uint4*>(v), n, sink); },
                     bytes));
  }
  auto set_attr = [](auto kernel, int bytes) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  };
  set_attr(per_head<3>, 4 * 3 * 2 * kHeadTileBytes);
  set_attr(per_head<4>, 4 * 4 * 2 * kHeadTileBytes);
  set_attr(all_heads<2>, 8 * 2 * 2 * kHeadTileBytes);
  set_attr(all_heads<3>, 8 * 3 * 2 * kHeadTileBytes);
  set_attr(page_rows<2>, 2 * 2 * kPageBytes);
  set_attr(page_rows<3>, 3 * 2 * kPageBytes);

  struct Cell { int batch, kv_len, head_splits; };
  const Cell cells[] = {{1, 65536, 16}, {16, 8192, 1}, {64, 2048, 1}};
  const char* orders[] = {"ordered", "random", "local"};
  std::mt19937 rng(7);
  for (const Cell& c : cells) {
    const int pages_per_seq = c.kv_len / kPageTokens, pages = c.batch * pages_per_seq;
    const double bytes = 2.0 * pages * kPageBytes;
    for (int order = 0; order < 3; ++order) {
      std::vector<int32_t> perm(pages);
      std::iota(perm.begin(), perm.end(), 0);
      if (order == 1) std::shuffle(perm.begin(), perm.end(), rng);
      if (order == 2)
        for (int s = 0; s < pages; s += 64) std::shuffle(perm.begin() + s, perm.begin() + std::min(pages, s + 64), rng);
      CHECK(cudaMemcpy(table, perm.data(), pages * sizeof(int32_t), cudaMemcpyHostToDevice));
      Problem p{k, v, table, pages_per_seq, 1, sink};
      auto report = [&](const char* reader, int ctas, double r) {
        std::printf("%2d x %5d  %-7s  %-12s CTAs %4d  %.3f TB/s\n", c.batch, c.kv_len, orders[order], reader, ctas, r);
      };
      for (int stages : {3, 4}) {
        p.splits = c.head_splits;
        const dim3 grid(p.splits, kHeads, c.batch);
        const int smem = 4 * stages * 2 * kHeadTileBytes;
        const double r = tbps([&] {
          if (stages == 3) per_head<3><<<grid, 128, smem>>>(p);
          else per_head<4><<<grid, 128, smem>>>(p);
        }, bytes);
        report(stages == 3 ? "per_head/3" : "per_head/4", p.splits * kHeads * c.batch, r);
      }
      // CTA counts near one or two per SM.
      for (int ctas : {sms - sms % 4, 2 * (sms - sms % 4)}) {
        p.splits = std::max(1, ctas / c.batch);
        const dim3 grid(p.splits, 1, c.batch);
        for (int stages : {2, 3}) {
          const int smem = 8 * stages * 2 * kHeadTileBytes;
          const double r = tbps([&] {
            if (stages == 2) all_heads<2><<<grid, 256, smem>>>(p);
            else all_heads<3><<<grid, 256, smem>>>(p);
          }, bytes);
          report(stages == 2 ? "all_heads/2" : "all_heads/3", p.splits * c.batch, r);
          const int smem2 = stages * 2 * kPageBytes;
          const double r2 = tbps([&] {
            if (stages == 2) page_rows<2><<<grid, 256, smem2>>>(p);
            else page_rows<3><<<grid, 256, smem2>>>(p);
          }, bytes);
          report(stages == 2 ? "page_rows/2" : "page_rows/3", p.splits * c.batch, r2);
        }
      }
    }
  }
  return 0;
}

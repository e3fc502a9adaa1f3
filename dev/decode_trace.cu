// Where a decode call's time goes: runs the decode benchmark's cells (GQA 32 / 8 heads, d = 128,
// bf16, one query token; 1 x 65536, 16 x 8192, 64 x 2048; contiguous and paged 16 with the pages in
// random order) through cuda::kvcache_forward built with FLASHCORE_DECODE_TRACE
// (src/cuda/decode/decode_trace.cuh), many calls back to back as programmatic dependents, and
// prints for the last call the phases of the attention kernel's CTAs on the global timer: when they
// entered and got past the wait, how long the prologue took, the loop, the epilogue, and how far
// apart they ended, next to the time per call (CUDA events over the calls) and its K+V rate.
//
// build (on the GPU machine, from the repository root; ~20 s):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -DFLASHCORE_DECODE_TRACE -DFLASHCORE_HDIM_128 -DFLASHCORE_DTYPE_BF16 -I include -I src -I dev \
//     dev/decode_trace.cu src/cuda/device.cu -o build/decode_trace
// run:   build/decode_trace            (HEADS_KV=2 CELLS=1x65536,4x16384 build/decode_trace: other shapes,
//                                       GQA 32 / HEADS_KV)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "api/kvcache_backends.hpp"
// Included, not linked: without relocatable device code each translation unit has its own
// g_decode_trace, and the one the kernels write must be the one this tool sets.
#include "cuda/decode/decode_api.cu"
#include "cuda_tool.hpp"

#ifndef FLASHCORE_DECODE_TRACE
#error "build with -DFLASHCORE_DECODE_TRACE (see the top of this file)"
#endif

namespace fc = flashcore;
namespace dec = flashcore::cuda::decode;

// The traced cells have one query token, so the forward-kernel route (prefill_route.cu and the
// forward kernels behind it) never applies: it is left out of this build, its entry points
// declining every call.
namespace flashcore::cuda::decode {
bool prefill_route_applies(const KvCacheParams&) { return false; }
bool decode_kernel_suits(const KvCacheParams&) { return true; }
bool prefill_route_on_hopper(const KvCacheParams&) { return false; }
size_t prefill_route_workspace(const KvCacheParams&) { return 0; }
Status run_prefill_route(const KvCacheParams&, bool, void*) {
  return Status::internal("decode_trace: the forward-kernel route is not built into this tool");
}
}  // namespace flashcore::cuda::decode

namespace {

constexpr int64_t kHeadsQ = 32, kDim = 128;

struct Stat {
  std::vector<double> v;
  void add(double x) { v.push_back(x); }
  double q(double f) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[std::min(v.size() - 1, size_t(f * (v.size() - 1) + 0.5))];
  }
};

}  // namespace

/** HEADS_KV from the environment (default 8: the benchmark's GQA 32 / 8), for shapes beside the
 *  target's; main reads CELLS ("BxL,BxL,...", default the benchmark's three cells). */
int64_t heads_kv_from_env() {
  const char* v = std::getenv("HEADS_KV");
  const int64_t h = v ? std::atoll(v) : 8;
  if (h < 1 || h > 32 || 32 % h != 0) {
    std::fprintf(stderr, "HEADS_KV: a divisor of 32 (the query heads), got %s\n", v);
    std::exit(1);
  }
  return h;
}

int main() {
  const int64_t kHeadsKv = heads_kv_from_env();
  const int64_t max_tokens = 131072 * 8 / kHeadsKv;
  struct Cell { int64_t batch, kv_len; };
  std::vector<Cell> cells = {{1, 65536}, {16, 8192}, {64, 2048}};
  if (const char* spec = std::getenv("CELLS")) {
    cells.clear();
    long long b = 0, l = 0;
    for (const char* at = spec;; ++at) {
      if (std::sscanf(at, "%lldx%lld", &b, &l) != 2) {
        std::fprintf(stderr, "CELLS: expected BATCHxKEYS[,BATCHxKEYS...], got %s\n", spec);
        return 1;
      }
      // Whole 16-key pages: the paged run's tables cover the length exactly.
      if (b < 1 || b > 64 || l < 16 || l % 16 != 0 || b * l > max_tokens) {
        std::fprintf(stderr, "CELLS: %lldx%lld: 1-64 sequences of a multiple of 16 keys, %lld keys in all at most\n", b, l,
                     (long long)max_tokens);
        return 1;
      }
      cells.push_back({b, l});
      at = std::strchr(at, ',');
      if (at == nullptr) break;
    }
  }
  __nv_bfloat16 *k, *v, *q, *out;
  const size_t cache_bytes = max_tokens * kHeadsKv * kDim * 2;
  CHECK(cudaMalloc(&k, cache_bytes));
  CHECK(cudaMalloc(&v, cache_bytes));
  CHECK(cudaMalloc(&q, 64 * kHeadsQ * kDim * 2));
  CHECK(cudaMalloc(&out, 64 * kHeadsQ * kDim * 2));
  {
    const auto host = uniform_values<__nv_bfloat16>(max_tokens * kHeadsKv * kDim, [](float x) { return __float2bfloat16(x); });
    CHECK(cudaMemcpy(k, host.data(), cache_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(v, host.data(), cache_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(q, host.data(), 64 * kHeadsQ * kDim * 2, cudaMemcpyHostToDevice));
  }
  int32_t *seqlens, *table;
  CHECK(cudaMalloc(&seqlens, 64 * sizeof(int32_t)));
  CHECK(cudaMalloc(&table, max_tokens / 16 * sizeof(int32_t)));
  void* workspace = nullptr;
  CHECK(cudaMalloc(&workspace, 64 << 20));
  const int64_t trace_slots = 1 << 20;
  uint64_t* trace;
  CHECK(cudaMalloc(&trace, trace_slots * sizeof(uint64_t)));
  CHECK(cudaMemcpyToSymbol(dec::g_decode_trace, &trace, sizeof(trace)));
  std::mt19937 rng(11);

  // One query token: the GQA group's rows, in chunks of the attention CTA's rows.
  const int64_t row_chunks = (kHeadsQ / kHeadsKv + dec::DecodeTraits::kRows - 1) / dec::DecodeTraits::kRows;
  for (const Cell c : cells) {
    for (const int page : {0, 16}) {
      fc::KvCacheParams p;
      p.dtype = fc::DType::BF16;
      p.device_type = 1;
      p.q = {q, kHeadsQ * kDim, kHeadsQ * kDim, kDim};
      p.out = {out, kHeadsQ * kDim, kHeadsQ * kDim, kDim};
      p.batch = c.batch;
      p.seqlen_q = 1;
      p.heads_q = kHeadsQ;
      p.heads_kv = kHeadsKv;
      p.head_dim = kDim;
      p.softmax_scale = 1.f / std::sqrt(float(kDim));
      const std::vector<int32_t> lens(c.batch, static_cast<int32_t>(c.kv_len));
      CHECK(cudaMemcpy(seqlens, lens.data(), c.batch * sizeof(int32_t), cudaMemcpyHostToDevice));
      p.cache_seqlens = seqlens;
      if (page == 0) {
        p.k_cache = {k, c.kv_len * kHeadsKv * kDim, kHeadsKv * kDim, kDim};
        p.cache_rows = c.batch;
        p.page_size = c.kv_len;
      } else {
        const int64_t per_seq = c.kv_len / page, pages = c.batch * per_seq;
        std::vector<int32_t> perm(pages);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        CHECK(cudaMemcpy(table, perm.data(), pages * sizeof(int32_t), cudaMemcpyHostToDevice));
        p.k_cache = {k, page * kHeadsKv * kDim, kHeadsKv * kDim, kDim};
        p.paged = true;
        p.cache_rows = pages;
        p.page_size = page;
        p.pages_per_seq = per_seq;
        p.block_table = table;
        p.block_table_batch_stride = per_seq;
      }
      p.v_cache = p.k_cache;
      p.v_cache.data = v;
      const fc::cuda::AttentionPlan plan = fc::cuda::plan_attention(p);  // decode_api.cu's choices
      const int splits = plan.splits, warps = plan.tile.warps;
      const int64_t ctas = int64_t(splits) * kHeadsKv * row_chunks * c.batch;
      if (ctas * warps * dec::kDecodePhases > trace_slots || fc::cuda::kvcache_workspace(p) > (64u << 20)) {
        std::fprintf(stderr, "trace or workspace too small\n");
        return 1;
      }
      auto run = [&] { require_ok(fc::cuda::kvcache_forward(p, workspace, 64 << 20)); };
      for (int i = 0; i < 5; ++i) run();
      constexpr int kCalls = 50;
      const double call_us = ms_per_call(run, kCalls) * 1e3;
      const double bytes = 2.0 * c.batch * c.kv_len * kHeadsKv * kDim * 2;
      // The call's pieces timed alone, back to back (the trace below is of the full calls'):
      // the attention kernel without the merge, the merge alone, and the full call with ordinary
      // launches instead of programmatic dependents.
      const dec::SplitOutput so = fc::cuda::split_output(p, plan, workspace, true);
      auto attention = [&](bool programmatic) {
        require_ok(fc::cuda::launch_planned_attention<__nv_bfloat16, kDim>(p, plan, so, nullptr, programmatic));
      };
      const double attention_us = ms_per_call([&] { attention(true); }, kCalls) * 1e3;
      double merge_us = 0, ordinary_us = call_us;
      if (splits > 1) {
        const fc::MergeParams m = fc::cuda::merge_params(p, so);
        merge_us = ms_per_call([&] { require_ok(fc::cuda::launch_merge<__nv_bfloat16>(m, true)); }, kCalls) * 1e3;
        const dec::SplitOutput plain = fc::cuda::split_output(p, plan, workspace, false);
        ordinary_us = ms_per_call([&] {
          require_ok(fc::cuda::launch_planned_attention<__nv_bfloat16, kDim>(p, plan, plain, nullptr, false));
          require_ok(fc::cuda::launch_merge<__nv_bfloat16>(fc::cuda::merge_params(p, plain), false));
        }, kCalls) * 1e3;
      }
      run();  // the traced call: the last one before the trace is read

      std::vector<uint64_t> t(ctas * warps * dec::kDecodePhases);
      CHECK(cudaMemcpy(t.data(), trace, t.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
      auto at = [&](int64_t cta, int w, int ph) { return double(t[(cta * warps + w) * dec::kDecodePhases + ph]); };
      double t0 = 1e300, t_end = 0;
      for (int64_t i = 0; i < ctas; ++i) {
        t0 = std::min(t0, at(i, 0, dec::kDecodeEntry));
        t_end = std::max(t_end, at(i, 0, dec::kDecodeEnd));
      }
      Stat entry, waited, seqlen, range, lookup0, issued0, prologue, qready, landed, loop, epilogue, end, warp_loop_spread;
      for (int64_t i = 0; i < ctas; ++i) {
        const double w0 = at(i, 0, dec::kDecodeWaited);
        entry.add((at(i, 0, dec::kDecodeEntry) - t0) / 1e3);
        waited.add((w0 - t0) / 1e3);
        seqlen.add((at(i, 0, dec::kDecodeSeqlenReady) - w0) / 1e3);
        range.add((at(i, 0, dec::kDecodeRangeReady) - w0) / 1e3);
        lookup0.add((at(i, 0, dec::kDecodeLookup0) - w0) / 1e3);
        issued0.add((at(i, 0, dec::kDecodeIssued0) - w0) / 1e3);
        prologue.add((at(i, 0, dec::kDecodeFirstIssued) - w0) / 1e3);
        qready.add((at(i, 0, dec::kDecodeQReady) - w0) / 1e3);
        landed.add((at(i, 0, dec::kDecodeTile0Landed) - w0) / 1e3);
        double lo = 1e300, hi = 0;
        for (int w = 0; w < warps; ++w) {
          lo = std::min(lo, at(i, w, dec::kDecodeLoopDone));
          hi = std::max(hi, at(i, w, dec::kDecodeLoopDone));
        }
        loop.add((hi - w0) / 1e3);
        warp_loop_spread.add((hi - lo) / 1e3);
        epilogue.add((at(i, 0, dec::kDecodeEnd) - hi) / 1e3);
        end.add((at(i, 0, dec::kDecodeEnd) - t0) / 1e3);
      }
      std::printf("\n%lld x %lld %s: splits %d, %lld CTAs of %d warps; %.2f us per call = %.3f TB/s; attention span %.2f us "
                  "(%.3f TB/s)\n",
                  (long long)c.batch, (long long)c.kv_len, page ? "paged 16" : "contiguous", splits, (long long)ctas, warps,
                  call_us, bytes / (call_us * 1e-6) / 1e12, (t_end - t0) / 1e3, bytes / ((t_end - t0) * 1e-9) / 1e12);
      std::printf("  pieces alone, us per call: attention %.2f (%.3f TB/s), merge %.2f; the call with ordinary launches %.2f\n",
                  attention_us, bytes / (attention_us * 1e-6) / 1e12, merge_us, ordinary_us);
      std::printf("  us (min / median / p90 / max over CTAs)\n");
      auto row = [](const char* name, Stat& s) {
        std::printf("  %-34s %8.2f %8.2f %8.2f %8.2f\n", name, s.q(0), s.q(0.5), s.q(0.9), s.q(1));
      };
      row("entry since first entry", entry);
      row("past the wait since first entry", waited);
      row("sequence length loaded after wait", seqlen);
      row("key range ready after wait", range);
      row("first tile looked up after wait", lookup0);
      row("first tile's copies issued after wait", issued0);
      row("first copies issued after wait", prologue);
      row("Q ready after wait", qready);
      row("warp 0's first tile landed", landed);
      row("loop done (last warp) after wait", loop);
      row("warps' loop-done spread", warp_loop_spread);
      row("epilogue (last loop done -> end)", epilogue);
      row("end since first entry", end);
    }
  }
  return 0;
}

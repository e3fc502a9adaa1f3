// TESTING.md grids (see grids.hpp).
#include "grids.hpp"

namespace flashcore::testing {

std::vector<Case> grid_seqlens(const GridOptions& g) {
  std::vector<Case> v;
  int i = 0;
  for (auto [sq, sk] : seqlen_pairs(g.large))
    for (bool causal : {false, true})
      for (int32_t dt : g.dtypes) {
        Case c;
        c.batch = sq * sk > 500000 ? 1 : 2;
        c.seqlen_q = sq;
        c.seqlen_k = sk;
        c.heads_q = (i % 2) ? 4 : 2;  // MQA (4 q heads on 1 kv head) and MHA alternate
        c.heads_kv = (i % 2) ? 1 : 2;
        c.head_dim = g.head_dims[i % g.head_dims.size()];
        c.dtype = dt;
        c.causal = causal;
        v.push_back(c);
        ++i;
      }
  return v;
}

std::vector<Case> grid_shapes(const GridOptions& g) {
  std::vector<Case> v;
  std::vector<int64_t> dims = g.head_dims;
  dims.insert(dims.end(), g.odd_head_dims.begin(), g.odd_head_dims.end());
  for (int64_t d : dims)
    for (int32_t dt : g.dtypes) {
      Case c;
      c.batch = 1;
      c.seqlen_q = 113;
      c.seqlen_k = 203;
      c.heads_q = 2;
      c.heads_kv = 1;
      c.head_dim = d;
      c.dtype = dt;
      c.causal = d % 2 == 1;
      v.push_back(c);
    }
  const int64_t heads[][2] = {{4, 4}, {8, 2}, {4, 1}};
  for (auto& hh : heads)
    for (bool causal : {false, true}) {
      Case c;
      c.batch = 2;
      c.seqlen_q = 77;
      c.seqlen_k = 150;
      c.heads_q = hh[0];
      c.heads_kv = hh[1];
      c.head_dim = g.head_dims[0];
      c.dtype = g.dtypes[0];
      c.causal = causal;
      v.push_back(c);
    }
  return v;
}

std::vector<Case> grid_masks(const GridOptions& g) {
  std::vector<Case> v;
  struct W {
    int32_t left, right;
    bool causal;
  };
  const W windows[] = {{16, -1, false}, {-1, 8, false}, {32, 7, false}, {0, 0, false}, {24, -1, true}};
  const int64_t sizes[][2] = {{100, 300}, {300, 100}, {128, 128}};
  for (auto& s : sizes)
    for (auto& w : windows) {
      Case c;
      c.seqlen_q = s[0];
      c.seqlen_k = s[1];
      c.heads_q = 2;
      c.heads_kv = 1;
      c.head_dim = g.head_dims[0];
      c.dtype = g.dtypes.back();
      c.window_left = w.left;
      c.window_right = w.right;
      c.causal = w.causal;
      v.push_back(c);
    }
  for (double cap : {5.0, 30.0})
    for (bool causal : {false, true}) {
      Case c;
      c.seqlen_q = 130;
      c.seqlen_k = 190;
      c.heads_q = 2;
      c.heads_kv = 2;
      c.head_dim = g.head_dims.back();
      c.dtype = cap < 10 ? g.dtypes[0] : g.dtypes.back();
      c.softcap = cap;
      c.causal = causal;
      c.q_magnitude = 4.f;
      v.push_back(c);
    }
  for (int32_t dt : g.dtypes) {
    Case c;
    c.batch = 2;
    c.seqlen_q = 70;
    c.seqlen_k = 90;
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = g.head_dims[0];
    c.dtype = dt;
    c.padded = true;
    c.causal = true;
    c.softmax_scale = 0.3;
    v.push_back(c);
  }
  return v;
}

/** One row of the ALiBi and dropout grids: a dense shape with its mask, softcap, ALiBi and dropout. */
struct MaskedShape {
  int64_t batch, sq, sk, heads_q, heads_kv;
  bool causal;
  int32_t left, right;
  double softcap;
  int alibi;
  double dropout_p = 0;  // the ALiBi grid leaves it out

  Case to_case() const {
    Case c;
    c.batch = batch;
    c.seqlen_q = sq;
    c.seqlen_k = sk;
    c.heads_q = heads_q;
    c.heads_kv = heads_kv;
    c.causal = causal;
    c.window_left = left;
    c.window_right = right;
    c.softcap = softcap;
    c.alibi = alibi;
    c.dropout_p = dropout_p;
    return c;
  }
};

std::vector<Case> grid_alibi(const GridOptions& g) {
  std::vector<Case> v;
  const MaskedShape shapes[] = {
      {2, 200, 200, 4, 4, true, -1, -1, 0, 1},     // causal, square
      {2, 100, 300, 4, 2, false, -1, -1, 0, 2},    // keys on both sides of the diagonal, GQA, per batch
      {1, 300, 100, 2, 1, true, -1, -1, 0, 1},     // rows before the first key (fully masked)
      {1, 130, 190, 2, 2, false, 32, 7, 30, 2},    // window and softcap
      {3, 1, 257, 8, 2, false, -1, -1, 0, 1},      // one query row against many keys
      {1, 600, 600, 2, 1, true, -1, -1, 0, 2},     // several key blocks per row
      {1, 520, 700, 2, 2, false, -1, -1, 0, 1},    // unmasked, several key blocks
  };
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); ++i) {
    Case c = shapes[i].to_case();
    c.head_dim = g.head_dims[i % g.head_dims.size()];
    c.dtype = g.dtypes[i % g.dtypes.size()];
    c.padded = i == 1;
    v.push_back(c);
  }
  for (bool causal : {false, true}) {  // varlen: each sequence's own diagonal and batch entry
    Case c;
    c.varlen_q = {5, 0, 130, 64};
    c.varlen_k = {7, 33, 0, 200};
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = g.head_dims.back();
    c.dtype = g.dtypes[0];
    c.causal = causal;
    c.alibi = causal ? 2 : 1;
    v.push_back(c);
  }
  return v;
}

std::vector<Case> grid_dropout(const GridOptions& g) {
  std::vector<Case> v;
  const MaskedShape shapes[] = {
      {2, 200, 200, 4, 4, true, -1, -1, 0, 0, 0.17},   // causal, square
      {2, 100, 300, 4, 2, false, -1, -1, 0, 0, 0.5},   // GQA, keys past several 64-key blocks
      {1, 300, 100, 2, 1, true, -1, -1, 0, 0, 0.17},   // rows before the first key (fully masked)
      {1, 130, 190, 2, 2, false, 37, 5, 30, 0, 0.5},   // window starting inside a block, softcap
      {3, 1, 257, 8, 2, false, -1, -1, 0, 0, 0.9},     // one query row, most entries dropped
      {1, 333, 333, 4, 1, true, -1, -1, 0, 2, 0.17},   // MQA, ALiBi, off every tile size
      {1, 77, 500, 2, 2, false, -1, -1, 0, 1, 0.5},    // ALiBi, unmasked, several key blocks
  };
  std::vector<int64_t> dims = g.head_dims;
  dims.insert(dims.end(), g.odd_head_dims.begin(), g.odd_head_dims.end());
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); ++i) {
    Case c = shapes[i].to_case();
    c.dropout_seed += i;
    c.dropout_offset = i * 1000003ull << 20;  // offsets above 2^32 too
    c.head_dim = dims[i % dims.size()];
    c.dtype = g.dtypes[i % g.dtypes.size()];
    c.padded = i == 1;
    v.push_back(c);
  }
  for (bool causal : {false, true}) {  // varlen: each sequence's own rows and columns
    Case c;
    c.varlen_q = {5, 0, 130, 64};
    c.varlen_k = {7, 33, 0, 200};
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = g.head_dims.back();
    c.dtype = g.dtypes[0];
    c.causal = causal;
    c.dropout_p = causal ? 0.5 : 0.17;
    v.push_back(c);
  }
  return v;
}

std::vector<Case> grid_dropout_matrix(const std::vector<int64_t>& dims, int64_t window_keys, int32_t window_left,
                                      uint64_t first_offset) {
  std::vector<Case> cases;
  uint64_t offset = first_offset;
  for (int32_t dtype : {FC_DTYPE_F16, FC_DTYPE_BF16}) {
    for (int64_t dim : dims) {
      for (bool causal : {false, true}) {
        Case c;
        c.batch = 2;
        c.seqlen_q = causal ? 333 : 200;
        c.seqlen_k = causal ? 200 : 333;
        c.heads_q = 4;
        c.heads_kv = 2;
        c.head_dim = dim;
        c.dtype = dtype;
        c.causal = causal;
        c.dropout_p = causal ? 0.5 : 0.17;
        c.dropout_offset = offset++ << 33;
        cases.push_back(c);
      }
      Case sc;  // softcap, two-sided window
      sc.seqlen_q = 150;
      sc.seqlen_k = window_keys;
      sc.heads_q = sc.heads_kv = 2;
      sc.head_dim = dim;
      sc.dtype = dtype;
      sc.softcap = 20;
      sc.window_left = window_left;
      sc.window_right = 9;
      sc.dropout_p = 0.5;
      sc.dropout_offset = offset++;
      cases.push_back(sc);
      Case al = sc;  // ALiBi, (batch, heads_q) slopes, causal, MQA
      al.batch = 2;
      al.softcap = 0;
      al.window_left = al.window_right = -1;
      al.causal = true;
      al.heads_q = 4;
      al.heads_kv = 1;
      al.alibi = 2;
      al.dropout_p = 0.17;
      al.dropout_offset = offset++;
      cases.push_back(al);
    }
  }
  return cases;
}

Case dropout_repeat_case() {
  Case c;
  c.varlen_q = {130, 77, 256};
  c.varlen_k = {300, 77, 129};
  c.heads_q = 4;
  c.heads_kv = 2;
  c.causal = true;
  c.dropout_p = 0.5;
  return c;
}

std::vector<Case> grid_varlen(const GridOptions& g) {
  std::vector<Case> v;
  const std::vector<std::vector<int32_t>> qs = {{5, 0, 130, 64}, {1, 1, 1}, {200, 17}};
  const std::vector<std::vector<int32_t>> ks = {{7, 33, 0, 64}, {300, 0, 2}, {150, 250}};
  for (size_t i = 0; i < qs.size(); ++i)
    for (bool causal : {false, true}) {
      Case c;
      c.varlen_q = qs[i];
      c.varlen_k = ks[i];
      c.heads_q = 4;
      c.heads_kv = i == 1 ? 1 : 2;
      c.head_dim = g.head_dims[i % g.head_dims.size()];
      c.dtype = g.dtypes[i % g.dtypes.size()];
      c.causal = causal;
      c.window_left = i == 2 ? 40 : -1;
      v.push_back(c);
    }
  return v;
}

std::vector<Case> grid_paged(const GridOptions& g, const std::vector<int64_t>& page_sizes) {
  std::vector<Case> v;
  for (int64_t page : page_sizes) {
    for (Case c : grid_varlen(g)) {
      c.page_size = page;
      v.push_back(c);
    }
    Case c;
    c.varlen_q = {300, 1, 77};
    c.varlen_k = {1100, 700, 77};
    c.heads_q = 8;
    c.heads_kv = 2;
    c.head_dim = g.head_dims[0];
    c.dtype = g.dtypes.back();
    c.softcap = 30;
    c.window_left = 600;
    c.window_right = 0;
    c.page_size = page;
    v.push_back(c);
  }
  return v;
}

std::vector<Case> grid_edges(const GridOptions& g) {
  std::vector<Case> v;
  Case base;
  base.heads_q = 2;
  base.heads_kv = 1;
  base.head_dim = g.head_dims[0];
  base.dtype = g.dtypes[0];
  {  // a window that excludes every key for the early rows (sq > sk with causal)
    Case c = base;
    c.seqlen_q = 150;
    c.seqlen_k = 40;
    c.causal = true;
    v.push_back(c);
  }
  {  // a two-sided window that leaves the first 67 rows without keys
    Case c = base;
    c.seqlen_q = 100;
    c.seqlen_k = 30;
    c.window_left = 5;
    c.window_right = 3;
    v.push_back(c);
  }
  {  // seqlen_k = 0
    Case c = base;
    c.seqlen_q = 33;
    c.seqlen_k = 0;
    v.push_back(c);
  }
  {  // seqlen_q = 0
    Case c = base;
    c.seqlen_q = 0;
    c.seqlen_k = 33;
    v.push_back(c);
  }
  // Scores spread over many log2 units across many key tiles: a row's running max moves by less
  // than a kernel's lazy-rescale threshold (kept, probabilities above 1) and by more (O rescaled),
  // both many times along the row, in every dtype.
  for (int32_t dt : g.dtypes)
    for (float mag : {3.f, 12.f}) {
      Case c = base;
      c.seqlen_q = 70;
      c.seqlen_k = 1100;
      c.head_dim = g.head_dims.back();
      c.dtype = dt;
      c.q_magnitude = mag;
      c.causal = mag > 10.f;
      v.push_back(c);
    }
  {  // a negative softmax scale (allowed: any finite non-zero value): the lowest scores weigh most
    Case c = base;
    c.seqlen_q = 90;
    c.seqlen_k = 300;
    c.head_dim = g.head_dims.back();
    c.dtype = g.dtypes.back();
    c.softmax_scale = -0.2;
    v.push_back(c);
  }
  // More query tiles than a GPU has SMs, many of them without keys, so that a persistent CTA walks
  // empty and non-empty tiles in turn (the sm90 forward carries a tile's last P V into the next):
  // dense, seqlen_q >> seqlen_k under a causal mask (the first 900 rows of each sequence see no
  // key), and varlen with empty and short sequences among longer ones.
  {
    Case c = base;
    c.batch = 12;
    c.heads_q = 4;
    c.seqlen_q = 1000;
    c.seqlen_k = 100;
    c.causal = true;
    v.push_back(c);
  }
  {
    Case c = base;
    c.heads_q = 8;
    c.heads_kv = 2;
    for (int i = 0; i < 40; ++i) {
      c.varlen_q.push_back((i * 97) % 300);
      c.varlen_k.push_back(i % 5 == 0 ? 0 : (i * 61) % 280 + 1);
    }
    v.push_back(c);
  }
  for (float mag : {100.f, 1500.f}) {  // scores near +-1e4: overflow in exp if unguarded
    Case c = base;
    c.seqlen_q = 97;
    c.seqlen_k = 131;
    c.q_magnitude = mag;
    c.causal = mag > 1000.f;
    v.push_back(c);
  }
  return v;
}

}  // namespace flashcore::testing

// CPU implementation of the DDTree ops: same semantics as reference.py, so CI (no GPU) can
// build and test the extension, and so hosts without a GPU still get a compiled path.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <queue>
#include <vector>

#include "ddtree.h"

namespace ddtree {

void topk_lse_cpu(const float* logits, int64_t rows, int64_t vocab, int k, int64_t* ids, float* logprobs,
                  float* lse) {
  std::vector<int64_t> order(vocab);
  for (int64_t row = 0; row < rows; ++row) {
    const float* x = logits + row * vocab;
    // logsumexp in double, rounded once to fp32 (the reference's definition).
    double m = -INFINITY;
    for (int64_t v = 0; v < vocab; ++v) m = std::max(m, double(x[v]));
    double s = 0.0;
    if (std::isfinite(m)) {
      for (int64_t v = 0; v < vocab; ++v) s += std::exp(double(x[v]) - m);
    }
    const float row_lse = std::isfinite(m) ? float(m + std::log(s)) : float(m);
    lse[row] = row_lse;
    std::iota(order.begin(), order.end(), 0);
    auto better = [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
    std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
    for (int r = 0; r < k; ++r) {
      ids[row * k + r] = order[r];
      logprobs[row * k + r] = x[order[r]] - row_lse;
    }
  }
}

namespace {
struct Entry {
  float score;
  RankKey key;
  int32_t parent, depth, rank, prev_sibling;
};
// priority_queue pops the "largest": highest score, then the smallest rank tuple.
struct Worse {
  bool operator()(const Entry& a, const Entry& b) const {
    if (a.score != b.score) return a.score < b.score;
    return rank_key_less(b.key, a.key);
  }
};
}  // namespace

void build_tree_cpu(const int64_t* ids, const float* logprobs, int bs, int depth_limit, int k, int budget,
                    int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                    int32_t* first_child, int32_t* next_sibling) {
  for (int b = 0; b < bs; ++b) {
    const float* lp = logprobs + int64_t(b) * depth_limit * k;
    const int64_t* id = ids + int64_t(b) * depth_limit * k;
    int64_t* tok = tokens + int64_t(b) * budget;
    int32_t* dep = depths + int64_t(b) * budget;
    int32_t* rk = ranks + int64_t(b) * budget;
    int32_t* par = parents + int64_t(b) * (budget + 1);
    int32_t* fc = first_child + int64_t(b) * (budget + 1);
    int32_t* ns = next_sibling + int64_t(b) * (budget + 1);
    std::fill(tok, tok + budget, -1);
    std::fill(dep, dep + budget, 0);
    std::fill(rk, rk + budget, -1);
    std::fill(par, par + budget + 1, -1);
    std::fill(fc, fc + budget + 1, -1);
    std::fill(ns, ns + budget + 1, -1);
    int n = 0;
    if (budget > 0 && k > 0 && depth_limit > 0) {
      std::priority_queue<Entry, std::vector<Entry>, Worse> heap;
      heap.push(Entry{lp[0], rank_key_with(RankKey{{0, 0, 0}}, 0, 0), 0, 1, 0, -1});
      while (!heap.empty() && n < budget) {
        const Entry e = heap.top();
        heap.pop();
        const int node = ++n;
        tok[node - 1] = id[(e.depth - 1) * k + e.rank];
        dep[node - 1] = e.depth;
        rk[node - 1] = e.rank;
        par[node] = e.parent;
        if (e.rank == 0) fc[e.parent] = node; else ns[e.prev_sibling] = node;
        const float* row = lp + (e.depth - 1) * k;
        if (e.rank + 1 < k) {
          const float s = (e.score - row[e.rank]) + row[e.rank + 1];
          heap.push(Entry{s, rank_key_with(e.key, e.depth - 1, e.rank + 1), e.parent, e.depth, e.rank + 1, node});
        }
        if (e.depth < depth_limit) {
          const float s = e.score + lp[e.depth * k];
          heap.push(Entry{s, rank_key_with(e.key, e.depth, 0), node, e.depth + 1, 0, -1});
        }
      }
    }
    num_nodes[b] = n;
  }
}

void build_mask_cpu(const int32_t* parents, const int32_t* num_nodes, int bs, int budget, bool* vis,
                    uint32_t* vis_packed) {
  const int64_t side = budget + 1, words = (side + 31) / 32;
  for (int b = 0; b < bs; ++b) {
    bool* v = vis + b * side * side;
    uint32_t* p = vis_packed + b * side * words;
    std::memset(v, 0, side * side);
    std::memset(p, 0, side * words * sizeof(uint32_t));
    const int32_t* par = parents + b * side;
    for (int i = 0; i <= num_nodes[b]; ++i) {
      for (int a = i; a >= 0; a = par[a]) {  // self, then the ancestors up to the root
        v[i * side + a] = true;
        p[i * words + a / 32] |= 1u << (a % 32);
      }
    }
  }
}

void verify_cpu(const int64_t* posterior, const int64_t* tokens, const int32_t* parents,
                const int32_t* num_nodes, int bs, int budget, int max_accept, int32_t* accepted,
                int32_t* accept_len, int64_t* bonus) {
  for (int b = 0; b < bs; ++b) {
    const int64_t* post = posterior + int64_t(b) * (budget + 1);
    const int64_t* tok = tokens + int64_t(b) * budget;
    const int32_t* par = parents + int64_t(b) * (budget + 1);
    int32_t* acc = accepted + int64_t(b) * max_accept;
    std::fill(acc, acc + max_accept, -1);
    int node = 0, len = 0;
    acc[len++] = 0;
    int64_t next = post[0];
    while (len < max_accept) {
      int child = -1;
      for (int j = node + 1; j <= num_nodes[b]; ++j) {  // children have larger indices
        if (par[j] == node && tok[j - 1] == next) { child = j; break; }
      }
      if (child < 0) break;
      node = child;
      acc[len++] = node;
      next = post[node];
    }
    accept_len[b] = len;
    bonus[b] = next;
  }
}

void compact_kv_cpu(uint8_t* cache, int64_t row_bytes, const int64_t* slot_base, const int32_t* accepted,
                    const int32_t* accept_len, int bs, int max_accept) {
  for (int b = 0; b < bs; ++b) {
    for (int i = 0; i < accept_len[b]; ++i) {
      const int32_t a = accepted[int64_t(b) * max_accept + i];
      if (a != i) {  // a > i: the source is never a slot already overwritten
        std::memmove(cache + (slot_base[b] + i) * row_bytes, cache + (slot_base[b] + a) * row_bytes, row_bytes);
      }
    }
  }
}

}  // namespace ddtree

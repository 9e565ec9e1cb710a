// DDTree CUDA kernels. No torch headers: launchers take raw pointers and a cudaStream_t, so this
// file compiles with plain nvcc (CI does that) and every op is CUDA-graph safe: no host sync, no
// allocation, shapes fixed by the arguments.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdlib>
#include <cstdint>

#include "ddtree.h"

namespace ddtree {
namespace {

// ------------------------------------------------------------------ top-K + logsumexp
//
// One CTA per (request, depth) row. The K largest values are found by an exact radix select on
// order-preserving integer keys (16-bit keys for fp16/bf16, 32-bit for fp32): pass 0 reads the
// row once for the online logsumexp AND the histogram of the top 11 key bits; later passes refine
// the threshold digit by digit (re-reads hit L2); a gather pass collects the keys above the
// threshold and, in index order, the first ones equal to it (ties go to the lower token id); a
// bitonic sort in shared memory orders the K winners by (value desc, id asc).

constexpr int kTopkThreads = 1024;
constexpr int kRadixBits = 11;
constexpr int kBins = 1 << kRadixBits;

template <typename T> struct KeyTraits;
template <> struct KeyTraits<float> {
  static constexpr int kBits = 32;
  __device__ static uint32_t key(float v) {
    const uint32_t u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  __device__ static float value(uint32_t k) {
    const uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
    return __uint_as_float(u);
  }
  __device__ static float to_float(float v) { return v; }
};
template <> struct KeyTraits<__nv_bfloat16> {
  static constexpr int kBits = 16;
  __device__ static uint32_t key(__nv_bfloat16 v) {
    const uint32_t u = __bfloat16_as_ushort(v);
    return (u & 0x8000u) ? (~u & 0xFFFFu) : (u | 0x8000u);
  }
  __device__ static float value(uint32_t k) {
    const uint16_t u = (k & 0x8000u) ? uint16_t(k & 0x7FFFu) : uint16_t(~k & 0xFFFFu);
    return __bfloat162float(__ushort_as_bfloat16(u));
  }
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};
template <> struct KeyTraits<__half> {
  static constexpr int kBits = 16;
  __device__ static uint32_t key(__half v) {
    const uint32_t u = __half_as_ushort(v);
    return (u & 0x8000u) ? (~u & 0xFFFFu) : (u | 0x8000u);
  }
  __device__ static float value(uint32_t k) {
    const uint16_t u = (k & 0x8000u) ? uint16_t(k & 0x7FFFu) : uint16_t(~k & 0xFFFFu);
    return __half2float(__ushort_as_half(u));
  }
  __device__ static float to_float(__half v) { return __half2float(v); }
};

// Calls f(index, value) for the row, 16-byte vector loads when the row is aligned for them.
template <typename T, typename F>
__device__ __forceinline__ void for_each_in_row(const T* __restrict__ x, int64_t vocab, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = (reinterpret_cast<uintptr_t>(x) % 16 == 0);
  int64_t done = 0;
  if (aligned) {
    const int64_t nvec = vocab / kVec;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      uint4 raw = __ldg(xv + i);
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(i * kVec + j, vals[j]);
    }
    done = nvec * kVec;
  }
  for (int64_t i = done + threadIdx.x; i < vocab; i += blockDim.x) f(i, x[i]);
}

struct TopkShared {
  uint32_t hist[kBins];
  unsigned long long cand[kMaxTopK];
  float red_m[32], red_s[32];
  uint32_t prefix, prefix_mask;
  int remaining;  // how many keys equal to the threshold still to take
  int n_greater;
  int eq_taken;
  float lse;
  typename cub::BlockScan<int, kTopkThreads>::TempStorage scan;
};

// Warp 0 finds the bin holding the `remaining`-th largest key; updates prefix and remaining.
__device__ void select_bin(TopkShared& sh, int shift, int bins) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  const int per_lane = bins / 32;
  // Lane l owns bins [l*per_lane, (l+1)*per_lane); count from the top bin down.
  int total = 0;
  for (int j = 0; j < per_lane; ++j) total += sh.hist[lane * per_lane + j];
  // suffix sum over lanes: above[l] = sum of totals of lanes > l
  int incl = total;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int other = __shfl_down_sync(0xffffffffu, incl, off);
    if (lane + off < 32) incl += other;
  }
  const int above = incl - total;
  const int need = sh.remaining;
  const bool mine = above < need && need <= incl;
  if (mine) {
    int acc = above;
    for (int j = per_lane - 1; j >= 0; --j) {
      const int bin = lane * per_lane + j;
      const int c = sh.hist[bin];
      if (acc + c >= need) {
        sh.prefix |= uint32_t(bin) << shift;
        sh.prefix_mask |= uint32_t(bins - 1) << shift;
        sh.remaining = need - acc;
        break;
      }
      acc += c;
    }
  }
}

// `variant` is a profiling knob (env DDTREE_TOPK_VARIANT; 0 in normal use) that skips stages so
// their cost can be timed by difference: 1 plain atomics, 2 no exp, 4 no refinement, 8 no gather.
template <typename T>
__global__ void __launch_bounds__(kTopkThreads) topk_lse_kernel(const T* __restrict__ logits, int64_t vocab, int k,
                                                                int64_t* __restrict__ out_ids,
                                                                float* __restrict__ out_lp,
                                                                float* __restrict__ out_lse, int variant) {
  using Traits = KeyTraits<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  TopkShared& sh = *reinterpret_cast<TopkShared*>(smem_raw);
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  for (int i = threadIdx.x; i < kBins; i += blockDim.x) sh.hist[i] = 0;
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.prefix_mask = 0;
    sh.remaining = k;
    sh.n_greater = 0;
    sh.eq_taken = 0;
  }
  __syncthreads();

  // Pass 0: online logsumexp + histogram of the top kRadixBits key bits.
  const int shift0 = Traits::kBits - kRadixBits;
  float m = -INFINITY, s = 0.f;
  for_each_in_row(x, vocab, [&](int64_t, T raw) {
    const float v = Traits::to_float(raw);
    if (variant & 2) {
      m = fmaxf(m, v);
    } else if (v > m) {
      s = s * __expf(m - v) + 1.f;
      m = v;
    } else if (v != -INFINITY) {
      s += __expf(v - m);
    }
    const uint32_t bin = Traits::key(raw) >> shift0;
    if (variant & 1) {
      atomicAdd(&sh.hist[bin], 1u);
    } else {
      // Warp-aggregated atomics: logits crowd into few bins, so lanes with the same bin add once.
      const unsigned peers = __match_any_sync(__activemask(), bin);
      if (lane == __ffs(peers) - 1) atomicAdd(&sh.hist[bin], __popc(peers));
    }
  });
  // Block-wide (max, sum) merge.
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, m, off), os = __shfl_xor_sync(0xffffffffu, s, off);
    const float nm = fmaxf(m, om);
    s = (nm == -INFINITY) ? 0.f : s * __expf(m - nm) + os * __expf(om - nm);
    m = nm;
  }
  if (lane == 0) { sh.red_m[warp] = m; sh.red_s[warp] = s; }
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x / 32;
    m = lane < nwarps ? sh.red_m[lane] : -INFINITY;
    s = lane < nwarps ? sh.red_s[lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float om = __shfl_xor_sync(0xffffffffu, m, off), os = __shfl_xor_sync(0xffffffffu, s, off);
      const float nm = fmaxf(m, om);
      s = (nm == -INFINITY) ? 0.f : s * __expf(m - nm) + os * __expf(om - nm);
      m = nm;
    }
    if (lane == 0) sh.lse = (m == -INFINITY) ? m : m + logf(s);
  }
  select_bin(sh, shift0, kBins);
  __syncthreads();

  // Refinement passes over the lower key bits, only for keys matching the prefix so far.
  for (int shift = (variant & 4) ? 0 : shift0; shift > 0;) {
    const int bits = shift >= kRadixBits ? kRadixBits : shift;
    shift -= bits;
    const int bins = 1 << bits;
    for (int i = threadIdx.x; i < bins; i += blockDim.x) sh.hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = sh.prefix, mask = sh.prefix_mask;
    for_each_in_row(x, vocab, [&](int64_t, T raw) {
      const uint32_t key = Traits::key(raw);
      if ((key & mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & (bins - 1)], 1u);
    });
    __syncthreads();
    select_bin(sh, shift, bins < 32 ? 32 : bins);  // bins < 32: lanes past `bins` see zeros
    __syncthreads();
  }
  const uint32_t threshold = sh.prefix;
  const int take_equal = sh.remaining;

  // Gather: keys > threshold in any order; keys == threshold in index order, the first take_equal.
  constexpr int kItems = 16 / sizeof(T);
  const int64_t tile = int64_t(blockDim.x) * kItems;
  for (int64_t base = 0; base < ((variant & 8) ? 0 : vocab); base += tile) {
    const int64_t first = base + int64_t(threadIdx.x) * kItems;
    uint32_t keys[kItems];
    int n_eq = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = first + j;
      keys[j] = i < vocab ? Traits::key(x[i]) : 0u;
      if (i < vocab) {
        if (keys[j] > threshold) {
          const int slot = atomicAdd(&sh.n_greater, 1);
          sh.cand[slot] = (uint64_t(~keys[j]) << 32) | uint64_t(i);
        } else if (keys[j] == threshold) {
          ++n_eq;
        }
      }
    }
    const int eq_taken = sh.eq_taken;  // block-uniform
    if (eq_taken < take_equal) {
      int before, total;
      cub::BlockScan<int, kTopkThreads>(sh.scan).ExclusiveSum(n_eq, before, total);
      int pos = eq_taken + before;
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int64_t i = first + j;
        if (i < vocab && keys[j] == threshold) {
          if (pos < take_equal) sh.cand[(k - take_equal) + pos] = (uint64_t(~keys[j]) << 32) | uint64_t(i);
          ++pos;
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) sh.eq_taken = eq_taken + total;
    }
    __syncthreads();
  }

  // Bitonic sort of the K candidates by (key desc, index asc) = ascending composite key.
  int p2 = 1;
  while (p2 < k) p2 <<= 1;
  for (int i = k + threadIdx.x; i < p2; i += blockDim.x) sh.cand[i] = ~0ull;
  __syncthreads();
  for (int size = 2; size <= p2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < p2; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned long long a = sh.cand[i], b = sh.cand[j];
          const bool ascending = (i & size) == 0;
          if ((a > b) == ascending) { sh.cand[i] = b; sh.cand[j] = a; }
        }
      }
      __syncthreads();
    }
  }
  const float lse = sh.lse;
  for (int r = threadIdx.x; r < k; r += blockDim.x) {
    const unsigned long long c = sh.cand[r];
    const uint32_t key = ~uint32_t(c >> 32) & (Traits::kBits == 32 ? 0xFFFFFFFFu : 0xFFFFu);
    out_ids[row * k + r] = int64_t(c & 0xFFFFFFFFull);
    out_lp[row * k + r] = Traits::value(key) - lse;
  }
  if (threadIdx.x == 0) out_lse[row] = lse;
}

template <typename T>
int launch_topk(const void* logits, int64_t rows, int64_t vocab, int k, int64_t* ids, float* lp, float* lse,
                cudaStream_t stream) {
  const size_t smem = sizeof(TopkShared);
  auto kernel = topk_lse_kernel<T>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  static const int variant = getenv("DDTREE_TOPK_VARIANT") ? atoi(getenv("DDTREE_TOPK_VARIANT")) : 0;
  kernel<<<dim3(unsigned(rows)), kTopkThreads, smem, stream>>>(static_cast<const T*>(logits), vocab, k, ids, lp,
                                                                lse, variant);
  return cudaGetLastError();
}

// ------------------------------------------------------------------ best-first tree build
//
// One warp per request. Everything a pop touches is in shared memory: the request's log-probs
// [L, K] (staged once, coalesced) and the frontier (at most pops + 1 entries) as arrays of
// scores, rank keys and packed metadata. Each pop is a warp-wide argmax by (score desc, rank
// tuple asc); then lane 0 emits the node and replaces the popped entry by its next sibling and
// appends its first child. No global load sits on the per-pop path: token ids are written at
// the end, in parallel. Score arithmetic is the reference's, in fp32, in the same order.

struct BuildSmem {  // per warp; arrays carved from dynamic shared memory
  float* lp;        // [L * K]
  float* score;     // [B + 1]
  RankKey* key;     // [B + 1]
  int4* meta;       // [B + 1]: parent, depth, rank, prev_sibling
  int2* node;       // [B]: depth, rank of node i+1
};

__host__ __device__ inline size_t build_smem_per_warp(int depth_limit, int k, int budget) {
  size_t bytes = size_t(depth_limit) * k * sizeof(float);
  bytes = (bytes + 15) / 16 * 16 + size_t(budget + 1) * (sizeof(RankKey) + sizeof(int4) + sizeof(float));
  return (bytes + size_t(budget) * sizeof(int2) + 15) / 16 * 16;
}

constexpr int kBuildWarps = 4;

__device__ __forceinline__ bool better(float sa, const RankKey& ka, float sb, const RankKey& kb) {
  return sa > sb || (sa == sb && rank_key_less(ka, kb));
}

__global__ void build_tree_kernel(const int64_t* __restrict__ ids, const float* __restrict__ logprobs, int bs,
                                  int depth_limit, int k, int budget, int32_t* __restrict__ num_nodes,
                                  int64_t* __restrict__ tokens, int32_t* __restrict__ depths,
                                  int32_t* __restrict__ ranks, int32_t* __restrict__ parents,
                                  int32_t* __restrict__ first_child, int32_t* __restrict__ next_sibling) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.x * (blockDim.x >> 5) + warp;
  if (b >= bs) return;
  unsigned char* base = smem_raw + size_t(warp) * build_smem_per_warp(depth_limit, k, budget);
  BuildSmem sm;
  sm.lp = reinterpret_cast<float*>(base);
  size_t off = (size_t(depth_limit) * k * sizeof(float) + 15) / 16 * 16;
  sm.key = reinterpret_cast<RankKey*>(base + off);
  off += size_t(budget + 1) * sizeof(RankKey);
  sm.meta = reinterpret_cast<int4*>(base + off);
  off += size_t(budget + 1) * sizeof(int4);
  sm.score = reinterpret_cast<float*>(base + off);
  off += size_t(budget + 1) * sizeof(float);
  sm.node = reinterpret_cast<int2*>(base + off);

  const float* lp_g = logprobs + int64_t(b) * depth_limit * k;
  for (int i = lane; i < depth_limit * k; i += 32) sm.lp[i] = lp_g[i];
  int32_t* par = parents + int64_t(b) * (budget + 1);
  int32_t* fc = first_child + int64_t(b) * (budget + 1);
  int32_t* ns = next_sibling + int64_t(b) * (budget + 1);
  for (int i = lane; i <= budget; i += 32) { par[i] = -1; fc[i] = -1; ns[i] = -1; }
  const bool any = budget > 0 && k > 0 && depth_limit > 0;
  if (any && lane == 0) {
    sm.score[0] = lp_g[0];
    sm.key[0] = rank_key_with(RankKey{{0, 0, 0}}, 0, 0);
    sm.meta[0] = make_int4(0, 1, 0, -1);
  }
  int size = any ? 1 : 0;
  __syncwarp();
  int n = 0;
  while (size > 0 && n < budget) {
    float best_s = -INFINITY;
    int best_i = -1;
    for (int i = lane; i < size; i += 32) {
      const float si = sm.score[i];
      if (best_i < 0 || better(si, sm.key[i], best_s, sm.key[best_i])) { best_s = si; best_i = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float os = __shfl_xor_sync(0xffffffffu, best_s, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (oi >= 0 && (best_i < 0 || better(os, sm.key[oi], best_s, sm.key[best_i]))) { best_s = os; best_i = oi; }
    }
    if (lane == 0) {
      const int w = best_i;
      const float s = sm.score[w];
      const RankKey key = sm.key[w];
      const int4 m = sm.meta[w];  // parent, depth, rank, prev_sibling
      const int node = n + 1;
      sm.node[n] = make_int2(m.y, m.z);
      par[node] = m.x;
      if (m.z == 0) fc[m.x] = node; else ns[m.w] = node;
      const float* row = sm.lp + (m.y - 1) * k;
      int new_size = size;
      if (m.z + 1 < k) {
        sm.score[w] = __fadd_rn(__fsub_rn(s, row[m.z]), row[m.z + 1]);
        sm.key[w] = rank_key_with(key, m.y - 1, m.z + 1);
        sm.meta[w] = make_int4(m.x, m.y, m.z + 1, node);
      } else {
        --new_size;
        sm.score[w] = sm.score[new_size];
        sm.key[w] = sm.key[new_size];
        sm.meta[w] = sm.meta[new_size];
      }
      if (m.y < depth_limit) {
        sm.score[new_size] = __fadd_rn(s, sm.lp[m.y * k]);
        sm.key[new_size] = rank_key_with(key, m.y, 0);
        sm.meta[new_size] = make_int4(node, m.y + 1, 0, -1);
        ++new_size;
      }
      size = new_size;
    }
    size = __shfl_sync(0xffffffffu, size, 0);
    ++n;
    __syncwarp();
  }
  // Node outputs, in parallel; the token ids are read from global only now.
  const int64_t* id = ids + int64_t(b) * depth_limit * k;
  int64_t* tok = tokens + int64_t(b) * budget;
  int32_t* dep = depths + int64_t(b) * budget;
  int32_t* rk = ranks + int64_t(b) * budget;
  for (int i = lane; i < budget; i += 32) {
    if (i < n) {
      const int2 dr = sm.node[i];
      tok[i] = id[(dr.x - 1) * k + dr.y];
      dep[i] = dr.x;
      rk[i] = dr.y;
    } else {
      tok[i] = -1; dep[i] = 0; rk[i] = -1;
    }
  }
  if (lane == 0) num_nodes[b] = n;
}

// ------------------------------------------------------------------ visibility mask
// One thread per (request, row, 32-column word): walk the row's ancestor chain (<= 16 steps).
__global__ void build_mask_kernel(const int32_t* __restrict__ parents, const int32_t* __restrict__ num_nodes,
                                  int budget, bool* __restrict__ vis, uint32_t* __restrict__ vis_packed) {
  const int64_t side = budget + 1, words = (side + 31) / 32;
  const int b = blockIdx.y;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= side * words) return;
  const int row = int(t / words), word = int(t % words);
  const int32_t* par = parents + b * side;
  uint32_t bits = 0;
  if (row <= num_nodes[b]) {
    for (int a = row; a >= 0; a = par[a]) {
      if (a / 32 == word) bits |= 1u << (a % 32);
    }
  }
  vis_packed[(b * side + row) * words + word] = bits;
  bool* out = vis + (b * side + row) * side + int64_t(word) * 32;
  const int64_t left = side - int64_t(word) * 32;
  const int cols = left < 32 ? int(left) : 32;
  for (int c = 0; c < cols; ++c) out[c] = (bits >> c) & 1u;
}

// ------------------------------------------------------------------ greedy verify walk
// One warp per request: at each step the warp scans the nodes after the current one for the
// child whose token is the target's next token (tokens of siblings are distinct).
__global__ void verify_kernel(const int64_t* __restrict__ posterior, const int64_t* __restrict__ tokens,
                              const int32_t* __restrict__ parents, const int32_t* __restrict__ num_nodes, int bs,
                              int budget, int max_accept, int32_t* __restrict__ accepted,
                              int32_t* __restrict__ accept_len, int64_t* __restrict__ bonus) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.x * (blockDim.x >> 5) + warp;
  if (b >= bs) return;
  const int64_t* post = posterior + int64_t(b) * (budget + 1);
  const int64_t* tok = tokens + int64_t(b) * budget;
  const int32_t* par = parents + int64_t(b) * (budget + 1);
  int32_t* acc = accepted + int64_t(b) * max_accept;
  const int n = num_nodes[b];
  for (int i = lane; i < max_accept; i += 32) acc[i] = -1;
  __syncwarp();
  int node = 0, len = 1;
  int64_t next = post[0];
  if (lane == 0) acc[0] = 0;
  while (len < max_accept) {
    int found = 0x7fffffff;
    for (int base = node + 1; base <= n; base += 32) {
      const int j = base + lane;
      const bool hit = j <= n && par[j] == node && tok[j - 1] == next;
      const unsigned ballot = __ballot_sync(0xffffffffu, hit);
      if (ballot) { found = base + __ffs(ballot) - 1; break; }
    }
    if (found == 0x7fffffff) break;
    node = found;
    if (lane == 0) acc[len] = node;
    ++len;
    next = post[node];
  }
  if (lane == 0) { accept_len[b] = len; bonus[b] = next; }
}

// ------------------------------------------------------------------ KV compaction
// Thread = one 4-byte column of a slot row, looping over the accepted nodes in increasing order:
// within a column that order is the reference's, so the in-place copy is safe, and columns are
// independent, so the whole grid runs in parallel.
template <typename Word>
__global__ void compact_kv_kernel(Word* __restrict__ cache, int64_t row_words, const int64_t* __restrict__ slot_base,
                                  const int32_t* __restrict__ accepted, const int32_t* __restrict__ accept_len,
                                  int max_accept) {
  const int b = blockIdx.y;
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= row_words) return;
  const int64_t base = slot_base[b];
  const int len = accept_len[b];
  for (int i = 0; i < len; ++i) {
    const int a = accepted[int64_t(b) * max_accept + i];
    if (a != i) cache[(base + i) * row_words + col] = cache[(base + a) * row_words + col];
  }
}

}  // namespace

int topk_lse_cuda(const void* logits, DType dtype, int64_t rows, int64_t vocab, int k, int64_t* ids,
                  float* logprobs, float* lse, void* stream) {
  if (rows == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: return launch_topk<float>(logits, rows, vocab, k, ids, logprobs, lse, s);
    case DType::kFloat16: return launch_topk<__half>(logits, rows, vocab, k, ids, logprobs, lse, s);
    case DType::kBFloat16: return launch_topk<__nv_bfloat16>(logits, rows, vocab, k, ids, logprobs, lse, s);
  }
  return cudaErrorInvalidValue;
}

int build_tree_cuda(const int64_t* ids, const float* logprobs, int bs, int depth_limit, int k, int budget,
                    int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                    int32_t* first_child, int32_t* next_sibling, void* stream) {
  if (bs == 0) return cudaSuccess;
  const size_t per_warp = build_smem_per_warp(depth_limit, k, budget);
  const int warps = per_warp * kBuildWarps <= 100 * 1024 ? kBuildWarps : 1;
  const size_t smem = size_t(warps) * per_warp;
  cudaError_t err = cudaFuncSetAttribute(build_tree_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  build_tree_kernel<<<(bs + warps - 1) / warps, warps * 32, smem, static_cast<cudaStream_t>(stream)>>>(
      ids, logprobs, bs, depth_limit, k, budget, num_nodes, tokens, depths, ranks, parents, first_child,
      next_sibling);
  return cudaGetLastError();
}

int build_mask_cuda(const int32_t* parents, const int32_t* num_nodes, int bs, int budget, bool* vis,
                    uint32_t* vis_packed, void* stream) {
  if (bs == 0) return cudaSuccess;
  const int64_t side = budget + 1, words = (side + 31) / 32;
  const int threads = 256;
  dim3 grid(unsigned((side * words + threads - 1) / threads), unsigned(bs));
  build_mask_kernel<<<grid, threads, 0, static_cast<cudaStream_t>(stream)>>>(parents, num_nodes, budget, vis,
                                                                            vis_packed);
  return cudaGetLastError();
}

int verify_cuda(const int64_t* posterior, const int64_t* tokens, const int32_t* parents, const int32_t* num_nodes,
                int bs, int budget, int max_accept, int32_t* accepted, int32_t* accept_len, int64_t* bonus,
                void* stream) {
  if (bs == 0) return cudaSuccess;
  const int warps = 4;
  verify_kernel<<<(bs + warps - 1) / warps, warps * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      posterior, tokens, parents, num_nodes, bs, budget, max_accept, accepted, accept_len, bonus);
  return cudaGetLastError();
}

int compact_kv_cuda(uint8_t* cache, int64_t row_bytes, const int64_t* slot_base, const int32_t* accepted,
                    const int32_t* accept_len, int bs, int max_accept, void* stream) {
  if (bs == 0 || row_bytes == 0) return cudaSuccess;
  const int threads = 256;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(cache) % 16 == 0;
  const bool word = row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(cache) % 4 == 0;
  if (wide) {
    const int64_t words = row_bytes / 16;
    dim3 grid(unsigned((words + threads - 1) / threads), unsigned(bs));
    compact_kv_kernel<uint4><<<grid, threads, 0, s>>>(reinterpret_cast<uint4*>(cache), words, slot_base, accepted,
                                                      accept_len, max_accept);
  } else if (word) {
    const int64_t words = row_bytes / 4;
    dim3 grid(unsigned((words + threads - 1) / threads), unsigned(bs));
    compact_kv_kernel<uint32_t><<<grid, threads, 0, s>>>(reinterpret_cast<uint32_t*>(cache), words, slot_base,
                                                         accepted, accept_len, max_accept);
  } else {
    dim3 grid(unsigned((row_bytes + threads - 1) / threads), unsigned(bs));
    compact_kv_kernel<uint8_t><<<grid, threads, 0, s>>>(cache, row_bytes, slot_base, accepted, accept_len,
                                                        max_accept);
  }
  return cudaGetLastError();
}

}  // namespace ddtree

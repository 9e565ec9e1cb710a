// DDTree CUDA kernels. No torch headers: launchers take raw pointers and a cudaStream_t, so this
// file compiles with plain nvcc (CI does that) and every op is CUDA-graph safe: no host sync, no
// allocation, shapes fixed by the arguments.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "ddtree.h"

namespace ddtree {
namespace {

// ------------------------------------------------------------------ top-K + logsumexp
//
// Two kernels. topk_chunk_kernel: each CTA stages one chunk of a row (<= 64 KB) in shared memory
// (HBM is read once), computes the chunk's max and sum of exp, and its exact top-K:
//   * lower bound: tau = the K-th largest of the per-thread maxima. They are K distinct elements
//     of the chunk, so at least K elements are >= tau, and for real logits few more than K are;
//   * candidates (key >= tau) are appended with a shared atomic counter and bitonic-sorted by
//     (value desc, index asc), the reference's order, ties included;
//   * when ties flood the candidate buffer (flat logits), an exact radix select over the staged
//     chunk takes over: histogram passes on order-preserving keys, then an index-ordered gather.
// topk_merge_kernel: one CTA per row merges the chunks' sorted lists and logsumexp partials.
// Chunks give bs=1 enough CTAs to fill the GPU; rows give large batches theirs.

constexpr int kTopkThreads = 512;
// 3 CTAs per SM: while one runs its barrier stages on staged data, the others' copies are in
// flight (at 2 per SM, bs=64 spent most of each CTA's time outside the staging). Shared memory
// per CTA: a 48 KB chunk + ~19 KB of ChunkShared.
constexpr int kCtasPerSm = 3;
constexpr int kRadixBits = 11;
constexpr int kBins = 1 << kRadixBits;
constexpr int kCandCap = 2048;  // the radix fallback needs kBins/2 + 1024 (K <= 1024)
constexpr int kChunkBytes = 48 * 1024;
constexpr int kMergeMax = 16384;
constexpr int kRankByCount = 1024;  // up to this many candidates, rank by counting instead of sorting
static_assert(kCandCap >= (1 << 11) / 2 + 1024, "the radix fallback keeps its histogram and up to 1024 winners in cand");

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
// 16-bit floats (bf16, fp16) share the sign-magnitude layout, so one key transform serves both.
__device__ __forceinline__ uint32_t key16(uint32_t u) { return (u & 0x8000u) ? (~u & 0xFFFFu) : (u | 0x8000u); }
__device__ __forceinline__ uint16_t bits16(uint32_t k) {
  return (k & 0x8000u) ? uint16_t(k & 0x7FFFu) : uint16_t(~k & 0xFFFFu);
}
template <> struct KeyTraits<__nv_bfloat16> {
  static constexpr int kBits = 16;
  __device__ static uint32_t key(__nv_bfloat16 v) { return key16(__bfloat16_as_ushort(v)); }
  __device__ static float value(uint32_t k) { return __bfloat162float(__ushort_as_bfloat16(bits16(k))); }
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};
template <> struct KeyTraits<__half> {
  static constexpr int kBits = 16;
  __device__ static uint32_t key(__half v) { return key16(__half_as_ushort(v)); }
  __device__ static float value(uint32_t k) { return __half2float(__ushort_as_half(bits16(k))); }
  __device__ static float to_float(__half v) { return __half2float(v); }
};

__device__ __forceinline__ unsigned long long composite(uint32_t key, int64_t index) {
  return (uint64_t(~key) << 32) | uint64_t(index);  // ascending = key desc, then index asc
}

struct ChunkShared {
  unsigned long long cand[kCandCap];  // candidates; the radix fallback uses it as hist + output
  uint32_t tmax[kTopkThreads];
  float red[32];
  uint32_t redk[32];
  uint32_t prefix, prefix_mask;
  int remaining, count, n_greater, eq_taken;
  typename cub::BlockScan<int, kTopkThreads>::TempStorage scan;
};

// Finds the bin holding the `remaining`-th largest key and updates prefix and remaining. All
// threads call it: thread t owns the kPer bins just below those of thread t-1, counting from the
// top bin, so one block-wide inclusive scan in thread order counts from the top bin down. (An
// earlier warp-0 version had each lane sum 64 strided bins: a 32-way bank conflict per read.)
__device__ void select_bin(const uint32_t* hist, ChunkShared& sh, int shift, int bins) {
  constexpr int kPer = kBins / kTopkThreads;
  const int top = kBins - 1 - kPer * int(threadIdx.x);  // this thread's highest bin
  int c[kPer], mine = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int bin = top - j;
    c[j] = bin < bins ? int(hist[bin]) : 0;
    mine += c[j];
  }
  int incl;
  cub::BlockScan<int, kTopkThreads>(sh.scan).InclusiveSum(mine, incl);
  int acc = incl - mine;  // keys in bins above this thread's
  const int need = sh.remaining;
  __syncthreads();  // everyone has read `remaining` before it changes
  if (acc < need && need <= incl) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (acc < need && need <= acc + c[j]) {
        sh.prefix |= uint32_t(top - j) << shift;
        sh.prefix_mask |= uint32_t(bins - 1) << shift;
        sh.remaining = need - acc;
      }
      acc += c[j];
    }
  }
}

// Exact K-th largest key of `keys[0..n)` (any memory), radix select; all threads call it.
template <int kBits, typename KeyAt>
__device__ uint32_t radix_kth(ChunkShared& sh, uint32_t* hist, int n, int k, KeyAt key_at) {
  if (threadIdx.x == 0) { sh.prefix = 0; sh.prefix_mask = 0; sh.remaining = k; }
  for (int shift = kBits; shift > 0;) {
    const int bits = shift >= kRadixBits ? kRadixBits : shift;
    shift -= bits;
    const int bins = 1 << bits;
    for (int i = threadIdx.x; i < kBins; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = sh.prefix, mask = sh.prefix_mask;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const uint32_t key = key_at(i);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & (bins - 1)], 1u);
    }
    __syncthreads();
    select_bin(hist, sh, shift, bins);
    __syncthreads();
  }
  return sh.prefix;
}

__device__ void bitonic_sort(unsigned long long* a, int p2) {
  for (int size = 2; size <= p2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < p2; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned long long x = a[i], y = a[j];
          if ((x > y) == ((i & size) == 0)) { a[i] = y; a[j] = x; }
        }
      }
      __syncthreads();
    }
  }
}

__device__ __forceinline__ int next_pow2(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

template <typename T>
__global__ void __launch_bounds__(kTopkThreads, kCtasPerSm) topk_chunk_kernel(const T* __restrict__ logits, int64_t vocab,
                                                                  int chunk, int splits, int k,
                                                                  unsigned long long* __restrict__ ws_cand,
                                                                  float2* __restrict__ ws_stats) {
  using Traits = KeyTraits<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ChunkShared& sh = *reinterpret_cast<ChunkShared*>(smem_raw);
  T* xs = reinterpret_cast<T*>(smem_raw + (sizeof(ChunkShared) + 15) / 16 * 16);
  const int64_t row = blockIdx.y;
  const int split = blockIdx.x;
  const int64_t start = int64_t(split) * chunk;
  const int64_t left = vocab - start;
  const int len = left < chunk ? int(left) : chunk;
  const T* x = logits + row * vocab + start;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;

  // 1. Stage the chunk, tracking each thread's largest key. Aligned chunks go through cp.async:
  // every thread has all its 16-byte copies in flight at once (a load-then-store loop keeps one
  // per thread, and at large batch the CTA's time was mostly that latency, not bandwidth).
  // A thread then reads back only the vectors it copied itself, so no barrier is needed here.
  uint32_t kmax = 0;
  constexpr int kVec = 16 / sizeof(T);
  int staged = 0;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int nvec = len / kVec;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* sv = reinterpret_cast<uint4*>(xs);
    for (int i = tid; i < nvec; i += blockDim.x) {
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(sv + i));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(xv + i) : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    for (int i = tid; i < nvec; i += blockDim.x) {
      const uint4 raw = sv[i];
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) kmax = max(kmax, Traits::key(vals[j]));
    }
    staged = nvec * kVec;
  }
  for (int i = staged + tid; i < len; i += blockDim.x) {
    xs[i] = x[i];
    kmax = max(kmax, Traits::key(x[i]));
  }
  sh.tmax[tid] = kmax;
  // 2. Chunk max (as a key), then the sum of exp over the staged chunk.
  uint32_t wk = kmax;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) wk = max(wk, __shfl_xor_sync(0xffffffffu, wk, off));
  if (lane == 0) sh.redk[warp] = wk;
  if (tid == 0) sh.count = 0;
  __syncthreads();
  wk = lane < nwarps ? sh.redk[lane] : 0u;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) wk = max(wk, __shfl_xor_sync(0xffffffffu, wk, off));
  const float m = Traits::value(wk);
  float s = 0.f;
  if (m != -INFINITY) {
    for (int i = tid; i < len; i += blockDim.x) s += __expf(Traits::to_float(xs[i]) - m);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) sh.red[warp] = s;
  // 3. tau: the K-th largest per-thread maximum (a lower bound of the chunk's K-th largest).
  uint32_t* hist = reinterpret_cast<uint32_t*>(sh.cand);
  const int kk = min(k, len);
  // With more winners wanted than threads, there is no such bound: every key is a candidate,
  // which overflows the buffer into the exact radix path below.
  const uint32_t tau = kk <= int(blockDim.x)
                           ? radix_kth<Traits::kBits>(sh, hist, blockDim.x, kk, [&](int i) { return sh.tmax[i]; })
                           : 0u;
  __syncthreads();  // the per-warp sums above are complete (radix_kth may not have run)
  if (tid == 0) {
    float total = 0.f;
    for (int w = 0; w < nwarps; ++w) total += sh.red[w];
    ws_stats[row * splits + split] = make_float2(m, total);
  }
  // 4. Candidates >= tau.
  for (int i = tid; i < len; i += blockDim.x) {
    const uint32_t key = Traits::key(xs[i]);
    if (key >= tau) {
      const int slot = atomicAdd(&sh.count, 1);
      if (slot < kCandCap) sh.cand[slot] = composite(key, start + i);
    }
  }
  __syncthreads();
  const int count = sh.count;
  unsigned long long* best = sh.cand;
  unsigned long long* out = ws_cand + (row * splits + split) * int64_t(k);
  if (count <= kRankByCount) {
    // Few candidates: each one's rank is the number of better ones (keys are distinct, and all
    // threads read the same candidate at once: a broadcast, no bank conflicts). No sort stages.
    for (int c = tid; c < count; c += blockDim.x) {
      const unsigned long long mine = sh.cand[c];
      int rank = 0;
      for (int j = 0; j < count; ++j) rank += sh.cand[j] < mine;
      if (rank < kk) out[rank] = mine;
    }
    for (int r = kk + tid; r < k; r += blockDim.x) out[r] = ~0ull;
    return;
  }
  if (count <= kCandCap) {
    const int p2 = next_pow2(count);
    for (int i = count + tid; i < p2; i += blockDim.x) sh.cand[i] = ~0ull;
    __syncthreads();
    bitonic_sort(sh.cand, p2);
  } else {
    // Ties flooded the buffer: exact radix select of the K-th largest key over the chunk, then
    // the keys above it (any order) and the first equal ones in index order, then a sort.
    const uint32_t kth = radix_kth<Traits::kBits>(sh, hist, len, kk, [&](int i) { return Traits::key(xs[i]); });
    const int take_equal = sh.remaining;
    best = sh.cand + kBins / 2;  // after the histogram's 2048 words
    if (tid == 0) { sh.n_greater = 0; sh.eq_taken = 0; }
    __syncthreads();
    constexpr int kItems = 4;
    for (int base = 0; base < len; base += kTopkThreads * kItems) {
      const int first = base + tid * kItems;
      int n_eq = 0;
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int i = first + j;
        if (i < len) {
          const uint32_t key = Traits::key(xs[i]);
          if (key > kth) best[atomicAdd(&sh.n_greater, 1)] = composite(key, start + i);
          else if (key == kth) ++n_eq;
        }
      }
      const int eq_taken = sh.eq_taken;
      __syncthreads();
      if (eq_taken < take_equal) {
        int before, total;
        cub::BlockScan<int, kTopkThreads>(sh.scan).ExclusiveSum(n_eq, before, total);
        int pos = eq_taken + before;
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const int i = first + j;
          if (i < len && Traits::key(xs[i]) == kth) {
            if (pos < take_equal) best[(kk - take_equal) + pos] = composite(kth, start + i);
            ++pos;
          }
        }
        __syncthreads();
        if (tid == 0) sh.eq_taken = eq_taken + total;
      }
      __syncthreads();
    }
    const int p2 = next_pow2(kk);
    for (int i = kk + tid; i < p2; i += blockDim.x) best[i] = ~0ull;
    __syncthreads();
    bitonic_sort(best, p2);
  }
  for (int r = tid; r < k; r += blockDim.x) out[r] = r < kk ? best[r] : ~0ull;
}

// Each chunk's list is sorted and keys are distinct across chunks, so a candidate's final rank is
// its position in its own list plus, for every other list, how many entries there are better
// (a binary search). One pass, no sort stages.
template <typename T>
__global__ void __launch_bounds__(kTopkThreads) topk_merge_kernel(const unsigned long long* __restrict__ ws_cand,
                                                                  const float2* __restrict__ ws_stats, int splits,
                                                                  int k, int64_t* __restrict__ out_ids,
                                                                  float* __restrict__ out_lp,
                                                                  float* __restrict__ out_lse) {
  using Traits = KeyTraits<T>;
  extern __shared__ __align__(16) unsigned long long merge_buf[];
  __shared__ float lse_s;
  const int64_t row = blockIdx.x;
  const int n = splits * k;
  const unsigned long long* in = ws_cand + row * int64_t(n);
  for (int i = threadIdx.x; i < n; i += blockDim.x) merge_buf[i] = in[i];
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int j = 0; j < splits; ++j) m = fmaxf(m, ws_stats[row * splits + j].x);
    float total = 0.f;
    if (m != -INFINITY) {
      for (int j = 0; j < splits; ++j) {
        const float2 st = ws_stats[row * splits + j];
        if (st.x != -INFINITY) total += st.y * __expf(st.x - m);
      }
    }
    lse_s = (m == -INFINITY) ? m : m + logf(total);
  }
  __syncthreads();
  const float lse = lse_s;
  const uint32_t mask = Traits::kBits == 32 ? 0xFFFFFFFFu : 0xFFFFu;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const unsigned long long c = merge_buf[i];
    if (c == ~0ull) continue;  // padding of a short chunk
    const int list = i / k;
    int rank = i - list * k;
    for (int j = 0; j < splits && rank < k; ++j) {
      if (j == list) continue;
      const unsigned long long* other = merge_buf + j * k;
      int lo = 0, hi = k;  // entries of `other` better than c: first position with value > c
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (other[mid] < c) lo = mid + 1; else hi = mid;
      }
      rank += lo;
    }
    if (rank < k) {
      out_ids[row * k + rank] = int64_t(c & 0xFFFFFFFFull);
      out_lp[row * k + rank] = Traits::value(~uint32_t(c >> 32) & mask) - lse;
    }
  }
  if (threadIdx.x == 0) out_lse[row] = lse;
}

struct TopkPlan {
  int splits, chunk;
};

inline TopkPlan topk_plan(int64_t rows, int64_t vocab, int k, int elem_bytes, int sms) {
  const int per_chunk = kChunkBytes / elem_bytes;
  int splits = int((vocab + per_chunk - 1) / per_chunk);
  // Small batches: about two chunks per SM. More (one per resident CTA) measured slower at bs=1:
  // the merge kernel's work grows with the number of chunk lists.
  const int64_t want = 2 * int64_t(sms) / rows;
  if (want > splits) splits = int(want);
  const int max_splits = kMergeMax / k;
  if (splits > max_splits) splits = max_splits;
  int64_t chunk = (vocab + splits - 1) / splits;
  chunk = (chunk + 15) / 16 * 16;  // keep 16-byte alignment of every chunk start
  if (chunk < k) chunk = k;
  splits = int((vocab + chunk - 1) / chunk);
  return TopkPlan{splits, int(chunk)};
}

// Host-side costs are paid once per process: eager calls are dominated by them otherwise.
inline int sm_count() {
  static const int sms = [] {
    int device = 0, n = 132;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n;
  }();
  return sms;
}

// One static per kernel (keyed by the function itself, not its type: instantiations can share one).
template <auto Kernel>
cudaError_t allow_smem_once() {
  static const cudaError_t err =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024);
  return err;
}

template <typename T>
int launch_topk(const void* logits, int64_t rows, int64_t vocab, int k, int64_t* ids, float* lp, float* lse,
                void* workspace, cudaStream_t stream) {
  const TopkPlan plan = topk_plan(rows, vocab, k, sizeof(T), sm_count());
  if (int64_t(plan.chunk) * sizeof(T) > kChunkBytes + 1024) return cudaErrorInvalidValue;  // over the plan's limit
  auto* ws_cand = static_cast<unsigned long long*>(workspace);
  auto* ws_stats = reinterpret_cast<float2*>(ws_cand + rows * plan.splits * int64_t(k));
  const size_t smem = (sizeof(ChunkShared) + 15) / 16 * 16 + size_t(plan.chunk) * sizeof(T);
  cudaError_t err = allow_smem_once<topk_chunk_kernel<T>>();
  if (err != cudaSuccess) return err;
  topk_chunk_kernel<T><<<dim3(unsigned(plan.splits), unsigned(rows)), kTopkThreads, smem, stream>>>(
      static_cast<const T*>(logits), vocab, plan.chunk, plan.splits, k, ws_cand, ws_stats);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const size_t merge_smem = size_t(plan.splits) * k * sizeof(unsigned long long);
  err = allow_smem_once<topk_merge_kernel<T>>();
  if (err != cudaSuccess) return err;
  topk_merge_kernel<T><<<dim3(unsigned(rows)), kTopkThreads, merge_smem, stream>>>(ws_cand, ws_stats, plan.splits, k,
                                                                                   ids, lp, lse);
  return cudaGetLastError();
}

// ------------------------------------------------------------------ best-first tree build
//
// One lane per request runs a binary heap of (score, slot) pairs in shared memory; slot data
// (rank key, metadata) stays put, and the request's log-probs [L, K] are staged in shared memory
// first, so no global load sits on the per-pop path (token ids are written at the end, by the
// whole warp). A sift-down level is one 16-byte load of the child pair. Pop order: score desc,
// then rank tuple asc; score arithmetic is the reference's, in fp32, in the same order.
// (A warp-argmax version over a shared frontier measured 55 us at B=64 against 33 us for this
// heap on the H200, 273 against 125 us at B=256.)

__host__ __device__ inline size_t align16(size_t n) { return (n + 15) / 16 * 16; }

constexpr int kBuildWarps = 4;

__host__ __device__ inline size_t heap_smem_per_warp(int depth_limit, int k, int budget) {
  const int slots = 2 * budget + 2;
  return align16(size_t(depth_limit) * k * sizeof(float)) + align16(size_t(budget + 2) * sizeof(float2)) +
         align16(size_t(slots) * sizeof(int4)) + align16(size_t(slots) * sizeof(RankKey)) +
         align16(size_t(budget) * sizeof(int2));
}

struct HeapItem {
  float score;
  int slot;
};

__device__ __forceinline__ bool heap_better(const HeapItem& a, const HeapItem& b, const RankKey* key) {
  return a.score > b.score || (a.score == b.score && rank_key_less(key[a.slot], key[b.slot]));
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
  unsigned char* base = smem_raw + size_t(warp) * heap_smem_per_warp(depth_limit, k, budget);
  const int slots = 2 * budget + 2;
  float* lp = reinterpret_cast<float*>(base);
  size_t off = align16(size_t(depth_limit) * k * sizeof(float));
  HeapItem* heap = reinterpret_cast<HeapItem*>(base + off);  // 1-based: children of i at 2i, 2i+1
  off += align16(size_t(budget + 2) * sizeof(float2));
  int4* meta = reinterpret_cast<int4*>(base + off);  // parent, depth, rank, prev_sibling
  off += align16(size_t(slots) * sizeof(int4));
  RankKey* key = reinterpret_cast<RankKey*>(base + off);
  off += align16(size_t(slots) * sizeof(RankKey));
  int2* node_dr = reinterpret_cast<int2*>(base + off);

  const float* lp_g = logprobs + int64_t(b) * depth_limit * k;
  for (int i = lane; i < depth_limit * k; i += 32) lp[i] = lp_g[i];
  int32_t* par = parents + int64_t(b) * (budget + 1);
  int32_t* fc = first_child + int64_t(b) * (budget + 1);
  int32_t* ns = next_sibling + int64_t(b) * (budget + 1);
  for (int i = lane; i <= budget; i += 32) { par[i] = -1; fc[i] = -1; ns[i] = -1; }
  __syncwarp();
  int n = 0;
  if (lane == 0 && budget > 0 && k > 0 && depth_limit > 0) {
    int size = 1, next_slot = 1;
    heap[1] = HeapItem{lp[0], 0};
    key[0] = rank_key_with(RankKey{{0, 0, 0}}, 0, 0);
    meta[0] = make_int4(0, 1, 0, -1);
    while (size > 0 && n < budget) {
      const HeapItem top = heap[1];
      const int4 m = meta[top.slot];
      const RankKey tk = key[top.slot];
      const int node = ++n;
      node_dr[node - 1] = make_int2(m.y, m.z);
      par[node] = m.x;
      if (m.z == 0) fc[m.x] = node; else ns[m.w] = node;
      const float* row = lp + (m.y - 1) * k;
      // Replace the root by the next sibling (or the last item), then sift it down.
      HeapItem moving;
      if (m.z + 1 < k) {
        const int slot = next_slot++;
        key[slot] = rank_key_with(tk, m.y - 1, m.z + 1);
        meta[slot] = make_int4(m.x, m.y, m.z + 1, node);
        moving = HeapItem{__fadd_rn(__fsub_rn(top.score, row[m.z]), row[m.z + 1]), slot};
      } else {
        moving = heap[size--];
      }
      if (size > 0) {
        int i = 1;
        while (2 * i <= size) {
          const float4 pair = *reinterpret_cast<const float4*>(&heap[2 * i]);  // children 2i, 2i+1
          HeapItem c = HeapItem{pair.x, __float_as_int(pair.y)};
          int ci = 2 * i;
          if (2 * i + 1 <= size) {
            const HeapItem c1 = HeapItem{pair.z, __float_as_int(pair.w)};
            if (heap_better(c1, c, key)) { c = c1; ci = 2 * i + 1; }
          }
          if (!heap_better(c, moving, key)) break;
          heap[i] = c;
          i = ci;
        }
        heap[i] = moving;
      }
      if (m.y < depth_limit) {  // push the first child, sift up
        const int slot = next_slot++;
        key[slot] = rank_key_with(tk, m.y, 0);
        meta[slot] = make_int4(node, m.y + 1, 0, -1);
        const HeapItem item{__fadd_rn(top.score, lp[m.y * k]), slot};
        int i = ++size;
        while (i > 1) {
          const HeapItem p = heap[i >> 1];
          if (!heap_better(item, p, key)) break;
          heap[i] = p;
          i >>= 1;
        }
        heap[i] = item;
      }
    }
  }
  n = __shfl_sync(0xffffffffu, n, 0);
  __syncwarp();
  const int64_t* id = ids + int64_t(b) * depth_limit * k;
  int64_t* tok = tokens + int64_t(b) * budget;
  int32_t* dep = depths + int64_t(b) * budget;
  int32_t* rk = ranks + int64_t(b) * budget;
  for (int i = lane; i < budget; i += 32) {
    if (i < n) {
      const int2 dr = node_dr[i];
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

int64_t topk_workspace_bytes(DType dtype, int64_t rows, int64_t vocab, int k) {
  const int elem = dtype == DType::kFloat32 ? 4 : 2;
  const TopkPlan plan = topk_plan(rows, vocab, k, elem, sm_count());
  return rows * plan.splits * (int64_t(k) * 8 + 8);
}

int topk_lse_cuda(const void* logits, DType dtype, int64_t rows, int64_t vocab, int k, int64_t* ids,
                  float* logprobs, float* lse, void* workspace, void* stream) {
  if (rows == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: return launch_topk<float>(logits, rows, vocab, k, ids, logprobs, lse, workspace, s);
    case DType::kFloat16: return launch_topk<__half>(logits, rows, vocab, k, ids, logprobs, lse, workspace, s);
    case DType::kBFloat16:
      return launch_topk<__nv_bfloat16>(logits, rows, vocab, k, ids, logprobs, lse, workspace, s);
  }
  return cudaErrorInvalidValue;
}

int build_tree_cuda(const int64_t* ids, const float* logprobs, int bs, int depth_limit, int k, int budget,
                    int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                    int32_t* first_child, int32_t* next_sibling, void* stream) {
  if (bs == 0) return cudaSuccess;
  const size_t per_warp = heap_smem_per_warp(depth_limit, k, budget);
  const int warps = per_warp * kBuildWarps <= 100 * 1024 ? kBuildWarps : 1;
  cudaError_t err = allow_smem_once<build_tree_kernel>();
  if (err != cudaSuccess) return err;
  build_tree_kernel<<<(bs + warps - 1) / warps, warps * 32, size_t(warps) * per_warp,
                      static_cast<cudaStream_t>(stream)>>>(ids, logprobs, bs, depth_limit, k, budget, num_nodes,
                                                           tokens, depths, ranks, parents, first_child,
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

// DDTree CUDA kernels. No torch headers: launchers take raw pointers and a cudaStream_t, so this
// file compiles with plain nvcc (CI does that) and every op is CUDA-graph safe: no host sync, no
// allocation, shapes fixed by the arguments.
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <type_traits>

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
    const uint32_t u = __float_as_uint(v) == 0x80000000u ? 0u : __float_as_uint(v);  // -0 ties with +0
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  __device__ static float value(uint32_t k) {
    const uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
    return __uint_as_float(u);
  }
  __device__ static float to_float(float v) { return v; }
  __device__ static float from_float(float v) { return v; }
};
// 16-bit floats (bf16, fp16) share the sign-magnitude layout, so one key transform serves both.
// -0 maps to +0's key: equal values tie by token id, as in the reference's float sort.
__device__ __forceinline__ uint32_t key16(uint32_t u) {
  u = u == 0x8000u ? 0u : u;
  return (u & 0x8000u) ? (~u & 0xFFFFu) : (u | 0x8000u);
}
__device__ __forceinline__ uint16_t bits16(uint32_t k) {
  return (k & 0x8000u) ? uint16_t(k & 0x7FFFu) : uint16_t(~k & 0xFFFFu);
}
template <> struct KeyTraits<__nv_bfloat16> {
  static constexpr int kBits = 16;
  __device__ static uint32_t key(__nv_bfloat16 v) { return key16(__bfloat16_as_ushort(v)); }
  __device__ static float value(uint32_t k) { return __bfloat162float(__ushort_as_bfloat16(bits16(k))); }
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};
template <> struct KeyTraits<__half> {
  static constexpr int kBits = 16;
  __device__ static uint32_t key(__half v) { return key16(__half_as_ushort(v)); }
  __device__ static float value(uint32_t k) { return __half2float(__ushort_as_half(bits16(k))); }
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
};

constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- the logsumexp in one fixed order, whatever the path, grid, chunking or batch
//
// Every top-K path sums exp in its own layout (a fused CTA's chunk in registers, a streaming
// thread's vectors across the row, a staged chunk in shared memory), and fp32 sums in different
// orders differ in the last bits: a request's log-probs (and, at near-ties, its tree) would
// depend on the path `auto` takes, i.e. on the batch it is in. So the sum has one definition:
//   * the row is cut into segments of 32 16-byte vectors (element e is in vector e / kVec,
//     segment e / (32 kVec), lane (e / kVec) % 32 of it; elements past the row are -inf);
//   * a segment's partial (m_j, s_j): m_j its max (order-free: a max of keys); each lane sums
//     ex2(x * log2e - m_j * log2e) over its vector's elements in index order, then the 32 lane
//     sums are added by an xor butterfly (offsets 16, 8, 4, 2, 1; every lane gets the same sum);
//   * the row: m = max_j m_j; lane l adds s_j * ex2((m_j - m) * log2e) over j = l, l + 32, ...
//     in increasing j, then the same butterfly; lse = m + log(sum).
// A path only has to hand one warp each segment with the lanes in that order: every top-K
// kernel's chunk starts at a multiple of 256 elements (a whole number of segments for every
// dtype), and a warp's 32 consecutive vectors are a segment in each of them.
template <typename T>
__host__ __device__ constexpr int seg_elems() { return 32 * (16 / int(sizeof(T))); }
__host__ __device__ inline int64_t seg_count(int64_t vocab, int elem_bytes) {
  const int64_t per = 32 * (16 / elem_bytes);
  return (vocab + per - 1) / per;
}
constexpr int kSegAlign = 256;  // chunk starts: a multiple of every dtype's segment

// Element j (a compile-time index after unrolling) of a 16-byte vector, as float.
template <typename T>
__device__ __forceinline__ float vec_elem(const uint4& r, int j) {
  if constexpr (sizeof(T) == 4) {
    const uint32_t w = j == 0 ? r.x : j == 1 ? r.y : j == 2 ? r.z : r.w;
    return __uint_as_float(w);
  } else {
    const int q = j >> 1;
    const uint32_t w = q == 0 ? r.x : q == 1 ? r.y : q == 2 ? r.z : r.w;
    const uint32_t h = (j & 1) ? (w >> 16) : (w & 0xFFFFu);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(h << 16);  // exact
    else return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  }
}

// Elements [first, first + 16 / sizeof(T)) of x, those below len; the rest -inf, which adds
// nothing to the max or the sum of exp (the candidate pass checks positions when tau is -inf).
template <typename T>
__device__ __forceinline__ uint4 load_partial(const T* x, int first, int len) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr uint32_t kNegInf = sizeof(T) == 4 ? 0xFF800000u
                               : std::is_same_v<T, __nv_bfloat16> ? 0xFF80FF80u : 0xFC00FC00u;
  uint32_t w[4] = {kNegInf, kNegInf, kNegInf, kNegInf};
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    if (first + j < len) {
      if constexpr (sizeof(T) == 4) {
        w[j] = reinterpret_cast<const uint32_t*>(x)[first + j];
      } else {
        const int shift = 16 * (j % 2);
        const uint32_t bits = reinterpret_cast<const uint16_t*>(x)[first + j];
        w[j / 2] = (w[j / 2] & ~(0xFFFFu << shift)) | (bits << shift);
      }
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The largest value of a 16-byte vector of T: 16-bit types by packed pair maxima (exact).
template <typename T>
__device__ __forceinline__ float vec_max(const uint4& r) {
  if constexpr (sizeof(T) == 4) {
    return fmaxf(fmaxf(__uint_as_float(r.x), __uint_as_float(r.y)), fmaxf(__uint_as_float(r.z), __uint_as_float(r.w)));
  } else {
    using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
    auto pair = [](uint32_t w) { T2 p; memcpy(&p, &w, 4); return p; };
    const T2 m2 = __hmax2(__hmax2(pair(r.x), pair(r.y)), __hmax2(pair(r.z), pair(r.w)));
    return fmaxf(__low2float(m2), __high2float(m2));
  }
}

// A lane's share of a segment: its vector's elements in index order, relative to the segment's
// max m (0 when m is -inf, or for a lane with no vector: `valid` false).
template <typename T>
__device__ __forceinline__ float lane_sum(const uint4& raw, float m, bool valid) {
  constexpr int kVec = 16 / sizeof(T);
  if (!valid || m == -INFINITY) return 0.f;
  const float shift = __fmul_rn(m, kLog2e);
  float p = 0.f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) p = __fadd_rn(p, ex2_approx(__fmaf_rn(vec_elem<T>(raw, j), kLog2e, -shift)));
  return p;
}

// The warp's largest value by a signed max of order-preserving ints (the bits, magnitude flipped
// for negatives: two instructions each way; -0 < +0, so the max is one value whatever the order).
__device__ __forceinline__ int ordered_int(float v) {
  const int b = __float_as_int(v);
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}
__device__ __forceinline__ float warp_max_value(float v) {
  return __int_as_float(ordered_int(__int_as_float(__reduce_max_sync(kFull, ordered_int(v)))));
}

// One segment's partial from its warp: raw is this lane's vector (elements past the row -inf),
// vm the exact max of its elements (-inf: no vector, then valid is false). Every lane of the
// warp calls it and gets the same (m_j, s_j).
template <typename T>
__device__ __forceinline__ float2 segment_partial(const uint4& raw, float vm, bool valid) {
  const float m = warp_max_value(vm);
  float p = lane_sum<T>(raw, m, valid);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) p = __fadd_rn(p, __shfl_xor_sync(kFull, p, off));
  return make_float2(m, p);
}

// Two segments at once, five shuffles instead of ten: lanes 0-15 get the first's partial, lanes
// 16-31 the second's, the same bits as segment_partial (each butterfly addition is the same one,
// the lane's own value first: after the first swap a half holds one segment's pair sums).
template <typename T>
__device__ __forceinline__ float2 segment_partial2(const uint4& r0, float vm0, bool valid0, const uint4& r1, float vm1,
                                                   bool valid1) {
  const float m0 = warp_max_value(vm0), m1 = warp_max_value(vm1);
  const float p0 = lane_sum<T>(r0, m0, valid0), p1 = lane_sum<T>(r1, m1, valid1);
  const bool hi = (threadIdx.x & 16) != 0;
  float q = __fadd_rn(hi ? p1 : p0, __shfl_xor_sync(kFull, hi ? p0 : p1, 16));
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) q = __fadd_rn(q, __shfl_xor_sync(kFull, q, off));
  return make_float2(hi ? m1 : m0, q);
}

// The row's logsumexp from its n segment partials, load(j) -> float2. One full warp calls it;
// every lane gets the result.
template <typename Load>
__device__ float segment_lse(int n, Load load) {
  const int lane = threadIdx.x & 31;
  uint32_t mk = KeyTraits<float>::key(-INFINITY);
  for (int j = lane; j < n; j += 32) mk = max(mk, KeyTraits<float>::key(load(j).x));
  const float m = KeyTraits<float>::value(__reduce_max_sync(kFull, mk));
  if (m == -INFINITY) return m;
  float t = 0.f;
  for (int j = lane; j < n; j += 32) {
    const float2 st = load(j);
    if (st.x != -INFINITY) t = __fadd_rn(t, __fmul_rn(st.y, ex2_approx(__fmul_rn(__fsub_rn(st.x, m), kLog2e))));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) t = __fadd_rn(t, __shfl_xor_sync(kFull, t, off));
  return __fadd_rn(m, logf(t));
}

__device__ __forceinline__ unsigned long long composite(uint32_t key, int64_t index) {
  return (uint64_t(~key) << 32) | uint64_t(index);  // ascending = key desc, then index asc
}

struct ChunkShared {
  unsigned long long cand[kCandCap];  // candidates; the radix fallback uses it as hist + output
  uint32_t tmax[kTopkThreads];
  alignas(16) float red[32];  // read 16 bytes at a time (draft_chunk)
  alignas(16) uint32_t redk[32];
  uint32_t prefix, prefix_mask;
  int remaining, count, n_greater, eq_taken;
  int last;  // fused kernel: this CTA finished its row (or request) last
  int role;  // fused kernel: 0 the row's bound arrives, 1 this CTA selects it for the row, 2 for itself
  typename cub::BlockScan<int, kTopkThreads>::TempStorage scan;
};

// Phase timestamps of the fused launch, for the probe (set_timeline_cuda; null, the default,
// records nothing): where a bs=1 launch spends its time is not visible in Nsight's per-kernel
// totals. Slots: [0] first CTA start, [1] last CTA start, [2] last chunk done, [3] the request's
// top-K done, [4] last CTA end, [10] first chunk done (globaltimer ns); [5] ranking the rows'
// candidates, [6] (counter variant) loading and placing them, [7] tree build, [8] tree write, [9] mask write, and inside the
// parallel build [11] the comb, [12] its radix select, [13] the gather of E, [14] ranking, check
// and records; inside a chunk CTA [15] loads to per-thread max and sum, [16] (counter variant)
// publishing its keys and waiting for the row's bound, (clusters) keys, barriers, bound and
// candidates, [17] (counter variant) selecting the bound (the row's first CTA) and the
// candidates (SM cycles, the largest over CTAs); [18] rows redone exactly, [19] the most
// candidates a row had.
enum TimelineSlot { kTlStart, kTlLastStart, kTlChunks, kTlMerges, kTlEnd, kTlMerge, kTlStage, kTlBuild, kTlWrite,
                    kTlMask, kTlFirstChunk, kTlComb, kTlRadix, kTlGather, kTlRank, kTlChunkScan, kTlChunkBound,
                    kTlChunkCand, kTlExactRows, kTlRowCands, kTlSlots };
static_assert(kTlSlots == 20, "bindings.cpp checks and probe.py allocates 20 timeline slots");

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Thread 0 of the CTA records: slots that keep a first time take the minimum, the rest the maximum.
__device__ __forceinline__ void mark(unsigned long long* tl, int slot, unsigned long long value) {
  if (tl == nullptr || threadIdx.x != 0) return;
  if (slot == kTlStart || slot == kTlFirstChunk) atomicMin(tl + slot, value);
  else atomicMax(tl + slot, value);
}

unsigned long long* g_timeline = nullptr;  // host side: passed to each fused launch

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

// Exact K-th largest key of `keys[0..n)` (any memory), radix select; all threads call it. With
// kStop > 0 the low kStop bits are not resolved: the result is the smallest key of the K-th
// largest key's bin of 2^kStop keys, a lower bound on it one pass sooner.
template <int kBits, typename KeyAt, int kStop = 0>
__device__ uint32_t radix_kth(ChunkShared& sh, uint32_t* hist, int n, int k, KeyAt key_at) {
  if (threadIdx.x == 0) { sh.prefix = 0; sh.prefix_mask = 0; sh.remaining = k; }
  for (int shift = kBits; shift > kStop;) {
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

// Ranks n distinct keys a[0..n) (ascending = better) by counting: emit(key, number of better
// keys) for each. Every thread reads the same key at once (a broadcast, no bank conflicts).
// (Splitting each key's count over up to 8 lanes measured no faster at bs=1 or bs=64, nor did
// four counters in place of one; splitting a row's ~70 candidates over 4 lanes each left the
// cluster variant's ranking at 1.7 us and slowed the many-row top-K, bs=64 111 -> 116 us.)
// All threads of the CTA call it.
__device__ __forceinline__ int count_below(const unsigned long long* a, int n, unsigned long long mine) {
  int rank = 0;
  for (int j = 0; j < n; ++j) rank += a[j] < mine;
  return rank;
}

template <typename Emit>
__device__ void rank_by_count(const unsigned long long* a, int n, Emit emit) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) emit(a[i], count_below(a, n, a[i]));
}

// Slots for `n` items of each lane in a shared buffer, one atomic per warp: returns the lane's
// first slot. All lanes of a warp call it. (An atomic per item on one shared counter queues the
// warps of the CTA behind each other.)
__device__ __forceinline__ int warp_reserve(int* counter, int n) {
  const int lane = threadIdx.x & 31;
  int incl = n;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += y;
  }
  int base = 0;
  if (lane == 31 && incl > 0) base = atomicAdd(counter, incl);
  return __shfl_sync(0xffffffffu, base, 31) + incl - n;
}

// Ranks the `count` (<= kCandCap) candidates in sh.cand by (value desc, index asc) and writes
// the best kk to out[0..k), padding with ~0. All threads call it.
__device__ void write_ranked(ChunkShared& sh, int count, int kk, int k, unsigned long long* out) {
  const int tid = threadIdx.x;
  if (count <= kRankByCount) {  // few candidates: no sort stages
    rank_by_count(sh.cand, count, [&](unsigned long long c, int rank) {
      if (rank < kk) out[rank] = c;
    });
    for (int r = kk + tid; r < k; r += blockDim.x) out[r] = ~0ull;
    return;
  }
  const int p2 = next_pow2(count);
  for (int i = count + tid; i < p2; i += blockDim.x) sh.cand[i] = ~0ull;
  __syncthreads();
  bitonic_sort(sh.cand, p2);
  for (int r = tid; r < k; r += blockDim.x) out[r] = r < kk ? sh.cand[r] : ~0ull;
}

// Ties flooded the candidate buffer (flat logits): exact radix select of the K-th largest key over
// the chunk, then the keys above it (any order) and the first equal ones in index order, then a
// sort. key_at(i) is element i's key, in the key space of `composite`. All threads call it.
template <int kBits, typename KeyAt>
__device__ void exact_topk(ChunkShared& sh, int len, int kk, int k, int64_t start, KeyAt key_at,
                           unsigned long long* out) {
  const int tid = threadIdx.x;
  uint32_t* hist = reinterpret_cast<uint32_t*>(sh.cand);
  const uint32_t kth = radix_kth<kBits>(sh, hist, len, kk, key_at);
  const int take_equal = sh.remaining;
  unsigned long long* best = sh.cand + kBins / 2;  // after the histogram's 2048 words
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
        const uint32_t key = key_at(i);
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
        if (i < len && key_at(i) == kth) {
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
  for (int r = tid; r < k; r += blockDim.x) out[r] = r < kk ? best[r] : ~0ull;
}

// The exact top-K of a whole row of logits x[0..vocab) into list[0..k) (sorted composites), for
// the fused launch's rows whose candidates overflowed (flat or heavily tied logits); ends behind
// a barrier. All threads call it.
template <typename T>
__device__ void exact_row_topk(ChunkShared& sh, const T* x, int64_t vocab, int k, unsigned long long* list) {
  exact_topk<32>(sh, int(vocab), k, k, 0, [&](int i) { return KeyTraits<float>::key(KeyTraits<T>::to_float(x[i])); },
                 list);
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kTopkThreads, kCtasPerSm) topk_chunk_kernel(const T* __restrict__ logits, int64_t vocab,
                                                                  int chunk, int splits, int k,
                                                                  unsigned long long* __restrict__ ws_cand,
                                                                  float2* __restrict__ ws_seg, int n_seg) {
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

  // 1. Stage the chunk and take each thread's largest value. Aligned chunks go through cp.async:
  // every thread has all its 16-byte copies in flight at once, and reads back only the vectors it
  // copied itself (no barrier needed). Values are compared as floats here and below: Nsight showed
  // the kernel issue-bound on integer work (the order-preserving key transform of every element),
  // so keys are made only for the per-thread maxima and for candidates.
  constexpr int kVec = 16 / sizeof(T);
  const int nvec = reinterpret_cast<uintptr_t>(x) % 16 == 0 ? len / kVec : 0;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* sv = reinterpret_cast<const uint4*>(xs);
  if (nvec > 0) {
    for (int i = tid; i < nvec; i += blockDim.x) {
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(sv + i));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(xv + i) : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  }
  float vmax = -INFINITY;
  bool any = false;
  for (int i = tid; i < nvec; i += blockDim.x) {
    const uint4 raw = sv[i];
    const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec; ++j) vmax = fmaxf(vmax, Traits::to_float(vals[j]));
    any = true;
  }
  for (int i = nvec * kVec + tid; i < len; i += blockDim.x) {
    const T v = x[i];
    xs[i] = v;
    vmax = fmaxf(vmax, Traits::to_float(v));
    any = true;
  }
  // The max is one of the thread's own values, so converting it back to T is exact.
  sh.tmax[tid] = any ? Traits::key(Traits::from_float(vmax)) : 0u;
  // 2. Chunk max.
  float wm = vmax;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) wm = fmaxf(wm, __shfl_xor_sync(0xffffffffu, wm, off));
  if (lane == 0) sh.redk[warp] = __float_as_uint(wm);
  if (tid == 0) sh.count = 0;
  __syncthreads();
  wm = lane < nwarps ? __uint_as_float(sh.redk[lane]) : -INFINITY;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) wm = fmaxf(wm, __shfl_xor_sync(0xffffffffu, wm, off));
  const float m = wm;
  // 3. tau: the K-th largest per-thread maximum (a lower bound of the chunk's K-th largest).
  uint32_t* hist = reinterpret_cast<uint32_t*>(sh.cand);
  const int kk = min(k, len);
  // With more winners wanted than threads, there is no such bound: every key is a candidate,
  // which overflows the buffer into the exact radix path below.
  const uint32_t tau = kk <= int(blockDim.x)
                           ? radix_kth<Traits::kBits>(sh, hist, blockDim.x, kk, [&](int i) { return sh.tmax[i]; })
                           : 0u;
  __syncthreads();  // the histogram (in cand) is no longer read
  // 4. The chunk's segment partials of the logsumexp (one fixed order, above): a warp per
  // segment, lane l on its vector l, from the staged chunk (elements past it -inf).
  {
    float2* seg_out = ws_seg + row * n_seg + start / seg_elems<T>();
    for (int j = warp; j * seg_elems<T>() < len; j += nwarps) {
      const int v = j * 32 + lane;
      const bool valid = v * kVec < len;
      const uint4 raw = v < nvec ? sv[v] : load_partial(xs, v * kVec, len);
      const float2 part = segment_partial<T>(raw, valid ? vec_max<T>(raw) : -INFINITY, valid);
      if (lane == 0) seg_out[j] = part;
    }
  }
  (void)m;
  // 5. The candidates (value >= tau). Every element whose key is >= tau has a value >=
  // value(tau), so the candidates include all of them (a -0 equal to +0 may join: harmless,
  // ranks use the exact keys).
  const float tau_f = tau ? Traits::value(tau) : -INFINITY;
  for (int i = tid; i < nvec; i += blockDim.x) {
    const uint4 raw = sv[i];
    const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float f = Traits::to_float(vals[j]);
      if (f >= tau_f) {
        const int slot = atomicAdd(&sh.count, 1);
        if (slot < kCandCap) sh.cand[slot] = composite(Traits::key(vals[j]), start + int64_t(i) * kVec + j);
      }
    }
  }
  for (int i = nvec * kVec + tid; i < len; i += blockDim.x) {
    const float f = Traits::to_float(xs[i]);
    if (f >= tau_f) {
      const int slot = atomicAdd(&sh.count, 1);
      if (slot < kCandCap) sh.cand[slot] = composite(Traits::key(xs[i]), start + i);
    }
  }
  __syncthreads();
  const int count = sh.count;
  unsigned long long* out = ws_cand + (row * splits + split) * int64_t(k);
  if (count <= kCandCap) {
    write_ranked(sh, count, kk, k, out);
  } else {
    exact_topk<Traits::kBits>(sh, len, kk, k, start, [&](int i) { return Traits::key(xs[i]); }, out);
  }
}

// Merging a row's sorted candidate lists (keys distinct across lists) into its top-K. Only
// entries at least as good as tau can make the top K, where tau is the worst of the lists' q-th
// entries (q = ceil(K / lists)): lists x q >= K entries are at least that good. For real logits
// few more than K pass, and each one's rank is the number of better ones among them (every
// thread reads the same entry at once: a broadcast). Measured on the H200 at bs=1 (17 lists):
// the merge took 22 us when every entry was ranked by a binary search in each other list (bank
// conflicts on 8-byte loads); that search remains the fallback when more than `cap` pass.
constexpr int kMergeCap = 1024;

// The lists are in shared memory: buf[j * len + i], ~0 padding last. `pass` holds up to `cap`
// entries. Writes ranks < k. All threads call it.
template <typename Decode>
__device__ void merge_lists(const unsigned long long* buf, int lists, int len, int k, unsigned long long* pass,
                            int cap, float lse, Decode decode, int64_t* out_ids, float* out_lp) {
  __shared__ unsigned long long tau_s;
  __shared__ int count_s;
  if (threadIdx.x < 32) {
    const int q = min((k + lists - 1) / lists, len);
    unsigned long long t = 0;
    for (int j = threadIdx.x; j < lists; j += 32) t = max(t, buf[j * len + q - 1]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) t = max(t, __shfl_xor_sync(0xffffffffu, t, off));
    if (threadIdx.x == 0) { tau_s = t; count_s = 0; }
  }
  __syncthreads();
  const unsigned long long tau = tau_s;
  const int n = lists * len;
  for (int base = 0; base < n; base += blockDim.x) {  // the same trip count in every lane
    const int i = base + int(threadIdx.x);
    const unsigned long long c = i < n ? buf[i] : ~0ull;
    const bool in = c <= tau && c != ~0ull;  // ~0: padding of a short list
    const int slot = warp_reserve(&count_s, in);
    if (in && slot < cap) pass[slot] = c;
  }
  __syncthreads();
  const int count = count_s;
  auto emit = [&](unsigned long long c, int rank) {
    if (rank < k) {
      out_ids[rank] = int64_t(c & 0xFFFFFFFFull);
      out_lp[rank] = decode(c) - lse;
    }
  };
  if (count <= cap) {
    rank_by_count(pass, count, emit);
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const unsigned long long c = buf[i];
      if (c == ~0ull) continue;
      const int list = i / len;
      int rank = i - list * len;
      for (int j = 0; j < lists && rank < k; ++j) {
        if (j == list) continue;
        const unsigned long long* other = buf + j * len;
        int lo = 0, hi = len;  // entries of `other` better than c: first position with value > c
        while (lo < hi) {
          const int mid = (lo + hi) >> 1;
          if (other[mid] < c) lo = mid + 1; else hi = mid;
        }
        rank += lo;
      }
      emit(c, rank);
    }
  }
}

// The chunk lists of a row from global memory (`in`, `segs`: this row's; loads through L2 with
// __ldcg, since in the fused kernel other CTAs wrote them during this launch) -> its top-K.
// buf holds splits * k + kMergeCap entries, seg_buf n_seg partials. All threads call it.
// The segment partials are staged by the whole CTA (one round of loads in flight) before warp 0
// combines them: warp 0 loading them itself made two passes of ~n_seg / 32 (19 at V = 151936,
// bf16) L2 round trips, few in flight, per merge CTA. Same values, same order: the same bits.
template <typename Decode>
__device__ void merge_row(const unsigned long long* in, const float2* segs, int n_seg, int splits, int k,
                          unsigned long long* buf, float2* seg_buf, float& lse_s, Decode decode, int64_t* out_ids,
                          float* out_lp, float* out_lse) {
  const int n = splits * k;
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = __ldcg(in + i);
  if (seg_buf != nullptr) {  // null: too many segments to stage (the launcher's kSegStageMax)
    for (int j = threadIdx.x; j < n_seg; j += blockDim.x) seg_buf[j] = __ldcg(segs + j);
    __syncthreads();
  }
  if (threadIdx.x < 32) {
    const float lse = seg_buf != nullptr ? segment_lse(n_seg, [&](int j) { return seg_buf[j]; })
                                         : segment_lse(n_seg, [&](int j) { return __ldcg(segs + j); });
    if (threadIdx.x == 0) lse_s = lse;
  }
  __syncthreads();
  merge_lists(buf, splits, k, k, buf + n, kMergeCap, lse_s, decode, out_ids, out_lp);
  if (threadIdx.x == 0) *out_lse = lse_s;
}

template <typename T>
__global__ void __launch_bounds__(kTopkThreads) topk_merge_kernel(const unsigned long long* __restrict__ ws_cand,
                                                                  const float2* __restrict__ ws_seg, int n_seg,
                                                                  int splits, int k, bool stage_segs,
                                                                  int64_t* __restrict__ out_ids,
                                                                  float* __restrict__ out_lp,
                                                                  float* __restrict__ out_lse) {
  using Traits = KeyTraits<T>;
  extern __shared__ __align__(16) unsigned long long merge_buf[];
  __shared__ float lse_s;
  const int64_t row = blockIdx.x;
  const uint32_t mask = Traits::kBits == 32 ? 0xFFFFFFFFu : 0xFFFFu;
  merge_row(ws_cand + row * int64_t(splits) * k, ws_seg + row * n_seg, n_seg, splits, k, merge_buf,
            stage_segs ? reinterpret_cast<float2*>(merge_buf + int64_t(splits) * k + kMergeCap) : nullptr, lse_s,
            [&](unsigned long long c) { return Traits::value(~uint32_t(c >> 32) & mask); }, out_ids + row * k,
            out_lp + row * k, out_lse + row);
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
  if (chunk < k) chunk = k;
  chunk = (chunk + kSegAlign - 1) / kSegAlign * kSegAlign;  // whole segments: 16-byte aligned starts
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

// The row merge after a kernel that wrote `plan.splits` lists per row (the chunk or the
// streaming kernel): one CTA per row. Rows of up to kSegStageMax segment partials (32 KB; V =
// 151936 has 594 in 16-bit, 1187 in fp32) are staged in shared memory for the logsumexp.
constexpr int kSegStageMax = 4096;
template <typename T>
int launch_topk_merge(const TopkPlan& plan, int64_t rows, int k, const unsigned long long* ws_cand,
                      const float2* ws_seg, int n_seg, int64_t* ids, float* lp, float* lse, cudaStream_t stream) {
  const bool stage_segs = n_seg <= kSegStageMax;
  const size_t merge_smem =
      (size_t(plan.splits) * k + kMergeCap + (stage_segs ? size_t(n_seg) : 0)) * sizeof(unsigned long long);
  const cudaError_t err = allow_smem_once<topk_merge_kernel<T>>();
  if (err != cudaSuccess) return err;
  topk_merge_kernel<T><<<dim3(unsigned(rows)), kTopkThreads, merge_smem, stream>>>(
      ws_cand, ws_seg, n_seg, plan.splits, k, stage_segs, ids, lp, lse);
  return cudaGetLastError();
}

template <typename T>
int launch_topk(const void* logits, int64_t rows, int64_t vocab, int k, int64_t* ids, float* lp, float* lse,
                void* workspace, cudaStream_t stream) {
  const TopkPlan plan = topk_plan(rows, vocab, k, sizeof(T), sm_count());
  if (int64_t(plan.chunk) * sizeof(T) > kChunkBytes + 1024) return cudaErrorInvalidValue;  // over the plan's limit
  auto* ws_cand = static_cast<unsigned long long*>(workspace);
  auto* ws_seg = reinterpret_cast<float2*>(ws_cand + rows * plan.splits * int64_t(k));
  const int n_seg = int(seg_count(vocab, sizeof(T)));
  const size_t smem = (sizeof(ChunkShared) + 15) / 16 * 16 + size_t(plan.chunk) * sizeof(T);
  cudaError_t err = allow_smem_once<topk_chunk_kernel<T>>();
  if (err != cudaSuccess) return err;
  topk_chunk_kernel<T><<<dim3(unsigned(plan.splits), unsigned(rows)), kTopkThreads, smem, stream>>>(
      static_cast<const T*>(logits), vocab, plan.chunk, plan.splits, k, ws_cand, ws_seg, n_seg);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_topk_merge<T>(plan, rows, k, ws_cand, ws_seg, n_seg, ids, lp, lse, stream);
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

// Global -> shared copy of n floats by `stride` threads, 8 loads in flight per thread: a plain
// load-store loop waits a memory round trip per element (a warp staging B=64 log-probs made
// ~30 of them in a row). Loads go through L2 (__ldcg): the fused kernel stages what other CTAs
// wrote during the same launch.
__device__ __forceinline__ void stage_floats(float* dst, const float* src, int n, int tid, int stride) {
  constexpr int kInFlight = 8;
  for (int base = 0; base < n; base += kInFlight * stride) {
    float v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = base + u * stride + tid;
      v[u] = i < n ? __ldcg(src + i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = base + u * stride + tid;
      if (i < n) dst[i] = v[u];
    }
  }
}

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

  stage_floats(lp, logprobs + int64_t(b) * depth_limit * k, depth_limit * k, lane, 32);
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

// ------------------------------------------------------------------ fused draft step (K, B <= 256)
//
// One launch from logits to tree and mask. Every CTA takes one chunk of one row:
//   * the chunk stays in registers (no shared-memory staging): 4 x 16-byte loads per thread, all
//     in flight at once, then every pass below reads registers;
//   * per-thread max and sum of exp relative to it (no barrier), combined per CTA once;
//   * candidates >= tau, where tau is the smallest over warps of the warp's q-th largest
//     per-thread maximum (q = ceil(K / warps)): warps x q distinct elements are >= tau, so at
//     least K are. A warp finds its q-th largest with a shuffle sort, no barrier;
//   * candidates are ranked as in topk_chunk_kernel (count, sort, or exact radix fallback).
// The last CTA to finish a row (atomic counter) merges the row's chunk lists; the last row of a
// request to finish builds its tree and mask. The counters return to zero when used, and the
// launcher zeroes them first (a memset node in a graph).
// Values compare as floats (keys from fp32, -0 folded into +0), so equal values tie by token id.

constexpr int kDraftThreads = kTopkThreads;  // shares ChunkShared and the ranking helpers
constexpr int kDraftWarps = kDraftThreads / 32;
constexpr int kDraftVecs = 4;  // 16-byte vectors per thread: chunks up to 32 KB (6 spilled at 64 registers)
constexpr int kFastMaxK = 256, kFastMaxBudget = 256;

// One chunk into registers (Vecs x 16-byte loads per thread, all in flight at once), each
// vector's max, each thread's max, and the chunk's segment partials: store(j, partial) for the
// chunk's segment j (vector v of warp w is segment v * warps + w), called by the one lane that
// holds it. The chunk starts at a multiple of kSegAlign elements. Vectors wholly past the chunk
// are not loaded (at bs=1 a thread holds 2-3 of its 4: Nsight counted the chunk CTAs
// issue-bound, ~1100 instructions a warp).
template <typename T, int Vecs, typename Store>
__device__ __forceinline__ void scan_chunk(const T* __restrict__ x, int len, uint4 (&raw)[Vecs],
                                           float (&vmax)[Vecs], float& tmax, Store store) {
  constexpr int kVec = 16 / sizeof(T);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;
#pragma unroll
  for (int v = 0; v < Vecs; ++v) {
    const int first = (v * kDraftThreads + tid) * kVec;
    if (aligned && first + kVec <= len) raw[v] = __ldcs(reinterpret_cast<const uint4*>(x + first));
    else raw[v] = load_partial(x, first, len);
  }
  tmax = -INFINITY;
#pragma unroll
  for (int v = 0; v < Vecs; ++v) {
    vmax[v] = -INFINITY;
    if ((v * kDraftThreads + tid) * kVec < len) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) vmax[v] = fmaxf(vmax[v], vec_elem<T>(raw[v], j));
    }
    tmax = fmaxf(tmax, vmax[v]);
  }
  // Uniform over the warp: does segment v hold any element of the chunk?
  auto in_chunk = [&](int v) { return (v * kDraftThreads + warp * 32) * kVec < len; };
  auto valid = [&](int v) { return (v * kDraftThreads + tid) * kVec < len; };
#pragma unroll
  for (int v = 0; v + 1 < Vecs; v += 2) {
    if (in_chunk(v)) {
      const float2 part = segment_partial2<T>(raw[v], vmax[v], valid(v), raw[v + 1], vmax[v + 1], valid(v + 1));
      if (lane == 0) store(v * kDraftWarps + warp, part);
      if (lane == 16 && in_chunk(v + 1)) store((v + 1) * kDraftWarps + warp, part);
    }
  }
  if constexpr (Vecs % 2 == 1) {
    constexpr int v = Vecs - 1;
    if (in_chunk(v)) {
      const float2 part = segment_partial<T>(raw[v], vmax[v], valid(v));
      if (lane == 0) store(v * kDraftWarps + warp, part);
    }
  }
}

// How the fused launch bounds a row (draft_layout picks them): each warp offers its qw largest
// per-thread maxima, each CTA publishes the qc largest of those, and a CTA writes at most `cap`
// candidates (more: the row is redone exactly). Model: `PYTHONPATH=kernels python -m ddtree.stream_model --fused`.
struct RowBound {
  int qw, qc, cap;
};

constexpr unsigned long long kBoundWaitNs = 20000;  // then go on with what the row has published

// Between CTAs. Published keys and the row's bound are self-validating 64-bit words (1 << 32 |
// key; the workspace is zeroed before the launch), stored and polled relaxed: no fence sits on
// the row's path (the release pattern, every publisher's fence and counter, then the last
// one's loads, took ~3.4 us from the last publish to the bound at bs=1). The request's counter
// is an acquire-release add after the CTA's barrier (CUTLASS's generic barrier pattern).
__device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_relaxed(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// The warp's qw largest thread maxima as keys (a lane's is taken once: distinct elements) into
// sh.tmax[warp * qw ..], then the CTA's max (returned; sh.red holds the warps'). Zeroes sh.count
// and sh.prefix; contains the CTA's barrier. All threads call it.
__device__ __forceinline__ float offer_keys(ChunkShared& sh, float tmax, int qw) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint32_t mine = KeyTraits<float>::key(tmax);
  for (int i = 0; i < qw; ++i) {
    const uint32_t top = __reduce_max_sync(kFull, mine);
    if (lane == 0) {
      sh.tmax[warp * qw + i] = top;
      if (i == 0) sh.red[warp] = KeyTraits<float>::value(top);
    }
    if (lane == __ffs(__ballot_sync(kFull, mine == top)) - 1) mine = 0;
  }
  if (tid == 0) { sh.count = 0; sh.prefix = 0; }
  __syncthreads();
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kDraftWarps; w += 4) {  // 16-byte reads: sh.red is 16-byte aligned
    const float4 a = *reinterpret_cast<const float4*>(sh.red + w);
    m = fmaxf(m, fmaxf(fmaxf(a.x, a.y), fmaxf(a.z, a.w)));
  }
  return m;
}

// The CTA's qc largest offered keys (ties by slot): publish(rank, key) for rank < qc. One warp calls it.
template <typename Publish>
__device__ __forceinline__ void cta_keys(const uint32_t* offered_keys, RowBound rb, Publish publish) {
  const int lane = threadIdx.x & 31, offered = kDraftWarps * rb.qw;
  for (int i = lane; i < offered; i += 32) {
    const uint32_t ki = offered_keys[i];
    int rank = 0;
    for (int j = 0; j < offered; ++j) {
      const uint32_t kj = offered_keys[j];
      rank += kj > ki || (kj == ki && j < i);
    }
    if (rank < rb.qc) publish(rank, ki);
  }
}

// sh.prefix = the K-th largest of keys[0..n) (0, nothing, is never chosen: fewer than K keys leave
// sh.prefix as it was, 0). Four threads count for each key; every key that is the K-th largest
// writes the same value. All threads call it; the caller's barrier follows.
__device__ __forceinline__ void select_kth_key(ChunkShared& sh, const uint32_t* keys, int n, int k) {
  const int tid = threadIdx.x;
  constexpr int kParts = 4;
  for (int base = 0; base < n; base += kDraftThreads / kParts) {  // the same trip count everywhere
    const int i = base + tid / kParts;
    const uint32_t ki = i < n ? keys[i] : 0u;
    int greater = 0, at_least = 0;
    if (i < n) {
      for (int j = tid % kParts; j < n; j += kParts) {
        const uint32_t kj = keys[j];
        greater += kj > ki;
        at_least += kj >= ki;
      }
    }
#pragma unroll
    for (int off = 1; off < kParts; off <<= 1) {
      greater += __shfl_xor_sync(kFull, greater, off);
      at_least += __shfl_xor_sync(kFull, at_least, off);
    }
    if (ki != 0u && tid % kParts == 0 && greater < k && at_least >= k) sh.prefix = ki;
  }
}

// The thread's elements >= tau (the key tau_key; 0: -inf, every element of the chunk, positions
// checked since vectors past the chunk hold -inf) into dst[slot * stride] for slot < cap, slots
// reserved one atomic per warp on *counter (which counts past cap). Only vectors whose max
// reaches tau are looked at. All threads call it.
template <typename T, int Vecs>
__device__ __forceinline__ void append_candidates(const uint4 (&raw)[Vecs], const float (&vmax)[Vecs],
                                                  uint32_t tau_key, int len, int64_t start, int* counter,
                                                  unsigned long long* dst, int64_t stride, int cap) {
  constexpr int kVec = 16 / sizeof(T);
  const int tid = threadIdx.x;
  const float tau = tau_key == 0u ? -INFINITY : KeyTraits<float>::value(tau_key);
  auto take = [&](float f, int pos) { return f >= tau && (tau != -INFINITY || pos < len); };
  int found = 0;
#pragma unroll
  for (int v = 0; v < Vecs; ++v) {
    if (vmax[v] >= tau) {
      const int first = (v * kDraftThreads + tid) * kVec;
#pragma unroll
      for (int j = 0; j < kVec; ++j) found += take(vec_elem<T>(raw[v], j), first + j);
    }
  }
  if (!__any_sync(kFull, found > 0)) return;
  int slot = warp_reserve(counter, found);
#pragma unroll
  for (int v = 0; v < Vecs; ++v) {
    if (found > 0 && vmax[v] >= tau) {
      const int first = (v * kDraftThreads + tid) * kVec;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float f = vec_elem<T>(raw[v], j);
        if (take(f, first + j)) {
          if (slot < cap) dst[slot * stride] = composite(KeyTraits<float>::key(f), start + first + j);
          ++slot;
        }
      }
    }
  }
}

// One chunk of a row in the fused launch's counter variant: its (max, candidate count) into
// *record, its segment partials (the logsumexp's, above) into seg_out and its candidates,
// unranked, into cand[slot * cand_stride] (slot < cap).
// Candidates are the elements >= tau, tau being the
// K-th largest key the row's CTAs published: every published key is a distinct element (a thread's
// maximum), so at least K elements are >= tau and none below it can make the row's top K (equal
// ones are kept: ties go by token id). On bf16 rows of randn x 3 that leaves ~67 candidates a row
// for K = 64 (the chunk-local bound this replaced let ~250 through per chunk, each chunk ranking
// its own and a merge CTA merging the lists: 13.5 us of the bs=1 launch). The row's first CTA
// collects the keys and publishes tau; the waits are bounded, since the grid need not be
// resident at once: keys not yet published read as 0 (the workspace is zeroed before the
// launch) and a looser bound still is one (fewer than K keys: tau = -inf, every element a
// candidate).
template <typename T>
__device__ void draft_chunk(const T* __restrict__ x, int len, int64_t start, int k, int splits, int split,
                            RowBound rb, ChunkShared& sh, unsigned long long* row_keys,
                            unsigned long long* row_tau, unsigned long long* cand, int64_t cand_stride,
                            float4* record, float2* seg_out, unsigned long long* tl) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long t0 = clock64();
  uint4 raw[kDraftVecs];
  float vmax[kDraftVecs], tmax;
  scan_chunk<T, kDraftVecs>(x, len, raw, vmax, tmax, [&](int j, float2 part) { seg_out[j] = part; });
  long long t1 = clock64();
  mark(tl, kTlChunkScan, t1 - t0);
  uint32_t* warp_keys = sh.tmax;                       // [kDraftWarps * qw]
  const float m = offer_keys(sh, tmax, rb.qw);
  const int n_pub = splits * rb.qc;
  uint32_t* row_keys_s = reinterpret_cast<uint32_t*>(sh.cand);  // [n_pub] (<= 4096: draft_layout)
  if (warp == 0) {
    // This CTA's qc largest offered keys (ties by slot). The row's first CTA collects the row's
    // keys and selects the bound for all; the others wait for it. Either wait is bounded: the
    // grid need not be resident at once, and any subset of the keys gives a bound (keys never
    // published read as 0; a CTA whose wait for the bound ran out selects from what it finds).
    cta_keys(warp_keys, rb, [&](int rank, uint32_t key) {
      store_relaxed(row_keys + split * rb.qc + rank, (1ull << 32) | key);
    });
    int role = split == 0 ? 1 : 0;
    const unsigned long long deadline = global_ns() + (role == 1 ? kBoundWaitNs : 2 * kBoundWaitNs);
    if (role == 0) {
      unsigned long long got = 0;
      if (lane == 0) {
        while (((got = load_relaxed(row_tau)) >> 32) == 0 && global_ns() < deadline) {
        }
      }
      got = __shfl_sync(kFull, got, 0);
      if ((got >> 32) != 0) {
        if (lane == 0) sh.prefix = uint32_t(got);
      } else {
        role = 2;
      }
    }
    if (role != 0) {
      // Collect the published keys (8 loads in flight per lane), again until all are there.
      bool all;
      do {
        all = true;
        for (int base = 0; base < n_pub; base += 32 * 8) {
          unsigned long long v[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) v[u] = base + u * 32 + lane < n_pub ? load_relaxed(row_keys + base + u * 32 + lane) : 1ull << 32;
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            all &= (v[u] >> 32) != 0;
            if (base + u * 32 + lane < n_pub) row_keys_s[base + u * 32 + lane] = uint32_t(v[u]);
          }
        }
        all = __all_sync(kFull, all);
      } while (!all && global_ns() < deadline);
    }
    if (lane == 0) sh.role = role;
  }
  __syncthreads();
  long long t2 = clock64();
  mark(tl, kTlChunkBound, t2 - t1);
  if (sh.role != 0) {
    select_kth_key(sh, row_keys_s, n_pub, k);
    __syncthreads();
    if (tid == 0 && sh.role == 1) store_relaxed(row_tau, (1ull << 32) | sh.prefix);
  }
  append_candidates<T, kDraftVecs>(raw, vmax, sh.prefix, len, start, &sh.count, cand, cand_stride, rb.cap);
  __syncthreads();
  mark(tl, kTlChunkCand, clock64() - t2);
  if (tid == 0) *record = make_float4(m, 0.f, __int_as_float(sh.count), 0.f);  // the sum: seg_out
}

// ---- top-K for many rows: one streaming pass per (row, split)
//
// The chunk kernel stages 48 KB, then runs its barrier stages with no load in flight: at bs=64
// it read at ~1.5 TB/s of the ~4 the copy engine reaches. Here each thread streams its own
// 16-byte vectors through a private cp.async ring in shared memory — three steps of two vectors
// in flight per thread, no barrier, since a thread reads back only what it copied — keeping a
// running max and sum of exp. Candidates: a vector holding an element >= tau is staged (its
// number), where tau, a lower bound of the item's K-th largest, rises as the stream goes: each
// warp publishes the q-th largest (q = ceil(K / warps)) of its lanes' running maxima, i.e. q
// distinct elements at least that large, and tau is the smallest published bound, so K elements
// already seen are >= tau. An element below tau cannot make the top K; equal ones are kept (ties
// go by token id). Publishing needs no barrier: a warp's bound only rises, and a stale one is
// still a bound. At the end the staged vectors are read again, their elements below the final
// tau dropped and the rest ranked by counting; if ties flood the buffers (flat logits) the exact
// radix path reads the item again.
constexpr int kStreamThreads = 512;
constexpr int kStreamWarps = kStreamThreads / 32;
constexpr int kStreamVecs = 2;        // 16-byte vectors per thread and step (one commit group)
constexpr int kStreamDepth = 4;       // ring steps per thread (a power of two): 64 KB a CTA
constexpr int kStreamCtasPerSm = 2;   // 2 x (64 KB ring + ChunkShared): ~96 KB in flight per SM
// q = ceil(K / 16) lane maxima per warp. At K = 256 (q = 16, the warp's median) on bf16 rows of
// randn x 3 ~2200 vectors are staged and ~550 elements survive the final bound (stream_model.py),
// within the caps below: bs=64 top-K 409.8 us (the chunk kernel) -> 231.8 (this one), same run
// (an earlier version, staging fewer vectors, took 1.5 ms there). fp32 rows have twice the
// vectors, so twice as many staged, near kStreamStaged: they stay at K <= 64, unmeasured above.
constexpr int kStreamMaxK16 = 256;
constexpr int kStreamMaxK32 = 64;
constexpr int kStreamStaged = 4096;  // candidate vectors' numbers, in ChunkShared::cand
constexpr int kStreamRingBytes = kStreamThreads * kStreamDepth * kStreamVecs * 16;
static_assert(kStreamStaged * 4 <= kCandCap * 8, "staged numbers live in ChunkShared::cand");
static_assert((kStreamDepth & (kStreamDepth - 1)) == 0, "ring index by mask");

// Element j's key (the order-preserving key of `composite`) of a 16-byte vector of T.
template <typename T>
__device__ __forceinline__ uint32_t vec_key(const uint4& r, int j) {
  if constexpr (sizeof(T) == 4) {
    return KeyTraits<float>::key(vec_elem<float>(r, j));
  } else {
    const int q = j >> 1;
    const uint32_t w = q == 0 ? r.x : q == 1 ? r.y : q == 2 ? r.z : r.w;
    return key16((j & 1) ? (w >> 16) : (w & 0xFFFFu));
  }
}

// The q-th largest (1-based) of the warp's 32 values, to every lane: up to q rounds of a
// hardware max over order-preserving keys, each taking out the lanes that hold it (~30
// instructions at q = 4, against ~100 for a shuffle sort).
__device__ __forceinline__ float warp_qth_largest(float v, int q) {
  uint32_t key = KeyTraits<float>::key(v);
  for (int seen = 0;;) {
    const uint32_t top = __reduce_max_sync(kFull, key);
    seen += __popc(__ballot_sync(kFull, key == top));
    if (seen >= q) return KeyTraits<float>::value(top);  // each round takes out >= 1 lane
    if (key == top) key = 0u;  // below every float's key
  }
}

template <typename T>
__global__ void __launch_bounds__(kStreamThreads, kStreamCtasPerSm)
    topk_stream_kernel(const T* __restrict__ logits, int64_t vocab, int chunk, int splits, int k,
                       unsigned long long* __restrict__ ws_cand, float2* __restrict__ ws_seg, int n_seg) {
  using Traits = KeyTraits<T>;
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kPerStep = kStreamVecs * kStreamThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ChunkShared& sh = *reinterpret_cast<ChunkShared*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // ring[(step slot * kStreamVecs + u) * T + tid]: each vector's 512 copies are contiguous, so
  // the copies and the reads back are conflict-free and every copy instruction is coalesced.
  uint4* ring = reinterpret_cast<uint4*>(smem_raw + align16(sizeof(ChunkShared))) + tid;
  int* staged_at = reinterpret_cast<int*>(sh.cand);  // candidate vectors' numbers, until the end
  volatile float* bound = reinterpret_cast<float*>(sh.tmax);  // [kStreamWarps]
  const int64_t row = blockIdx.y;
  const int split = blockIdx.x;
  const int64_t start = int64_t(split) * chunk;
  const int len = int(min(int64_t(chunk), vocab - start));
  const T* x = logits + row * vocab + start;
  const uint4* xv = reinterpret_cast<const uint4*>(x) + tid;
  const int nvec = len / kVec;  // the launcher sends items of whole, 16-byte aligned vectors only
  const int steps = (nvec + kPerStep - 1) / kPerStep;
  const int kk = min(k, len);
  const int q = (kk + kStreamWarps - 1) / kStreamWarps;

  // One commit group per step (empty past the last), so wait_group counts steps. Vector u of
  // step i is vector (i * kStreamVecs + u) * T + tid of the item. Steps are issued in order:
  // the source pointer and the count of this thread's vectors left just advance (the SASS
  // recomputed a 64-bit address per copy from the step index).
  const uint4* src = xv;
  int left = nvec - tid;  // this thread's vectors not yet issued: those at src + u * T, u * T < left
  auto issue = [&](int i) {
    const unsigned dst = unsigned(__cvta_generic_to_shared(ring + (i & (kStreamDepth - 1)) * kPerStep));
#pragma unroll
    for (int u = 0; u < kStreamVecs; ++u) {
      if (u * kStreamThreads < left)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + u * kStreamThreads * 16),
                     "l"(src + u * kStreamThreads) : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    src += kPerStep;
    left -= kPerStep;
  };
  // Step i's vectors once they landed. The copies issued first go into the slot step i - 1
  // came from, whose values the previous step has already used.
  auto next = [&](int i, uint4 (&raw)[kStreamVecs]) {
    issue(i + kStreamDepth - 1);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStreamDepth - 1) : "memory");
#pragma unroll
    for (int u = 0; u < kStreamVecs; ++u) raw[u] = ring[((i & (kStreamDepth - 1)) * kStreamVecs + u) * kStreamThreads];
  };
  float m = -INFINITY;  // running max (the bound's)
  // Vector u of step i of this warp's lanes is one segment of the logsumexp (above); the step's
  // two are summed together (segment_partial2), their partials stored by lanes 0 and 16.
  static_assert(kStreamVecs == 2, "one segment pair a step");
  float2* seg_out = ws_seg + row * n_seg + start / seg_elems<T>();
  auto absorb = [&](int i, const uint4 (&raw)[kStreamVecs], float (&vm)[kStreamVecs]) {  // -inf past the item
    const int s0 = (i * kStreamVecs) * kStreamThreads + warp * 32;  // the first segment's first vector
    const int s1 = s0 + kStreamThreads;
    if (s1 + 32 <= nvec) {  // both segments whole (uniform; all but a row's last steps): no checks
      vm[0] = vec_max<T>(raw[0]);
      vm[1] = vec_max<T>(raw[1]);
      const float2 part = segment_partial2<T>(raw[0], vm[0], true, raw[1], vm[1], true);
      if ((lane & 15) == 0) seg_out[s0 / 32 + lane] = part;  // lane 16: segment s1 / 32 = s0 / 32 + 16
      m = fmaxf(m, fmaxf(vm[0], vm[1]));
      return;
    }
    const bool mine0 = s0 + lane < nvec, mine1 = s1 + lane < nvec;
    vm[0] = mine0 ? vec_max<T>(raw[0]) : -INFINITY;
    vm[1] = mine1 ? vec_max<T>(raw[1]) : -INFINITY;
    if (s0 < nvec) {  // uniform over the warp
      const float2 part = segment_partial2<T>(raw[0], vm[0], mine0, raw[1], vm[1], mine1);
      // Lane 0 holds segment s0 / 32, lane 16 segment s1 / 32 = s0 / 32 + 16: one store.
      if ((lane & 15) == 0 && (lane == 0 || s1 < nvec)) seg_out[s0 / 32 + lane] = part;
    }
    m = fmaxf(m, fmaxf(vm[0], vm[1]));
  };
  // A vector holding an element >= tau is staged by its number; its elements are sorted out
  // once, at the end, against the final bound (reading it again: ~650 vectors of a 19k-vector
  // row). (Taking elements here cost ~57 warp instructions per event, the warp following the
  // one lane that had one: Nsight counted ~157 instructions per vector step at bs=64, a third
  // of them this. Staging whole vectors in shared memory capped them at 1024, which some rows
  // passed: their exact fallback doubled the launch.)
  auto take = [&](int v) {
    const int slot = atomicAdd(&sh.count, 1);
    if (slot < kStreamStaged) staged_at[slot] = v;
  };
  auto publish = [&] {
    const float b = warp_qth_largest(m, q);
    if (lane == 0) bound[warp] = b;
  };
  auto current_tau = [&] {
    float t = lane < kStreamWarps ? bound[lane] : INFINITY;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) t = fminf(t, __shfl_xor_sync(kFull, t, off));
    return t;
  };

  if (tid == 0) sh.count = 0;
#pragma unroll
  for (int i = 0; i < kStreamDepth - 1; ++i) issue(i);
  // The first step sets the first bound (one barrier) before any candidate is taken.
  uint4 raw[kStreamVecs];
  float vmax[kStreamVecs];
  if (steps > 0) next(0, raw);
  absorb(0, raw, vmax);
  publish();
  __syncthreads();
  float tau = current_tau();
#pragma unroll
  for (int u = 0; u < kStreamVecs; ++u)
    if (u * kStreamThreads + tid < nvec && vmax[u] >= tau) take(u * kStreamThreads + tid);
  // Then the bound is raised after 2, 3, 4, 6, 9, 13, ... steps (each window adds about half
  // the candidates the last bound let through).
  int refresh = 2;
  for (int i = 1; i < steps; ++i) {
    next(i, raw);
    absorb(i, raw, vmax);
#pragma unroll
    for (int u = 0; u < kStreamVecs; ++u) {
      const int v = (i * kStreamVecs + u) * kStreamThreads + tid;
      if (vmax[u] >= tau && v < nvec) take(v);
    }
    if (i + 1 == refresh) {
      publish();
      tau = current_tau();
      refresh += max(1, refresh / 2);
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  publish();
  __syncthreads();
  const float tau_final = current_tau();
  const int count = sh.count;
  unsigned long long* out = ws_cand + (row * splits + split) * int64_t(k);
  // Flat logits flood the buffers (the bound never rose, or ties at it): the exact path.
  bool flooded = count > kStreamStaged;
  if (!flooded) {
    // The staged vectors' elements that the final bound lets through, as ranked candidates.
    constexpr int kPer = kStreamStaged / kStreamThreads;
    int held_at[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int c = tid + u * kStreamThreads;
      held_at[u] = c < count ? staged_at[c] : -1;
    }
    __syncthreads();
    if (tid == 0) sh.count = 0;
    __syncthreads();
    const uint4* item = reinterpret_cast<const uint4*>(x);
#pragma unroll
    for (int half = 0; half < kPer; half += kPer / 2) {  // half the loads in flight at once
      uint4 vec[kPer / 2];
#pragma unroll
      for (int u = 0; u < kPer / 2; ++u)
        if (held_at[half + u] >= 0) vec[u] = item[held_at[half + u]];
#pragma unroll
      for (int u = 0; u < kPer / 2; ++u) {
        if (held_at[half + u] < 0) continue;
        const int64_t first = start + int64_t(held_at[half + u]) * kVec;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          if (vec_elem<T>(vec[u], j) >= tau_final) {
            const int slot = atomicAdd(&sh.count, 1);
            if (slot < kCandCap) sh.cand[slot] = composite(vec_key<T>(vec[u], j), first + j);
          }
        }
      }
    }
    __syncthreads();
    flooded = sh.count > kCandCap;
  }
  if (flooded) {
    exact_topk<Traits::kBits>(sh, len, kk, k, start, [&](int i) { return Traits::key(x[i]); }, out);
    return;
  }
  write_ranked(sh, sh.count, kk, k, out);
}


// ---- the tree build of the fused path: one warp, the frontier in registers.
//
// The frontier holds, for every popped node p (and the root, p = 0), the entry of p's next
// unpopped child: slot p, in lane p % 32, register p / 32 (F = ceil(B / 32) per lane). Popping
// node i from slot p puts i's next sibling into slot p (the same lane: nothing moves) and i's
// first child into slot i, which is empty until then: the only cross-lane traffic of a pop is
// the vote and four shuffles from the popping lane to lane i % 32. Each entry carries the scores
// its own sibling and first child will get, and a lane's best entry has the log-probs its
// successors' successors need loaded in advance, so a pop makes its new entries without waiting
// on a load. The popping lane writes the node's record. Exact score ties (equal keys) go to a
// slower branch that compares rank tuples rebuilt from the records.
// (v9 kept entries by position with a packed parent and a rank tuple per node, broadcast 8
// fields to all lanes per pop and updated them under lane 0: ~245 instructions per pop.)

constexpr int kSelectCap = 1024;  // nodes the parallel build may gather before it falls back

// The parallel build's workspace (select_build): comb scores, then the gathered nodes E.
struct SelectSmem {
  float* comb;    // [L * min(K, B)]
  float* score;   // [kSelectCap]
  int* dr;        // depth | rank << 8
  int* par;       // index in E of the parent, -1: the root
  int* prev;      // index in E of the previous sibling, -1: none
  int* rank;      // position by (score desc, rank tuple asc)
  RankKey* key;   // rank tuple
  int* flags;     // [0] |E| (-1: gave up), [1] a check failed
};

struct BuildSmem {
  float* lp;  // [L * K] log-probs of the request
  int* par;   // [B + 1]
  int* fc;    // [B + 1]
  int* ns;    // [B + 1]
  int* dr;    // [B]: depth | rank << 8 of node i at i - 1
  SelectSmem sel;
};

__host__ __device__ inline size_t select_smem(int depth_limit, int k, int budget) {
  return align16(size_t(depth_limit) * (k < budget ? k : budget) * 4) + 5 * align16(size_t(kSelectCap) * 4) +
         align16(size_t(kSelectCap) * sizeof(RankKey)) + 16;
}

__host__ __device__ inline size_t fast_build_smem(int depth_limit, int k, int budget) {
  return align16(size_t(depth_limit) * k * 4) + 3 * align16(size_t(budget + 1) * 4) + align16(size_t(budget) * 4) +
         select_smem(depth_limit, k, budget);
}

__device__ inline BuildSmem carve_build_smem(unsigned char* base, int depth_limit, int k, int budget) {
  BuildSmem s;
  size_t off = 0;
  s.lp = reinterpret_cast<float*>(base + off); off += align16(size_t(depth_limit) * k * 4);
  s.par = reinterpret_cast<int*>(base + off); off += align16(size_t(budget + 1) * 4);
  s.fc = reinterpret_cast<int*>(base + off); off += align16(size_t(budget + 1) * 4);
  s.ns = reinterpret_cast<int*>(base + off); off += align16(size_t(budget + 1) * 4);
  s.dr = reinterpret_cast<int*>(base + off); off += align16(size_t(budget) * 4);
  SelectSmem& w = s.sel;
  w.comb = reinterpret_cast<float*>(base + off); off += align16(size_t(depth_limit) * min(k, budget) * 4);
  w.score = reinterpret_cast<float*>(base + off); off += align16(size_t(kSelectCap) * 4);
  w.dr = reinterpret_cast<int*>(base + off); off += align16(size_t(kSelectCap) * 4);
  w.par = reinterpret_cast<int*>(base + off); off += align16(size_t(kSelectCap) * 4);
  w.prev = reinterpret_cast<int*>(base + off); off += align16(size_t(kSelectCap) * 4);
  w.rank = reinterpret_cast<int*>(base + off); off += align16(size_t(kSelectCap) * 4);
  w.key = reinterpret_cast<RankKey*>(base + off); off += align16(size_t(kSelectCap) * sizeof(RankKey));
  w.flags = reinterpret_cast<int*>(base + off);
  return s;
}

__device__ __forceinline__ uint32_t score_key(float s) { return KeyTraits<float>::key(s); }
// An entry's depth, rank and the node index of its previous sibling (0 for a first child).
__device__ __forceinline__ int meta_depth(uint32_t m) { return int(m & 15u); }
__device__ __forceinline__ int meta_rank(uint32_t m) { return int((m >> 4) & 511u); }
__device__ __forceinline__ int meta_prev(uint32_t m) { return int(m >> 13); }
__device__ __forceinline__ uint32_t make_meta(int depth, int rank, int prev) {
  return uint32_t(depth) | uint32_t(rank) << 4 | uint32_t(prev) << 13;
}
// The reference's arithmetic, in its order: a sibling's score from the entry's score s and the
// log-probs of ranks r and r + 1 at the entry's depth; a first child's from s and lp[d, 0].
__device__ __forceinline__ float sibling_score(float s, float lp_r, float lp_next) {
  return __fadd_rn(__fsub_rn(s, lp_r), lp_next);
}

template <int F>
struct Frontier {
  uint32_t key[F], meta[F];  // key 0: the slot is empty
  float sib[F], child[F];    // the scores the entry's sibling and first child get
  // The lane's best entry (largest key; dup: another of its entries has the same key), a copy of
  // its fields, and the log-probs its successors' successors need, loaded when it became best.
  uint32_t bkey, bmeta;
  int bj;
  bool bdup;
  float bsib, bchild;
  float l_r1, l_r2, l_d0, l_d1, l_e0;

  __device__ __forceinline__ void set(int j, uint32_t k, uint32_t m, float sb, float ch) {
#pragma unroll
    for (int i = 0; i < F; ++i) {
      if (i == j) { key[i] = k; meta[i] = m; sib[i] = sb; child[i] = ch; }
    }
  }
  __device__ __forceinline__ void pick(int j) {
#pragma unroll
    for (int i = 0; i < F; ++i) {
      if (i == j) { bmeta = meta[i]; bsib = sib[i]; bchild = child[i]; }
    }
    bj = j;
  }
  __device__ __forceinline__ void refresh_best() {
    bkey = key[0];
    int j = 0;
    bdup = false;
#pragma unroll
    for (int i = 1; i < F; ++i) {
      if (key[i] > bkey) { bkey = key[i]; j = i; bdup = false; }
      else if (key[i] == bkey && bkey != 0u) bdup = true;
    }
    pick(j);
  }
  __device__ __forceinline__ void load_successors(const float* lp, int L, int K) {
    if (bkey == 0u) return;
    // Indices clamped into the array instead of a branch per load: a value read past its row is
    // never used (every use checks the same bound).
    const int d = meta_depth(bmeta), r = meta_rank(bmeta), last = L * K - 1;
    l_r1 = lp[min((d - 1) * K + r + 1, last)];
    l_r2 = lp[min((d - 1) * K + r + 2, last)];
    l_d0 = lp[min(d * K, last)];
    l_d1 = lp[min(d * K + 1, last)];
    l_e0 = lp[min((d + 1) * K, last)];
  }
};

// Rank tuple of the entry (depth d, rank r) in slot p: p's tuple, read off the records by walking
// up its parents, extended by r at level d - 1.
__device__ RankKey slot_rank_key(const BuildSmem& s, int p, int d, int r) {
  RankKey key{{0, 0, 0}};
  for (int a = p; a > 0; a = s.par[a]) {
    const int dr = s.dr[a - 1];
    key = rank_key_with(key, (dr & 255) - 1, dr >> 8);
  }
  return rank_key_with(key, d - 1, r);
}

// Exact tie: several entries hold the largest key M. The winner is the one with the smallest rank
// tuple; returns its lane and, in that lane, makes it the lane's best.
template <int F>
__device__ int resolve_tie(Frontier<F>& fr, uint32_t M, const BuildSmem& s, const float* lp, int L, int K) {
  const int lane = threadIdx.x & 31;
  __syncwarp();  // the records written by other lanes are visible
  RankKey best{{~0ull, ~0ull, ~0ull}};
  int best_j = -1;
#pragma unroll
  for (int j = 0; j < F; ++j) {
    if (fr.key[j] == M) {
      const uint32_t m = fr.meta[j];
      const RankKey t = slot_rank_key(s, lane + 32 * j, meta_depth(m), meta_rank(m));
      if (best_j < 0 || rank_key_less(t, best)) { best = t; best_j = j; }
    }
  }
  int best_lane = lane;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    RankKey o;
    o.w[0] = __shfl_xor_sync(kFull, best.w[0], off);
    o.w[1] = __shfl_xor_sync(kFull, best.w[1], off);
    o.w[2] = __shfl_xor_sync(kFull, best.w[2], off);
    const int o_lane = __shfl_xor_sync(kFull, best_lane, off);
    if (rank_key_less(o, best)) { best = o; best_lane = o_lane; }  // tuples of distinct entries differ
  }
  if (lane == best_lane && best_j != fr.bj) {
    fr.pick(best_j);
    fr.load_successors(lp, L, K);
  }
  return best_lane;
}

// Runs on one full warp after the log-probs are staged and the links reset (stage_build);
// returns the node count. Node records go to s.
template <int F>
__device__ int fast_build(const BuildSmem& s, int L, int K, int budget) {
  const int lane = threadIdx.x & 31;
  const float* lp = s.lp;
  Frontier<F> fr;
#pragma unroll
  for (int j = 0; j < F; ++j) { fr.key[j] = 0u; fr.meta[j] = 0u; fr.sib[j] = 0.f; fr.child[j] = 0.f; }
  fr.l_r1 = fr.l_r2 = fr.l_d0 = fr.l_d1 = fr.l_e0 = 0.f;
  if (lane == 0) {  // slot 0: the root's first child, (0,) at depth 1 with score lp[0, 0]
    const float s0 = lp[0];
    fr.set(0, score_key(s0), make_meta(1, 0, 0), K > 1 ? sibling_score(s0, lp[0], lp[1]) : 0.f,
           L > 1 ? __fadd_rn(s0, lp[K]) : 0.f);
  }
  fr.refresh_best();
  fr.load_successors(lp, L, K);
  int n = 0;
  while (n < budget) {
    const uint32_t M = __reduce_max_sync(kFull, fr.bkey);
    if (M == 0u) break;
    const bool holds = fr.bkey == M;
    const unsigned holders = __ballot_sync(kFull, holds);
    const bool tie = (holders & (holders - 1)) != 0 || __any_sync(kFull, holds && fr.bdup);
    const int w = tie ? resolve_tie(fr, M, s, lp, L, K) : __ffs(holders) - 1;
    const int node = ++n;
    // The popping lane: the record, its slot's next sibling, and the fields of the first child.
    uint32_t c_key = 0u, c_meta = 0u;
    float c_sib = 0.f, c_child = 0.f;
    if (lane == w) {
      const int d = meta_depth(fr.bmeta), r = meta_rank(fr.bmeta), parent = lane + 32 * fr.bj;
      s.par[node] = parent;
      s.dr[node - 1] = d | (r << 8);
      if (r == 0) s.fc[parent] = node; else s.ns[meta_prev(fr.bmeta)] = node;
      if (d < L) {
        c_key = score_key(fr.bchild);
        c_meta = make_meta(d + 1, 0, 0);
        c_sib = K > 1 ? sibling_score(fr.bchild, fr.l_d0, fr.l_d1) : 0.f;
        c_child = d + 1 < L ? __fadd_rn(fr.bchild, fr.l_e0) : 0.f;
      }
      if (r + 1 < K) {
        fr.set(fr.bj, score_key(fr.bsib), make_meta(d, r + 1, node),
               r + 2 < K ? sibling_score(fr.bsib, fr.l_r1, fr.l_r2) : 0.f, d < L ? __fadd_rn(fr.bsib, fr.l_d0) : 0.f);
      } else {
        fr.set(fr.bj, 0u, 0u, 0.f, 0.f);
      }
    }
    if (n == budget) break;
    c_key = __shfl_sync(kFull, c_key, w);
    c_meta = __shfl_sync(kFull, c_meta, w);
    c_sib = __shfl_sync(kFull, c_sib, w);
    c_child = __shfl_sync(kFull, c_child, w);
    const int t = node & 31;
    if (lane == t) fr.set(node >> 5, c_key, c_meta, c_sib, c_child);
    if (lane == w || lane == t) {
      fr.refresh_best();
      fr.load_successors(lp, L, K);
    }
  }
  __syncwarp();
  return n;
}

// ---- the parallel tree build: the B best nodes at once, checked, the pop order read off.
//
// When every popped node's successors score no higher than it (always for a first child, since
// log-probs are <= 0; for a sibling, fp32 rounding of (s - a) + b can break it), the heap pops
// the B best nodes by (score desc, rank tuple asc) in that order. So:
//   1. tau0: the B-th best score of the "comb" — the chain of first children and each chain
//      node's siblings — a closed set of nodes, so at least B nodes score >= tau0 (a radix
//      select that stops 2^10 ulps short: any lower bound on it serves);
//   2. E: every node reachable through nodes scoring >= tau0, gathered depth by depth by one warp
//      (depth 1 read off the comb; deeper, each parent walks its sibling chain until a score
//      falls below tau0);
//   3. each node's position among E by (score, rank tuple), by counting;
//   4. the check: every one of the B best has a generator (parent or previous sibling) scoring
//      at least as high. With it, the B best are closed, every successor outside them ranks
//      after all of them (in E by position, outside E below tau0), and the heap pops exactly
//      them, in order. Any failure (the check, E over kSelectCap, fewer than B nodes, NaN or
//      infinite scores) returns -1 and the caller runs the serial build.
// Measured on the H200 (results/): see kernels/ddtree/README.md. frontier_model.select_build
// models it; a CPU test checks it against the reference.

// Node `pos` of E: depth d, rank r, score sc, parent index par, previous sibling prev.
__device__ __forceinline__ void put_node(const SelectSmem& w, int pos, float sc, int d, int r, int par, int prev,
                                         const RankKey& parent_key) {
  w.score[pos] = sc;
  w.dr[pos] = d | (r << 8);
  w.par[pos] = par;
  w.prev[pos] = prev;
  w.key[pos] = rank_key_with(parent_key, d - 1, r);
}

// Warp 0: E, depth by depth. Writes flags[0] = |E| (-1: gave up) and clears flags[1].
// Depth 1 is the root's sibling chain, which the comb's first row already holds (same
// arithmetic): its nodes are that row's leading entries >= tau, found by ballots instead of one
// lane walking the chain twice (the longest serial walk of the build on flat distributions).
__device__ void gather_nodes(const float* lp, const SelectSmem& w, int L, int K, int M, float tau) {
  const int lane = threadIdx.x & 31;
  int n = 0, lo = 0, hi = 0;  // E so far; the previous depth's nodes are E[lo, hi)
  bool bad = false;
  for (int base = 0; base < M; base += 32) {
    const int i = base + lane;
    const float sc = i < M ? w.comb[i] : -INFINITY;
    const unsigned below = __ballot_sync(kFull, i < M && !(sc >= tau));
    const unsigned odd = __ballot_sync(kFull, i < M && (sc != sc || sc == INFINITY));
    const int take = below ? __ffs(below) - 1 : min(32, M - base);
    bad = bad || (odd & ((take < 32 ? (2u << take) : 0u) - 1u)) != 0;  // NaN/inf up to the first below
    if (i - base < take) put_node(w, i, sc, 1, i, -1, i - 1, RankKey{{0, 0, 0}});
    n = base + take;
    if (below || bad) break;
  }
  if (!bad && n == M && M < K) {  // the whole row passed: the chain goes on past the comb
    if (lane == 0) {
      const float* row = lp;
      float sc = w.comb[M - 1];
      for (int r = M; r < K && n < kSelectCap; ++r) {
        sc = sibling_score(sc, row[r - 1], row[r]);
        if (sc != sc || sc == INFINITY) { n = -1; break; }
        if (!(sc >= tau)) break;
        put_node(w, n, sc, 1, r, -1, n - 1, RankKey{{0, 0, 0}});
        ++n;
      }
      if (n == kSelectCap) n = -1;  // may have more: give up
    }
    n = __shfl_sync(kFull, n, 0);
    bad = n < 0;
  }
  __syncwarp();
  hi = bad ? 0 : n;
  for (int d = 2; d <= L && !bad; ++d) {
    const int parents = hi - lo;
    if (parents == 0) break;
    const int first_new = n;
    const float* row = lp + (d - 1) * K;
    for (int base = 0; base < parents && !bad; base += 32) {
      const int pi = base + lane;
      const int p = lo + pi;
      const float head = pi < parents ? __fadd_rn(w.score[p], row[0]) : 0.f;
      int cnt = 0;
      bool nan = false;
      if (pi < parents) {
        float sc = head;
        for (int r = 0; r < K; ++r) {
          if (r > 0) sc = sibling_score(sc, row[r - 1], row[r]);
          if (sc != sc || sc == INFINITY) { nan = true; break; }
          if (!(sc >= tau)) break;
          ++cnt;
        }
      }
      int incl = cnt;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(kFull, incl, off);
        if (lane >= off) incl += y;
      }
      const int total = __shfl_sync(kFull, incl, 31);
      bad = __any_sync(kFull, nan) || n + total > kSelectCap;
      if (!bad && cnt > 0) {
        int pos = n + incl - cnt;
        const RankKey pk = w.key[p];
        float sc = head;
        for (int r = 0; r < cnt; ++r, ++pos) {
          if (r > 0) sc = sibling_score(sc, row[r - 1], row[r]);
          put_node(w, pos, sc, d, r, p, r > 0 ? pos - 1 : -1, pk);
        }
      }
      n += total;
    }
    __syncwarp();  // this depth's entries are visible before the next depth reads them
    lo = first_new;
    hi = n;
  }
  if (lane == 0) {
    w.flags[0] = bad ? -1 : n;
    w.flags[1] = 0;
  }
}

// Past this many nodes E is ranked by a sort instead of by counting: counting is n_e^2 / 512
// comparisons a thread, and at B = 256 (n_e of several hundred) the CTA issued them for most
// of the 16 us its rank phase took (probe --phases --budget 256, bs=1).
constexpr int kRankSortMin = 256;

// Positions of E by (score desc, rank tuple asc), as the counting below gives them: (score, index)
// keys sorted ascending in `a` (a bitonic sort; [next_pow2(n_e)] entries), then within each run of
// equal scores the rank tuples counted. -0 is taken as +0 (they compare equal as floats, so the
// counting treats them as a tie). All threads call it; w.rank is written, then a barrier.
__device__ void rank_by_sort(unsigned long long* a, const SelectSmem& w, int n_e) {
  const int p2 = next_pow2(n_e);
  for (int i = threadIdx.x; i < p2; i += blockDim.x) {
    unsigned long long c = ~0ull;  // past E: after every finite score (whose keys are below ~0u)
    if (i < n_e) {
      const float sc = w.score[i];
      c = (static_cast<unsigned long long>(~score_key(sc == 0.f ? 0.f : sc)) << 32) | unsigned(i);
    }
    a[i] = c;
  }
  __syncthreads();
  bitonic_sort(a, p2);  // ends behind a barrier
  for (int p = threadIdx.x; p < n_e; p += blockDim.x) {
    const unsigned long long c = a[p];
    const uint32_t hi = uint32_t(c >> 32);
    const int i = int(c & 0xFFFFFFFFull);
    int lo = p, end = p + 1;  // the run of scores equal to this one: [lo, end)
    while (lo > 0 && uint32_t(a[lo - 1] >> 32) == hi) --lo;
    while (end < n_e && uint32_t(a[end] >> 32) == hi) ++end;
    int pos = lo;
    if (end - lo > 1) {
      const RankKey ki = w.key[i];
      for (int q = lo; q < end; ++q) {
        const int j = int(a[q] & 0xFFFFFFFFull);
        pos += j != i && rank_key_less(w.key[j], ki);
      }
    }
    w.rank[i] = pos;
  }
  __syncthreads();
}

// All threads of a kTopkThreads CTA call it, after stage_build. Returns the node count (records
// written to s) or -1: fall back to fast_build (nothing written then).
// kSort: whether E may be ranked by rank_by_sort (budgets over 64; at B <= 64 the sort's code
// left in the launch measured 0.25-0.35 us slower though it never ran there).
template <bool kSort>
__device__ int select_build(ChunkShared& sh, const BuildSmem& s, int L, int K, int budget,
                            unsigned long long* tl) {
  const int tid = threadIdx.x;
  const float* lp = s.lp;
  const SelectSmem& w = s.sel;
  const int M = min(K, budget);
  if (L * M < budget) return -1;
  long long t0 = clock64();
  // The comb: row d is depth d + 1's chain node and its siblings, one sequential chain (the
  // reference's rounding) on lane 0 of warp d. (Lanes 0..14 of one warp took 4.4 us at B=64:
  // rows K floats apart put every load and store of the 15 lanes in one bank.) Log-probs are
  // read 8 ahead: a store to the comb would otherwise hold back the next step's loads.
  if ((tid & 31) == 0 && (tid >> 5) < L) {
    const int d = tid >> 5;
    float m = lp[0];
#pragma unroll
    for (int j = 1; j < kMaxDepth; ++j) {  // unrolled: the loads need not wait on the sum
      if (j <= d) m = __fadd_rn(m, lp[j * K]);
    }
    float* out = w.comb + d * M;
    const float* row = lp + d * K;
    out[0] = m;
    float prev = row[0];
    for (int base = 1; base < M; base += 8) {
      float ahead[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) ahead[u] = base + u < M ? row[base + u] : 0.f;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (base + u < M) {
          m = sibling_score(m, prev, ahead[u]);
          prev = ahead[u];
          out[base + u] = m;
        }
      }
    }
  }
  __syncthreads();
  long long t1 = clock64();
  mark(tl, kTlComb, t1 - t0);
  // Any tau at or below the comb's B-th best score serves (a lower one only gathers more), so the
  // select stops after two of its three passes: tau is within 2^10 ulps below the B-th score.
  auto comb_key = [&](int i) { return KeyTraits<float>::key(w.comb[i]); };
  const uint32_t kth =
      radix_kth<32, decltype(comb_key), 10>(sh, reinterpret_cast<uint32_t*>(sh.cand), L * M, budget, comb_key);
  const float tau = KeyTraits<float>::value(kth);
  if (!(tau > -INFINITY && tau < INFINITY)) return -1;
  t0 = clock64();
  mark(tl, kTlRadix, t0 - t1);
  if (tid < 32) gather_nodes(lp, w, L, K, M, tau);
  __syncthreads();
  t1 = clock64();
  mark(tl, kTlGather, t1 - t0);
  const int n_e = w.flags[0];
  if (n_e < budget) return -1;
  // Position by (score desc, rank tuple asc). Many nodes: a sort (above). Otherwise 4 lanes per
  // node, each counting a quarter of E; rank tuples are compared only where scores tie (measured
  // 6.9 us for this stage at B=64 with one thread per node looping over all of E).
  constexpr int kParts = 4;
  const bool sorted = kSort && n_e > kRankSortMin;
  if constexpr (kSort) {
    if (sorted) rank_by_sort(sh.cand, w, n_e);  // sh.cand: free since the comb select
  }
  for (int base = 0; !sorted && base < n_e; base += kTopkThreads / kParts) {  // same trips everywhere
    const int i = base + tid / kParts, part = tid % kParts;
    int pos = 0;
    if (i < n_e) {
      const float si = w.score[i];
      bool tie = false;
      for (int j = part; j < n_e; j += kParts) {
        const float sj = w.score[j];
        pos += sj > si;
        tie |= sj == si && j != i;
      }
      if (tie) {
        for (int j = part; j < n_e; j += kParts) pos += j != i && w.score[j] == si && rank_key_less(w.key[j], w.key[i]);
      }
    }
#pragma unroll
    for (int off = 1; off < kParts; off <<= 1) pos += __shfl_xor_sync(kFull, pos, off);
    if (i < n_e && part == 0) w.rank[i] = pos;
  }
  __syncthreads();
  for (int i = tid; i < n_e; i += blockDim.x) {
    if (w.rank[i] < budget) {
      const int g = (w.dr[i] >> 8) > 0 ? w.prev[i] : w.par[i];
      if (g >= 0 && !(w.score[g] >= w.score[i])) w.flags[1] = 1;
    }
  }
  __syncthreads();
  if (w.flags[1] != 0) return -1;
  for (int i = tid; i < n_e; i += blockDim.x) {
    const int pos = w.rank[i];
    if (pos < budget) {
      const int node = pos + 1, dr = w.dr[i];
      const int parent = w.par[i] < 0 ? 0 : w.rank[w.par[i]] + 1;
      s.par[node] = parent;
      s.dr[node - 1] = dr;
      if ((dr >> 8) == 0) s.fc[parent] = node; else s.ns[w.rank[w.prev[i]] + 1] = node;
    }
  }
  __syncthreads();
  mark(tl, kTlRank, clock64() - t1);
  return budget;
}

// The tree of one request into s: the parallel build, else the serial one on warp 0. All
// threads of a kTopkThreads CTA call it after stage_build and a barrier.
template <int F>
__device__ int build_request(ChunkShared& sh, const BuildSmem& s, int L, int K, int budget,
                             unsigned long long* tl = nullptr) {
  int n = select_build<(F > 2)>(sh, s, L, K, budget, tl);
  if (n >= 0) return n;
  if (threadIdx.x < 32) {
    n = fast_build<F>(s, L, K, budget);
    if (threadIdx.x == 0) sh.count = n;
  }
  __syncthreads();
  return sh.count;
}

// Node records -> the output tensors of request b; all threads of the CTA call it.
__device__ void write_tree(const BuildSmem& s, int n, int b, int L, int K, int budget, const int64_t* ids,
                           int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                           int32_t* first_child, int32_t* next_sibling) {
  const int64_t* id = ids + int64_t(b) * L * K;
  int64_t* tok = tokens + int64_t(b) * budget;
  int32_t* dep = depths + int64_t(b) * budget;
  int32_t* rk = ranks + int64_t(b) * budget;
  for (int i = threadIdx.x; i < budget; i += blockDim.x) {
    if (i < n) {
      const int dr = s.dr[i], d = dr & 255, r = dr >> 8;
      tok[i] = __ldcg(id + (d - 1) * K + r);
      dep[i] = d;
      rk[i] = r;
    } else {
      tok[i] = -1; dep[i] = 0; rk[i] = -1;
    }
  }
  for (int i = threadIdx.x; i <= budget; i += blockDim.x) {
    parents[int64_t(b) * (budget + 1) + i] = s.par[i];
    first_child[int64_t(b) * (budget + 1) + i] = s.fc[i];
    next_sibling[int64_t(b) * (budget + 1) + i] = s.ns[i];
  }
  if (threadIdx.x == 0) num_nodes[b] = n;
}

// Visibility of request b: packed words into `packed` (shared, [B+1][W]) and both outputs.
__device__ void write_mask(const BuildSmem& s, uint32_t* packed, int n, int b, int budget, bool* vis,
                           uint32_t* vis_packed) {
  const int side = budget + 1, words = (side + 31) / 32;
  for (int t = threadIdx.x; t < side * words; t += blockDim.x) {
    const int row = t / words, word = t % words;
    uint32_t bits = 0;
    if (row <= n) {
      for (int a = row; a >= 0; a = s.par[a]) {
        if (a / 32 == word) bits |= 1u << (a % 32);
      }
    }
    packed[t] = bits;
    vis_packed[int64_t(b) * side * words + t] = bits;
  }
  __syncthreads();
  // The bool mask as 4-byte words over the request's flat [side * side] bytes (the bytes before
  // the first word boundary and after the last one singly): one round of stores at B = 64, where
  // a row per warp and a byte per lane took ~15 rounds per warp (mask write 1.1 -> 1.0 us at bs=1).
  unsigned char* out = reinterpret_cast<unsigned char*>(vis + int64_t(b) * side * side);
  const int total = side * side;
  const int head = min(total, int((4 - (reinterpret_cast<uintptr_t>(out) & 3u)) & 3u));
  const int n4 = (total - head) / 4;
  auto bit_at = [&](int row, int col) { return (packed[row * words + (col >> 5)] >> (col & 31)) & 1u; };
  for (int f = threadIdx.x; f < head; f += blockDim.x) out[f] = static_cast<unsigned char>(bit_at(f / side, f % side));
  for (int w = threadIdx.x; w < n4; w += blockDim.x) {
    const int f = head + 4 * w;
    int row = f / side, col = f - row * side;
    uint32_t v = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v |= bit_at(row, col) << (8 * j);
      if (++col == side) { col = 0; ++row; }
    }
    reinterpret_cast<uint32_t*>(out + head)[w] = v;
  }
  for (int f = head + 4 * n4 + threadIdx.x; f < total; f += blockDim.x)
    out[f] = static_cast<unsigned char>(bit_at(f / side, f % side));
}


// Where the request's last CTA keeps the rows' candidates while it ranks them (draft_layout
// places them: over the parallel build's workspace, unused until the build).
struct RankSmem {
  unsigned long long* stage;  // [stage_cap] row after row
  float2* stat;               // [L * splits] the chunks' (max, sum of exp)
  int stage_cap;
};

constexpr int kSpecSlots = 16;  // candidate slots of a chunk loaded before its count is known

// The top-K of rows row0 .. row0 + L from their chunks' records and candidates: ids, log-probs
// (also into lp_s [L][k] when given, for the build) and logsumexp. One round of loads: a thread
// per chunk reads its record and its first kSpecSlots slots at once (a model's largest chunk at
// bs=1, K=64 had 10 candidates); a block scan places them. The candidates are few (the row's
// bound is tight), so each is ranked within its row by counting. A row with a chunk over its
// `cap` slots (ties: flat logits), or past the stage, is redone exactly from the logits. All
// threads call it.
template <typename T>
__device__ void draft_rank_rows(const T* __restrict__ logits, int64_t vocab, int64_t row0, int L, int splits,
                                int k, RowBound rb, const float4* records, unsigned long long* cand,
                                const float2* segs, int n_seg, ChunkShared& sh,
                                const RankSmem& r, float* lp_s, int64_t* out_ids, float* out_lp, float* out_lse,
                                unsigned long long* tl) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pairs = L * splits;
  float* lse_s = sh.red;                            // [L]
  int* row_start = reinterpret_cast<int*>(sh.tmax);  // [L + 1] stage positions
  int* exact_s = row_start + 32;                    // [L] 1: redo the row exactly
  if (tid < L) exact_s[tid] = 0;
  const long long t0 = clock64();
  int placed = 0;
  for (int base = 0; base < pairs; base += blockDim.x) {  // one pass up to 512 chunks a request
    const int p = base + tid;
    const bool valid = p < pairs;
    const float4 rec = valid ? __ldcg(records + row0 * splits + p) : make_float4(-INFINITY, 0.f, 0.f, 0.f);
    const unsigned long long* src = cand + row0 * splits * int64_t(rb.cap) + p;  // slot u at src[u * pairs]
    unsigned long long v[kSpecSlots];
#pragma unroll
    for (int u = 0; u < kSpecSlots; ++u) v[u] = valid && u < rb.cap ? __ldcg(src + u * pairs) : 0ull;
    const int c = valid ? __float_as_int(rec.z) : 0;
    const int kept = min(c, rb.cap);
    int before, total;
    cub::BlockScan<int, kTopkThreads>(sh.scan).ExclusiveSum(kept, before, total);
    before += placed;
    if (valid) {
      const int w = p / splits;
      r.stat[p] = make_float2(rec.x, rec.y);
      if (p == w * splits) row_start[w] = before;
      if (c > rb.cap) exact_s[w] = 1;
#pragma unroll
      for (int u = 0; u < kSpecSlots; ++u) {
        if (u < kept && before + u < r.stage_cap) r.stage[before + u] = v[u];
      }
      for (int i = kSpecSlots; i < kept && before + i < r.stage_cap; ++i) r.stage[before + i] = __ldcg(src + i * pairs);
    }
    placed += total;
    __syncthreads();  // sh.scan is reused
  }
  if (tid == 0) row_start[L] = placed;
  __syncthreads();
  long long t1 = clock64();
  mark(tl, kTlStage, t1 - t0);
  // A warp per row: its logsumexp (from the segment partials, the one order every path takes);
  // a row past the stage is redone exactly.
  for (int w = warp; w < L; w += kDraftWarps) {
    const float2* st = segs + (row0 + w) * int64_t(n_seg);
    const float lse = segment_lse(n_seg, [&](int j) { return __ldcg(st + j); });
    if (lane == 0) {
      lse_s[w] = lse;
      out_lse[row0 + w] = lse;
      if (row_start[w + 1] > r.stage_cap) exact_s[w] = 1;
    }
  }
  __syncthreads();
  auto emit = [&](int w, int rank, unsigned long long c) {
    const int64_t o = (row0 + w) * k + rank;
    const float lp = KeyTraits<float>::value(~uint32_t(c >> 32)) - lse_s[w];
    out_ids[o] = int64_t(c & 0xFFFFFFFFull);
    out_lp[o] = lp;
    if (lp_s != nullptr) lp_s[w * k + rank] = lp;
  };
  // Rank each staged candidate within its row (composites are distinct: ascending = better).
  const int staged = min(placed, r.stage_cap);
  int most = 0;
  for (int e = tid; e < staged; e += blockDim.x) {
    int w = 0;  // the row holding e: the last with row_start <= e (rows may be empty)
    for (int step = 16; step > 0; step >>= 1) {
      if (w + step < L && row_start[w + step] <= e) w += step;
    }
    if (exact_s[w]) continue;
    const unsigned long long c = r.stage[e];
    const int lo = row_start[w], hi = row_start[w + 1];
    most = max(most, hi - lo);
    int rank = 0;
#pragma unroll 8
    for (int j = lo; j < hi; ++j) rank += r.stage[j] < c;
    if (rank < k) emit(w, rank, c);
  }
  if (tl != nullptr) {
    most = __reduce_max_sync(kFull, unsigned(most));
    if (lane == 0) atomicMax(tl + kTlRowCands, (unsigned long long)most);
    mark(tl, kTlMerge, clock64() - t1);
  }
  // Rows that did not fit: an exact radix select over the whole row, its list through the
  // request's candidate slots (cap * L * S >= K; what the stage needed is copied by now).
  int exact = 0;
  for (int w = 0; w < L; ++w) {
    if (!exact_s[w]) continue;  // the same in every thread
    ++exact;
    const T* x = logits + (row0 + w) * vocab;
    unsigned long long* list = cand + row0 * splits * int64_t(rb.cap);
    __syncthreads();
    exact_row_topk(sh, x, vocab, k, list);
    for (int i = tid; i < k; i += blockDim.x) emit(w, i, __ldcg(list + i));
  }
  if (exact > 0) mark(tl, kTlExactRows, unsigned(exact));
  __syncthreads();
}

// The tree of request b from its log-probs in s.lp (staged, not yet behind a barrier), then its
// outputs and mask. All threads of the request's CTA call it.
template <int F>
__device__ void build_and_write(ChunkShared& sh, const BuildSmem& s, unsigned char* extra, int b, int L, int k,
                                int budget, const int64_t* ids, int32_t* num_nodes, int64_t* tokens, int32_t* depths,
                                int32_t* ranks, int32_t* parents, int32_t* first_child, int32_t* next_sibling,
                                bool* vis, uint32_t* vis_packed, unsigned long long* tl) {
  for (int i = threadIdx.x; i <= budget; i += blockDim.x) { s.par[i] = -1; s.fc[i] = -1; s.ns[i] = -1; }
  __syncthreads();
  long long t1 = clock64();
  const int n = build_request<F>(sh, s, L, k, budget, tl);
  long long t0 = clock64();
  mark(tl, kTlBuild, t0 - t1);
  write_tree(s, n, b, L, k, budget, ids, num_nodes, tokens, depths, ranks, parents, first_child, next_sibling);
  t1 = clock64();
  mark(tl, kTlWrite, t1 - t0);
  if (vis != nullptr) {
    uint32_t* packed = reinterpret_cast<uint32_t*>(extra + fast_build_smem(L, k, budget));
    write_mask(s, packed, n, b, budget, vis, vis_packed);
    mark(tl, kTlMask, clock64() - t1);
  }
  if (tl != nullptr) mark(tl, kTlEnd, global_ns());
}

// One launch from logits to tree and mask. Grid (splits, bs * L): every CTA takes one chunk of
// one row (draft_chunk); the last CTA of a request to finish (a counter; threadfence pattern)
// ranks its rows' candidates, builds the tree and writes the mask. budget = 0: top-K only (a
// "request" is then one row).
template <typename T, int F>
__global__ void __launch_bounds__(kDraftThreads, 2)
    draft_kernel(const T* __restrict__ logits, int64_t vocab, int L, int chunk, int splits, int k, int budget,
                 RowBound rb, unsigned long long* __restrict__ ws_tau, unsigned long long* __restrict__ ws_keys,
                 unsigned* __restrict__ req_done,
                 float4* __restrict__ ws_records, unsigned long long* __restrict__ ws_cand,
                 float2* __restrict__ ws_seg, int n_seg, int stage_off, int stage_cap, int pairs_off,
                 int64_t* __restrict__ out_ids, float* __restrict__ out_lp, float* __restrict__ out_lse,
                 int32_t* __restrict__ num_nodes, int64_t* __restrict__ tokens, int32_t* __restrict__ depths,
                 int32_t* __restrict__ ranks, int32_t* __restrict__ parents, int32_t* __restrict__ first_child,
                 int32_t* __restrict__ next_sibling, bool* __restrict__ vis, uint32_t* __restrict__ vis_packed,
                 unsigned long long* tl) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ChunkShared& sh = *reinterpret_cast<ChunkShared*>(smem_raw);
  unsigned char* extra = smem_raw + align16(sizeof(ChunkShared));
  const int64_t row = blockIdx.y;
  const int split = blockIdx.x;
  const int64_t start = int64_t(split) * chunk;
  const int len = int(min(int64_t(chunk), vocab - start));
  if (tl != nullptr) { mark(tl, kTlStart, global_ns()); mark(tl, kTlLastStart, global_ns()); }
  // A request's candidate slots are slot-major ([cap][L * splits]): the last CTA's loads of the
  // first kSpecSlots of every chunk are then contiguous.
  const int64_t b = row / L, pairs = int64_t(L) * splits, pair = (row - b * L) * splits + split;
  draft_chunk<T>(logits + row * vocab + start, len, start, k, splits, split, rb, sh, ws_keys + row * splits * rb.qc,
                 ws_tau + row, ws_cand + b * rb.cap * pairs + pair, pairs, ws_records + b * pairs + pair,
                 ws_seg + row * n_seg + start / seg_elems<T>(), tl);
  if (tl != nullptr) { mark(tl, kTlChunks, global_ns()); mark(tl, kTlFirstChunk, global_ns()); }
  // The request's last CTA goes on.
  __syncthreads();
  if (threadIdx.x == 0) sh.last = add_acq_rel(req_done + b, 1u) == unsigned(L * splits - 1);
  __syncthreads();
  if (!sh.last) return;
  const BuildSmem s = carve_build_smem(extra, L, k, budget);
  RankSmem r;
  r.stage = reinterpret_cast<unsigned long long*>(extra + stage_off);
  r.stat = reinterpret_cast<float2*>(extra + pairs_off);
  r.stage_cap = stage_cap;
  draft_rank_rows<T>(logits, vocab, b * L, L, splits, k, rb, ws_records, ws_cand, ws_seg, n_seg, sh, r,
                     budget > 0 ? s.lp : nullptr, out_ids, out_lp, out_lse, tl);
  if (tl != nullptr) mark(tl, kTlMerges, global_ns());
  if (budget == 0) return;  // top-K only
  build_and_write<F>(sh, s, extra, int(b), L, k, budget, out_ids, num_nodes, tokens, depths, ranks, parents,
                     first_child, next_sibling, vis, vis_packed, tl);
}

// ---- the fused launch with rows as thread-block clusters (sm_90; 16-bit logits)
//
// A row is one cluster of `splits` <= 8 CTAs (5 vectors a thread: 151936 bf16 logits in 8). The
// row's CTAs exchange their keys through distributed shared memory between two cluster barriers
// instead of through L2 (the counter variant above: ~3.4 us from the last key to the bound at
// bs=1, its request's last CTA then loading and ranking every row); every CTA selects the bound
// itself (at most 8 x 64 keys) and appends its candidates to the cluster's first CTA, which ranks
// its row. (Clusters of 8 are placed at once: a probe on the H200 started 240 CTAs as 30 clusters
// of 8 within 0.1 us; clusters of 16 took 3.3 us, the cause of an earlier 16-CTA version's loss.)
constexpr int kClusterVecs = 5;
constexpr int kClusterMax = 8;  // the portable cluster size

// sh.prefix = the K-th largest of `lists` lists of `per` keys, each sorted descending (cs.keys:
// every CTA's cta_keys, in rank order): the value select_kth_key finds (the K-th largest value is
// one value), each key's counts (greater, at least) taken by binary searches in the lists, the
// lists' searches interleaved, instead of a pass over all keys. At K = 256 (8 lists of 64) the
// pass was 512 x 512 comparisons issued by each CTA of the row (probe --phases --budget 256, bs=1:
// keys, bound and candidates 15.4 us against 4.8 at K = 64); few keys keep the pass, whose one
// round beats the searches' dependent loads. All threads call it; the caller's barrier follows.
constexpr int kSortedSelectMin = 256;  // keys in the row from which the searches pay

__device__ __forceinline__ void select_kth_sorted(ChunkShared& sh, const uint32_t* keys, int lists, int per,
                                                  int k) {
  int top = 1;
  while (top * 2 <= per) top *= 2;
  for (int i = threadIdx.x; i < lists * per; i += blockDim.x) {
    const uint32_t ki = keys[i];
    int gt[kClusterMax], ge[kClusterMax];  // entries > ki, >= ki of list c
#pragma unroll
    for (int c = 0; c < kClusterMax; ++c) gt[c] = ge[c] = 0;
    for (int step = top; step > 0; step >>= 1) {
#pragma unroll
      for (int c = 0; c < kClusterMax; ++c) {
        if (c < lists) {
          const uint32_t* list = keys + c * per;
          if (gt[c] + step <= per && list[gt[c] + step - 1] > ki) gt[c] += step;
          if (ge[c] + step <= per && list[ge[c] + step - 1] >= ki) ge[c] += step;
        }
      }
    }
    int greater = 0, at_least = 0;
#pragma unroll
    for (int c = 0; c < kClusterMax; ++c) { greater += gt[c]; at_least += ge[c]; }
    if (ki != 0u && greater < k && at_least >= k) sh.prefix = ki;
  }
}

// Dynamic shared memory of a cluster CTA past ChunkShared, before the build (which reuses it).
struct ClusterSmem {
  uint32_t pub[kDraftWarps * 4];       // this CTA's qc published keys
  uint32_t keys[kClusterMax * kDraftWarps * 4];  // the row's keys; the flooded path's list after
  float2 seg[kClusterVecs * kDraftWarps];                  // this CTA's segment partials
  float2 segs[kClusterMax * kClusterVecs * kDraftWarps];   // the first CTA's copy of the row's
};
static_assert(sizeof(ClusterSmem::keys) >= 256 * sizeof(unsigned long long), "the flooded path lists K <= 256");

template <typename T, int F>
__global__ void __launch_bounds__(kDraftThreads, 2)
    draft_cluster_kernel(const T* __restrict__ logits, int64_t vocab, int L, int chunk, int splits, int k,
                         int budget, RowBound rb, unsigned* __restrict__ req_done, int64_t* __restrict__ out_ids,
                         float* __restrict__ out_lp, float* __restrict__ out_lse, int32_t* __restrict__ num_nodes,
                         int64_t* __restrict__ tokens, int32_t* __restrict__ depths, int32_t* __restrict__ ranks,
                         int32_t* __restrict__ parents, int32_t* __restrict__ first_child,
                         int32_t* __restrict__ next_sibling, bool* __restrict__ vis, uint32_t* __restrict__ vis_packed,
                         unsigned long long* tl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // the host launches it only on sm_90 and later
#else
  namespace cg = cooperative_groups;
  // Launched with programmatic stream serialization (launch_draft_cluster): the CTAs may be
  // placed while the kernel before it in the stream still runs, and wait here, before the first
  // global access, for it to complete with its writes visible. The trigger lets the next launch
  // of this kind be placed the same way, onto the SMs this launch leaves idle while one CTA per
  // request builds its tree (where there is no launch with the attribute both are no-ops).
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ChunkShared& sh = *reinterpret_cast<ChunkShared*>(smem_raw);
  unsigned char* extra = smem_raw + align16(sizeof(ChunkShared));
  ClusterSmem& cs = *reinterpret_cast<ClusterSmem*>(extra);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.y;
  const int rank = int(cluster.block_rank());
  const int64_t start = int64_t(rank) * chunk;
  const int len = int(min(int64_t(chunk), vocab - start));
  const T* x = logits + row * vocab;
  if (tl != nullptr) { mark(tl, kTlStart, global_ns()); mark(tl, kTlLastStart, global_ns()); }
  long long t0 = clock64();
  uint4 raw[kClusterVecs];
  float vmax[kClusterVecs], tmax;
  scan_chunk<T, kClusterVecs>(x + start, len, raw, vmax, tmax, [&](int j, float2 part) { cs.seg[j] = part; });
  long long t1 = clock64();
  mark(tl, kTlChunkScan, t1 - t0);
  offer_keys(sh, tmax, rb.qw);
  if (warp == 0) cta_keys(sh.tmax, rb, [&](int r, uint32_t key) { cs.pub[r] = key; });
  cluster.sync();  // every CTA's keys and segment partials are out, and every CTA of the row runs
  const int n_pub = splits * rb.qc;
  for (int i = tid; i < n_pub; i += blockDim.x) cs.keys[i] = cluster.map_shared_rank(cs.pub, i / rb.qc)[i % rb.qc];
  // The row's segment partials into the first CTA (its CTAs' chunks are whole segments, in order).
  const int per_cta = chunk / seg_elems<T>();
  const int n_seg = int(seg_count(vocab, sizeof(T)));
  if (rank == 0)
    for (int j = tid; j < n_seg; j += blockDim.x) cs.segs[j] = cluster.map_shared_rank(cs.seg, j / per_cta)[j % per_cta];
  __syncthreads();
  if constexpr (F > 2) {  // K <= B <= 64 (F <= 2) publishes at most 128 keys a row: the pass only
    if (n_pub >= kSortedSelectMin) select_kth_sorted(sh, cs.keys, splits, rb.qc, k);
    else select_kth_key(sh, cs.keys, n_pub, k);
  } else {
    select_kth_key(sh, cs.keys, n_pub, k);
  }
  __syncthreads();
  ChunkShared* first = cluster.map_shared_rank(&sh, 0);
  append_candidates<T, kClusterVecs>(raw, vmax, sh.prefix, len, start, &first->count, first->cand, 1, kCandCap);
  cluster.sync();  // the row's candidates are in the first CTA; no remote access after this
  t0 = clock64();
  mark(tl, kTlChunkBound, t0 - t1);
  if (tl != nullptr) { mark(tl, kTlChunks, global_ns()); mark(tl, kTlFirstChunk, global_ns()); }
  if (rank != 0) return;
  // The first CTA of the cluster: the row's logsumexp and top-K. The usual few candidates are
  // ranked by warps 1.. while warp 0 computes the logsumexp, which only writing them needs.
  const int count = sh.count;
  const bool overlap = count <= kDraftThreads - 32;
  unsigned long long mine = 0;
  int mine_rank = kCandCap;  // no candidate: past every rank emit writes (K <= 256)
  if (warp == 0) {
    const float lse = segment_lse(n_seg, [&](int j) { return cs.segs[j]; });
    if (lane == 0) { sh.red[0] = lse; out_lse[row] = lse; }
  } else if (overlap && tid - 32 < count) {
    mine = sh.cand[tid - 32];
    mine_rank = count_below(sh.cand, count, mine);
  }
  __syncthreads();
  const float lse = sh.red[0];
  auto emit = [&](unsigned long long c, int r) {
    if (r < k) {
      out_ids[row * k + r] = int64_t(c & 0xFFFFFFFFull);
      out_lp[row * k + r] = KeyTraits<float>::value(~uint32_t(c >> 32)) - lse;
    }
  };
  if (overlap) {
    emit(mine, mine_rank);
  } else if (count <= kCandCap) {
    rank_by_count(sh.cand, count, emit);
  } else {  // flooded by ties (flat logits): an exact radix select over the whole row
    auto* list = reinterpret_cast<unsigned long long*>(cs.keys);
    exact_row_topk(sh, x, vocab, k, list);
    for (int r = tid; r < k; r += blockDim.x) emit(list[r], r);
    if (tl != nullptr) mark(tl, kTlExactRows, 1);
  }
  if (tl != nullptr) { mark(tl, kTlRowCands, unsigned(count)); mark(tl, kTlMerge, clock64() - t0); }
  // The request's last row builds its tree.
  const int64_t b = row / L;
  __syncthreads();
  if (tid == 0) {
    sh.last = add_acq_rel(req_done + b, 1u) == unsigned(L - 1);
    if (sh.last) req_done[b] = 0u;  // the counters are a pool, zero between launches (below)
  }
  __syncthreads();
  if (!sh.last) return;
  if (tl != nullptr) mark(tl, kTlMerges, global_ns());
  const BuildSmem s = carve_build_smem(extra, L, k, budget);
  t0 = clock64();
  stage_floats(s.lp, out_lp + b * L * k, L * k, tid, blockDim.x);
  build_and_write<F>(sh, s, extra, int(b), L, k, budget, out_ids, num_nodes, tokens, depths, ranks, parents,
                     first_child, next_sibling, vis, vis_packed, tl);
#endif
}

// The build alone on the fast path (build_tree op), and with vis non-null the mask too (the
// composed draft_tree past the fused launch's rows): one CTA per request (build_and_write, the
// fused launch's own build and mask writer, so the trees and masks are the same code's).
// (The composed path used to launch the shared-memory heap at B > 64 and a mask kernel of one
// thread per 32-column word writing single bytes: at bs=64, B=256, 175 + 47 us.)
template <int F>
__global__ void __launch_bounds__(kTopkThreads) fast_build_kernel(const int64_t* __restrict__ ids,
                                                        const float* __restrict__ logprobs, int L, int k, int budget,
                                                        int32_t* __restrict__ num_nodes, int64_t* __restrict__ tokens,
                                                        int32_t* __restrict__ depths, int32_t* __restrict__ ranks,
                                                        int32_t* __restrict__ parents,
                                                        int32_t* __restrict__ first_child,
                                                        int32_t* __restrict__ next_sibling, bool* __restrict__ vis,
                                                        uint32_t* __restrict__ vis_packed) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ChunkShared& sh = *reinterpret_cast<ChunkShared*>(smem_raw);
  const int b = blockIdx.x;
  unsigned char* extra = smem_raw + align16(sizeof(ChunkShared));
  const BuildSmem s = carve_build_smem(extra, L, k, budget);
  stage_floats(s.lp, logprobs + int64_t(b) * L * k, L * k, threadIdx.x, blockDim.x);
  build_and_write<F>(sh, s, extra, b, L, k, budget, ids, num_nodes, tokens, depths, ranks, parents, first_child,
                     next_sibling, vis, vis_packed, nullptr);
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


// ---- fused path launchers

inline TopkPlan draft_plan(int64_t rows, int64_t vocab, int k, int elem_bytes, int sms) {
  const int64_t cap = int64_t(kDraftThreads) * kDraftVecs * 16 / elem_bytes;  // a multiple of 16
  const int64_t min_splits = (vocab + cap - 1) / cap;
  int64_t splits = 2 * int64_t(sms) / rows;  // small batches: about two CTAs per SM
  const int64_t max_splits = 4096 / k;       // keys a row publishes (<= 4096, qc >= 1) fit ChunkShared::cand
  if (splits > max_splits) splits = max_splits;
  if (splits < min_splits) splits = min_splits;
  int64_t chunk = (vocab + splits - 1) / splits;
  if (chunk < k) chunk = k;
  chunk = (chunk + kSegAlign - 1) / kSegAlign * kSegAlign;  // whole segments (cap is a multiple)
  splits = (vocab + chunk - 1) / chunk;
  return TopkPlan{int(splits), int(chunk)};
}

// Offered keys per warp and published per CTA: about twice K over the row (a NumPy model of bf16
// randn x 3 rows: ~67 candidates a row at K = 64, ~270 at K = 256; stream_model --fused).
// Candidate slots per CTA (counter variant): the model's largest chunk had ~3x its share of a
// row's; small chunks keep all their elements (tau = -inf when a row has fewer keys than K).
inline RowBound row_bound(int k, int64_t splits, int chunk) {
  RowBound rb;
  rb.qw = k <= 32 ? 1 : k <= 64 ? 2 : 4;
  const int64_t want = std::max<int64_t>(8, (2 * int64_t(k) + splits - 1) / splits);
  rb.qc = int(std::min<int64_t>(int64_t(kDraftWarps) * rb.qw, want));
  if (splits * rb.qc > 2 * kCandCap) rb.qc = int(std::max<int64_t>(1, 2 * kCandCap / splits));
  const int64_t share = (int64_t(k) + splits - 1) / splits;
  rb.cap = chunk <= 256 ? chunk : int(std::min<int64_t>(256, std::max<int64_t>(32, 4 * share)));
  return rb;
}

// The fused launch's workspace (zeroed part first: the counters and the published keys) and
// its shared memory past ChunkShared: the build's, with the ranking stage over the parallel
// build's workspace (top-K only: the stage alone), then the chunks' offsets.
struct DraftLayout {
  TopkPlan plan;
  RowBound rb;
  int64_t zeroed_bytes, records_off, cand_off, seg_off, n_seg, total_bytes;
  int stage_off, stage_cap, pairs_off;
  size_t smem;
};

inline DraftLayout draft_layout(int elem_bytes, int64_t bs, int64_t L, int64_t vocab, int k, int budget) {
  DraftLayout d;
  const int64_t rows = bs * L, splits = (d.plan = draft_plan(rows, vocab, k, elem_bytes, sm_count())).splits;
  d.rb = row_bound(k, splits, d.plan.chunk);
  d.zeroed_bytes = (rows + rows * splits * d.rb.qc) * 8 + bs * 4;
  d.records_off = align16(size_t(d.zeroed_bytes));
  d.cand_off = d.records_off + rows * splits * 16;
  d.seg_off = align16(size_t(d.cand_off + rows * splits * d.rb.cap * 8));
  d.n_seg = seg_count(vocab, elem_bytes);
  d.total_bytes = d.seg_off + rows * d.n_seg * 8;
  size_t build = 0;
  if (budget > 0) {
    const int side = budget + 1, words = (side + 31) / 32;
    build = fast_build_smem(int(L), k, budget) + size_t(side) * words * 4;
    d.stage_off = int(fast_build_smem(int(L), k, budget) - select_smem(int(L), k, budget));
    d.stage_cap = int(select_smem(int(L), k, budget) / 8);
  } else {
    d.stage_off = 0;
    d.stage_cap = 2 * kCandCap;
  }
  d.pairs_off = int(align16(std::max(build, size_t(d.stage_off) + size_t(d.stage_cap) * 8)));
  d.smem = align16(sizeof(ChunkShared)) + d.pairs_off + size_t(L * splits) * 8;
  return d;
}

template <typename T, int F>
int launch_draft(const void* logits, int bs, int L, int64_t vocab, int k, int budget, int64_t* ids, float* lp,
                 float* lse, int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                 int32_t* first_child, int32_t* next_sibling, bool* vis, uint32_t* vis_packed, void* workspace,
                 cudaStream_t stream) {
  const DraftLayout d = draft_layout(sizeof(T), bs, L, vocab, k, budget);
  if (int64_t(d.plan.splits) * d.rb.qc > 2 * kCandCap) return cudaErrorInvalidValue;  // vocab past the chunks
  auto* bytes = static_cast<unsigned char*>(workspace);
  const int64_t rows = int64_t(bs) * L;
  auto* tau = reinterpret_cast<unsigned long long*>(bytes);
  auto* keys = tau + rows;
  auto* req_done = reinterpret_cast<unsigned*>(keys + rows * d.plan.splits * d.rb.qc);
  cudaError_t err = allow_smem_once<draft_kernel<T, F>>();
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(workspace, 0, size_t(d.zeroed_bytes), stream);
  if (err != cudaSuccess) return err;
  draft_kernel<T, F><<<dim3(unsigned(d.plan.splits), unsigned(rows)), kDraftThreads, d.smem, stream>>>(
      static_cast<const T*>(logits), vocab, L, d.plan.chunk, d.plan.splits, k, budget, d.rb, tau, keys,
      req_done, reinterpret_cast<float4*>(bytes + d.records_off),
      reinterpret_cast<unsigned long long*>(bytes + d.cand_off), reinterpret_cast<float2*>(bytes + d.seg_off),
      int(d.n_seg), d.stage_off, d.stage_cap, d.pairs_off, ids, lp, lse,
      num_nodes, tokens, depths, ranks, parents, first_child, next_sibling, vis, vis_packed, g_timeline);
  return cudaGetLastError();
}

// The cluster variant's plan: up to kClusterMax chunks of at most kClusterVecs vectors a thread.
// Returns false where it does not apply (32-bit logits, a vocabulary past 8 such chunks).
inline bool cluster_plan(int64_t vocab, int k, int elem_bytes, TopkPlan& plan) {
  if (elem_bytes != 2) return false;
  const int64_t cap = int64_t(kDraftThreads) * kClusterVecs * 16 / elem_bytes;
  int64_t chunk = (vocab + kClusterMax - 1) / kClusterMax;
  if (chunk < k) chunk = k;
  chunk = (chunk + kSegAlign - 1) / kSegAlign * kSegAlign;  // whole segments (cap is a multiple)
  if (chunk > cap) return false;
  plan = TopkPlan{int((vocab + chunk - 1) / chunk), int(chunk)};
  return true;
}

// DDTREE_FUSED=counter keeps the fused launch off clusters; =cluster takes no fall-back, so a
// cluster launch that fails is an error (tuning and tests; read once per process).
enum class ClusterUse { kTry, kNever, kOnly };
inline ClusterUse cluster_use() {
  static const ClusterUse use = [] {
    const char* v = std::getenv("DDTREE_FUSED");
    if (v != nullptr && std::strcmp(v, "counter") == 0) return ClusterUse::kNever;
    if (v != nullptr && std::strcmp(v, "cluster") == 0) return ClusterUse::kOnly;
    return ClusterUse::kTry;
  }();
  return use;
}

// DDTREE_PDL=0 launches the cluster variant without programmatic dependent launch (read once).
inline bool pdl_wanted() {
  static const bool off = [] {
    const char* v = std::getenv("DDTREE_PDL");
    return v != nullptr && std::strcmp(v, "0") == 0;
  }();
  return !off;
}

// The cluster variant's request counters: a pool in device memory, zero from module load, each
// launch's left at zero by its last CTAs, so no memset node precedes the kernel (a graph of
// fused launches spent ~4 us per launch outside the kernel with one). Launches take regions in
// turn: a region is reused only 64 launches later, stream-ordered after its previous use unless
// 64 launches run at once on different streams.
constexpr int kCounterRegions = 64, kCounterSlots = 128;  // requests per launch: bs <= 128
__device__ unsigned g_request_counters[kCounterRegions * kCounterSlots];

inline unsigned* request_counters() {
  static unsigned* base[64] = {};
  static std::atomic<unsigned> turn{0};
  int device = 0;
  cudaGetDevice(&device);
  if (device >= 64) return nullptr;
  if (base[device] == nullptr) {
    void* p = nullptr;
    if (cudaGetSymbolAddress(&p, g_request_counters) != cudaSuccess) return nullptr;
    base[device] = static_cast<unsigned*>(p);
  }
  return base[device] + (turn.fetch_add(1, std::memory_order_relaxed) % kCounterRegions) * kCounterSlots;
}

template <typename T, int F>
int launch_draft_cluster(const TopkPlan& plan, const void* logits, int bs, int L, int64_t vocab, int k, int budget,
                         int64_t* ids, float* lp, float* lse, int32_t* num_nodes, int64_t* tokens, int32_t* depths,
                         int32_t* ranks, int32_t* parents, int32_t* first_child, int32_t* next_sibling, bool* vis,
                         uint32_t* vis_packed, void* workspace, cudaStream_t stream) {
  const RowBound rb = row_bound(k, plan.splits, plan.chunk);
  const int side = budget + 1, words = (side + 31) / 32;
  const size_t build = fast_build_smem(L, k, budget) + size_t(side) * words * 4;
  const size_t smem = align16(sizeof(ChunkShared)) + std::max(build, sizeof(ClusterSmem));
  unsigned* req_done = bs <= kCounterSlots ? request_counters() : nullptr;
  cudaError_t err = allow_smem_once<draft_cluster_kernel<T, F>>();
  if (err != cudaSuccess) return err;
  if (req_done == nullptr) {  // more requests than a region holds: zeroed workspace counters
    req_done = static_cast<unsigned*>(workspace);
    err = cudaMemsetAsync(req_done, 0, size_t(bs) * 4, stream);
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(plan.splits), unsigned(int64_t(bs) * L));
  cfg.blockDim = dim3(kDraftThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(plan.splits);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  // Programmatic dependent launch: the grid may be placed before the previous kernel in the
  // stream ends (the kernel waits for it before touching memory), hiding the launch latency
  // behind that kernel's tail — here, behind the one CTA per request that builds the tree.
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_wanted() ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, draft_cluster_kernel<T, F>, static_cast<const T*>(logits), vocab, L, plan.chunk,
                            plan.splits, k, budget, rb, req_done, ids, lp, lse, num_nodes, tokens, depths, ranks,
                            parents, first_child, next_sibling, vis, vis_packed, g_timeline);
}

// The largest K the streaming top-K takes (above it: the chunk kernel). DDTREE_STREAM_MAXK=N
// overrides it, up to 256 (tuning; =64 is the dispatch before K <= 256 streamed; past 512 a
// warp's q-th largest lane maximum would not exist).
inline int stream_max_k(int elem_bytes) {
  static const int forced = [] {
    const char* v = std::getenv("DDTREE_STREAM_MAXK");
    return v ? std::atoi(v) : 0;
  }();
  if (forced > 0) return std::min(forced, kStreamMaxK16);
  return elem_bytes == 2 ? kStreamMaxK16 : kStreamMaxK32;
}

// The streaming top-K takes rows of whole 16-byte vectors that start 16-byte aligned.
inline bool stream_fits(const void* logits, int64_t vocab, int k, int elem_bytes) {
  return k <= stream_max_k(elem_bytes) && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
         vocab * elem_bytes % 16 == 0;
}

// Whole rows as items once they fill the resident CTAs (splitting bs=32's 480 rows in two took
// 97 against 76 us, bs=64's 960 178 against 142); fewer rows are split until they do.
// DDTREE_STREAM_SPLITS overrides (tuning).
inline TopkPlan stream_plan(int64_t rows, int64_t vocab, int k, int sms) {
  const int64_t want = int64_t(sms) * kStreamCtasPerSm;
  int64_t splits = (want + rows - 1) / rows;
  static const int forced = [] {
    const char* v = std::getenv("DDTREE_STREAM_SPLITS");
    return v ? std::atoi(v) : 0;
  }();
  if (forced > 0) splits = forced;
  const int64_t max_splits = kMergeMax / k;
  if (splits > max_splits) splits = max_splits;
  int64_t chunk = (vocab + splits - 1) / splits;
  if (chunk < k) chunk = k;
  chunk = (chunk + kSegAlign - 1) / kSegAlign * kSegAlign;  // whole segments for every dtype
  splits = (vocab + chunk - 1) / chunk;
  return TopkPlan{int(splits), int(chunk)};
}

template <typename T>
int launch_topk_stream(const void* logits, int64_t rows, int64_t vocab, int k, int64_t* ids, float* lp, float* lse,
                       void* workspace, cudaStream_t stream) {
  const TopkPlan plan = stream_plan(rows, vocab, k, sm_count());
  auto* ws_cand = static_cast<unsigned long long*>(workspace);
  auto* ws_seg = reinterpret_cast<float2*>(ws_cand + rows * plan.splits * int64_t(k));
  const int n_seg = int(seg_count(vocab, sizeof(T)));
  const size_t smem = align16(sizeof(ChunkShared)) + kStreamRingBytes;
  cudaError_t err = allow_smem_once<topk_stream_kernel<T>>();
  if (err != cudaSuccess) return err;
  topk_stream_kernel<T><<<dim3(unsigned(plan.splits), unsigned(rows)), kStreamThreads, smem, stream>>>(
      static_cast<const T*>(logits), vocab, plan.chunk, plan.splits, k, ws_cand, ws_seg, n_seg);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_topk_merge<T>(plan, rows, k, ws_cand, ws_seg, n_seg, ids, lp, lse, stream);
}

// Which top-K runs for many rows: DDTREE_TOPK=chunk forces the staged chunk kernel (tuning).
inline bool stream_wanted() {
  static const bool chunk = [] {
    const char* v = std::getenv("DDTREE_TOPK");
    return v != nullptr && std::strcmp(v, "chunk") == 0;
  }();
  return !chunk;
}

// Frontier entries per lane: the smallest of 1, 2, 4, 8 with 32 F >= budget.
template <typename Fn>
int with_frontier(int budget, Fn fn) {
  if (budget <= 32) return fn(std::integral_constant<int, 1>{});
  if (budget <= 64) return fn(std::integral_constant<int, 2>{});
  if (budget <= 128) return fn(std::integral_constant<int, 4>{});
  return fn(std::integral_constant<int, 8>{});
}

template <typename Fn>
int with_dtype(DType dtype, Fn fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat16: return fn(__half{});
    case DType::kBFloat16: return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}
}  // namespace

int set_timeline_cuda(void* slots) {
  g_timeline = static_cast<unsigned long long*>(slots);
  return cudaSuccess;
}

bool draft_fast_path(int k, int budget) { return k <= kFastMaxK && budget <= kFastMaxBudget; }

// Where each path measured faster on the H200 (kernels/ddtree/README.md): the fused launch for
// small batches (about one wave of rows: <= 128), for the whole tree at K, B <= 256 (its parallel
// build made B = 256 faster there too: bs=1 103 against 190 us composed, bs=8 183 against 235),
// for the top-K alone at K <= 64; the chunk kernel staged through shared memory with cp.async
// (3 CTAs per SM) for more rows or a larger K; the register-frontier build up to B = 64, the
// shared-memory heap above.
bool draft_fused_pays(int64_t rows, int k, int budget) {
  return rows <= 128 && (budget > 0 ? draft_fast_path(k, budget) : k <= 64);
}
// The fast build (parallel, then the register frontier) wherever the fused launch builds: at
// B = 256 the heap took 175 us for bs=64 (results/h200-probe.txt), one fused bs=1 launch 59 in all.
inline bool fast_build_pays(int k, int budget) { return draft_fast_path(k, budget); }

int64_t draft_workspace_bytes(DType dtype, int64_t bs, int64_t depth_limit, int64_t vocab, int k, int budget) {
  return draft_layout(dtype == DType::kFloat32 ? 4 : 2, bs, depth_limit, vocab, k, budget).total_bytes;
}

int64_t topk_workspace_bytes(DType dtype, int64_t rows, int64_t vocab, int k) {
  if (draft_fused_pays(rows, k, 0)) return draft_workspace_bytes(dtype, rows, 1, vocab, k, 0);
  const int elem = dtype == DType::kFloat32 ? 4 : 2;
  // Either kernel may run (the streaming one needs aligned logits, unknown here): room for both.
  const TopkPlan plan = topk_plan(rows, vocab, k, elem, sm_count());
  const TopkPlan stream = stream_plan(rows, vocab, k, sm_count());
  const int64_t splits = plan.splits > stream.splits ? plan.splits : stream.splits;
  return rows * splits * int64_t(k) * 8 + rows * seg_count(vocab, elem) * 8;  // lists, segment partials
}

int topk_lse_cuda(const void* logits, DType dtype, int64_t rows, int64_t vocab, int k, int64_t* ids,
                  float* logprobs, float* lse, void* workspace, void* stream) {
  if (rows == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (draft_fused_pays(rows, k, 0)) {  // the fused kernel without its build: one launch, merge included
      return launch_draft<T, 1>(logits, int(rows), 1, vocab, k, 0, ids, logprobs, lse, nullptr, nullptr, nullptr,
                                nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, workspace, s);
    }
    if (stream_wanted() && stream_fits(logits, vocab, k, sizeof(T)))
      return launch_topk_stream<T>(logits, rows, vocab, k, ids, logprobs, lse, workspace, s);
    return launch_topk<T>(logits, rows, vocab, k, ids, logprobs, lse, workspace, s);
  });
}

int draft_tree_cuda(const void* logits, DType dtype, int bs, int depth_limit, int64_t vocab, int k, int budget,
                    int64_t* ids, float* logprobs, float* lse, int32_t* num_nodes, int64_t* tokens, int32_t* depths,
                    int32_t* ranks, int32_t* parents, int32_t* first_child, int32_t* next_sibling, bool* vis,
                    uint32_t* vis_packed, void* workspace, void* stream) {
  if (bs == 0) return cudaSuccess;
  if (!draft_fast_path(k, budget) || budget < 1) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    TopkPlan cluster;
    const bool clustered = cluster_use() != ClusterUse::kNever && cluster_plan(vocab, k, sizeof(T), cluster);
    return with_frontier(budget, [&](auto f) {
      constexpr int F = decltype(f)::value;
      if (clustered) {
        const int err = launch_draft_cluster<T, F>(cluster, logits, bs, depth_limit, vocab, k, budget, ids, logprobs,
                                                   lse, num_nodes, tokens, depths, ranks, parents, first_child,
                                                   next_sibling, vis, vis_packed, workspace, s);
        if (err == cudaSuccess || cluster_use() == ClusterUse::kOnly) return err;
        cudaGetLastError();  // a GPU that cannot place the clusters (not sm_90): the counter variant
      }
      return launch_draft<T, F>(logits, bs, depth_limit, vocab, k, budget, ids, logprobs, lse, num_nodes, tokens,
                                depths, ranks, parents, first_child, next_sibling, vis, vis_packed, workspace, s);
    });
  });
}

namespace {
// The tree (and with vis non-null the mask) of each request: the fast build (parallel, serial
// register frontier behind it) and the mask in one launch where the fused launch's build serves
// (K, B <= 256), else the shared-memory heap and (vis) the mask kernel.
int build_tree_impl(const int64_t* ids, const float* logprobs, int bs, int depth_limit, int k, int budget,
                    int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                    int32_t* first_child, int32_t* next_sibling, bool* vis, uint32_t* vis_packed, cudaStream_t s) {
  if (fast_build_pays(k, budget)) {
    return with_frontier(budget, [&](auto f) {
      constexpr int F = decltype(f)::value;
      cudaError_t err = allow_smem_once<fast_build_kernel<F>>();
      if (err != cudaSuccess) return int(err);
      const int side = budget + 1, words = (side + 31) / 32;
      const size_t smem = align16(sizeof(ChunkShared)) + fast_build_smem(depth_limit, k, budget) +
                          (vis != nullptr ? size_t(side) * words * 4 : 0);
      fast_build_kernel<F><<<bs, kTopkThreads, smem, s>>>(ids, logprobs, depth_limit, k, budget, num_nodes, tokens,
                                                          depths, ranks, parents, first_child, next_sibling, vis,
                                                          vis_packed);
      return int(cudaGetLastError());
    });
  }
  const size_t per_warp = heap_smem_per_warp(depth_limit, k, budget);
  const int warps = per_warp * kBuildWarps <= 100 * 1024 ? kBuildWarps : 1;
  cudaError_t err = allow_smem_once<build_tree_kernel>();
  if (err != cudaSuccess) return err;
  build_tree_kernel<<<(bs + warps - 1) / warps, warps * 32, size_t(warps) * per_warp, s>>>(
      ids, logprobs, bs, depth_limit, k, budget, num_nodes, tokens, depths, ranks, parents, first_child, next_sibling);
  err = cudaGetLastError();
  if (err != cudaSuccess || vis == nullptr) return err;
  return build_mask_cuda(parents, num_nodes, bs, budget, vis, vis_packed, s);
}
}  // namespace

int build_tree_cuda(const int64_t* ids, const float* logprobs, int bs, int depth_limit, int k, int budget,
                    int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                    int32_t* first_child, int32_t* next_sibling, void* stream) {
  if (bs == 0) return cudaSuccess;
  return build_tree_impl(ids, logprobs, bs, depth_limit, k, budget, num_nodes, tokens, depths, ranks, parents,
                         first_child, next_sibling, nullptr, nullptr, static_cast<cudaStream_t>(stream));
}

int build_tree_mask_cuda(const int64_t* ids, const float* logprobs, int bs, int depth_limit, int k, int budget,
                         int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                         int32_t* first_child, int32_t* next_sibling, bool* vis, uint32_t* vis_packed, void* stream) {
  if (bs == 0) return cudaSuccess;
  return build_tree_impl(ids, logprobs, bs, depth_limit, k, budget, num_nodes, tokens, depths, ranks, parents,
                         first_child, next_sibling, vis, vis_packed, static_cast<cudaStream_t>(stream));
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

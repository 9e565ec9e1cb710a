// DDTree ops: declarations shared by the CPU implementation, the CUDA kernels and the bindings.
// Raw pointers only (no torch headers), so ddtree_cuda.cu compiles with plain nvcc.
//
// Shapes (bs = batch, L = depths, V = vocab, K = top-k, B = node budget, n <= B nodes):
//   topk:    logits [bs*L, V]           -> ids [bs*L, K] int64, logprobs [bs*L, K] f32, lse [bs*L] f32
//   build:   ids/logprobs [bs, L, K]    -> num_nodes [bs], tokens/depths/ranks [bs, B] (node i at i-1),
//            parents/first_child/next_sibling [bs, B+1] (-1 = none; parents[0] = -1)
//   mask:    parents, num_nodes         -> vis bool [bs, B+1, B+1], vis_packed u32 [bs, B+1, W], W=ceil((B+1)/32)
//   verify:  posterior [bs, B+1] int64  -> accepted [bs, M] int32 (-1 pad), accept_len [bs], bonus [bs] int64
//   compact: cache [slots, row_bytes]   in place: cache[base+i] <- cache[base+accepted[i]]
#pragma once
#include <cstdint>

namespace ddtree {

constexpr int kMaxDepth = 15;    // rank tuples pack 15 levels of 11 bits into 3 x u64
constexpr int kMaxTopK = 1024;   // rank + 1 must fit 11 bits
constexpr int kMaxBudget = 1024;

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Rank tuples as three 64-bit words, 5 levels of 11 bits per word from the most significant
// bit, each level holding rank+1 (0 = absent). Unsigned lexicographic order of (w0, w1, w2) is
// then exactly the tuple order: (0,) < (0,0) < (0,1) < (1,).
struct RankKey {
  uint64_t w[3];
};

#if defined(__CUDACC__)
#define DDTREE_HD __host__ __device__ __forceinline__
#else
#define DDTREE_HD inline
#endif

DDTREE_HD int rank_key_shift(int level) { return 64 - 11 * ((level % 5) + 1); }

DDTREE_HD RankKey rank_key_with(RankKey key, int level, int rank) {
  // Selects, not key.w[level / 5]: a run-time array index would put the key in local memory.
  const int word = level / 5, shift = rank_key_shift(level);
  const uint64_t clear = ~(uint64_t(0x7FF) << shift), set = uint64_t(rank + 1) << shift;
  key.w[0] = word == 0 ? (key.w[0] & clear) | set : key.w[0];
  key.w[1] = word == 1 ? (key.w[1] & clear) | set : key.w[1];
  key.w[2] = word == 2 ? (key.w[2] & clear) | set : key.w[2];
  return key;
}

DDTREE_HD bool rank_key_less(const RankKey& a, const RankKey& b) {
  if (a.w[0] != b.w[0]) return a.w[0] < b.w[0];
  if (a.w[1] != b.w[1]) return a.w[1] < b.w[1];
  return a.w[2] < b.w[2];
}

// ---- CPU (ddtree_cpu.cpp)
void topk_lse_cpu(const float* logits, int64_t rows, int64_t vocab, int k, int64_t* ids, float* logprobs,
                  float* lse);
void build_tree_cpu(const int64_t* ids, const float* logprobs, int bs, int depth_limit, int k, int budget,
                    int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                    int32_t* first_child, int32_t* next_sibling);
void build_mask_cpu(const int32_t* parents, const int32_t* num_nodes, int bs, int budget, bool* vis,
                    uint32_t* vis_packed);
void verify_cpu(const int64_t* posterior, const int64_t* tokens, const int32_t* parents,
                const int32_t* num_nodes, int bs, int budget, int max_accept, int32_t* accepted,
                int32_t* accept_len, int64_t* bonus);
void compact_kv_cpu(uint8_t* cache, int64_t row_bytes, const int64_t* slot_base, const int32_t* accepted,
                    const int32_t* accept_len, int bs, int max_accept);

// ---- CUDA (ddtree_cuda.cu); `stream` is a cudaStream_t. Return a cudaError_t as int.
// Workspace (device bytes) the top-K needs for the chunks' candidates and logsumexp partials.
int64_t topk_workspace_bytes(DType dtype, int64_t rows, int64_t vocab, int k);
int topk_lse_cuda(const void* logits, DType dtype, int64_t rows, int64_t vocab, int k, int64_t* ids,
                  float* logprobs, float* lse, void* workspace, void* stream);
// The fused path (top-K + build + mask in one launch) covers K <= 256 and B <= 256; outside it
// draft_tree composes the three ops. Its workspace also holds counters it keeps at zero.
bool draft_fast_path(int k, int budget);
bool draft_fused_pays(int64_t rows, int k, int budget);  // where the fused launch measured faster
int64_t draft_workspace_bytes(DType dtype, int64_t bs, int64_t depth_limit, int64_t vocab, int k, int budget);
int draft_tree_cuda(const void* logits, DType dtype, int bs, int depth_limit, int64_t vocab, int k, int budget,
                    int64_t* ids, float* logprobs, float* lse, int32_t* num_nodes, int64_t* tokens, int32_t* depths,
                    int32_t* ranks, int32_t* parents, int32_t* first_child, int32_t* next_sibling, bool* vis,
                    uint32_t* vis_packed, void* workspace, void* stream);
// Probe only: phase timestamps of later fused launches go to `slots` (16 x u64 on the device,
// [0] and [10] preset to all ones, the rest to 0); null stops recording.
int set_timeline_cuda(void* slots);
int build_tree_cuda(const int64_t* ids, const float* logprobs, int bs, int depth_limit, int k, int budget,
                    int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                    int32_t* first_child, int32_t* next_sibling, void* stream);
int build_mask_cuda(const int32_t* parents, const int32_t* num_nodes, int bs, int budget, bool* vis,
                    uint32_t* vis_packed, void* stream);
// build_tree_cuda and build_mask_cuda of its output in one (where the fast build serves, K and
// B <= 256, one launch): the composed draft_tree's second step.
int build_tree_mask_cuda(const int64_t* ids, const float* logprobs, int bs, int depth_limit, int k, int budget,
                         int32_t* num_nodes, int64_t* tokens, int32_t* depths, int32_t* ranks, int32_t* parents,
                         int32_t* first_child, int32_t* next_sibling, bool* vis, uint32_t* vis_packed, void* stream);
int verify_cuda(const int64_t* posterior, const int64_t* tokens, const int32_t* parents,
                const int32_t* num_nodes, int bs, int budget, int max_accept, int32_t* accepted,
                int32_t* accept_len, int64_t* bonus, void* stream);
int compact_kv_cuda(uint8_t* cache, int64_t row_bytes, const int64_t* slot_base, const int32_t* accepted,
                    const int32_t* accept_len, int bs, int max_accept, void* stream);

}  // namespace ddtree

// Linked only into CPU-only builds: the CUDA entry points the bindings reference. The bindings
// refuse CUDA tensors before reaching them, so these only report that CUDA is missing.
#include "ddtree.h"

namespace ddtree {
namespace {
constexpr int kNoCuda = 35;  // cudaErrorInsufficientDriver: "no CUDA here"
}

int64_t topk_workspace_bytes(DType, int64_t, int64_t, int) { return 0; }
bool draft_fast_path(int, int) { return false; }
bool draft_fused_pays(int64_t, int, int) { return false; }
int64_t draft_workspace_bytes(DType, int64_t, int64_t, int64_t, int, int) { return 0; }
int draft_tree_cuda(const void*, DType, int, int, int64_t, int, int, int64_t*, float*, float*, int32_t*, int64_t*,
                    int32_t*, int32_t*, int32_t*, int32_t*, int32_t*, bool*, uint32_t*, void*, void*) {
  return kNoCuda;
}
int topk_lse_cuda(const void*, DType, int64_t, int64_t, int, int64_t*, float*, float*, void*, void*) {
  return kNoCuda;
}
int build_tree_cuda(const int64_t*, const float*, int, int, int, int, int32_t*, int64_t*, int32_t*, int32_t*,
                    int32_t*, int32_t*, int32_t*, void*) {
  return kNoCuda;
}
int build_tree_mask_cuda(const int64_t*, const float*, int, int, int, int, int32_t*, int64_t*, int32_t*, int32_t*,
                         int32_t*, int32_t*, int32_t*, bool*, uint32_t*, void*) {
  return kNoCuda;
}
int set_timeline_cuda(void*) { return kNoCuda; }
int build_mask_cuda(const int32_t*, const int32_t*, int, int, bool*, uint32_t*, void*) { return kNoCuda; }
int verify_cuda(const int64_t*, const int64_t*, const int32_t*, const int32_t*, int, int, int, int32_t*, int32_t*,
                int64_t*, void*) {
  return kNoCuda;
}
int compact_kv_cuda(uint8_t*, int64_t, const int64_t*, const int32_t*, const int32_t*, int, int, void*) {
  return kNoCuda;
}

}  // namespace ddtree

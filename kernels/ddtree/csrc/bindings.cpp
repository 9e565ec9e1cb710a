// Torch bindings for the DDTree ops: checks shapes and dtypes, allocates outputs, dispatches to
// the CPU implementation or (when built WITH_CUDA) the CUDA launchers on the current stream.
#include <torch/extension.h>
#ifdef WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <stdexcept>
#include <string>

#include "ddtree.h"

namespace {

// Errors are std::runtime_error (Python RuntimeError) with messages built by std::to_string, not
// TORCH_CHECK: formatting numbers through c10::str's ostream crashed (SIGSEGV in
// ostream::_M_insert<long>) when the extension's libstdc++ differed from the one torch loaded.
[[noreturn]] void fail(const std::string& message) { throw std::runtime_error("ddtree: " + message); }
#define DDTREE_CHECK(cond, message) \
  do {                              \
    if (!(cond)) fail(message);     \
  } while (0)
using std::to_string;

void check_cuda(int err, const char* what) {
#ifdef WITH_CUDA
  DDTREE_CHECK(err == 0, std::string(what) + " failed: " + cudaGetErrorString(static_cast<cudaError_t>(err)));
#else
  (void)err;
  (void)what;
#endif
}

void* stream_of(const at::Tensor& t) {
#ifdef WITH_CUDA
  return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
#else
  (void)t;
  fail("this build has no CUDA support");
  return nullptr;
#endif
}

#ifndef WITH_CUDA
#define DDTREE_NO_CUDA(t) DDTREE_CHECK(!(t).is_cuda(), "built without CUDA; got a CUDA tensor")
#else
#define DDTREE_NO_CUDA(t)
#endif

ddtree::DType logits_dtype(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return ddtree::DType::kFloat32;
  if (x.scalar_type() == at::kHalf) return ddtree::DType::kFloat16;
  if (x.scalar_type() == at::kBFloat16) return ddtree::DType::kBFloat16;
  fail("logits must be float32, float16 or bfloat16");
}

std::vector<at::Tensor> topk_lse(const at::Tensor& logits, int64_t k) {
  DDTREE_CHECK(logits.dim() == 3, "logits must be [bs, L, V]");
  DDTREE_NO_CUDA(logits);
  const int64_t bs = logits.size(0), depth = logits.size(1), vocab = logits.size(2);
  DDTREE_CHECK(k >= 1 && k <= vocab && k <= ddtree::kMaxTopK, "k must be in [1, min(V, 1024)], got " + to_string(k));
  DDTREE_CHECK(vocab < (int64_t(1) << 32), "vocab too large");
  auto opts = logits.options();
  auto ids = at::empty({bs, depth, k}, opts.dtype(at::kLong));
  auto lp = at::empty({bs, depth, k}, opts.dtype(at::kFloat));
  auto lse = at::empty({bs, depth}, opts.dtype(at::kFloat));
  auto x = logits.contiguous();
  if (x.is_cuda()) {
    const ddtree::DType dt = logits_dtype(x);
    // Workspace from the caching allocator: graph-safe, no cudaMalloc per call.
    auto ws = at::empty({ddtree::topk_workspace_bytes(dt, bs * depth, vocab, int(k))}, opts.dtype(at::kByte));
    check_cuda(ddtree::topk_lse_cuda(x.data_ptr(), dt, bs * depth, vocab, int(k), ids.data_ptr<int64_t>(),
                                     lp.data_ptr<float>(), lse.data_ptr<float>(), ws.data_ptr(), stream_of(x)),
               "topk_lse");
  } else {
    auto xf = x.to(at::kFloat).contiguous();  // exact for fp16/bf16
    ddtree::topk_lse_cpu(xf.data_ptr<float>(), bs * depth, vocab, int(k), ids.data_ptr<int64_t>(),
                         lp.data_ptr<float>(), lse.data_ptr<float>());
  }
  return {ids, lp, lse};
}

// The tree of each request from its top-K, and with `with_mask` (CUDA only) its mask from the
// same launch: {num_nodes, tokens, depths, ranks, parents, first_child, next_sibling[, vis, packed]}.
std::vector<at::Tensor> build_tree_outputs(const at::Tensor& ids, const at::Tensor& logprobs, int64_t budget,
                                           bool with_mask) {
  DDTREE_CHECK(ids.dim() == 3 && logprobs.sizes() == ids.sizes(), "ids and logprobs must be [bs, L, K]");
  DDTREE_CHECK(ids.scalar_type() == at::kLong && logprobs.scalar_type() == at::kFloat, "ids int64, logprobs float32");
  DDTREE_CHECK(ids.device() == logprobs.device(), "ids and logprobs on one device");
  DDTREE_NO_CUDA(ids);
  const int64_t bs = ids.size(0), depth = ids.size(1), k = ids.size(2);
  DDTREE_CHECK(depth <= ddtree::kMaxDepth, "depth L must be <= 15, got " + to_string(depth));
  DDTREE_CHECK(k <= ddtree::kMaxTopK, "K must be <= 1024, got " + to_string(k));
  DDTREE_CHECK(budget >= 1 && budget <= ddtree::kMaxBudget, "budget must be in [1, 1024], got " + to_string(budget));
  auto i32 = ids.options().dtype(at::kInt);
  auto num_nodes = at::empty({bs}, i32);
  auto tokens = at::empty({bs, budget}, ids.options());
  auto depths = at::empty({bs, budget}, i32);
  auto ranks = at::empty({bs, budget}, i32);
  auto parents = at::empty({bs, budget + 1}, i32);
  auto first_child = at::empty({bs, budget + 1}, i32);
  auto next_sibling = at::empty({bs, budget + 1}, i32);
  auto id = ids.contiguous();
  auto lp = logprobs.contiguous();
  if (id.is_cuda()) {
    if (with_mask) {
      const int64_t side = budget + 1, words = (side + 31) / 32;
      auto vis = at::empty({bs, side, side}, ids.options().dtype(at::kBool));
      auto packed = at::empty({bs, side, words}, i32);
      check_cuda(ddtree::build_tree_mask_cuda(
                     id.data_ptr<int64_t>(), lp.data_ptr<float>(), int(bs), int(depth), int(k), int(budget),
                     num_nodes.data_ptr<int32_t>(), tokens.data_ptr<int64_t>(), depths.data_ptr<int32_t>(),
                     ranks.data_ptr<int32_t>(), parents.data_ptr<int32_t>(), first_child.data_ptr<int32_t>(),
                     next_sibling.data_ptr<int32_t>(), vis.data_ptr<bool>(),
                     reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()), stream_of(id)),
                 "build_tree");
      return {num_nodes, tokens, depths, ranks, parents, first_child, next_sibling, vis, packed};
    }
    check_cuda(ddtree::build_tree_cuda(id.data_ptr<int64_t>(), lp.data_ptr<float>(), int(bs), int(depth), int(k),
                                       int(budget), num_nodes.data_ptr<int32_t>(), tokens.data_ptr<int64_t>(),
                                       depths.data_ptr<int32_t>(), ranks.data_ptr<int32_t>(),
                                       parents.data_ptr<int32_t>(), first_child.data_ptr<int32_t>(),
                                       next_sibling.data_ptr<int32_t>(), stream_of(id)),
               "build_tree");
  } else {
    DDTREE_CHECK(!with_mask, "the tree and mask in one call are CUDA only");
    ddtree::build_tree_cpu(id.data_ptr<int64_t>(), lp.data_ptr<float>(), int(bs), int(depth), int(k), int(budget),
                           num_nodes.data_ptr<int32_t>(), tokens.data_ptr<int64_t>(), depths.data_ptr<int32_t>(),
                           ranks.data_ptr<int32_t>(), parents.data_ptr<int32_t>(), first_child.data_ptr<int32_t>(),
                           next_sibling.data_ptr<int32_t>());
  }
  return {num_nodes, tokens, depths, ranks, parents, first_child, next_sibling};
}

std::vector<at::Tensor> build_tree(const at::Tensor& ids, const at::Tensor& logprobs, int64_t budget) {
  return build_tree_outputs(ids, logprobs, budget, false);
}

std::vector<at::Tensor> build_mask(const at::Tensor& parents, const at::Tensor& num_nodes) {
  DDTREE_CHECK(parents.dim() == 2 && parents.scalar_type() == at::kInt, "parents must be int32 [bs, B+1]");
  DDTREE_NO_CUDA(parents);
  const int64_t bs = parents.size(0), side = parents.size(1), words = (side + 31) / 32;
  auto vis = at::empty({bs, side, side}, parents.options().dtype(at::kBool));
  auto packed = at::empty({bs, side, words}, parents.options().dtype(at::kInt));
  auto par = parents.contiguous();
  auto nn = num_nodes.contiguous();
  if (par.is_cuda()) {
    check_cuda(ddtree::build_mask_cuda(par.data_ptr<int32_t>(), nn.data_ptr<int32_t>(), int(bs), int(side - 1),
                                       vis.data_ptr<bool>(), reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()),
                                       stream_of(par)),
               "build_mask");
  } else {
    ddtree::build_mask_cpu(par.data_ptr<int32_t>(), nn.data_ptr<int32_t>(), int(bs), int(side - 1),
                           vis.data_ptr<bool>(), reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()));
  }
  return {vis, packed};
}

std::vector<at::Tensor> verify(const at::Tensor& posterior, const at::Tensor& tokens, const at::Tensor& parents,
                               const at::Tensor& num_nodes, int64_t max_accept) {
  DDTREE_CHECK(posterior.dim() == 2 && posterior.scalar_type() == at::kLong, "posterior must be int64 [bs, B+1]");
  DDTREE_NO_CUDA(posterior);
  const int64_t bs = posterior.size(0), budget = posterior.size(1) - 1;
  DDTREE_CHECK(tokens.size(1) == budget && parents.size(1) == budget + 1, "tokens [bs, B], parents [bs, B+1]");
  DDTREE_CHECK(max_accept >= 1, "max_accept >= 1");
  auto accepted = at::empty({bs, max_accept}, parents.options());
  auto accept_len = at::empty({bs}, parents.options());
  auto bonus = at::empty({bs}, posterior.options());
  auto post = posterior.contiguous();
  auto tok = tokens.contiguous();
  auto par = parents.contiguous();
  auto nn = num_nodes.contiguous();
  if (post.is_cuda()) {
    check_cuda(ddtree::verify_cuda(post.data_ptr<int64_t>(), tok.data_ptr<int64_t>(), par.data_ptr<int32_t>(),
                                   nn.data_ptr<int32_t>(), int(bs), int(budget), int(max_accept),
                                   accepted.data_ptr<int32_t>(), accept_len.data_ptr<int32_t>(),
                                   bonus.data_ptr<int64_t>(), stream_of(post)),
               "verify");
  } else {
    ddtree::verify_cpu(post.data_ptr<int64_t>(), tok.data_ptr<int64_t>(), par.data_ptr<int32_t>(),
                       nn.data_ptr<int32_t>(), int(bs), int(budget), int(max_accept), accepted.data_ptr<int32_t>(),
                       accept_len.data_ptr<int32_t>(), bonus.data_ptr<int64_t>());
  }
  return {accepted, accept_len, bonus};
}

// logits -> top-K, tree and (with_mask) mask in one call. On CUDA inside the fused path
// (K <= 256, B <= 256) that is one kernel launch; elsewhere the three ops run in turn.
// path: "auto" (the faster one for the shape, as measured), "fused" (CUDA, K and B <= 256) or
// "composed".
std::vector<at::Tensor> draft_tree(const at::Tensor& logits, int64_t budget, int64_t k, bool with_mask,
                                   const std::string& path) {
  DDTREE_CHECK(logits.dim() == 3, "logits must be [bs, L, V]");
  DDTREE_NO_CUDA(logits);
  const int64_t bs = logits.size(0), depth = logits.size(1), vocab = logits.size(2);
  DDTREE_CHECK(k >= 1 && k <= vocab && k <= ddtree::kMaxTopK, "k must be in [1, min(V, 1024)], got " + to_string(k));
  DDTREE_CHECK(depth >= 1 && depth <= ddtree::kMaxDepth, "depth L must be in [1, 15], got " + to_string(depth));
  DDTREE_CHECK(budget >= 1 && budget <= ddtree::kMaxBudget, "budget must be in [1, 1024], got " + to_string(budget));
  DDTREE_CHECK(vocab < (int64_t(1) << 32), "vocab too large");
  DDTREE_CHECK(path == "auto" || path == "fused" || path == "composed",
               "path must be auto, fused or composed, got " + path);
  const bool fused_ok = logits.is_cuda() && ddtree::draft_fast_path(int(k), int(budget));
  DDTREE_CHECK(path != "fused" || fused_ok, "the fused path needs a CUDA tensor, K <= 256 and B <= 256");
#ifdef WITH_CUDA
  if (path == "fused" || (path == "auto" && fused_ok && ddtree::draft_fused_pays(bs * depth, int(k), int(budget)))) {
    auto x = logits.contiguous();
    const ddtree::DType dt = logits_dtype(x);
    auto opts = x.options();
    auto i32 = opts.dtype(at::kInt);
    auto ids = at::empty({bs, depth, k}, opts.dtype(at::kLong));
    auto lp = at::empty({bs, depth, k}, opts.dtype(at::kFloat));
    auto lse = at::empty({bs, depth}, opts.dtype(at::kFloat));
    auto num_nodes = at::empty({bs}, i32);
    auto tokens = at::empty({bs, budget}, opts.dtype(at::kLong));
    auto depths = at::empty({bs, budget}, i32);
    auto ranks = at::empty({bs, budget}, i32);
    auto parents = at::empty({bs, budget + 1}, i32);
    auto first_child = at::empty({bs, budget + 1}, i32);
    auto next_sibling = at::empty({bs, budget + 1}, i32);
    const int64_t words = (budget + 1 + 31) / 32;
    at::Tensor vis, packed;
    if (with_mask) {
      vis = at::empty({bs, budget + 1, budget + 1}, opts.dtype(at::kBool));
      packed = at::empty({bs, budget + 1, words}, i32);
    }
    auto ws = at::empty({ddtree::draft_workspace_bytes(dt, bs, depth, vocab, int(k), int(budget))},
                        opts.dtype(at::kByte));
    check_cuda(ddtree::draft_tree_cuda(
                   x.data_ptr(), dt, int(bs), int(depth), vocab, int(k), int(budget), ids.data_ptr<int64_t>(),
                   lp.data_ptr<float>(), lse.data_ptr<float>(), num_nodes.data_ptr<int32_t>(),
                   tokens.data_ptr<int64_t>(), depths.data_ptr<int32_t>(), ranks.data_ptr<int32_t>(),
                   parents.data_ptr<int32_t>(), first_child.data_ptr<int32_t>(), next_sibling.data_ptr<int32_t>(),
                   with_mask ? vis.data_ptr<bool>() : nullptr,
                   with_mask ? reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()) : nullptr, ws.data_ptr(),
                   stream_of(x)),
               "draft_tree");
    return {ids, lp, lse, num_nodes, tokens, depths, ranks, parents, first_child, next_sibling, vis, packed};
  }
#endif
  auto top = topk_lse(logits, k);
  std::vector<at::Tensor> out = {top[0], top[1], top[2]};
  if (with_mask && logits.is_cuda()) {  // tree and mask from one launch
    auto tree = build_tree_outputs(top[0], top[1], budget, true);
    out.insert(out.end(), tree.begin(), tree.end());
    return out;
  }
  auto tree = build_tree(top[0], top[1], budget);
  out.insert(out.end(), tree.begin(), tree.end());
  if (with_mask) {
    auto mask = build_mask(tree[4], tree[0]);
    out.push_back(mask[0]);
    out.push_back(mask[1]);
  } else {
    out.push_back(at::Tensor());
    out.push_back(at::Tensor());
  }
  return out;
}

void compact_kv(at::Tensor& cache, const at::Tensor& slot_base, const at::Tensor& accepted,
                const at::Tensor& accept_len) {
  DDTREE_CHECK(cache.is_contiguous(), "cache must be contiguous [slots, ...]");
  DDTREE_NO_CUDA(cache);
  const int64_t row_bytes = cache.numel() / cache.size(0) * cache.element_size();
  auto base = slot_base.contiguous();
  auto acc = accepted.contiguous();
  auto len = accept_len.contiguous();
  const int bs = int(acc.size(0)), max_accept = int(acc.size(1));
  auto* raw = static_cast<uint8_t*>(cache.data_ptr());
  if (cache.is_cuda()) {
    check_cuda(ddtree::compact_kv_cuda(raw, row_bytes, base.data_ptr<int64_t>(), acc.data_ptr<int32_t>(),
                                       len.data_ptr<int32_t>(), bs, max_accept, stream_of(cache)),
               "compact_kv");
  } else {
    ddtree::compact_kv_cpu(raw, row_bytes, base.data_ptr<int64_t>(), acc.data_ptr<int32_t>(),
                           len.data_ptr<int32_t>(), bs, max_accept);
  }
}

}  // namespace

// Probe only (kernels/ddtree/probe.py, its phase table): later fused launches record phase times into
// `slots` (int64 [20] on the GPU; the probe presets and reads it), None stops it.
void set_timeline(const c10::optional<at::Tensor>& slots) {
  if (!slots.has_value()) {
    ddtree::set_timeline_cuda(nullptr);
    return;
  }
  const at::Tensor& t = *slots;
  DDTREE_CHECK(t.is_cuda() && t.scalar_type() == at::kLong && t.numel() >= 20 && t.is_contiguous(),
               "timeline slots must be a contiguous CUDA int64 tensor of >= 20 elements");
  ddtree::set_timeline_cuda(t.data_ptr());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "DDTree ops: top-K + logsumexp, best-first tree build, visibility mask, verify walk, KV compaction";
  m.def("topk_lse", &topk_lse, "logits [bs,L,V], k -> ids [bs,L,K], logprobs [bs,L,K], lse [bs,L]");
  m.def("build_tree", &build_tree,
        "ids, logprobs [bs,L,K], budget -> num_nodes, tokens, depths, ranks, parents, first_child, next_sibling");
  m.def("build_mask", &build_mask, "parents [bs,B+1], num_nodes -> vis bool [bs,B+1,B+1], vis_packed [bs,B+1,W]");
  m.def("verify", &verify, "posterior, tokens, parents, num_nodes, max_accept -> accepted, accept_len, bonus");
  m.def("draft_tree", &draft_tree, pybind11::arg("logits"), pybind11::arg("budget"), pybind11::arg("k"),
        pybind11::arg("with_mask") = true, pybind11::arg("path") = "auto",
        "logits [bs,L,V], budget, k -> ids, logprobs, lse, num_nodes, tokens, depths, ranks, parents, first_child, "
        "next_sibling, vis, vis_packed (vis and vis_packed None without the mask)");
  m.def("compact_kv", &compact_kv, "cache [slots,...], slot_base, accepted, accept_len (in place)");
  m.def("_set_timeline", &set_timeline, "probe only: phase timestamps of fused launches into an int64 [20] tensor");
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}

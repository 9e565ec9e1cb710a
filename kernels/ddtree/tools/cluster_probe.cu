// How fast thread-block clusters of a given size are placed (device only; not part of the
// extension): every CTA of a 512-thread, 100 KB-shared-memory grid records its start time, and
// the spread between the first and last start is printed per cluster size. On the H200: 240 CTAs
// as clusters of 8 within 0.1 us, of 16 in 3.3 us (kernels/ddtree/README.md).
//
//     nvcc -arch=sm_90 -O2 kernels/ddtree/tools/cluster_probe.cu -o /tmp/cluster_probe && /tmp/cluster_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

__global__ void probe(unsigned long long* t, int spin_ns) {
  extern __shared__ unsigned char smem[];
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (threadIdx.x == 0) {
    t[blockIdx.x + blockIdx.y * gridDim.x] = t0;
    smem[0] = 1;
  }
  unsigned long long now = t0;  // stay resident a while, as the fused launch's CTAs do
  while (now - t0 < static_cast<unsigned long long>(spin_ns)) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
}

int main() {
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024);
  cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  unsigned long long* d = nullptr;
  cudaMalloc(&d, 1 << 20);
  std::vector<unsigned long long> h(65536);
  for (int rows : {15, 120}) {
    for (int cl : {1, 2, 4, 8, 16}) {
      const int splits = rows == 15 ? 16 : (cl < 8 ? 8 : cl);
      std::vector<double> spread;
      for (int it = 0; it < 15; ++it) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(splits, rows);
        cfg.blockDim = dim3(512);
        cfg.dynamicSmemBytes = 100 * 1024;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = cl;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        const cudaError_t e = cudaLaunchKernelEx(&cfg, probe, d, 3000);
        if (e != cudaSuccess) {
          std::printf("rows %d cluster %d: %s\n", rows, cl, cudaGetErrorString(e));
          break;
        }
        cudaDeviceSynchronize();
        cudaMemcpy(h.data(), d, size_t(splits) * rows * 8, cudaMemcpyDeviceToHost);
        const auto mm = std::minmax_element(h.begin(), h.begin() + splits * rows);
        spread.push_back((*mm.second - *mm.first) / 1e3);
      }
      if (spread.empty()) continue;
      std::sort(spread.begin(), spread.end());
      std::printf("rows %3d x splits %2d, cluster %2d: CTA start spread median %.2f us (min %.2f)\n", rows, splits,
                  cl, spread[spread.size() / 2], spread[0]);
    }
  }
}

// What running code the SM has not run before costs: one CTA runs a block of straight-line code
// (kInstr independent FMAs in four chains, about 16 bytes each) twice and times both passes with
// clock64; three launches in a row show whether a launch finds the last one's code still cached.
// Also a "branchy" block: kHops short blocks, each ending in a jump past the next cold block
// (what loops and ifs run once look like).
//   nvcc -O3 -arch=sm_90 -o /tmp/icache_probe kernels/ddtree/tools/icache_probe.cu && /tmp/icache_probe
#include <cstdio>

constexpr int kInstr = 4096;  // ~64 KB of code
constexpr int kHops = 256;

__global__ void straight(float* out, long long* t) {
  float a = threadIdx.x, b = a + 1.f, c = a + 2.f, d = a + 3.f;
  const float m = 1.0001f;
  for (int pass = 0; pass < 2; ++pass) {
    __syncthreads();
    const long long t0 = clock64();
#pragma unroll
    for (int i = 0; i < kInstr / 4; ++i) {
      a = fmaf(a, m, 0.5f); b = fmaf(b, m, 0.25f); c = fmaf(c, m, 0.125f); d = fmaf(d, m, 0.0625f);
    }
    __syncthreads();
    const long long t1 = clock64();
    if (threadIdx.x == 0) t[pass] = t1 - t0;
  }
  out[threadIdx.x] = a + b + c + d;
}

__global__ void branchy(float* out, long long* t, const int* __restrict__ sel) {
  float a = threadIdx.x;
  for (int pass = 0; pass < 2; ++pass) {
    __syncthreads();
    const long long t0 = clock64();
#pragma unroll
    for (int i = 0; i < kHops; ++i) {
      if (sel[i] != 0) {  // never taken: each hop jumps over a cold block of 8 FMAs
#pragma unroll
        for (int j = 0; j < 8; ++j) a = fmaf(a, 1.0001f, float(i + j));
      }
      a = fmaf(a, 0.9999f, 1.f);
    }
    __syncthreads();
    const long long t1 = clock64();
    if (threadIdx.x == 0) t[pass] = t1 - t0;
  }
  out[threadIdx.x] = a;
}

int main() {
  float* out;
  long long* t;
  int* sel;
  cudaMalloc(&out, 1024 * sizeof(float));
  cudaMalloc(&t, 2 * sizeof(long long));
  cudaMalloc(&sel, kHops * sizeof(int));
  cudaMemset(sel, 0, kHops * sizeof(int));
  long long h[2];
  for (int threads : {32, 512}) {
    for (int launch = 0; launch < 3; ++launch) {
      straight<<<1, threads>>>(out, t);
      cudaMemcpy(h, t, sizeof(h), cudaMemcpyDeviceToHost);
      printf("straight %d threads, launch %d: first pass %lld cycles, second %lld (%d instructions)\n", threads,
             launch, h[0], h[1], kInstr);
    }
    for (int launch = 0; launch < 3; ++launch) {
      branchy<<<1, threads>>>(out, t, sel);
      cudaMemcpy(h, t, sizeof(h), cudaMemcpyDeviceToHost);
      printf("branchy  %d threads, launch %d: first pass %lld cycles, second %lld (%d hops)\n", threads, launch,
             h[0], h[1], kHops);
    }
  }
  // Back to back without a copy between: does a launch find the previous one's code?
  long long* many;
  cudaMalloc(&many, 8 * 2 * sizeof(long long));
  for (int launch = 0; launch < 8; ++launch) straight<<<1, 512>>>(out, many + 2 * launch);
  long long hm[16];
  cudaMemcpy(hm, many, sizeof(hm), cudaMemcpyDeviceToHost);
  for (int launch = 0; launch < 8; ++launch)
    printf("back to back, launch %d: first pass %lld, second %lld\n", launch, hm[2 * launch], hm[2 * launch + 1]);
  return cudaGetLastError() != cudaSuccess;
}

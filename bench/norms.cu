/**
 *  @file   norms.cu
 *  @brief  Times uform's RMSNorm kernels at the bench geometry (32768 tokens of 512, bf16) beside a
 *          device-to-device copy of the same bytes, the bandwidth they could reach. The kernels are
 *          the library's own: this file includes `libuform/src/vram/rmsnorm.cu`.
 *
 *      nvcc -O3 -arch=sm_90a -std=c++17 -Ilibuform/src -Ilibuform/include bench/norms.cu -o norms && ./norms [hidden]
 */
#define uform_vram_fail uform_vram_fail_bench /* the plug-in's message hook, which this program never calls */
#include "vram/rmsnorm.cu"
#undef uform_vram_fail
uform_fail_t uform_vram_fail_bench;

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
    size_t tokens = 32768, hidden = argc > 1 ? (size_t)atoi(argv[1]) : 512, n = tokens * hidden;
    int multiprocessors = 0;
    cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0);
    uform_plan_t plan = {};
    plan.tokens = tokens, plan.hidden = hidden;
    uform_vram_context_t context = {};
    context.multiprocessors = multiprocessors;
    context.scratch_bytes[uform_vram_scratch_rmsnorm_k] = uform_vram_rmsnorm_scratch(&plan);
    void *x, *d_out, *d_x, *out;
    float *gain, *rstd, *d_gain;
    if (cudaMalloc(&x, n * 2) || cudaMalloc(&d_out, n * 2) || cudaMalloc(&d_x, n * 2) || cudaMalloc(&out, n * 2) ||
        cudaMalloc(&gain, hidden * 4) || cudaMalloc(&rstd, tokens * 4) || cudaMalloc(&d_gain, hidden * 4) ||
        cudaMalloc(&context.scratch[uform_vram_scratch_rmsnorm_k], context.scratch_bytes[uform_vram_scratch_rmsnorm_k]))
        return std::printf("no GPU memory\n"), 1;
    cudaMemset(x, 0x3F, n * 2), cudaMemset(d_out, 0x3C, n * 2), cudaMemset(d_x, 0, n * 2), cudaMemset(gain, 0, hidden * 4);
    cudaEvent_t start, stop;
    cudaEventCreate(&start), cudaEventCreate(&stop);
    double row_bytes = (double)n * 2;
    auto time = [&](char const* name, double bytes, auto launch) {
        for (int i = 0; i != 5; ++i) launch();
        cudaEventRecord(start);
        for (int i = 0; i != 50; ++i) launch();
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms = 0;
        cudaEventElapsedTime(&ms, start, stop);
        double us = ms * 1e3 / 50;
        std::printf("%-48s %8.1f us %7.0f GB/s\n", name, us, bytes / us / 1e3);
    };
    time("copy: read and write one activation", 2 * row_bytes, [&] { cudaMemcpyAsync(out, x, n * 2, cudaMemcpyDeviceToDevice); });
    time("forward: read x, write the normed", 2 * row_bytes,
         [&] { uform_vram_rmsnorm_forward(&context, out, rstd, x, gain, tokens, hidden); });
    time("backward: read x, d_out, d_x, write d_x; d_gain", 4 * row_bytes,
         [&] { uform_vram_rmsnorm_backward(&context, d_x, d_gain, d_out, x, gain, rstd, tokens, hidden); });
    cudaError_t error = cudaDeviceSynchronize();
    return error != cudaSuccess ? std::printf("%s\n", cudaGetErrorString(error)), 1 : 0;
}

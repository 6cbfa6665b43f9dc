/**
 *  @file   measure.cuh
 *  @brief  What `gemm.cu` and `attention.cu` share: device values read back as floats, their largest
 *          difference from a reference, and a call's mean time.
 */
#ifndef UFORM_BENCH_MEASURE_CUH_
#define UFORM_BENCH_MEASURE_CUH_

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <vector>

/** `count` device values (bf16, f16 or float) as floats on the host. */
template <typename value_t> static std::vector<float> host(value_t const* device, size_t count) {
    std::vector<value_t> bits(count);
    cudaMemcpy(bits.data(), device, count * sizeof(value_t), cudaMemcpyDeviceToHost);
    std::vector<float> values(count);
    for (size_t i = 0; i < count; ++i) values[i] = (float)bits[i];
    return values;
}

/** Largest |x - y| over the largest |y|, over the entries `keep(i)` keeps; infinite where only one is NaN. */
template <typename keep_t>
static double difference(std::vector<float> const& x, std::vector<float> const& y, keep_t keep) {
    double worst = 0, scale = 1e-30;
    for (size_t i = 0; i < x.size(); ++i) {
        if (!keep(i)) continue;
        if (std::isnan(x[i]) != std::isnan(y[i])) return INFINITY;
        worst = std::fmax(worst, std::fabs((double)x[i] - y[i]));
        scale = std::fmax(scale, std::fabs((double)y[i]));
    }
    return worst / scale;
}

static double difference(std::vector<float> const& x, std::vector<float> const& y) {
    return difference(x, y, [](size_t) { return true; });
}

/** Milliseconds a call of `run` takes, the mean of 20 after 3. */
template <typename run_t> static float time_ms(run_t run) {
    cudaEvent_t start, stop;
    cudaEventCreate(&start), cudaEventCreate(&stop);
    for (int i = 0; i < 3; ++i) run();
    cudaEventRecord(start);
    for (int i = 0; i < 20; ++i) run();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms;
    cudaEventElapsedTime(&ms, start, stop);
    cudaEventDestroy(start), cudaEventDestroy(stop);
    return ms / 20;
}

#endif

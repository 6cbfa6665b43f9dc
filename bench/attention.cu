/**
 *  @file   attention.cu
 *  @brief  The library's Hopper attention (`libuform/src/vram/attention_hopper.cuh`) on its own:
 *          forward and both backward passes against float32 loops on ragged items, and their times
 *          and TFLOP/s on the bench's geometry (64 items of 512 tokens, 8 heads of 64), and the backward
 *          pass's time with the gradients turned back by text positions' rotary cosines and sines (its
 *          results are checked by the tests against the CPU). Exits with 1 when a comparison fails.
 *
 *      nvcc -O3 -std=c++17 -arch=sm_90a -Ilibuform/src/vram -I<CUDA include> bench/attention.cu -lcuda \
 *           -o attention && ./attention
 */
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "attention_hopper.cuh"
#include "measure.cuh"

typedef __nv_bfloat16 bf16;

/* One thread a (query, head): the float32 loop the kernels are checked against; `delta` from d_out. */
__global__ void reference_forward(float* out, float* lse, float* delta, bf16 const* qkv, bf16 const* d_out,
                                  int const* offsets, int items, int hidden, int stride) {
    int token = blockIdx.x * blockDim.x + threadIdx.x, head = blockIdx.y, item = 0;
    while (item < items && offsets[item + 1] <= token) ++item;
    if (item >= items) return;
    size_t row = 3 * (size_t)hidden;
    bf16 const* q = qkv + token * row + head * 64;
    float maximum = -INFINITY, sum = 0, o[64] = {};
    for (int key = offsets[item]; key < offsets[item + 1]; ++key) {
        bf16 const* k = qkv + key * row + hidden + head * 64;
        bf16 const* v = qkv + key * row + 2 * hidden + head * 64;
        float score = 0;
        for (int d = 0; d < 64; ++d) score += __bfloat162float(q[d]) * __bfloat162float(k[d]);
        score *= 0.125f;
        float next = fmaxf(maximum, score), correction = expf(maximum - next), p = expf(score - next);
        sum = sum * correction + p;
        for (int d = 0; d < 64; ++d) o[d] = o[d] * correction + p * __bfloat162float(v[d]);
        maximum = next;
    }
    float dot = 0;
    for (int d = 0; d < 64; ++d) {
        out[(size_t)token * hidden + head * 64 + d] = o[d] / sum;
        dot += o[d] / sum * __bfloat162float(d_out[(size_t)token * hidden + head * 64 + d]);
    }
    lse[(size_t)head * stride + token] = maximum + logf(sum);
    delta[(size_t)head * stride + token] = dot;
}

/* One thread a (token, head): d q of the token as a query, then d k and d v of it as a key. */
__global__ void reference_backward(float* d_qkv, bf16 const* qkv, bf16 const* d_out, float const* lse,
                                   float const* delta, int const* offsets, int items, int hidden, int stride) {
    int token = blockIdx.x * blockDim.x + threadIdx.x, head = blockIdx.y, item = 0;
    while (item < items && offsets[item + 1] <= token) ++item;
    if (item >= items) return;
    size_t row = 3 * (size_t)hidden;
    auto at = [&](int t, int part, int d) { return __bfloat162float(qkv[t * row + part * hidden + head * 64 + d]); };
    auto grad = [&](int t, int d) { return __bfloat162float(d_out[(size_t)t * hidden + head * 64 + d]); };
    auto probability = [&](int query, int key, float* d_p) {
        float score = 0, dot = 0;
        for (int d = 0; d < 64; ++d) score += at(query, 0, d) * at(key, 1, d), dot += grad(query, d) * at(key, 2, d);
        *d_p = dot;
        return expf(score * 0.125f - lse[(size_t)head * stride + query]);
    };
    float d_q[64] = {}, d_k[64] = {}, d_v[64] = {};
    for (int other = offsets[item]; other < offsets[item + 1]; ++other) {
        float d_p, p = probability(token, other, &d_p), d_s = p * (d_p - delta[(size_t)head * stride + token]);
        for (int d = 0; d < 64; ++d) d_q[d] += d_s * at(other, 1, d) * 0.125f;
        p = probability(other, token, &d_p), d_s = p * (d_p - delta[(size_t)head * stride + other]);
        for (int d = 0; d < 64; ++d) d_k[d] += d_s * at(other, 0, d) * 0.125f, d_v[d] += p * grad(other, d);
    }
    for (int d = 0; d < 64; ++d) {
        d_qkv[token * row + head * 64 + d] = d_q[d];
        d_qkv[token * row + hidden + head * 64 + d] = d_k[d];
        d_qkv[token * row + 2 * hidden + head * 64 + d] = d_v[d];
    }
}

__global__ void fill(bf16* values, size_t count, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)(i * 2654435761u) ^ (seed * 40503u);
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        values[i] = __float2bfloat16(((float)(h % 2001) / 1000.0f - 1.0f) * scale);
    }
}

static int failures = 0, multiprocessors = 0;

static void run(char const* name, std::vector<int> const& lengths, int hidden, float scale) {
    int items = (int)lengths.size(), heads = hidden / 64, longest = 0;
    std::vector<int> offsets(items + 1, 0);
    std::vector<uint32_t> segments(4 * items, 0); /* the library's items: start, length, row, column */
    for (int i = 0; i < items; ++i) {
        offsets[i + 1] = offsets[i] + lengths[i], longest = std::max(longest, lengths[i]);
        segments[4 * i] = (uint32_t)offsets[i], segments[4 * i + 1] = (uint32_t)lengths[i];
    }
    size_t tokens = (size_t)offsets[items];
    int stride = (int)tokens;
    bf16 *qkv, *out, *d_out, *d_qkv;
    float *lse, *delta, *expected, *expected_lse, *expected_delta, *expected_d_qkv;
    int* device_offsets;
    uint32_t* device_segments;
    unsigned* counter;
    cudaMalloc(&counter, 8), cudaMemset(counter, 0, 8);
    cudaMalloc(&qkv, tokens * 3 * hidden * 2), cudaMalloc(&out, tokens * hidden * 2);
    cudaMalloc(&d_out, tokens * hidden * 2), cudaMalloc(&d_qkv, tokens * 3 * hidden * 2);
    cudaMalloc(&lse, heads * stride * 4), cudaMalloc(&delta, heads * stride * 4);
    cudaMalloc(&expected, tokens * hidden * 4), cudaMalloc(&expected_lse, heads * stride * 4);
    cudaMalloc(&expected_delta, heads * stride * 4), cudaMalloc(&expected_d_qkv, tokens * 3 * hidden * 4);
    cudaMalloc(&device_offsets, (items + 1) * 4), cudaMalloc(&device_segments, 16 * items);
    cudaMemcpy(device_offsets, offsets.data(), (items + 1) * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(device_segments, segments.data(), 16 * items, cudaMemcpyHostToDevice);
    fill<<<1024, 256>>>(qkv, tokens * 3 * hidden, 7, scale);
    fill<<<1024, 256>>>(d_out, tokens * hidden, 9, 1.0f);
    uform_hopper_encoder_t encode = uform_hopper_encoder();
    auto check = [&](cudaError_t error, char const* what) {
        if (error == cudaSuccess) return;
        std::printf("%s, %s: %s\n", name, what, cudaGetErrorString(error));
        std::exit(1);
    };
    bool taking_turns = true; /* the forward's warpgroups issue their products in turns */
    auto run_forward = [&] {
        check(uform_flash_forward(encode, multiprocessors, 0, false, out, lse, qkv, device_segments, items, longest, tokens, hidden,
                                  stride, counter, taking_turns), "forward");
    };
    float2* turns = nullptr; /* the backward pass given them: text positions, 0.. in each item */
    auto run_backward = [&] {
        check(uform_flash_backward(encode, multiprocessors, 0, false, d_qkv, delta, d_out, out, lse, qkv, turns,
                                   device_segments, items, longest, tokens, hidden, stride, counter), "backward");
    };
    run_forward(), run_backward();
    dim3 reference_grid((unsigned)((tokens + 127) / 128), (unsigned)heads);
    reference_forward<<<reference_grid, 128>>>(expected, expected_lse, expected_delta, qkv, d_out, device_offsets,
                                               items, hidden, stride);
    reference_backward<<<reference_grid, 128>>>(expected_d_qkv, qkv, d_out, expected_lse, expected_delta,
                                                device_offsets, items, hidden, stride);
    cudaError_t error = cudaDeviceSynchronize();
    if (error != cudaSuccess) {
        std::printf("%s: %s\n", name, cudaGetErrorString(error));
        std::exit(1);
    }
    auto tokens_only = [&](size_t i) { return i % stride < tokens; };
    double out_error = difference(host(out, tokens * hidden), host(expected, tokens * hidden));
    double lse_error = difference(host(lse, heads * stride), host(expected_lse, heads * stride), tokens_only);
    double delta_error = difference(host(delta, heads * stride), host(expected_delta, heads * stride), tokens_only);
    std::vector<float> got = host(d_qkv, tokens * 3 * hidden), want = host(expected_d_qkv, tokens * 3 * hidden);
    double part_error[3];
    for (int part = 0; part != 3; ++part)
        part_error[part] = difference(got, want, [&](size_t i) { return (int)(i % (3 * hidden)) / hidden == part; });
    float forward_us = 1e3f * time_ms(run_forward), backward_us = 1e3f * time_ms(run_backward);
    /* Without turns each warpgroup still sums its own rows in the same order: the same bits. */
    std::vector<float> in_turns_out = host(out, tokens * hidden), in_turns_lse = host(lse, heads * stride);
    taking_turns = false;
    cudaMemset(out, 0, tokens * hidden * 2), cudaMemset(lse, 0, heads * stride * 4);
    run_forward();
    bool untaken_same = host(out, tokens * hidden) == in_turns_out && host(lse, heads * stride) == in_turns_lse;
    float untaken_us = 1e3f * time_ms(run_forward);
    taking_turns = true;
    std::vector<float2> text(tokens * 32);
    for (int i = 0; i != items; ++i)
        for (int t = 0; t != lengths[i]; ++t)
            for (int pair = 0; pair != 32; ++pair) {
                double angle = t * std::pow(10000.0, -pair / 32.0);
                text[(offsets[i] + t) * 32 + pair] = make_float2((float)std::cos(angle), (float)std::sin(angle));
            }
    cudaMalloc(&turns, tokens * 32 * sizeof(float2));
    cudaMemcpy(turns, text.data(), tokens * 32 * sizeof(float2), cudaMemcpyHostToDevice);
    float turned_us = 1e3f * time_ms(run_backward);
    double flops = 0;
    for (int length : lengths) flops += 4.0 * heads * length * (double)length * 64;
    std::printf("%-7s %3d items, %6zu tokens, %d heads: forward %6.1f us (%3.0f TFLOP/s), backward %6.1f us"
                " (%3.0f TFLOP/s of 2.5 forwards), %6.1f us turned back\n"
                "        forward without turns %6.1f us (%s)\n"
                "        differ: out %.1e, lse %.1e, delta %.1e, d_q %.1e, d_k %.1e, d_v %.1e\n",
                name, items, tokens, heads, forward_us, flops / forward_us / 1e6, backward_us,
                2.5 * flops / backward_us / 1e6, turned_us, untaken_us, untaken_same ? "the same bits" : "OTHER BITS",
                out_error, lse_error, delta_error, part_error[0], part_error[1], part_error[2]);
    if (!(out_error <= 1e-2 && lse_error <= 1e-5 && delta_error <= 1e-2 && part_error[0] <= 2e-2 &&
          part_error[1] <= 2e-2 && part_error[2] <= 2e-2 && untaken_same)) {
        std::printf("  ^ FAILED\n");
        ++failures;
    }
    for (void* p : {(void*)qkv, (void*)out, (void*)d_out, (void*)d_qkv, (void*)lse, (void*)delta, (void*)expected,
                    (void*)expected_lse, (void*)expected_delta, (void*)expected_d_qkv, (void*)device_offsets,
                    (void*)device_segments, (void*)counter, (void*)turns})
        cudaFree(p);
}

int main() {
    std::setvbuf(stdout, nullptr, _IONBF, 0);
    cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0);
    if (!uform_hopper_ready(0) || !uform_hopper_encoder()) return std::printf("not a Hopper GPU\n"), 0;
    run("single", {128}, 64, 1.0f);
    run("short", {1, 7, 130, 64}, 128, 1.0f);
    std::vector<int> ragged;
    for (int i = 0; i < 40; ++i) ragged.push_back(1 + (i * 7919) % 700);
    run("ragged", ragged, 512, 2.0f);
    run("bench", std::vector<int>(64, 512), 512, 1.0f);
    run("sharp", std::vector<int>(64, 512), 512, 4.0f); /* a sharper softmax */
    return failures ? std::printf("%d comparisons failed\n", failures), 1 : 0;
}

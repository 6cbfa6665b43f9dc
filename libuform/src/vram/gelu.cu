/**
 *  @file   gelu.cu
 *  @brief  GELU with the tanh approximation, element-wise over `count` bfloat16 values, and its
 *          derivative. Twin of `ram/gelu.c`.
 *
 *  0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3), in float32 with
 *  the CPU's formulas (`expf`, clamped as the CPU's polynomial exponential is), rounded once. A
 *  grid-stride loop, one thread per 8 values (16-byte loads) when the count and the pointers
 *  allow it, one value otherwise. Element-wise: deterministic. The backward pass writes d_in,
 *  which may alias d_out: each thread reads its values before it writes them.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_gelu_threads_k = 256;
__device__ constexpr float uform_vram_gelu_root = 0.7978845608f; /* sqrt(2 / pi) */
__device__ constexpr float uform_vram_gelu_cubic = 0.044715f;

/** e^x with the CPU's clamp of x to [-87, 88], so huge inputs saturate as on the CPU (NaN stays NaN in x). */
__device__ __forceinline__ float uform_vram_gelu_exp(float x) { return expf(fminf(fmaxf(x, -87.0f), 88.0f)); }

__device__ __forceinline__ float uform_vram_gelu(float x) {
    float inner = uform_vram_gelu_root * (x + uform_vram_gelu_cubic * x * x * x);
    return x / (1.0f + uform_vram_gelu_exp(-2.0f * inner));
}

/** d_out * (s + x s (1 - s) 2 du/dx), s = sigmoid(2u). */
__device__ __forceinline__ float uform_vram_gelu_derivative(float x, float gradient) {
    float inner = uform_vram_gelu_root * (x + uform_vram_gelu_cubic * x * x * x);
    float slope = uform_vram_gelu_root * (1.0f + 3.0f * uform_vram_gelu_cubic * x * x);
    float gate = 1.0f / (1.0f + uform_vram_gelu_exp(-2.0f * inner));
    return gradient * (gate + 2.0f * x * gate * (1.0f - gate) * slope);
}

__global__ void uform_vram_gelu_forward_vectors(uint4* __restrict__ out, uint4 const* __restrict__ in, size_t vectors) {
    uform_vram_chain();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < vectors; index += stride) {
        float values[8];
        uform_vram_unpack8(in[index], values);
#pragma unroll
        for (int k = 0; k != 8; ++k) values[k] = uform_vram_gelu(values[k]);
        out[index] = uform_vram_pack8(values);
    }
}

__global__ void uform_vram_gelu_forward_scalars(uform_bf16_t* __restrict__ out, uform_bf16_t const* __restrict__ in,
                                                size_t count) {
    uform_vram_chain();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < count; index += stride)
        out[index] = __float2bfloat16_rn(uform_vram_gelu(__bfloat162float(in[index])));
}

/* No __restrict__ on d_in and d_out: they may alias. */
__global__ void uform_vram_gelu_backward_vectors(uint4* d_in, uint4 const* d_out, uint4 const* __restrict__ in,
                                                 size_t vectors) {
    uform_vram_chain();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < vectors; index += stride) {
        float values[8], gradients[8];
        uform_vram_unpack8(in[index], values);
        uform_vram_unpack8(d_out[index], gradients);
#pragma unroll
        for (int k = 0; k != 8; ++k) values[k] = uform_vram_gelu_derivative(values[k], gradients[k]);
        d_in[index] = uform_vram_pack8(values);
    }
}

__global__ void uform_vram_gelu_backward_scalars(uform_bf16_t* d_in, uform_bf16_t const* d_out,
                                                 uform_bf16_t const* __restrict__ in, size_t count) {
    uform_vram_chain();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < count; index += stride)
        d_in[index] = __float2bfloat16_rn(
            uform_vram_gelu_derivative(__bfloat162float(in[index]), __bfloat162float(d_out[index])));
}

unsigned uform_vram_gelu_grid(void* context, size_t work) {
    size_t cap = (size_t)(uform_vram(context)->multiprocessors > 0 ? uform_vram(context)->multiprocessors : 1) * 16;
    size_t blocks = uform_vram_blocks(work, uform_vram_gelu_threads_k);
    return (unsigned)(blocks < cap ? blocks : cap);
}

bool uform_vram_gelu_aligned(void const* pointer) { return (uintptr_t)pointer % 16 == 0; }

} // namespace

uform_status_t uform_vram_gelu_forward(void* context, void* out, void const* in, size_t count) {
    if (!count) return uform_status_success_k;
    cudaStream_t stream = uform_vram(context)->stream;
    if (count % 8 == 0 && uform_vram_gelu_aligned(out) && uform_vram_gelu_aligned(in))
        uform_vram_launch(uform_vram_gelu_forward_vectors, uform_vram_gelu_grid(context, count / 8),
            uform_vram_gelu_threads_k, 0, stream, (uint4*)out, (uint4 const*)in, count / 8);
    else
        uform_vram_launch(uform_vram_gelu_forward_scalars, uform_vram_gelu_grid(context, count),
            uform_vram_gelu_threads_k, 0, stream, (uform_bf16_t*)out, (uform_bf16_t const*)in, count);
    return uform_vram_launched("uform_vram_gelu_forward");
}

uform_status_t uform_vram_gelu_backward(void* context, void* d_in, void const* d_out, void const* in, size_t count) {
    if (!count) return uform_status_success_k;
    cudaStream_t stream = uform_vram(context)->stream;
    if (count % 8 == 0 && uform_vram_gelu_aligned(d_in) && uform_vram_gelu_aligned(d_out) &&
        uform_vram_gelu_aligned(in))
        uform_vram_launch(uform_vram_gelu_backward_vectors, uform_vram_gelu_grid(context, count / 8),
            uform_vram_gelu_threads_k, 0, stream, (uint4*)d_in, (uint4 const*)d_out, (uint4 const*)in, count / 8);
    else
        uform_vram_launch(uform_vram_gelu_backward_scalars, uform_vram_gelu_grid(context, count),
            uform_vram_gelu_threads_k, 0, stream, (uform_bf16_t*)d_in, (uform_bf16_t const*)d_out,
            (uform_bf16_t const*)in, count);
    return uform_vram_launched("uform_vram_gelu_backward");
}

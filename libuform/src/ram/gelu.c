/**
 *  @file   gelu.c
 *  @brief  GELU with the tanh approximation, element-wise over `count` floats.
 *
 *  0.5 x (1 + tanh(u)) equals x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3): one
 *  vectorizable exponential per element instead of a scalar `tanhf`.
 */
#include "ram.h"

static float const uform_ram_gelu_root = 0.7978845608f; /* sqrt(2 / pi) */
static float const uform_ram_gelu_cubic = 0.044715f;

uform_status_t uform_ram_gelu_forward(void* context, void* out_, void const* in_, size_t count) {
    float* out = out_;
    float const* in = in_;
#pragma omp parallel for simd num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t index = 0; index < count; ++index) {
        float x = in[index];
        float inner = uform_ram_gelu_root * (x + uform_ram_gelu_cubic * x * x * x);
        out[index] = x / (1.0f + uform_ram_exp(-2.0f * inner));
    }
    return uform_status_success_k;
}

/** d_in = d_out * (s + x s (1 - s) 2 du/dx) with s = sigmoid(2u); written, not accumulated. */
uform_status_t uform_ram_gelu_backward(void* context, void* d_in_, void const* d_out_, void const* in_, size_t count) {
    float* d_in = d_in_;
    float const *d_out = d_out_, *in = in_;
#pragma omp parallel for simd num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t index = 0; index < count; ++index) {
        float x = in[index];
        float inner = uform_ram_gelu_root * (x + uform_ram_gelu_cubic * x * x * x);
        float slope = uform_ram_gelu_root * (1.0f + 3.0f * uform_ram_gelu_cubic * x * x);
        float gate = 1.0f / (1.0f + uform_ram_exp(-2.0f * inner));
        d_in[index] = d_out[index] * (gate + 2.0f * x * gate * (1.0f - gate) * slope);
    }
    return uform_status_success_k;
}

/**
 *  @file   rope.c
 *  @brief  Rotary positions on the query and key thirds of qkv (tokens, 3 hidden), in place.
 *
 *  Each 64-wide head rotates its pairs (x[2i], x[2i+1]) by position * 10000^(-2i/64), an image
 *  patch's by its row and its column in turn (`uform_rope_coordinate`). Angles,
 *  cosines and sines are computed in double and rounded once to float, so positions in the
 *  thousands keep their precision.
 */
#include "ram.h"

enum { uform_ram_rope_pairs_k = uform_head_width_k / 2 };

/** Rotates by +angle (`sign` 1) or by -angle, the transpose, for the gradients (`sign` -1). */
static uform_status_t uform_ram_rope_rotate(void* context, float* qkv, uint32_t const* positions, size_t tokens,
                                  size_t hidden, double sign) {
    double frequencies[uform_ram_rope_pairs_k];
    for (int pair = 0; pair < uform_ram_rope_pairs_k; ++pair)
        frequencies[pair] = pow(10000.0, -2.0 * pair / (double)uform_head_width_k);
    size_t rotated_heads = 2 * (hidden / uform_head_width_k); /* queries' heads, then keys' */
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t token = 0; token < tokens; ++token) {
        float cosines[uform_ram_rope_pairs_k], sines[uform_ram_rope_pairs_k];
        for (int pair = 0; pair < uform_ram_rope_pairs_k; ++pair) {
            int frequency;
            double angle = (double)uform_rope_coordinate(positions[token], pair, &frequency) * frequencies[frequency];
            cosines[pair] = (float)cos(angle);
            sines[pair] = (float)(sign * sin(angle));
        }
        float* row = qkv + token * 3 * hidden;
        for (size_t head = 0; head < rotated_heads; ++head) {
            float* restrict x = row + head * uform_head_width_k;
            for (int pair = 0; pair < uform_ram_rope_pairs_k; ++pair) {
                float x0 = x[2 * pair], x1 = x[2 * pair + 1];
                x[2 * pair] = x0 * cosines[pair] - x1 * sines[pair];
                x[2 * pair + 1] = x0 * sines[pair] + x1 * cosines[pair];
            }
        }
    }
    return uform_status_success_k;
}

uform_status_t uform_ram_rope_forward(void* context, void* qkv, uint32_t const* positions, size_t tokens, size_t hidden) {
    return uform_ram_rope_rotate(context, qkv, positions, tokens, hidden, 1.0);
}

uform_status_t uform_ram_rope_backward(void* context, void* d_qkv, uint32_t const* positions, size_t tokens,
                                       size_t hidden) {
    return uform_ram_rope_rotate(context, d_qkv, positions, tokens, hidden, -1.0);
}

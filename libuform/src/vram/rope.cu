/**
 *  @file   rope.cu
 *  @brief  Rotary positions on the query and key thirds of qkv (tokens, 3 hidden), in place, and
 *          the inverse rotation of their gradients. Twin of `ram/rope.c`.
 *
 *  Each 64-wide head rotates its pairs (x[2i], x[2i+1]) by position * 10000^(-2i/64), an image
 *  patch's by its row and its column in turn (`uform_rope_coordinate`). One thread
 *  per (token, pair index i): it computes that angle's cosine and sine once, in double with
 *  `sincospi` (the frequencies, divided by pi, are computed on the host in double and passed as a
 *  kernel argument), rounds them to float as the CPU does, and rotates pair i of every query and
 *  key head of its token. The 32 threads of a warp cover one head's 64 contiguous values, so each
 *  access is one 128-byte line. Every element is written by one thread: deterministic.
 *
 *  The library's own attention on Hopper takes the gradients' inverse turn as it writes them, with
 *  the same cosines and sines from a table of each token's that `uform_vram_rope_turns` fills.
 */
#include "vram.h"

namespace {

constexpr int uform_vram_rope_pairs_k = uform_head_width_k / 2;
constexpr unsigned uform_vram_rope_threads_k = 256;

/** pow(10000, -2i / 64) / pi, in double, for the pairs i of a head. */
struct uform_vram_rope_frequencies_t {
    double over_pi[uform_vram_rope_pairs_k];
};

/** The cosine and sine of pair `pair`'s angle at `position`: in double, rounded to float as the CPU rounds them. */
__device__ __forceinline__ float2 uform_vram_rope_turn(uint32_t position, int pair,
                                                       uform_vram_rope_frequencies_t const& frequencies) {
    double sine, cosine;
    int frequency;
    uint32_t coordinate = uform_rope_coordinate(position, pair, &frequency);
    sincospi((double)coordinate * frequencies.over_pi[frequency], &sine, &cosine);
    return make_float2((float)cosine, (float)sine);
}

__global__ void uform_vram_rope_kernel(__nv_bfloat162* __restrict__ qkv, uint32_t const* __restrict__ positions,
                                       size_t tokens, size_t hidden, uform_vram_rope_frequencies_t frequencies,
                                       float sign) {
    uform_vram_chain();
    size_t total = tokens * uform_vram_rope_pairs_k, stride = (size_t)gridDim.x * blockDim.x;
    size_t rotated_heads = 2 * (hidden / uform_head_width_k); /* queries' heads, then keys' */
    size_t row_pairs = 3 * hidden / 2;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < total; index += stride) {
        size_t token = index / uform_vram_rope_pairs_k;
        float2 turn = uform_vram_rope_turn(positions[token], (int)(index % uform_vram_rope_pairs_k), frequencies);
        float c = turn.x, s = sign * turn.y; /* the sign changes no bit of the rounded sine */
        __nv_bfloat162* row = qkv + token * row_pairs + (index % uform_vram_rope_pairs_k);
        for (size_t head = 0; head < rotated_heads; ++head) {
            __nv_bfloat162* at = row + head * uform_vram_rope_pairs_k;
            float2 x = __bfloat1622float2(*at);
            *at = __floats2bfloat162_rn(x.x * c - x.y * s, x.x * s + x.y * c);
        }
    }
}

/** turns (tokens, 32): the cosine and sine of each token's pairs' angles, as rounded above. */
__global__ void uform_vram_rope_turns_kernel(float2* __restrict__ turns, uint32_t const* __restrict__ positions,
                                             size_t tokens, uform_vram_rope_frequencies_t frequencies) {
    uform_vram_chain();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < tokens * uform_vram_rope_pairs_k;
         index += stride)
        turns[index] = uform_vram_rope_turn(positions[index / uform_vram_rope_pairs_k],
                                            (int)(index % uform_vram_rope_pairs_k), frequencies);
}

uform_vram_rope_frequencies_t uform_vram_rope_frequencies() {
    uform_vram_rope_frequencies_t frequencies;
    double const pi = 3.14159265358979323846;
    for (int pair = 0; pair < uform_vram_rope_pairs_k; ++pair)
        frequencies.over_pi[pair] = pow(10000.0, -2.0 * pair / (double)uform_head_width_k) / pi;
    return frequencies;
}

/** A grid over tokens x 32 pairs, at most 16 blocks a multiprocessor (the threads stride over the rest). */
unsigned uform_vram_rope_blocks(uform_vram_context_t* context, size_t tokens) {
    size_t cap = (size_t)(context->multiprocessors > 0 ? context->multiprocessors : 1) * 16;
    size_t blocks = uform_vram_blocks(tokens * uform_vram_rope_pairs_k, uform_vram_rope_threads_k);
    return (unsigned)(blocks < cap ? blocks : cap);
}

uform_status_t uform_vram_rope_rotate(void* context, void* qkv, uint32_t const* positions, size_t tokens,
                                      size_t hidden, float sign, char const* name) {
    if (!tokens || hidden < uform_head_width_k) return uform_status_success_k;
    if ((hidden * 3) % 2 || (uintptr_t)qkv % 4)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "%s: hidden %zu or qkv is misaligned", name,
                               hidden);
    uform_vram_launch(uform_vram_rope_kernel, uform_vram_rope_blocks(uform_vram(context), tokens),
        uform_vram_rope_threads_k, 0, uform_vram(context)->stream, (__nv_bfloat162*)qkv, positions, tokens, hidden,
        uform_vram_rope_frequencies(), sign);
    return uform_vram_launched(name);
}

} // namespace

uform_status_t uform_vram_rope_forward(void* context, void* qkv, uint32_t const* positions, size_t tokens,
                                       size_t hidden) {
    return uform_vram_rope_rotate(context, qkv, positions, tokens, hidden, 1.0f, "uform_vram_rope_forward");
}

uform_status_t uform_vram_rope_backward(void* context, void* d_qkv, uint32_t const* positions, size_t tokens,
                                        size_t hidden) {
    return uform_vram_rope_rotate(context, d_qkv, positions, tokens, hidden, -1.0f, "uform_vram_rope_backward");
}

uform_status_t uform_vram_rope_turns(uform_vram_context_t* context, float2* turns, uint32_t const* positions,
                                     size_t tokens) {
    if (!tokens) return uform_status_success_k;
    uform_vram_launch(uform_vram_rope_turns_kernel, uform_vram_rope_blocks(context, tokens), uform_vram_rope_threads_k,
        0, context->stream, turns, positions, tokens, uform_vram_rope_frequencies());
    return uform_vram_launched("uform_vram_rope_turns");
}

/**
 *  @file   adamw.cu
 *  @brief  The gradient's sum of squares behind clipping, one AdamW update of every tensor of the
 *          plan's layout, and float32 to bfloat16 conversion. Twin of `ram/adamw.c`.
 *
 *  Sum of squares: blocks of 256 threads each own 4096 consecutive floats (the CPU's block size);
 *  thread t adds, in double, the floats 4 (t + 256 j) .. + 3 for j = 0..3 in that order, and the
 *  threads meet in a fixed tree of shuffles. The blocks' partials land in the reduce scratch and
 *  one block of 1024 threads adds them in a fixed order (thread t takes partials t, t + 1024, ...,
 *  then a fixed tree). No atomics: the same bits run after run, whatever the GPU. A call past the
 *  plan's capacities, whose partials would not fit in the scratch, runs both steps in one block
 *  in the same order: slower, the same bits.
 *
 *  AdamW: at context creation the layout is cut into a table of pieces of at most 4096 floats,
 *  each within one tensor and carrying whether it decays (`uform_vram_adamw_plan`, into the AdamW
 *  scratch). One kernel runs a block per piece: it reads the step's scalars, leaves everything
 *  as it is when `uform_update_poisoned` says so, and otherwise updates each element exactly as
 *  `ram/adamw.c` does (bias corrections computed on the host in double, rounded to float), also
 *  writing the bfloat16 compute copy of the new weight when asked. Element-wise: deterministic.
 *
 *  Convert: a grid-stride loop, 4 floats a thread when aligned, rounding to nearest even.
 */
#include <cstdlib>

#include "vram.h"

namespace {

constexpr unsigned uform_vram_adamw_threads_k = 256;
constexpr size_t uform_vram_adamw_piece_k = 4096;  /* floats of a sum-of-squares block and of an AdamW piece */
constexpr unsigned uform_vram_reduce_threads_k = 1024;

/** A piece of one tensor: floats [begin, begin + length) of the flat buffers. */
struct uform_vram_adamw_piece_t {
    uint64_t begin;
    uint32_t length; /* at most uform_vram_adamw_piece_k */
    uint32_t decays;
};

/** The step's settings as a kernel reads them. */
struct uform_vram_adamw_settings_t {
    float learning_rate, beta1, beta2, epsilon, weight_decay, clip_norm;
    float first_correction, second_correction;
    uform_terms_t terms;
};

/* -------------------------------------------------------------------------------------------- */
/*  Sum of squares                                                                                */
/* -------------------------------------------------------------------------------------------- */

/** Thread `local`'s share of block `block`: floats 4 (local + 256 j) .. + 3, j = 0..3, in that order, in double. */
__device__ __forceinline__ double uform_vram_sum_squares_thread(float const* __restrict__ x, size_t count, size_t block,
                                                                unsigned local, int aligned) {
    size_t base = block * uform_vram_adamw_piece_k;
    double sum = 0;
    if (aligned && base + uform_vram_adamw_piece_k <= count) {
        float4 const* x4 = reinterpret_cast<float4 const*>(x + base);
#pragma unroll
        for (unsigned j = 0; j != 4; ++j) {
            float4 v = x4[local + uform_vram_adamw_threads_k * j];
            sum += (double)v.x * v.x; /* a float's square is exact in double: fused or not, the same bits */
            sum += (double)v.y * v.y;
            sum += (double)v.z * v.z;
            sum += (double)v.w * v.w;
        }
    } else {
        for (unsigned j = 0; j != 4; ++j)
            for (unsigned k = 0; k != 4; ++k) {
                size_t at = base + 4 * (local + uform_vram_adamw_threads_k * j) + k;
                if (at < count) sum += (double)x[at] * x[at];
            }
    }
    return sum;
}

/** A warp's butterfly of shuffles: every lane ends with the same sum. */
__device__ __forceinline__ double uform_vram_warp_sum(double sum) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
    return sum;
}

/** partials[block] = the sum of squares of x[block * 4096 .. + 4096): threads, then warps, then the 8 warps' sums. */
__global__ void uform_vram_sum_squares_blocks(double* __restrict__ partials, float const* __restrict__ x, size_t count,
                                              int aligned) {
    uform_vram_chain();
    __shared__ double warps[uform_vram_adamw_threads_k / 32];
    double sum = uform_vram_warp_sum(uform_vram_sum_squares_thread(x, count, blockIdx.x, threadIdx.x, aligned));
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        sum = uform_vram_warp_sum(threadIdx.x < uform_vram_adamw_threads_k / 32 ? warps[threadIdx.x] : 0.0);
        if (threadIdx.x == 0) partials[blockIdx.x] = sum;
    }
}

/** The last step of a 1024-thread block: thread t holds partials t, t + 1024, ... added in order. */
__device__ __forceinline__ double uform_vram_sum_squares_final(double sum) {
    __shared__ double warps[uform_vram_reduce_threads_k / 32];
    sum = uform_vram_warp_sum(sum);
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x < 32) sum = uform_vram_warp_sum(warps[threadIdx.x]);
    return sum; /* valid in thread 0 */
}

/** One block of 1024 threads: *total = the partials added in the fixed order (0 for none). */
__global__ void __launch_bounds__(uform_vram_reduce_threads_k) uform_vram_sum_squares_total(double* __restrict__ total, double const* __restrict__ partials,
                                             size_t count) {
    uform_vram_chain();
    double sum = 0;
    for (size_t index = threadIdx.x; index < count; index += uform_vram_reduce_threads_k) sum += partials[index];
    sum = uform_vram_sum_squares_final(sum);
    if (threadIdx.x == 0) *total = sum;
}

/**
 *  Both steps in one block of 1024 threads, for calls past the plan's capacities whose partials
 *  would not fit in the scratch: its four quarters compute four blocks' partials at a time exactly
 *  as `uform_vram_sum_squares_blocks` does, and thread t keeps the sum of partials t, t + 1024, ...
 *  in order, as `uform_vram_sum_squares_total` does. Slower, the same bits.
 */
__global__ void __launch_bounds__(uform_vram_reduce_threads_k) uform_vram_sum_squares_alone(double* __restrict__ total, float const* __restrict__ x, size_t count,
                                             int aligned) {
    uform_vram_chain();
    constexpr unsigned quarters = uform_vram_reduce_threads_k / uform_vram_adamw_threads_k;
    __shared__ double warps[uform_vram_reduce_threads_k / 32];
    __shared__ double partials[quarters];
    unsigned quarter = threadIdx.x / uform_vram_adamw_threads_k, local = threadIdx.x % uform_vram_adamw_threads_k;
    size_t blocks = (count + uform_vram_adamw_piece_k - 1) / uform_vram_adamw_piece_k;
    double mine = 0;
    for (size_t first = 0; first < blocks; first += quarters) {
        size_t block = first + quarter;
        double sum = block < blocks ? uform_vram_sum_squares_thread(x, count, block, local, aligned) : 0.0;
        sum = uform_vram_warp_sum(sum);
        if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = sum;
        __syncthreads();
        if (local < 32) {
            unsigned lane = local;
            sum = uform_vram_warp_sum(lane < uform_vram_adamw_threads_k / 32
                                          ? warps[quarter * (uform_vram_adamw_threads_k / 32) + lane]
                                          : 0.0);
            if (lane == 0) partials[quarter] = sum;
        }
        __syncthreads();
        for (unsigned q = 0; q != quarters; ++q)
            if (first + q < blocks && (first + q) % uform_vram_reduce_threads_k == threadIdx.x) mine += partials[q];
        __syncthreads();
    }
    mine = uform_vram_sum_squares_final(mine);
    if (threadIdx.x == 0) *total = mine;
}

/* -------------------------------------------------------------------------------------------- */
/*  AdamW                                                                                         */
/* -------------------------------------------------------------------------------------------- */

__device__ __forceinline__ float uform_vram_adamw_element(float& weight, float gradient, float& first, float& second,
                                                          uform_vram_adamw_settings_t const& s, float decay,
                                                          float scale) {
    /* ram/adamw.c's expressions, each operation rounded as C evaluates it (no fused multiply-adds):
     * the same bits as the CPU wherever its compiler does not fuse either. */
    gradient = __fmul_rn(gradient, scale);
    float mean = __fadd_rn(__fmul_rn(s.beta1, first), __fmul_rn(1.0f - s.beta1, gradient));
    float variance = __fadd_rn(__fmul_rn(s.beta2, second), __fmul_rn(__fmul_rn(1.0f - s.beta2, gradient), gradient));
    first = mean;
    second = variance;
    float update = __fdiv_rn(__fmul_rn(mean, s.first_correction),
                             __fadd_rn(__fsqrt_rn(__fmul_rn(variance, s.second_correction)), s.epsilon));
    weight = __fsub_rn(weight, __fmul_rn(s.learning_rate, __fadd_rn(update, __fmul_rn(decay, weight))));
    return weight;
}

/** One block per piece; thread t takes floats 4 (t + 256 j) .. + 3 of it, j = 0..3. */
__global__ void uform_vram_adamw_kernel(float* __restrict__ weights, uform_bf16_t* __restrict__ compute,
                                        float const* __restrict__ gradients, float* __restrict__ first,
                                        float* __restrict__ second, double const* __restrict__ scalars,
                                        int32_t const* __restrict__ after, int32_t* __restrict__ verdict,
                                        uform_vram_adamw_piece_t const* __restrict__ pieces,
                                        uform_vram_adamw_settings_t settings, int aligned) {
    uform_vram_chain();
    __shared__ float shared_scale;
    __shared__ int shared_skip;
    if (threadIdx.x == 0) {
        int skip = uform_update_poisoned(scalars, settings.terms) || (after && !*after);
        if (verdict && blockIdx.x == 0) *verdict = !skip;
        double norm = sqrt(scalars[uform_scalar_norm_squared_k]);
        shared_skip = skip;
        shared_scale = norm > settings.clip_norm ? (float)(settings.clip_norm / norm) : 1.0f;
    }
    __syncthreads();
    if (shared_skip) return;
    float scale = shared_scale;
    uform_vram_adamw_piece_t piece = pieces[blockIdx.x];
    float decay = piece.decays ? settings.weight_decay : 0.0f;
    bool vectors = aligned && piece.begin % 4 == 0;
#pragma unroll
    for (unsigned j = 0; j != 4; ++j) {
        size_t local = 4 * ((size_t)threadIdx.x + uform_vram_adamw_threads_k * j);
        if (local >= piece.length) break;
        size_t at = piece.begin + local;
        if (vectors && local + 4 <= piece.length) {
            float4 w = *reinterpret_cast<float4*>(weights + at);
            float4 g = *reinterpret_cast<float4 const*>(gradients + at);
            float4 m = *reinterpret_cast<float4*>(first + at);
            float4 v = *reinterpret_cast<float4*>(second + at);
            uform_vram_adamw_element(w.x, g.x, m.x, v.x, settings, decay, scale);
            uform_vram_adamw_element(w.y, g.y, m.y, v.y, settings, decay, scale);
            uform_vram_adamw_element(w.z, g.z, m.z, v.z, settings, decay, scale);
            uform_vram_adamw_element(w.w, g.w, m.w, v.w, settings, decay, scale);
            *reinterpret_cast<float4*>(weights + at) = w;
            *reinterpret_cast<float4*>(first + at) = m;
            *reinterpret_cast<float4*>(second + at) = v;
            if (compute) {
                uint2 bits;
                __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&bits);
                pairs[0] = __floats2bfloat162_rn(w.x, w.y);
                pairs[1] = __floats2bfloat162_rn(w.z, w.w);
                *reinterpret_cast<uint2*>(compute + at) = bits;
            }
        } else {
            size_t end = local + 4 < piece.length ? local + 4 : piece.length;
            for (size_t element = piece.begin + local; element < piece.begin + end; ++element) {
                float w = weights[element], m = first[element], v = second[element];
                uform_vram_adamw_element(w, gradients[element], m, v, settings, decay, scale);
                weights[element] = w, first[element] = m, second[element] = v;
                if (compute) compute[element] = __float2bfloat16_rn(w);
            }
        }
    }
}

/* -------------------------------------------------------------------------------------------- */
/*  Convert                                                                                       */
/* -------------------------------------------------------------------------------------------- */

__global__ void uform_vram_convert_vectors(uint2* __restrict__ out, float4 const* __restrict__ in, size_t vectors) {
    uform_vram_chain();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < vectors; index += stride) {
        float4 v = in[index];
        uint2 bits;
        __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&bits);
        pairs[0] = __floats2bfloat162_rn(v.x, v.y);
        pairs[1] = __floats2bfloat162_rn(v.z, v.w);
        out[index] = bits;
    }
}

__global__ void uform_vram_convert_scalars(uform_bf16_t* __restrict__ out, float const* __restrict__ in, size_t count) {
    uform_vram_chain();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < count; index += stride)
        out[index] = __float2bfloat16_rn(in[index]);
}

/** Pieces of the layout's tensors, in layout order; writes them when `pieces` is not NULL. */
size_t uform_vram_adamw_pieces(uform_layout_t const* layout, uform_vram_adamw_piece_t* pieces) {
    size_t count = 0;
    if (!layout) return 0;
    for (size_t i = 0; i != layout->count; ++i) {
        uform_tensor_t const* tensor = &layout->tensors[i];
        size_t elements = tensor->rows * tensor->cols;
        for (size_t done = 0; done < elements; done += uform_vram_adamw_piece_k, ++count) {
            if (!pieces) continue;
            size_t left = elements - done;
            pieces[count].begin = tensor->offset + done;
            pieces[count].length = (uint32_t)(left < uform_vram_adamw_piece_k ? left : uform_vram_adamw_piece_k);
            pieces[count].decays = tensor->decays ? 1u : 0u;
        }
    }
    return count;
}

unsigned uform_vram_adamw_grid(void* context, size_t work) {
    size_t cap = (size_t)(uform_vram(context)->multiprocessors > 0 ? uform_vram(context)->multiprocessors : 1) * 16;
    size_t blocks = uform_vram_blocks(work, uform_vram_adamw_threads_k);
    return (unsigned)(blocks < cap ? blocks : cap);
}

} // namespace

uform_status_t uform_vram_sum_squares(void* context, double* sum, float const* x, size_t count) {
    uform_vram_context_t* vram = uform_vram(context);
    size_t blocks = (count + uform_vram_adamw_piece_k - 1) / uform_vram_adamw_piece_k;
    int aligned = (uintptr_t)x % 16 == 0;
    if (blocks > 0x7FFFFFFFu || blocks * sizeof(double) > vram->scratch_bytes[uform_vram_scratch_reduce_k]) {
        uform_vram_launch(uform_vram_sum_squares_alone, 1, uform_vram_reduce_threads_k, 0, vram->stream, sum, x, count,
            aligned);
        return uform_vram_launched("uform_vram_sum_squares (past the plan)");
    }
    double* partials = (double*)vram->scratch[uform_vram_scratch_reduce_k];
    if (blocks) {
        uform_vram_launch(uform_vram_sum_squares_blocks, (unsigned)blocks, uform_vram_adamw_threads_k, 0, vram->stream,
            partials, x, count, aligned);
        uform_status_t status = uform_vram_launched("uform_vram_sum_squares (blocks)");
        if (status != uform_status_success_k) return status;
    }
    uform_vram_launch(uform_vram_sum_squares_total, 1, uform_vram_reduce_threads_k, 0, vram->stream, sum, partials,
        blocks);
    return uform_vram_launched("uform_vram_sum_squares (total)");
}

size_t uform_vram_adamw_scratch(uform_plan_t const* plan) {
    return uform_vram_adamw_pieces(plan->layout, NULL) * sizeof(uform_vram_adamw_piece_t);
}

uform_status_t uform_vram_adamw_plan(uform_vram_context_t* context) {
    size_t count = uform_vram_adamw_pieces(context->plan.layout, NULL), bytes = count * sizeof(uform_vram_adamw_piece_t);
    if (!count) return uform_status_success_k;
    if (bytes > context->scratch_bytes[uform_vram_scratch_adamw_k])
        return uform_vram_fail(NULL, uform_status_invalid_argument_k,
                               "AdamW: the layout's %zu pieces exceed the planned scratch of %zu bytes", count,
                               context->scratch_bytes[uform_vram_scratch_adamw_k]);
    uform_vram_adamw_piece_t* pieces = (uform_vram_adamw_piece_t*)std::malloc(bytes);
    if (!pieces) return uform_vram_fail(NULL, uform_status_out_of_memory_k, "no memory for AdamW's table of %zu pieces", count);
    uform_vram_adamw_pieces(context->plan.layout, pieces);
    uform_status_t status = uform_vram_check(cudaMemcpyAsync(context->scratch[uform_vram_scratch_adamw_k], pieces, bytes,
                                                             cudaMemcpyHostToDevice, context->stream),
                                             "cudaMemcpyAsync (AdamW's table)");
    if (status == uform_status_success_k)
        status = uform_vram_check(cudaStreamSynchronize(context->stream), "cudaStreamSynchronize (AdamW's table)");
    std::free(pieces);
    return status;
}

uform_status_t uform_vram_adamw(void* context, uform_update_t const* update) {
    uform_vram_context_t* vram = uform_vram(context);
    size_t count = vram->scratch_bytes[uform_vram_scratch_adamw_k] / sizeof(uform_vram_adamw_piece_t);
    if (!count) return uform_status_success_k;
    if (count > 0x7FFFFFFFu)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "AdamW: %zu pieces", count);
    uform_vram_adamw_settings_t settings;
    settings.learning_rate = update->learning_rate, settings.beta1 = update->beta1, settings.beta2 = update->beta2;
    settings.epsilon = update->epsilon, settings.weight_decay = update->weight_decay;
    settings.clip_norm = update->clip_norm, settings.terms = update->terms;
    settings.first_correction = (float)(1.0 / (1.0 - pow((double)update->beta1, (double)update->step)));
    settings.second_correction = (float)(1.0 / (1.0 - pow((double)update->beta2, (double)update->step)));
    int aligned = (uintptr_t)update->weights % 16 == 0 && (uintptr_t)update->gradients % 16 == 0 &&
                  (uintptr_t)update->first % 16 == 0 && (uintptr_t)update->second % 16 == 0 &&
                  (uintptr_t)update->compute % 8 == 0;
    uform_vram_launch(uform_vram_adamw_kernel, (unsigned)count, uform_vram_adamw_threads_k, 0, vram->stream,
        update->weights, (uform_bf16_t*)update->compute, update->gradients, update->first, update->second,
        update->scalars, update->after, update->verdict,
        (uform_vram_adamw_piece_t const*)vram->scratch[uform_vram_scratch_adamw_k], settings, aligned);
    return uform_vram_launched("uform_vram_adamw");
}

uform_status_t uform_vram_convert(void* context, void* activations, float const* source, size_t count) {
    if (!count) return uform_status_success_k;
    cudaStream_t stream = uform_vram(context)->stream;
    if (count % 4 == 0 && (uintptr_t)activations % 8 == 0 && (uintptr_t)source % 16 == 0)
        uform_vram_launch(uform_vram_convert_vectors, uform_vram_adamw_grid(context, count / 4),
            uform_vram_adamw_threads_k, 0, stream, (uint2*)activations, (float4 const*)source, count / 4);
    else
        uform_vram_launch(uform_vram_convert_scalars, uform_vram_adamw_grid(context, count), uform_vram_adamw_threads_k,
            0, stream, (uform_bf16_t*)activations, source, count);
    return uform_vram_launched("uform_vram_convert");
}

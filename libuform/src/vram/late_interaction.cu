/**
 *  @file   late_interaction.cu
 *  @brief  The late-interaction term (SPEC section 5): MaxSim scores of each query against the
 *          documents it names, the pair loss over each query's row, and the gradient of the unit
 *          token vectors. Twin of `ram/late_interaction.c`.
 *
 *  Four launches:
 *    scores    a block per (query, document) pair: its warps take the query's rows in turn, the
 *              lanes a document row each, dot products in double; the largest (the first on a
 *              tie, as on the CPU) is kept in the scratch for the backward pass, and the block adds
 *              its warps' sums in warp order into S;
 *    rows      one block: a thread per query row runs the pair loss over its documents in order,
 *              as the CPU does; thread 0 then adds the rows in order into the loss and the
 *              temperature's and bias's gradients, and every pair's gradient is scaled;
 *    zero, then
 *    vectors   a warp per vector row: the pairs in order, each adding what it sends to this row
 *              (a query row's share of its nearest document row, a document row the query rows
 *              whose nearest it is, in their order), a lane per column. No atomics: the same bits
 *              run after run, and the additions in the CPU's order.
 *  The scratch is planned for `plan->pairs` pairs of queries at most `plan->query_span` rows long.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_late_threads_k = 256;
constexpr unsigned uform_vram_late_warps_k = uform_vram_late_threads_k / 32;

struct uform_vram_late_scratch_t {
    double *scores, *d_scores, *row_losses, *row_d_temperatures, *row_d_biases, *row_counted;
    uint32_t* nearest; /* (pairs, query span) */
};

size_t uform_vram_late_align(size_t bytes) { return (bytes + 255) / 256 * 256; }

uform_vram_late_scratch_t uform_vram_late_regions(void* base, size_t pairs, size_t rows) {
    char* cursor = (char*)base;
    uform_vram_late_scratch_t scratch;
    double** doubles[6] = {&scratch.scores, &scratch.d_scores, &scratch.row_losses, &scratch.row_d_temperatures,
                           &scratch.row_d_biases, &scratch.row_counted};
    for (int i = 0; i != 6; ++i) *doubles[i] = (double*)cursor, cursor += uform_vram_late_align((i < 2 ? pairs : rows) * 8);
    scratch.nearest = (uint32_t*)cursor;
    return scratch;
}

/** The query row whose run of pairs holds pair `j`. */
__device__ size_t uform_vram_late_row_of(uint32_t const* offsets, size_t count, size_t j) {
    size_t low = 0, high = count; /* offsets[low] <= j < offsets[high] */
    while (high - low > 1) {
        size_t middle = (low + high) / 2;
        if (offsets[middle] <= j) low = middle;
        else high = middle;
    }
    return low;
}

__global__ void __launch_bounds__(uform_vram_late_threads_k)
    uform_vram_late_scores_kernel(uform_vram_late_scratch_t scratch, float const* __restrict__ vectors, size_t width,
                                  uform_late_interaction_setup_t setup, size_t query_span) {
    uform_vram_chain();
    __shared__ double warp_sums[uform_vram_late_warps_k];
    size_t j = blockIdx.x;
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uform_span_t query = setup.spans[setup.queries[uform_vram_late_row_of(setup.offsets, setup.count, j)]];
    uform_span_t document = setup.spans[setup.documents[j]];
    double sum = 0;
    for (uint32_t t = warp; t < query.length && t < query_span; t += uform_vram_late_warps_k) {
        float const* row = vectors + ((size_t)query.start + t) * width;
        double best = -INFINITY;
        uint32_t nearest = document.start;
        for (uint32_t u = document.start + lane; u < document.start + document.length; u += 32) {
            float const* other = vectors + (size_t)u * width;
            double dot = 0;
            for (size_t column = 0; column < width; ++column) dot += (double)row[column] * other[column];
            if (dot > best) best = dot, nearest = u;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) {
            double other_best = __shfl_xor_sync(0xFFFFFFFFu, best, offset);
            uint32_t other_nearest = __shfl_xor_sync(0xFFFFFFFFu, nearest, offset);
            if (other_best > best || (other_best == best && other_nearest < nearest)) best = other_best, nearest = other_nearest;
        }
        if (lane == 0) scratch.nearest[j * query_span + t] = nearest;
        sum += best;
    }
    if (lane == 0) warp_sums[warp] = sum;
    __syncthreads();
    if (threadIdx.x != 0) return;
    double score = 0;
    for (unsigned w = 0; w != uform_vram_late_warps_k; ++w) score += warp_sums[w];
    scratch.scores[j] = score;
}

__device__ double uform_vram_late_softplus(double x, double* sigmoid) {
    double small = exp(-fabs(x)); /* e^-|x| <= 1 */
    *sigmoid = x >= 0 ? 1.0 / (1.0 + small) : small / (1.0 + small);
    return (x > 0 ? x : 0.0) + log1p(small);
}

/** One query row's pair loss; `gradient` receives dL / ds per document, as `uform_ram_pair_row`. */
__device__ double uform_vram_late_row(uform_pair_loss_form_t form, double const* scores, double* gradient,
                                      uint8_t const* cells, float const* weights, size_t named, double temperature,
                                      double bias, double attract, double repel) {
    double loss = 0, sigmoid;
    for (size_t j = 0; j != named; ++j) gradient[j] = 0;
    if (form == uform_pair_loss_ranked_k) {
        double normalizer = 1.0 / (attract * repel);
        for (size_t p = 0; p != named; ++p) {
            if (weights[p] == 0 || cells[p] != uform_cell_attract_k) continue;
            double positive_weight = weights[p] * normalizer, positive_gradient = 0;
            for (size_t n = 0; n != named; ++n) {
                if (weights[n] == 0 || cells[n] != uform_cell_repel_k) continue;
                double pair_weight = positive_weight * weights[n];
                loss += pair_weight * uform_vram_late_softplus(temperature * (scores[n] - scores[p]), &sigmoid);
                gradient[n] += pair_weight * sigmoid;
                positive_gradient -= pair_weight * sigmoid;
            }
            gradient[p] += positive_gradient;
        }
        return loss;
    }
    for (size_t j = 0; j != named; ++j) {
        if (cells[j] == uform_cell_ignored_k || weights[j] == 0) continue;
        double sign = cells[j] == uform_cell_attract_k ? 1.0 : -1.0, weight = weights[j];
        if (form == uform_pair_loss_balanced_k) weight /= sign > 0 ? attract : repel;
        loss += weight * uform_vram_late_softplus(-sign * (temperature * scores[j] + bias), &sigmoid);
        gradient[j] = -sign * weight * sigmoid;
    }
    return loss;
}

__global__ void __launch_bounds__(uform_vram_late_threads_k)
    uform_vram_late_rows_kernel(uform_vram_late_scratch_t scratch, double* loss, float* d_log_inverse_temperature,
                                float* d_bias, float const* log_inverse_temperature, float const* bias,
                                uform_late_interaction_setup_t setup, float scale) {
    uform_vram_chain();
    __shared__ double factor;
    double temperature = exp((double)log_inverse_temperature[0]);
    for (size_t r = threadIdx.x; r < setup.count; r += uform_vram_late_threads_k) {
        uint32_t first = setup.offsets[r], named = setup.offsets[r + 1] - first;
        double attract = 0, repel = 0;
        for (uint32_t j = first; j != first + named; ++j)
            *(setup.cells[j] == uform_cell_attract_k ? &attract : &repel) += setup.weights[j];
        double counted = uform_row_counts(setup.form, attract, repel) ? 1.0 : 0.0;
        double row_loss = 0, d_temperature = 0, d_bias_sum = 0;
        for (uint32_t j = first; j != first + named; ++j) scratch.d_scores[j] = 0;
        if (counted) {
            row_loss = uform_vram_late_row(setup.form, scratch.scores + first, scratch.d_scores + first,
                                           setup.cells + first, setup.weights + first, named, temperature,
                                           (double)bias[0], attract, repel);
            for (uint32_t j = first; j != first + named; ++j)
                d_temperature += scratch.d_scores[j] * temperature * scratch.scores[j], d_bias_sum += scratch.d_scores[j];
        }
        scratch.row_losses[r] = row_loss, scratch.row_counted[r] = counted;
        scratch.row_d_temperatures[r] = d_temperature, scratch.row_d_biases[r] = d_bias_sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double counting = 0, total = 0, d_temperature = 0, d_bias_sum = 0;
        for (size_t r = 0; r != setup.count; ++r)
            counting += scratch.row_counted[r], total += scratch.row_losses[r],
                d_temperature += scratch.row_d_temperatures[r], d_bias_sum += scratch.row_d_biases[r];
        double coefficient = counting > 0 ? (double)scale / counting : 0.0;
        *loss = counting > 0 ? total / counting : __longlong_as_double(0x7FF8000000000000ll);
        if (counting > 0) {
            d_log_inverse_temperature[0] += (float)(coefficient * d_temperature);
            if (setup.form != uform_pair_loss_ranked_k) d_bias[0] += (float)(coefficient * d_bias_sum);
        }
        factor = coefficient * temperature;
    }
    __syncthreads();
    for (size_t j = threadIdx.x; j < setup.pairs; j += uform_vram_late_threads_k) scratch.d_scores[j] *= factor;
}

__global__ void __launch_bounds__(uform_vram_late_threads_k)
    uform_vram_late_vectors_kernel(float* __restrict__ d_vectors, uform_vram_late_scratch_t scratch,
                                   float const* __restrict__ vectors, size_t rows, size_t width,
                                   uform_late_interaction_setup_t setup, size_t query_span) {
    uform_vram_chain();
    size_t x = (size_t)blockIdx.x * uform_vram_late_warps_k + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    if (x >= rows) return;
    float* gradient = d_vectors + x * width;
    for (size_t r = 0; r != setup.count; ++r) {
        uform_span_t query = setup.spans[setup.queries[r]];
        for (uint32_t j = setup.offsets[r]; j != setup.offsets[r + 1]; ++j) {
            double d_score = scratch.d_scores[j];
            if (d_score == 0) continue;
            uint32_t const* nearest = scratch.nearest + (size_t)j * query_span;
            if (x >= query.start && x < (size_t)query.start + query.length) {
                float const* other = vectors + (size_t)nearest[x - query.start] * width;
                for (size_t column = lane; column < width; column += 32)
                    gradient[column] += (float)(d_score * other[column]);
            }
            uform_span_t document = setup.spans[setup.documents[j]];
            if (x < document.start || x >= (size_t)document.start + document.length) continue;
            for (uint32_t t = 0; t != query.length && t < query_span; ++t) {
                if (nearest[t] != x) continue;
                float const* other = vectors + ((size_t)query.start + t) * width;
                for (size_t column = lane; column < width; column += 32)
                    gradient[column] += (float)(d_score * other[column]);
            }
        }
    }
}

} // namespace

size_t uform_vram_late_interaction_scratch(uform_plan_t const* plan) {
    return 2 * uform_vram_late_align(plan->pairs * 8) + 4 * uform_vram_late_align(plan->segments * 8) +
           plan->pairs * plan->query_span * sizeof(uint32_t);
}

uform_status_t uform_vram_late_interaction(void* context, double* loss, float* d_vectors,
                                           float* d_log_inverse_temperature, float* d_bias, float const* vectors,
                                           size_t rows, size_t width, float const* log_inverse_temperature,
                                           float const* bias, uform_late_interaction_setup_t const* setup,
                                           float scale) {
    uform_vram_context_t* vram = uform_vram(context);
    uform_plan_t const* plan = &vram->plan;
    if (setup->pairs > plan->pairs || setup->count > plan->segments || setup->pairs > 0x7FFFFFFFu)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k,
                               "late interaction: %zu pairs over %zu query rows exceed the plan of %zu pairs, %zu rows",
                               setup->pairs, setup->count, plan->pairs, plan->segments);
    size_t blocks = (rows + uform_vram_late_warps_k - 1) / uform_vram_late_warps_k;
    if (blocks > 0x7FFFFFFFu) return uform_vram_fail(NULL, uform_status_invalid_argument_k, "late interaction: %zu rows", rows);
    cudaStream_t stream = vram->stream;
    uform_vram_late_scratch_t scratch =
        uform_vram_late_regions(vram->scratch[uform_vram_scratch_late_k], plan->pairs, plan->segments);
    uform_status_t status = uform_status_success_k;
    if (setup->pairs) {
        uform_vram_launch(uform_vram_late_scores_kernel, (unsigned)setup->pairs, uform_vram_late_threads_k, 0, stream,
            scratch, vectors, width, *setup, plan->query_span);
        status = uform_vram_launched("uform_vram_late_interaction (scores)");
    }
    if (status != uform_status_success_k) return status;
    uform_vram_launch(uform_vram_late_rows_kernel, 1, uform_vram_late_threads_k, 0, stream, scratch, loss,
        d_log_inverse_temperature, d_bias, log_inverse_temperature, bias, *setup, scale);
    status = uform_vram_launched("uform_vram_late_interaction (rows)");
    if (status != uform_status_success_k) return status;
    status = uform_vram_check(cudaMemsetAsync(d_vectors, 0, rows * width * sizeof(float), stream),
                              "cudaMemsetAsync (late interaction)");
    if (status != uform_status_success_k || !rows) return status;
    uform_vram_launch(uform_vram_late_vectors_kernel, (unsigned)blocks, uform_vram_late_threads_k, 0, stream, d_vectors,
        scratch, vectors, rows, width, *setup, plan->query_span);
    return uform_vram_launched("uform_vram_late_interaction (vectors)");
}

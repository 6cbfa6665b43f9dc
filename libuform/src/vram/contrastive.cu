/**
 *  @file   contrastive.cu
 *  @brief  The pairwise contrastive loss over pooled embeddings (SPEC section 5), with its
 *          gradients, for each Matryoshka prefix in turn: the CUDA twin of `ram/contrastive.c`.
 *
 *  For a prefix width m, z_i = pooled_i[:m] / |pooled_i[:m]| and s_ij = t_g(i) <z_i, z_j> + b_g(i)
 *  with t = exp(log_inverse_temperature). Everything inside is double, as on the CPU; only
 *  `normalized`, `d_pooled` and the parameter gradients are float32, converted once at the end.
 *
 *  @section  The split
 *
 *  Once per call:
 *    prepare   a block per item: the full-width unit embedding into `normalized`, and the row's
 *              attract and repel weight sums (which rows count depends on them alone);
 *    count     one block: how many rows count, and the coefficient scale / (prefixes x counting)
 *              that turns a row's dL_i / ds_ij into the mean's; into the scratch's header.
 *  Then for each prefix:
 *    prefix    a block per item: z_i (double) and 1 / |pooled_i[:m]|;
 *    cosines   a 32 x 32 tile of <z_i, z_j> per block, the classic shared-memory product;
 *    row       a block per anchor row i: the row's loss, its coupling c_ij = coefficient x t x
 *              dL_i / ds_ij, and its share of d log t and d b, as row partials in the scratch;
 *    couple    a 32 x 32 tile of d_z_i = sum_j (c_ij + c_ji) z_j per block, the same product;
 *    project   a block per item: back through z = p / |p| into the double sum of d_pooled.
 *  And at the end:
 *    finish    one block: adds the row partials in (prefix, row) order, exactly the reference's
 *              order, into `*loss` and the used groups' d_log_inverse_temperature and d_bias;
 *    apply     d_pooled += (float) the double sum over prefixes, element by element.
 *  Nothing is done (and the loss is NaN) when no row counts or there are no prefixes, as on the
 *  CPU, which returns before touching any gradient.
 *
 *  @section  Determinism
 *
 *  No atomics. Every sum has one fixed order that depends on the shapes alone: a block's
 *  reductions stride its 256 threads over the elements in index order and then halve a shared
 *  array in a fixed tree; a tile's output element is one thread's running sum over k (or j) in
 *  index order; the ranked form gives each positive its sum over the row's negatives, and each
 *  negative its sum over the row's positives, each in index order by one thread (so no cell is
 *  written by two threads; threads take the entries of the row's lists, not its cells, so that a
 *  warp's lanes walk the other side together), and the lists of positives and negatives are
 *  compacted in index order with warp ballots. Sums across rows (the loss, d log t, d b) are kept per row and per
 *  prefix in the scratch and added by one thread per group, in order. The same inputs give the
 *  same bits, run after run, whatever the GPU's scheduling.
 *
 *  Against the CPU the coupling values, the per-group sums and the loss follow the reference's
 *  order of operations; the within-row sums (dot products, the row's loss, weight sums) are
 *  tree-shaped here and vectorized there, and libdevice's exp / log1p are not glibc's, so the two
 *  agree to a few double ulps, which the float32 outputs almost never show (on an H200, every
 *  float output of every case tried, up to 1000 items, had the CPU's bits).
 *
 *  @section  Scratch
 *
 *  Planned for the capacities `plan->segments` (N) items and `plan->hidden` (H), each region on a
 *  256-byte boundary: the header {counting, coefficient}; z, d_z and the d_pooled sum, (N, H)
 *  doubles each; the cosines and the coupling, (N, N) doubles each, packed with the call's items
 *  as their stride; 1 / |prefix|, the attract and the repel sums, (N) doubles each; the row's
 *  loss, d log t and d b, (prefixes, N) doubles each; and the ranked lists, (N, N) uint32, a
 *  row's positives from its front and its negatives from its back.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_contrastive_threads_k = 256; /* a block per row: the reduction tree's shape */
constexpr unsigned uform_vram_contrastive_warps_k = uform_vram_contrastive_threads_k / 32;
constexpr unsigned uform_vram_contrastive_tile_k = 32;      /* a product's square tile */
constexpr unsigned uform_vram_contrastive_tile_rows_k = 8;  /* threads down a tile: 4 outputs each */
constexpr unsigned uform_vram_contrastive_finish_threads_k = 128;
constexpr unsigned uform_vram_contrastive_finish_chunk_k = 512; /* row partials staged at once by `finish` */
constexpr unsigned uform_vram_contrastive_groups_k = UFORM_MAX_TEMPERATURE_GROUPS;
static_assert(uform_vram_contrastive_groups_k < uform_vram_contrastive_finish_threads_k,
              "finish: a thread per group and one more for the loss");

typedef struct uform_vram_contrastive_header_t {
    unsigned long long counting; /* rows that take part in the mean */
    double coefficient;          /* scale / (prefixes x counting) */
} uform_vram_contrastive_header_t;

/** The scratch's regions; see the file's header. */
typedef struct uform_vram_contrastive_scratch_t {
    uform_vram_contrastive_header_t* header;
    double *embeddings, *d_embeddings, *d_pooled_sums; /* (N, H), rows `hidden` apart */
    double *cosines, *coupling;                        /* (N, N), rows `items` apart */
    double *inverse_norms, *attract_sums, *repel_sums; /* (N) */
    double *row_losses, *row_d_temperatures, *row_d_biases; /* (prefixes, N), prefixes `items` apart */
    uint32_t* lists;                                        /* (N, N), rows `items` apart */
} uform_vram_contrastive_scratch_t;

/** Lays the regions out from `base` for N items and H wide; returns the bytes. `base` may be NULL
 *  (and `scratch` then too) to size the scratch only. */
size_t uform_vram_contrastive_carve(void* base, size_t items, size_t hidden,
                                   uform_vram_contrastive_scratch_t* scratch) {
    size_t offset = 0;
    auto region = [&](size_t bytes) -> void* {
        size_t at = offset;
        offset += (bytes + 255) / 256 * 256;
        return base ? (void*)((char*)base + at) : nullptr;
    };
    size_t const dimensions = UFORM_MAX_MATRYOSHKA_DIMENSIONS;
    uform_vram_contrastive_scratch_t carved;
    carved.header = (uform_vram_contrastive_header_t*)region(sizeof(uform_vram_contrastive_header_t));
    carved.embeddings = (double*)region(sizeof(double) * items * hidden);
    carved.d_embeddings = (double*)region(sizeof(double) * items * hidden);
    carved.d_pooled_sums = (double*)region(sizeof(double) * items * hidden);
    carved.cosines = (double*)region(sizeof(double) * items * items);
    carved.coupling = (double*)region(sizeof(double) * items * items);
    carved.inverse_norms = (double*)region(sizeof(double) * items);
    carved.attract_sums = (double*)region(sizeof(double) * items);
    carved.repel_sums = (double*)region(sizeof(double) * items);
    carved.row_losses = (double*)region(sizeof(double) * dimensions * items);
    carved.row_d_temperatures = (double*)region(sizeof(double) * dimensions * items);
    carved.row_d_biases = (double*)region(sizeof(double) * dimensions * items);
    carved.lists = (uint32_t*)region(sizeof(uint32_t) * items * items);
    if (scratch) *scratch = carved;
    return offset;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Device helpers                                                                                 */
/* ---------------------------------------------------------------------------------------------- */

/** softplus(x) = log(1 + e^x) without overflow; its derivative, sigmoid(x), from the same exponential. */
__device__ __forceinline__ double uform_vram_softplus(double x, double* sigmoid) {
    double small = exp(-fabs(x)); /* e^-|x| <= 1 */
    *sigmoid = x >= 0 ? 1.0 / (1.0 + small) : small / (1.0 + small);
    return (x > 0 ? x : 0.0) + log1p(small);
}

/** sigmoid(x) alone, the same bits as `uform_vram_softplus` gives: a negative's pass needs no logarithm. */
__device__ __forceinline__ double uform_vram_sigmoid(double x) {
    double small = exp(-fabs(x));
    return x >= 0 ? 1.0 / (1.0 + small) : small / (1.0 + small);
}

/** The block's sum of each thread's `value`, in a fixed tree over `uform_vram_contrastive_threads_k`
 *  threads; every thread gets it. `shared` holds that many; it is free again on return. */
template <typename scalar_t>
__device__ __forceinline__ scalar_t uform_vram_block_sum(scalar_t value, scalar_t* shared) {
    shared[threadIdx.x] = value;
    __syncthreads();
    for (unsigned stride = uform_vram_contrastive_threads_k / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
        __syncthreads();
    }
    scalar_t total = shared[0];
    __syncthreads();
    return total;
}

/** 1 / |row[:width]| in double, or 0 for a zero prefix, which then stays zero and passes no gradient. */
__device__ __forceinline__ double uform_vram_inverse_norm(float const* row, size_t width, double* shared) {
    double squares = 0;
    for (size_t column = threadIdx.x; column < width; column += uform_vram_contrastive_threads_k)
        squares += (double)row[column] * row[column];
    squares = uform_vram_block_sum(squares, shared);
    return squares > 0 ? 1.0 / sqrt(squares) : 0.0;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Once per call                                                                                  */
/* ---------------------------------------------------------------------------------------------- */

/** A block per item: normalized_i = pooled_i / |pooled_i| (float32) and row i's weight sums. */
__global__ void __launch_bounds__(uform_vram_contrastive_threads_k)
    uform_vram_contrastive_prepare_kernel(float* normalized, double* attract_sums, double* repel_sums,
                                          float const* pooled, uint8_t const* cells, float const* weights, size_t items,
                                          size_t hidden) {
    uform_vram_chain();
    __shared__ double shared[uform_vram_contrastive_threads_k];
    size_t const i = blockIdx.x;
    float const* row = pooled + i * hidden;
    double inverse = uform_vram_inverse_norm(row, hidden, shared);
    for (size_t column = threadIdx.x; column < hidden; column += uform_vram_contrastive_threads_k)
        normalized[i * hidden + column] = (float)(row[column] * inverse);

    uint8_t const* row_cells = cells + i * items;
    float const* row_weights = weights + i * items;
    double attract = 0, repel = 0;
    for (size_t j = threadIdx.x; j < items; j += uform_vram_contrastive_threads_k) {
        if (row_cells[j] == uform_cell_attract_k) attract += row_weights[j];
        if (row_cells[j] == uform_cell_repel_k) repel += row_weights[j];
    }
    attract = uform_vram_block_sum(attract, shared);
    repel = uform_vram_block_sum(repel, shared);
    if (threadIdx.x == 0) attract_sums[i] = attract, repel_sums[i] = repel;
}

/** One block: the rows that count, and the coefficient of every row's gradient. */
__global__ void __launch_bounds__(uform_vram_contrastive_threads_k)
    uform_vram_contrastive_count_kernel(uform_vram_contrastive_header_t* header, double const* attract_sums,
                                        double const* repel_sums, size_t items, int form, size_t dimensions,
                                        float scale) {
    uform_vram_chain();
    __shared__ unsigned long long shared[uform_vram_contrastive_threads_k];
    unsigned long long counting = 0;
    for (size_t i = threadIdx.x; i < items; i += uform_vram_contrastive_threads_k)
        counting += uform_row_counts((uform_pair_loss_form_t)form, attract_sums[i], repel_sums[i]) ? 1 : 0;
    counting = uform_vram_block_sum(counting, shared);
    if (threadIdx.x != 0) return;
    header->counting = counting;
    header->coefficient = counting && dimensions ? (double)scale / ((double)dimensions * (double)counting) : 0.0;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Per prefix                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

/** A block per item: z_i = pooled_i[:width] / |pooled_i[:width]| in double, and that inverse norm. */
__global__ void __launch_bounds__(uform_vram_contrastive_threads_k)
    uform_vram_contrastive_prefix_kernel(double* embeddings, double* inverse_norms,
                                         uform_vram_contrastive_header_t const* header, float const* pooled,
                                         size_t hidden, size_t width) {
    uform_vram_chain();
    __shared__ double shared[uform_vram_contrastive_threads_k];
    if (header->counting == 0) return;
    size_t const i = blockIdx.x;
    float const* row = pooled + i * hidden;
    double inverse = uform_vram_inverse_norm(row, width, shared);
    if (threadIdx.x == 0) inverse_norms[i] = inverse;
    for (size_t column = threadIdx.x; column < width; column += uform_vram_contrastive_threads_k)
        embeddings[i * hidden + column] = row[column] * inverse;
}

/**
 *  cosines (items, items) = z z^T over the first `width` columns; a 32 x 32 tile per block of
 *  32 x 8 threads, 4 outputs each, every output one thread's sum over k in index order (and
 *  so exactly symmetric: the products commute).
 */
__global__ void __launch_bounds__(uform_vram_contrastive_tile_k * uform_vram_contrastive_tile_rows_k)
    uform_vram_contrastive_cosines_kernel(double* cosines, uform_vram_contrastive_header_t const* header,
                                          double const* embeddings, size_t items, size_t hidden, size_t width) {
    uform_vram_chain();
    constexpr unsigned tile = uform_vram_contrastive_tile_k, rows = uform_vram_contrastive_tile_rows_k;
    constexpr unsigned outputs = tile / rows;
    __shared__ double anchors[tile][tile + 1], others[tile][tile + 1]; /* [row][k], padded against conflicts */
    if (header->counting == 0) return;
    size_t const anchor_base = (size_t)blockIdx.y * tile, other_base = (size_t)blockIdx.x * tile;
    unsigned const x = threadIdx.x, y = threadIdx.y;
    double sums[outputs] = {};
    for (size_t k_base = 0; k_base < width; k_base += tile) {
        size_t const k = k_base + x;
        for (unsigned row = y; row < tile; row += rows) {
            size_t const anchor = anchor_base + row, other = other_base + row;
            anchors[row][x] = anchor < items && k < width ? embeddings[anchor * hidden + k] : 0.0;
            others[row][x] = other < items && k < width ? embeddings[other * hidden + k] : 0.0;
        }
        __syncthreads();
        unsigned const depth = width - k_base < tile ? (unsigned)(width - k_base) : tile;
        for (unsigned kk = 0; kk < depth; ++kk) {
            double const other = others[x][kk];
#pragma unroll
            for (unsigned output = 0; output < outputs; ++output)
                sums[output] += anchors[y + output * rows][kk] * other;
        }
        __syncthreads();
    }
    size_t const j = other_base + x;
    if (j >= items) return;
#pragma unroll
    for (unsigned output = 0; output < outputs; ++output) {
        size_t const i = anchor_base + y + output * rows;
        if (i < items) cosines[i * items + j] = sums[output];
    }
}

/**
 *  A block per anchor row i: L_i into row_losses[i], coupling row i = coefficient x t x dL_i / ds_ij
 *  (zero for ignored cells and rows that do not count), and the row's coefficient-scaled share
 *  of d log t and d b. Cosines of ignored cells are never read into anything.
 */
__global__ void __launch_bounds__(uform_vram_contrastive_threads_k)
    uform_vram_contrastive_row_kernel(double* coupling, double* row_losses, double* row_d_temperatures,
                                      double* row_d_biases, uint32_t* lists,
                                      uform_vram_contrastive_header_t const* header, double const* cosines,
                                      uint8_t const* cells, float const* weights, uint32_t const* groups,
                                      float const* log_inverse_temperature, float const* bias,
                                      double const* attract_sums, double const* repel_sums, size_t items, int form) {
    uform_vram_chain();
    constexpr unsigned threads = uform_vram_contrastive_threads_k, warps = uform_vram_contrastive_warps_k;
    __shared__ double shared[threads];
    __shared__ unsigned warp_positives[warps], warp_negatives[warps];
    if (header->counting == 0) return;
    size_t const i = blockIdx.x;
    double* gradients = coupling + i * items;
    double const attract = attract_sums[i], repel = repel_sums[i];
    if (!uform_row_counts((uform_pair_loss_form_t)form, attract, repel)) {
        for (size_t j = threadIdx.x; j < items; j += threads) gradients[j] = 0;
        if (threadIdx.x == 0) row_losses[i] = row_d_temperatures[i] = row_d_biases[i] = 0;
        return;
    }
    uint8_t const* row_cells = cells + i * items;
    float const* row_weights = weights + i * items;
    double const* row_cosines = cosines + i * items;
    size_t const group = groups ? groups[i] : 0;
    double const temperature = exp((double)log_inverse_temperature[group]);
    double const shift = (double)bias[group];
    double const coefficient = header->coefficient;
    double loss = 0, d_temperature = 0, d_bias = 0;

    if (form == uform_pair_loss_ranked_k) {
        /* The row's positives (attract, weighed) from the front of its list and its negatives
         * (repel, weighed) from the back, both in index order: ballots within a warp, then the
         * warps' counts in warp order. All threads take every pass, so the ballots see them all. */
        uint32_t* list = lists + i * items;
        unsigned const lane = threadIdx.x % 32, warp = threadIdx.x / 32, below = (1u << lane) - 1u;
        unsigned positives = 0, negatives = 0; /* so far; the same in every thread */
        for (size_t start = 0; start < items; start += threads) {
            size_t const j = start + threadIdx.x;
            bool positive = false, negative = false;
            if (j < items && row_weights[j] != 0) {
                positive = row_cells[j] == uform_cell_attract_k;
                negative = row_cells[j] == uform_cell_repel_k;
            }
            unsigned const positive_bits = __ballot_sync(0xFFFFFFFFu, positive);
            unsigned const negative_bits = __ballot_sync(0xFFFFFFFFu, negative);
            if (lane == 0) warp_positives[warp] = __popc(positive_bits), warp_negatives[warp] = __popc(negative_bits);
            __syncthreads();
            unsigned positive_at = positives, negative_at = negatives;
            for (unsigned other = 0; other < warps; ++other) {
                if (other < warp) positive_at += warp_positives[other], negative_at += warp_negatives[other];
                positives += warp_positives[other], negatives += warp_negatives[other];
            }
            if (positive) list[positive_at + __popc(positive_bits & below)] = (uint32_t)j;
            if (negative) list[items - 1 - (negative_at + __popc(negative_bits & below))] = (uint32_t)j;
            __syncthreads(); /* the list is whole for the block, and the warp counts free again */
        }

        /* The bias cancels in s_ip - s_in, so it is left out rather than added and subtracted. Each
         * listed cell's gradient is one thread's sum over the other side, in index order. Threads
         * take the list's entries, positives first, rather than the row's cells: a row's few
         * positives each walk every negative, and spread this way the lanes of a warp walk them
         * together, reading the same negative at once, instead of one lane walking while its
         * warp waits. */
        double const normalizer = 1.0 / (attract * repel);
        unsigned const listed = positives + negatives;
        for (unsigned entry = threadIdx.x; entry < listed; entry += threads) {
            bool const is_positive = entry < positives;
            uint32_t const j = is_positive ? list[entry] : list[items - 1 - (entry - positives)];
            double const cosine = row_cosines[j];
            double gradient = 0;
            if (is_positive) {
                double const positive_weight = row_weights[j] * normalizer;
#pragma unroll 4
                for (unsigned n = 0; n < negatives; ++n) {
                    uint32_t const negative = list[items - 1 - n];
                    double const pair_weight = positive_weight * row_weights[negative];
                    double const margin = temperature * (row_cosines[negative] - cosine); /* s_in - s_ip */
                    double sigmoid;
                    loss += pair_weight * uform_vram_softplus(margin, &sigmoid);
                    gradient -= pair_weight * sigmoid;
                }
            } else {
                float const weight = row_weights[j];
#pragma unroll 4
                for (unsigned p = 0; p < positives; ++p) {
                    uint32_t const positive = list[p];
                    double const pair_weight = (row_weights[positive] * normalizer) * weight; /* as the positive's */
                    double const margin = temperature * (cosine - row_cosines[positive]);
                    gradient += pair_weight * uform_vram_sigmoid(margin);
                }
            }
            d_temperature += gradient * temperature * cosine; /* ds / dlog t = t <z_i, z_j> */
            gradients[j] = gradient * (coefficient * temperature);
        }
        /* Every other cell: zero, and for a counted one its (zero) share of d log t, as on the CPU. */
        for (size_t j = threadIdx.x; j < items; j += threads) {
            uint8_t const cell = row_cells[j];
            bool const is_listed =
                row_weights[j] != 0 && (cell == uform_cell_attract_k || cell == uform_cell_repel_k);
            if (is_listed) continue;
            if (cell == uform_cell_ignored_k) {
                gradients[j] = 0;
                continue;
            }
            double const gradient = 0;
            d_temperature += gradient * temperature * row_cosines[j];
            gradients[j] = gradient * (coefficient * temperature);
        }
    } else {
        for (size_t j = threadIdx.x; j < items; j += threads) {
            uint8_t const cell = row_cells[j];
            if (cell == uform_cell_ignored_k) {
                gradients[j] = 0;
                continue;
            }
            float const stored = row_weights[j];
            double const cosine = row_cosines[j];
            double gradient = 0;
            if (stored != 0) {
                double const sign = cell == uform_cell_attract_k ? 1.0 : -1.0; /* y: pull attracts, push repels */
                double weight = stored;
                if (form == uform_pair_loss_balanced_k) weight /= sign > 0 ? attract : repel; /* that half's sum > 0 */
                double const score = temperature * cosine + shift;
                double sigmoid;
                loss += weight * uform_vram_softplus(-sign * score, &sigmoid);
                gradient = -sign * weight * sigmoid;
            }
            d_temperature += gradient * temperature * cosine;
            d_bias += gradient;
            gradients[j] = gradient * (coefficient * temperature);
        }
    }

    loss = uform_vram_block_sum(loss, shared);
    d_temperature = uform_vram_block_sum(d_temperature, shared);
    d_bias = uform_vram_block_sum(d_bias, shared);
    if (threadIdx.x != 0) return;
    row_losses[i] = loss;
    row_d_temperatures[i] = coefficient * d_temperature;
    row_d_biases[i] = form == uform_pair_loss_ranked_k ? 0.0 : coefficient * d_bias;
}

/**
 *  d_embeddings (items, width) = W z with W_ij = c_ij + c_ji: s_ij moves z_i through t_g(i) z_j and
 *  z_j through t_g(i) z_i, so z_i collects its row and its column. A 32 x 32 tile per block, every
 *  output one thread's sum over j in index order; zero weights are passed over, as on the CPU.
 */
__global__ void __launch_bounds__(uform_vram_contrastive_tile_k * uform_vram_contrastive_tile_rows_k)
    uform_vram_contrastive_couple_kernel(double* d_embeddings, uform_vram_contrastive_header_t const* header,
                                         double const* coupling, double const* embeddings, size_t items, size_t hidden,
                                         size_t width) {
    uform_vram_chain();
    constexpr unsigned tile = uform_vram_contrastive_tile_k, rows = uform_vram_contrastive_tile_rows_k;
    constexpr unsigned outputs = tile / rows;
    __shared__ double row_part[tile][tile + 1];    /* [i][j]: c_ij */
    __shared__ double column_part[tile][tile + 1]; /* [i][j]: c_ji */
    __shared__ double others[tile][tile + 1];      /* [j][column]: z_j */
    if (header->counting == 0) return;
    size_t const i_base = (size_t)blockIdx.y * tile, column_base = (size_t)blockIdx.x * tile;
    unsigned const x = threadIdx.x, y = threadIdx.y;
    double sums[outputs] = {};
    for (size_t j_base = 0; j_base < items; j_base += tile) {
        for (unsigned row = y; row < tile; row += rows) {
            size_t const i = i_base + row, j = j_base + row;
            /* Each load runs along x, the fastest index of its source. */
            row_part[row][x] = i < items && j_base + x < items ? coupling[i * items + j_base + x] : 0.0;
            column_part[x][row] = j < items && i_base + x < items ? coupling[j * items + i_base + x] : 0.0;
            others[row][x] = j < items && column_base + x < width ? embeddings[j * hidden + column_base + x] : 0.0;
        }
        __syncthreads();
        unsigned const depth = items - j_base < tile ? (unsigned)(items - j_base) : tile;
        for (unsigned jj = 0; jj < depth; ++jj) {
            double const other = others[jj][x];
#pragma unroll
            for (unsigned output = 0; output < outputs; ++output) {
                unsigned const row = y + output * rows;
                double const weight = row_part[row][jj] + column_part[row][jj];
                if (weight != 0) sums[output] += weight * other;
            }
        }
        __syncthreads();
    }
    size_t const column = column_base + x;
    if (column >= width) return;
#pragma unroll
    for (unsigned output = 0; output < outputs; ++output) {
        size_t const i = i_base + y + output * rows;
        if (i < items) d_embeddings[i * hidden + column] = sums[output];
    }
}

/** A block per item: through z = p / |p|, d_p = (d_z - <d_z, z> z) / |p|, added to the double sum. */
__global__ void __launch_bounds__(uform_vram_contrastive_threads_k)
    uform_vram_contrastive_project_kernel(double* d_pooled_sums, uform_vram_contrastive_header_t const* header,
                                          double const* d_embeddings, double const* embeddings,
                                          double const* inverse_norms, size_t hidden, size_t width) {
    uform_vram_chain();
    __shared__ double shared[uform_vram_contrastive_threads_k];
    if (header->counting == 0) return;
    size_t const i = blockIdx.x;
    double const* d_embedding = d_embeddings + i * hidden;
    double const* embedding = embeddings + i * hidden;
    double radial = 0;
    for (size_t column = threadIdx.x; column < width; column += uform_vram_contrastive_threads_k)
        radial += d_embedding[column] * embedding[column];
    radial = uform_vram_block_sum(radial, shared);
    double const inverse = inverse_norms[i];
    double* d_row = d_pooled_sums + i * hidden;
    for (size_t column = threadIdx.x; column < width; column += uform_vram_contrastive_threads_k)
        d_row[column] += (d_embedding[column] - radial * embedding[column]) * inverse;
}

/* ---------------------------------------------------------------------------------------------- */
/*  At the end                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

/**
 *  One block: thread g < 64 adds group g's row partials over (prefix, row) in order, as the CPU
 *  does, and thread 64 the rows' losses, prefix by prefix; partials are staged in shared memory a
 *  chunk at a time. Groups up to the largest used get their sums added, as on the CPU; nothing is
 *  touched and the loss is NaN when no row counts or there are no prefixes.
 */
__global__ void __launch_bounds__(uform_vram_contrastive_finish_threads_k)
    uform_vram_contrastive_finish_kernel(double* loss_out, float* d_log_inverse_temperature, float* d_bias,
                                         uform_vram_contrastive_header_t const* header, double const* row_losses,
                                         double const* row_d_temperatures, double const* row_d_biases,
                                         uint32_t const* groups, size_t items, size_t dimensions) {
    uform_vram_chain();
    constexpr unsigned chunk = uform_vram_contrastive_finish_chunk_k, threads = uform_vram_contrastive_finish_threads_k;
    constexpr unsigned losses_thread = uform_vram_contrastive_groups_k;
    __shared__ double staged_losses[chunk], staged_temperatures[chunk], staged_biases[chunk];
    __shared__ uint32_t staged_groups[chunk];
    unsigned long long const counting = header->counting;
    if (counting == 0 || dimensions == 0) {
        if (threadIdx.x == 0) *loss_out = __longlong_as_double(0x7FF8000000000000LL); /* the quiet NaN C's NAN is */
        return;
    }
    unsigned const group = threadIdx.x;
    double d_temperature = 0, d_shift = 0, total = 0;
    bool used = group == 0; /* the CPU adds every group up to the largest one used */
    for (size_t dimension = 0; dimension < dimensions; ++dimension) {
        double loss = 0;
        for (size_t start = 0; start < items; start += chunk) {
            unsigned const count = items - start < chunk ? (unsigned)(items - start) : chunk;
            for (unsigned k = threadIdx.x; k < count; k += threads) {
                size_t const row = dimension * items + start + k;
                staged_losses[k] = row_losses[row];
                staged_temperatures[k] = row_d_temperatures[row];
                staged_biases[k] = row_d_biases[row];
                staged_groups[k] = groups ? groups[start + k] : 0;
            }
            __syncthreads();
            if (group < uform_vram_contrastive_groups_k) {
                for (unsigned k = 0; k < count; ++k) {
                    uint32_t const row_group = staged_groups[k];
                    used |= row_group >= group && row_group < uform_vram_contrastive_groups_k;
                    if (row_group != group) continue;
                    d_temperature += staged_temperatures[k];
                    d_shift += staged_biases[k];
                }
            } else if (threadIdx.x == losses_thread) {
                for (unsigned k = 0; k < count; ++k) loss += staged_losses[k];
            }
            __syncthreads();
        }
        total += loss / (double)counting;
    }
    if (group < uform_vram_contrastive_groups_k && used) {
        d_log_inverse_temperature[group] += (float)d_temperature;
        d_bias[group] += (float)d_shift;
    }
    if (threadIdx.x == losses_thread) *loss_out = total / (double)dimensions;
}

/** d_pooled += (float) the double sum over prefixes, unless no row counted. */
__global__ void uform_vram_contrastive_apply_kernel(float* d_pooled, uform_vram_contrastive_header_t const* header,
                                                    double const* d_pooled_sums, size_t count) {
    uform_vram_chain();
    if (header->counting == 0) return;
    size_t const index = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (index < count) d_pooled[index] += (float)d_pooled_sums[index];
}

} // namespace

size_t uform_vram_contrastive_scratch(uform_plan_t const* plan) {
    if (!plan->contrastive) return 0;
    return uform_vram_contrastive_carve(nullptr, plan->segments, plan->hidden, nullptr);
}

#define UFORM_VRAM_CONTRASTIVE_LAUNCHED(kernel)                                                                       \
    do {                                                                                                               \
        uform_status_t launched_ = uform_vram_launched(kernel);                                                        \
        if (launched_ != uform_status_success_k) return launched_;                                                     \
    } while (0)

uform_status_t uform_vram_contrastive(void* context, double* loss, float* d_pooled, float* d_log_inverse_temperature,
                                      float* d_bias, float* normalized, float const* pooled,
                                      float const* log_inverse_temperature, float const* bias, uint8_t const* cells,
                                      float const* weights, uint32_t const* groups, size_t items, size_t hidden,
                                      uform_contrastive_setup_t const* setup, float scale) {
    uform_vram_context_t* vram = uform_vram(context);
    uform_plan_t const* plan = &vram->plan;
    if (items > plan->segments || hidden != plan->hidden)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k,
                               "contrastive: %zu items of %zu planned, hidden %zu of %zu planned", items,
                               plan->segments, hidden, plan->hidden);
    size_t const planned_bytes = uform_vram_contrastive_carve(nullptr, plan->segments, plan->hidden, nullptr);
    if (!plan->contrastive || vram->scratch_bytes[uform_vram_scratch_contrastive_k] < planned_bytes)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k,
                               "contrastive: the context was planned without the contrastive term's scratch");
    size_t const dimensions = setup->dimensions_count;
    if (dimensions > UFORM_MAX_MATRYOSHKA_DIMENSIONS)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k,
                               "contrastive: %zu Matryoshka dimensions of at most %d", dimensions,
                               UFORM_MAX_MATRYOSHKA_DIMENSIONS);
    int const form = (int)setup->form;
    cudaStream_t stream = vram->stream;
    uform_vram_contrastive_scratch_t s;
    uform_vram_contrastive_carve(vram->scratch[uform_vram_scratch_contrastive_k], plan->segments, plan->hidden, &s);

    unsigned const threads = uform_vram_contrastive_threads_k;
    unsigned const rows = (unsigned)items; /* a block per item; items <= plan->segments */
    if (items) {
        uform_vram_launch(uform_vram_contrastive_prepare_kernel, rows, threads, 0, stream, normalized, s.attract_sums,
            s.repel_sums, pooled, cells, weights, items, hidden);
        UFORM_VRAM_CONTRASTIVE_LAUNCHED("uform_vram_contrastive_prepare_kernel");
    }
    uform_vram_launch(uform_vram_contrastive_count_kernel, 1, threads, 0, stream, s.header, s.attract_sums,
        s.repel_sums, items, form, dimensions, scale);
    UFORM_VRAM_CONTRASTIVE_LAUNCHED("uform_vram_contrastive_count_kernel");

    if (items && dimensions) {
        uform_status_t status = uform_vram_check(cudaMemsetAsync(s.d_pooled_sums, 0, sizeof(double) * items * hidden,
                                                                 stream),
                                                 "cudaMemsetAsync (contrastive)");
        if (status != uform_status_success_k) return status;
        dim3 const tile_threads(uform_vram_contrastive_tile_k, uform_vram_contrastive_tile_rows_k);
        unsigned const item_tiles = uform_vram_blocks(items, uform_vram_contrastive_tile_k);
        for (size_t dimension = 0; dimension < dimensions; ++dimension) {
            size_t const width = setup->dimensions[dimension] < hidden ? setup->dimensions[dimension] : hidden;
            double* row_losses = s.row_losses + dimension * items;
            double* row_d_temperatures = s.row_d_temperatures + dimension * items;
            double* row_d_biases = s.row_d_biases + dimension * items;

            uform_vram_launch(uform_vram_contrastive_prefix_kernel, rows, threads, 0, stream, s.embeddings,
                s.inverse_norms, s.header, pooled, hidden, width);
            UFORM_VRAM_CONTRASTIVE_LAUNCHED("uform_vram_contrastive_prefix_kernel");
            uform_vram_launch(uform_vram_contrastive_cosines_kernel, dim3(item_tiles, item_tiles), tile_threads, 0,
                stream, s.cosines, s.header, s.embeddings, items, hidden, width);
            UFORM_VRAM_CONTRASTIVE_LAUNCHED("uform_vram_contrastive_cosines_kernel");
            uform_vram_launch(uform_vram_contrastive_row_kernel, rows, threads, 0, stream, s.coupling, row_losses,
                row_d_temperatures, row_d_biases, s.lists, s.header, s.cosines, cells, weights, groups,
                log_inverse_temperature, bias, s.attract_sums, s.repel_sums, items, form);
            UFORM_VRAM_CONTRASTIVE_LAUNCHED("uform_vram_contrastive_row_kernel");
            uform_vram_launch(uform_vram_contrastive_couple_kernel,
                dim3(uform_vram_blocks(width, uform_vram_contrastive_tile_k), item_tiles), tile_threads, 0, stream,
                s.d_embeddings, s.header, s.coupling, s.embeddings, items, hidden, width);
            UFORM_VRAM_CONTRASTIVE_LAUNCHED("uform_vram_contrastive_couple_kernel");
            uform_vram_launch(uform_vram_contrastive_project_kernel, rows, threads, 0, stream, s.d_pooled_sums,
                s.header, s.d_embeddings, s.embeddings, s.inverse_norms, hidden, width);
            UFORM_VRAM_CONTRASTIVE_LAUNCHED("uform_vram_contrastive_project_kernel");
        }
    }

    uform_vram_launch(uform_vram_contrastive_finish_kernel, 1, uform_vram_contrastive_finish_threads_k, 0, stream, loss,
        d_log_inverse_temperature, d_bias, s.header, s.row_losses, s.row_d_temperatures, s.row_d_biases, groups, items,
        items ? dimensions : 0);
    UFORM_VRAM_CONTRASTIVE_LAUNCHED("uform_vram_contrastive_finish_kernel");
    if (!items || !dimensions) return uform_status_success_k;
    size_t const count = items * hidden;
    uform_vram_launch(uform_vram_contrastive_apply_kernel, uform_vram_blocks(count, threads), threads, 0, stream,
        d_pooled, s.header, s.d_pooled_sums, count);
    return uform_vram_launched("uform_vram_contrastive_apply_kernel");
}

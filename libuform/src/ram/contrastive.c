/**
 *  @file   contrastive.c
 *  @brief  The pairwise contrastive loss over pooled embeddings (SPEC section 5), with its
 *          gradients, for each Matryoshka prefix in turn.
 *
 *  For a prefix width m, z_i = pooled_i[:m] / |pooled_i[:m]| and s_ij = t_g(i) <z_i, z_j> + b_g(i)
 *  with t = exp(log_inverse_temperature). Rows run in parallel, each with its own scratch, and
 *  everything that sums over rows (the loss, the temperature and bias gradients) is kept per row
 *  and added in row order afterwards: no number depends on the thread count. All in double.
 */
#include <math.h>
#include <omp.h>

#include "ram.h"

/** softplus(x) = log(1 + e^x) without overflow; its derivative, sigmoid(x), from the same exponential. */
static double uform_ram_softplus(double x, double* sigmoid) {
    double small = exp(-fabs(x)); /* e^-|x| <= 1 */
    *sigmoid = x >= 0 ? 1.0 / (1.0 + small) : small / (1.0 + small);
    return (x > 0 ? x : 0.0) + log1p(small);
}

/** 1 / |row[:width]|, or 0 for a zero prefix, which then stays zero and passes no gradient instead of NaN. */
static double uform_ram_inverse_norm(float const* row, size_t width) {
    double squares = 0;
#pragma omp simd reduction(+ : squares)
    for (size_t column = 0; column < width; ++column) squares += (double)row[column] * row[column];
    return squares > 0 ? 1.0 / sqrt(squares) : 0.0;
}

/**
 *  One anchor row: `cosines` (items) holds <z_i, z_j> for every counted cell; `gradient`
 *  (items) is zeroed on entry and receives dL_i / ds_ij. Returns L_i. `attract` and `repel` are
 *  the row's weight sums, `lists` scratch for 2 items indices. The late-interaction term scores
 *  its rows with it too.
 */
double uform_ram_pair_row(uform_pair_loss_form_t form, double const* cosines, double* gradient,
                                        uint8_t const* cells, float const* weights, size_t items, double temperature,
                                        double bias, double attract, double repel, uint32_t* lists) {
    double loss = 0, sigmoid;
    if (form == uform_pair_loss_ranked_k) {
        /* The bias cancels in s_ip - s_in, so it is left out rather than added and subtracted. */
        uint32_t *positives = lists, *negatives = lists + items;
        size_t positives_count = 0, negatives_count = 0;
        for (size_t j = 0; j < items; ++j) {
            if (weights[j] == 0) continue;
            if (cells[j] == uform_cell_attract_k) positives[positives_count++] = (uint32_t)j;
            if (cells[j] == uform_cell_repel_k) negatives[negatives_count++] = (uint32_t)j;
        }
        double normalizer = 1.0 / (attract * repel);
        for (size_t p = 0; p < positives_count; ++p) {
            size_t positive = positives[p];
            double positive_weight = weights[positive] * normalizer, positive_gradient = 0;
            for (size_t n = 0; n < negatives_count; ++n) {
                size_t negative = negatives[n];
                double pair_weight = positive_weight * weights[negative];
                double margin = temperature * (cosines[negative] - cosines[positive]); /* s_in - s_ip */
                loss += pair_weight * uform_ram_softplus(margin, &sigmoid);
                gradient[negative] += pair_weight * sigmoid;
                positive_gradient -= pair_weight * sigmoid;
            }
            gradient[positive] += positive_gradient;
        }
        return loss;
    }
    for (size_t j = 0; j < items; ++j) {
        if (cells[j] == uform_cell_ignored_k || weights[j] == 0) continue;
        double sign = cells[j] == uform_cell_attract_k ? 1.0 : -1.0; /* y: pull attracts up, push repels down */
        double weight = weights[j];
        if (form == uform_pair_loss_balanced_k) weight /= sign > 0 ? attract : repel; /* that half's sum is > 0 */
        double score = temperature * cosines[j] + bias;
        loss += weight * uform_ram_softplus(-sign * score, &sigmoid);
        gradient[j] = -sign * weight * sigmoid;
    }
    return loss;
}

uform_status_t uform_ram_contrastive(void* context, double* loss_out, float* d_pooled, float* d_log_inverse_temperature,
                                     float* d_bias, float* normalized, float const* pooled,
                                     float const* log_inverse_temperature, float const* bias, uint8_t const* cells,
                                     float const* weights, uint32_t const* groups, size_t items, size_t hidden,
                                     uform_contrastive_setup_t const* setup, float scale) {
    uform_ram_context_t const* planned = context;
    int threads = uform_ram_threads(context);
    if (items > planned->items || hidden != planned->hidden)
        return uform_fail(NULL, uform_status_invalid_argument_k,
                          "contrastive: %zu items of %zu planned, hidden %zu of %zu planned", items, planned->items,
                          hidden, planned->hidden);
    uform_pair_loss_form_t form = setup->form;

    /* normalized (items, hidden): the full-width unit embeddings, whatever the prefixes. */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < items; ++i) {
        float const* row = pooled + i * hidden;
        double inverse = uform_ram_inverse_norm(row, hidden);
        for (size_t column = 0; column < hidden; ++column)
            normalized[i * hidden + column] = (float)(row[column] * inverse);
    }

    size_t row_width = items > hidden ? items : hidden; /* a row of cosines or one embedding's gradient */
    double* embeddings = planned->contrastive;           /* planned for the capacity: uform_ram_contrastive_doubles */
    uint32_t* lists = planned->lists;                         /* (items, m): this prefix's z */
    double* d_pooled_sums = embeddings + items * hidden; /* (items, hidden) */
    double* coupling = d_pooled_sums + items * hidden;   /* (items, items): scale * t * dL_i / ds_ij */
    double* inverse_norms = coupling + items * items;    /* (items) */
    double* attract_sums = inverse_norms + items;        /* (items) */
    double* repel_sums = attract_sums + items;           /* (items) */
    double* row_losses = repel_sums + items;             /* (items) */
    double* row_d_temperatures = row_losses + items;     /* (items) */
    double* row_d_biases = row_d_temperatures + items;   /* (items) */
    double* thread_rows = row_d_biases + items;          /* (threads, row_width) */

    /* Which rows count depends on the cells and weights alone, so every prefix has the same
     * counting rows and one coefficient turns each row's gradient into the mean's. */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < items; ++i) {
        double attract = 0, repel = 0;
        for (size_t j = 0; j < items; ++j) {
            if (cells[i * items + j] == uform_cell_attract_k) attract += weights[i * items + j];
            if (cells[i * items + j] == uform_cell_repel_k) repel += weights[i * items + j];
        }
        attract_sums[i] = attract;
        repel_sums[i] = repel;
    }
    size_t counting = 0;
    for (size_t i = 0; i < items; ++i) counting += (size_t)uform_row_counts(form, attract_sums[i], repel_sums[i]);
    size_t dimensions = setup->dimensions_count;
    if (!counting || !dimensions) {
        *loss_out = NAN;
        return uform_status_success_k;
    }
    double coefficient = (double)scale / ((double)dimensions * (double)counting);

    double total = 0, d_temperatures[UFORM_MAX_TEMPERATURE_GROUPS] = {0}, d_biases[UFORM_MAX_TEMPERATURE_GROUPS] = {0};
    size_t used_groups = 1; /* the operation is not told the group count, only each item's group */
    memset(d_pooled_sums, 0, sizeof(double) * items * hidden);
    for (size_t dimension = 0; dimension < dimensions; ++dimension) {
        size_t width = setup->dimensions[dimension] < hidden ? setup->dimensions[dimension] : hidden;

#pragma omp parallel for num_threads(threads) schedule(static)
        for (size_t i = 0; i < items; ++i) {
            float const* row = pooled + i * hidden;
            double inverse = inverse_norms[i] = uform_ram_inverse_norm(row, width);
            for (size_t column = 0; column < width; ++column) embeddings[i * width + column] = row[column] * inverse;
        }

#pragma omp parallel for num_threads(threads) schedule(static)
        for (size_t i = 0; i < items; ++i) {
            double* restrict gradient = coupling + i * items;
            memset(gradient, 0, sizeof(double) * items);
            row_losses[i] = row_d_temperatures[i] = row_d_biases[i] = 0;
            if (!uform_row_counts(form, attract_sums[i], repel_sums[i])) continue;
            double* restrict cosines = thread_rows + (size_t)omp_get_thread_num() * row_width;
            uint8_t const* row_cells = cells + i * items;
            double const* anchor = embeddings + i * width;
            for (size_t j = 0; j < items; ++j) {
                if (row_cells[j] == uform_cell_ignored_k) continue;
                double const* other = embeddings + j * width;
                double dot = 0;
#pragma omp simd reduction(+ : dot)
                for (size_t column = 0; column < width; ++column) dot += anchor[column] * other[column];
                cosines[j] = dot;
            }
            size_t group = groups ? groups[i] : 0;
            double temperature = exp((double)log_inverse_temperature[group]);
            row_losses[i] = uform_ram_pair_row(form, cosines, gradient, row_cells, weights + i * items, items,
                                                      temperature, (double)bias[group], attract_sums[i],
                                                      repel_sums[i], lists + (size_t)omp_get_thread_num() * 2 * items);
            double d_temperature = 0, d_bias_row = 0;
            for (size_t j = 0; j < items; ++j) {
                if (row_cells[j] == uform_cell_ignored_k) continue;
                d_temperature += gradient[j] * temperature * cosines[j]; /* ds / dlog t = t <z_i, z_j> */
                d_bias_row += gradient[j];
                gradient[j] *= coefficient * temperature;
            }
            row_d_temperatures[i] = coefficient * d_temperature;
            row_d_biases[i] = form == uform_pair_loss_ranked_k ? 0.0 : coefficient * d_bias_row;
        }

        double loss = 0;
        for (size_t i = 0; i < items; ++i) {
            size_t group = groups ? groups[i] : 0;
            used_groups = group >= used_groups ? group + 1 : used_groups;
            loss += row_losses[i];
            d_temperatures[group] += row_d_temperatures[i];
            d_biases[group] += row_d_biases[i];
        }
        total += loss / (double)counting;

        /* s_ij moves z_i through t_g(i) z_j and z_j through t_g(i) z_i, so z_i collects its row
         * and its column; then the gradient passes back through z = p / |p|. */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (size_t i = 0; i < items; ++i) {
            double* restrict d_embedding = thread_rows + (size_t)omp_get_thread_num() * row_width;
            double const* restrict embedding = embeddings + i * width;
            memset(d_embedding, 0, sizeof(double) * width);
            for (size_t j = 0; j < items; ++j) {
                double weight = coupling[i * items + j] + coupling[j * items + i];
                if (weight == 0) continue;
                double const* restrict other = embeddings + j * width;
                for (size_t column = 0; column < width; ++column) d_embedding[column] += weight * other[column];
            }
            double radial = 0;
#pragma omp simd reduction(+ : radial)
            for (size_t column = 0; column < width; ++column) radial += d_embedding[column] * embedding[column];
            double* restrict d_row = d_pooled_sums + i * hidden;
            for (size_t column = 0; column < width; ++column)
                d_row[column] += (d_embedding[column] - radial * embedding[column]) * inverse_norms[i];
        }
    }

#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t index = 0; index < items * hidden; ++index) d_pooled[index] += (float)d_pooled_sums[index];
    for (size_t group = 0; group < used_groups; ++group) {
        d_log_inverse_temperature[group] += (float)d_temperatures[group];
        d_bias[group] += (float)d_biases[group];
    }
    *loss_out = total / (double)dimensions;
    return uform_status_success_k;
}

/**
 *  @file   matmul.c
 *  @brief  d (m, n) = a (m, k) x b (k, n) [+ c] through OpenBLAS, row-major.
 *
 *  OpenBLAS runs single-threaded and our OpenMP threads each take one block of `c`: rows when
 *  `m` is the larger side, columns otherwise, so every block keeps a long side for the kernel.
 *  `a` is stored (k, m) when `a_transposed`, `b` is stored (n, k) when `b_transposed`.
 *
 *  The blocks follow the thread count, and OpenBLAS may round a block's ragged edge differently
 *  from a full tile, so products are reproducible for one thread count, not across counts.
 */
#include <pthread.h>

#include <cblas.h>

#include "ram.h"

static pthread_once_t uform_ram_blas_once = PTHREAD_ONCE_INIT;

static void uform_ram_blas_single_threaded(void) { scipy_openblas_set_num_threads(1); }

void uform_ram_blas_init(void) { pthread_once(&uform_ram_blas_once, uform_ram_blas_single_threaded); }

uform_status_t uform_ram_matmul(void* context, void* d, void const* c, void const* a_, void const* b_, size_t m,
                                size_t n, size_t k, int a_transposed, int b_transposed, uform_element_t d_element) {
    (void)d_element; /* every element is a float here */
    if (!m || !n) return uform_status_success_k;
    uform_ram_blas_init();
    float const *a = a_, *b = b_;
    float* out = d;
    if (c && c != d) memcpy(out, c, m * n * sizeof(float)); /* a residual: added in place by beta = 1 */
    float beta = c ? 1.0f : 0.0f;
    int threads = uform_ram_threads(context);
    int by_rows = m >= n;
    size_t side = by_rows ? m : n;
    /* Multiples of 16, the widest kernel tile: only the last block has a ragged edge, and
     * column blocks start on a cache line. */
    size_t block = (side + (size_t)threads - 1) / (size_t)threads;
    block = (block + 15) / 16 * 16;
    size_t blocks = (side + block - 1) / block;
    enum CBLAS_TRANSPOSE a_op = a_transposed ? CblasTrans : CblasNoTrans;
    enum CBLAS_TRANSPOSE b_op = b_transposed ? CblasTrans : CblasNoTrans;
    /* BLAS refuses (and prints) a leading dimension below one, which k = 0 would give. */
    blasint lda = (blasint)(a_transposed ? m : k > 0 ? k : 1), ldb = (blasint)(b_transposed ? (k > 0 ? k : 1) : n);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t index = 0; index < blocks; ++index) {
        size_t first = index * block, count = side - first < block ? side - first : block;
        if (by_rows) {
            float const* a_block = a + (a_transposed ? first : first * k);
            scipy_cblas_sgemm(CblasRowMajor, a_op, b_op, (blasint)count, (blasint)n, (blasint)k, 1.0f, a_block, lda, b,
                              ldb, beta, out + first * n, (blasint)n);
        } else {
            float const* b_block = b + (b_transposed ? first * k : first);
            scipy_cblas_sgemm(CblasRowMajor, a_op, b_op, (blasint)m, (blasint)count, (blasint)k, 1.0f, a, lda, b_block,
                              ldb, beta, out + first, (blasint)n);
        }
    }
    return uform_status_success_k;
}

/**
 *  @file   gemm.cu
 *  @brief  The library's Hopper product (`libuform/src/vram/matmul_hopper.cuh`) beside cuBLASLt on the
 *          same operands: the largest difference between their outputs over the largest output, and
 *          each one's time, for the GELU products (forward and gradient) of a layer at depth 12 /
 *          hidden 512 / 64 x 512 tokens and plain products of a layer's shapes (the kernel's
 *          yardstick), plus ragged shapes; the sums (plain d, GELU's aux) are also checked against a
 *          float32 loop. Times include each call's host work (tensor maps, cuBLASLt's heuristic), which
 *          shows on the small shapes. Exits with 1 when any comparison fails.
 *
 *      nvcc -O3 -std=c++17 -arch=sm_90a -Ilibuform/src/vram -I<cuBLAS include> bench/gemm.cu \
 *           -L<cuBLAS lib> -lcublasLt -o gemm && ./gemm
 */
#include <cublasLt.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "matmul_hopper.cuh"
#include "measure.cuh"

typedef __nv_bfloat16 bf16;

static cublasLtHandle_t blas;
static void* workspace;
static size_t const workspace_bytes = 32 << 20;
static int multiprocessors;
static uform_hopper_encoder_t encode;

__global__ void fill(bf16* values, size_t count, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)(i * 2654435761u) ^ (seed * 40503u);
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        values[i] = __float2bfloat16(((float)(h % 2001) / 1000.0f - 1.0f) * scale);
    }
}

/* d = a (m, k) x b (n, k)^T in float32, one thread an element: the reference for ragged shapes. */
__global__ void reference(float* d, bf16 const* a, bf16 const* b, int m, int n, int k) {
    int row = blockIdx.y, column = blockIdx.x * blockDim.x + threadIdx.x;
    if (column >= n) return;
    float sum = 0;
    for (int i = 0; i < k; ++i)
        sum += __bfloat162float(a[(size_t)row * k + i]) * __bfloat162float(b[(size_t)column * k + i]);
    d[(size_t)row * n + column] = sum;
}

static void blas_product(uform_hopper_epilogue_t epilogue, bf16* d, bf16* aux, bf16 const* a,
                         bf16 const* b, size_t m, size_t n, size_t k) {
    cublasLtMatmulDesc_t description;
    cublasLtMatmulDescCreate(&description, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
    cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt));
    if (epilogue != uform_hopper_plain_k) {
        cublasLtEpilogue_t chosen = epilogue == uform_hopper_gelu_k ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_DGELU;
        int64_t ld = (int64_t)n;
        cudaDataType_t type = CUDA_R_16BF;
        cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_EPILOGUE, &chosen, sizeof(chosen));
        cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld));
        cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &type, sizeof(type));
        cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux));
    }
    cublasLtMatrixLayout_t lb, la, ld;
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, m, k);
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, m, n);
    cublasLtMatmulPreference_t preference;
    cublasLtMatmulPreferenceCreate(&preference);
    cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                         sizeof(workspace_bytes));
    cublasLtMatmulHeuristicResult_t heuristic;
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(blas, description, lb, la, ld, ld, preference, 1, &heuristic, &found);
    float alpha = 1, beta = 0;
    if (!found || cublasLtMatmul(blas, description, &alpha, b, lb, a, la, &beta, d, ld, d, ld, &heuristic.algo,
                                 workspace, workspace_bytes, 0) != CUBLAS_STATUS_SUCCESS) {
        std::printf("cuBLASLt failed on %zu x %zu x %zu\n", m, n, k);
        std::exit(1);
    }
    cublasLtMatmulPreferenceDestroy(preference);
    cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(description);
}

static void ours(uform_hopper_epilogue_t epilogue, bf16* d, bf16* aux, bf16 const* a, bf16 const* b, size_t m,
                 size_t n, size_t k) {
    cudaError_t error = uform_hopper_product(encode, multiprocessors, 0, false, epilogue, d, aux, a, b, m, n, k);
    if (error != cudaSuccess) {
        std::printf("uform_hopper_product: %s\n", cudaGetErrorString(error));
        std::exit(1);
    }
}

static char const* names[] = {"plain", "gelu", "gelu_backward"};
static int failures = 0;

static void compare(char const* name, uform_hopper_epilogue_t epilogue, size_t m, size_t n, size_t k) {
    bool const writes_aux = epilogue == uform_hopper_gelu_k;
    bf16 *a, *b, *aux_blas, *aux_ours, *d_blas, *d_ours;
    cudaMalloc(&a, m * k * 2), cudaMalloc(&b, n * k * 2), cudaMalloc(&aux_blas, m * n * 2);
    cudaMalloc(&d_blas, m * n * 2), cudaMalloc(&d_ours, m * n * 2);
    if (writes_aux) cudaMalloc(&aux_ours, m * n * 2);
    else aux_ours = aux_blas; /* the gradient reads one aux */
    fill<<<1024, 256>>>(a, m * k, 1, 1.0f), fill<<<1024, 256>>>(b, n * k, 2, 1.0f / std::sqrt((float)k));
    fill<<<1024, 256>>>(aux_blas, m * n, 4, 3.0f); /* sums before GELU, over GELU's curved part */
    blas_product(epilogue, d_blas, aux_blas, a, b, m, n, k);
    ours(epilogue, d_ours, aux_ours, a, b, m, n, k);
    cudaError_t error = cudaDeviceSynchronize();
    if (error != cudaSuccess) {
        std::printf("%s: %s\n", name, cudaGetErrorString(error));
        std::exit(1);
    }
    double against_blas = difference(host(d_ours, m * n), host(d_blas, m * n)), against_loop = -1;
    if (epilogue != uform_hopper_gelu_backward_k) { /* the sums themselves: d, or the aux GELU's product keeps */
        float* exact;
        cudaMalloc(&exact, m * n * 4);
        reference<<<dim3((unsigned)((n + 127) / 128), (unsigned)m), 128>>>(exact, a, b, (int)m, (int)n, (int)k);
        std::vector<float> loop(m * n);
        cudaMemcpy(loop.data(), exact, m * n * 4, cudaMemcpyDeviceToHost);
        against_loop = difference(host(writes_aux ? aux_ours : d_ours, m * n), loop);
        if (writes_aux) against_blas = std::fmax(against_blas, difference(host(aux_ours, m * n), host(aux_blas, m * n)));
        cudaFree(exact);
    }
    float blas_ms = time_ms([&] { blas_product(epilogue, d_blas, aux_blas, a, b, m, n, k); });
    float ours_ms = time_ms([&] { ours(epilogue, d_ours, aux_ours, a, b, m, n, k); });
    double flops = 2.0 * m * n * k;
    std::printf("%-10s %-13s %6zu x %5zu x %5zu  cuBLASLt %7.1f us (%4.0f TFLOP/s)  ours %7.1f us (%4.0f TFLOP/s)"
                "  differ %.2e  from float32 loop %.2e\n",
                name, names[epilogue], m, n, k, blas_ms * 1e3, flops / blas_ms / 1e9, ours_ms * 1e3,
                flops / ours_ms / 1e9, against_blas, against_loop);
    /* Sums round the same float32 values once; GELU and its slope differ by formula (2^-11). */
    if (against_blas > (epilogue == uform_hopper_plain_k ? 1e-2 : 2e-2) || against_loop > 1e-2) {
        std::printf("  ^ FAILED: the outputs differ more than bf16 rounding allows\n");
        ++failures;
    }
    for (bf16* p : {a, b, aux_blas, d_blas, d_ours}) cudaFree(p);
    if (writes_aux) cudaFree(aux_ours);
}

int main() {
    std::setvbuf(stdout, nullptr, _IONBF, 0);
    cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0);
    if (!uform_hopper_ready(0) || !(encode = uform_hopper_encoder())) return std::printf("not a Hopper GPU\n"), 0;
    cublasLtCreate(&blas);
    cudaMalloc(&workspace, workspace_bytes);
    size_t tokens = 64 * 512, hidden = 512, wide = 4 * hidden;
    compare("ragged", uform_hopper_plain_k, 1000, 200, 72);
    compare("ragged", uform_hopper_gelu_backward_k, 333, 136, 520);
    compare("ragged", uform_hopper_gelu_backward_k, 257, 8, 8);
    compare("ragged", uform_hopper_gelu_k, 333, 136, 520);
    compare("short k", uform_hopper_plain_k, 4096, 1024, 64); /* many tiles a block, fewer slices than stages */
    compare("short k", uform_hopper_gelu_backward_k, 4096, 1024, 200);
    compare("qkv", uform_hopper_plain_k, tokens, 3 * hidden, hidden);
    compare("up", uform_hopper_gelu_k, tokens, wide, hidden);
    compare("d_wide", uform_hopper_gelu_backward_k, tokens, wide, hidden);
    compare("d_normed", uform_hopper_plain_k, tokens, hidden, wide);
    compare("d_attn", uform_hopper_plain_k, tokens, hidden, hidden);
    compare("d_normed1", uform_hopper_plain_k, tokens, hidden, 3 * hidden);
    return failures ? std::printf("%d comparisons failed\n", failures), 1 : 0;
}

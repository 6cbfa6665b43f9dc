/**
 *  @file   products.cu
 *  @brief  Times every algorithm cuBLASLt offers (up to 16 a shape) for the twelve products of one
 *          layer at depth 12 / hidden 512 / 64 x 512 tokens, as `libuform/src/vram/matmul.cu` sets
 *          them up (row-major operands swapped into cuBLASLt's column-major order, bf16 in, float32
 *          accumulation, the GELU and dGELU epilogues). Candidate 0 is the one uform runs.
 *
 *      nvcc -arch=sm_90a -O2 -I<cuBLAS include> bench/products.cu -L<cuBLAS lib> -lcublasLt -o products && ./products
 *
 *  (with the nvidia-cublas wheel: `-I$NV/cu13/include -L$NV/cu13/lib -l:libcublasLt.so.13`, NV its `nvidia` folder)
 */
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <cstdio>

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        int status_ = (int)(call);                                                                                     \
        if (status_) {                                                                                                 \
            std::printf("%s failed: %d\n", #call, status_);                                                          \
            return;                                                                                                    \
        }                                                                                                              \
    } while (0)

enum epilogue_t { plain_k, gelu_k, gelu_backward_k };

static cublasLtHandle_t blas;
static size_t const workspace_bytes = 32 << 20; /* as `matmul.cu` plans */
static void *workspace, *a, *b, *c, *d, *aux;

__global__ void fill(__nv_bfloat16* values, size_t count) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
        values[i] = __float2bfloat16((float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f);
}

/* d (m, n) = a (m, k) x b (k, n) [+ c], row-major, each operand transposed as flagged. */
static void time_product(char const* name, size_t m, size_t n, size_t k, int a_transposed, int b_transposed,
                         int float_output, epilogue_t epilogue, int accumulate) {
    cublasLtMatmulDesc_t description;
    CHECK(cublasLtMatmulDescCreate(&description, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t op_b = b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
    CHECK(cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)));
    CHECK(cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)));
    if (epilogue != plain_k) {
        cublasLtEpilogue_t chosen = epilogue == gelu_k ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_DGELU;
        int64_t aux_ld = (int64_t)n;
        cudaDataType_t aux_type = CUDA_R_16BF;
        CHECK(cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_EPILOGUE, &chosen, sizeof(chosen)));
        CHECK(cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
        CHECK(cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &aux_type,
                                             sizeof(aux_type)));
        CHECK(cublasLtMatmulDescSetAttribute(description, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
    }
    cudaDataType_t output = float_output ? CUDA_R_32F : CUDA_R_16BF;
    cublasLtMatrixLayout_t layout_b, layout_a, layout_d;
    CHECK(cublasLtMatrixLayoutCreate(&layout_b, CUDA_R_16BF, b_transposed ? k : n, b_transposed ? n : k,
                                     b_transposed ? k : n));
    CHECK(cublasLtMatrixLayoutCreate(&layout_a, CUDA_R_16BF, a_transposed ? m : k, a_transposed ? k : m,
                                     a_transposed ? m : k));
    CHECK(cublasLtMatrixLayoutCreate(&layout_d, output, n, m, n));
    cublasLtMatmulPreference_t preference;
    CHECK(cublasLtMatmulPreferenceCreate(&preference));
    CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                               sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t candidates[16];
    int found = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(blas, description, layout_b, layout_a, layout_d, layout_d, preference, 16,
                                         candidates, &found));
    float alpha = 1, beta = accumulate ? 1 : 0;
    cudaEvent_t start, stop;
    cudaEventCreate(&start), cudaEventCreate(&stop);
    for (int i = 0; i < found; ++i) {
        int tile = 0, split_k = 0;
        size_t written;
        cublasLtMatmulAlgoConfigGetAttribute(&candidates[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile),
                                             &written);
        cublasLtMatmulAlgoConfigGetAttribute(&candidates[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k,
                                             sizeof(split_k), &written);
        for (int run = 0; run < 23; ++run) {
            if (run == 3) cudaEventRecord(start);
            CHECK(cublasLtMatmul(blas, description, &alpha, b, layout_b, a, layout_a, &beta, c, layout_d, d, layout_d,
                                 &candidates[i].algo, workspace, workspace_bytes, 0));
        }
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms;
        cudaEventElapsedTime(&ms, start, stop);
        ms /= 20;
        std::printf("%-8s candidate %2d  tile %3d  split-k %2d  %7.1f us  %6.1f TFLOP/s\n", name, i, tile, split_k,
                    ms * 1e3, 2.0 * m * n * k / ms / 1e9);
    }
}

int main() {
    size_t tokens = 64 * 512, hidden = 512, wide = 4 * hidden, bytes = tokens * wide * 4;
    cublasLtCreate(&blas);
    cudaMalloc(&workspace, workspace_bytes);
    for (void** buffer : {&a, &b, &c, &d, &aux}) {
        cudaMalloc(buffer, bytes);
        fill<<<1024, 256>>>((__nv_bfloat16*)*buffer, bytes / 2);
    }
    cudaDeviceSynchronize();
    /* forward */
    time_product("qkv", tokens, 3 * hidden, hidden, 0, 1, 0, plain_k, 0);
    time_product("out", tokens, hidden, hidden, 0, 1, 0, plain_k, 1);
    time_product("up", tokens, wide, hidden, 0, 1, 0, gelu_k, 0);
    time_product("down", tokens, hidden, wide, 0, 1, 0, plain_k, 1);
    /* backward: weights' gradients accumulate in float32 */
    time_product("d_down", hidden, wide, tokens, 1, 0, 1, plain_k, 1);
    time_product("d_wide", tokens, wide, hidden, 0, 0, 0, gelu_backward_k, 0);
    time_product("d_up", wide, hidden, tokens, 1, 0, 1, plain_k, 1);
    time_product("d_normed", tokens, hidden, wide, 0, 0, 0, plain_k, 0);
    time_product("d_out", hidden, hidden, tokens, 1, 0, 1, plain_k, 1);
    time_product("d_attn", tokens, hidden, hidden, 0, 0, 0, plain_k, 0);
    time_product("d_qkv", 3 * hidden, hidden, tokens, 1, 0, 1, plain_k, 1);
    time_product("d_normed", tokens, hidden, 3 * hidden, 0, 0, 0, plain_k, 0);
    return 0;
}

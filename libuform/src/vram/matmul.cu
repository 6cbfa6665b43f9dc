/**
 *  @file   matmul.cu
 *  @brief  d (m, n) = a (m, k) x b (k, n) [+ c] through cuBLASLt, bf16 operands, float32
 *          accumulation, with the GELU and GELU-gradient epilogues fused where the model asks (on
 *          Hopper, by the library's own kernel: `matmul_hopper.cuh`).
 *
 *  cuBLASLt is column-major; a row-major (m, n) matrix is its column-major transpose, so the
 *  row-major d = a x b is computed as the column-major d^T = b^T x a^T: the operands swap places
 *  and each keeps its own transposition flag. A product's descriptors and the algorithm the
 *  heuristic picked are planned once per shape and kept: the same shape then runs the same
 *  kernel, which makes its bits repeat run to run (`uform_vram_choose`).
 */
#include <cublasLt.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>

#include "matmul_hopper.cuh"
#include "vram.h"

namespace {

enum uform_vram_epilogue_t { uform_vram_plain_k, uform_vram_gelu_k, uform_vram_gelu_backward_k };

typedef std::tuple<size_t, size_t, size_t, int, int, int, int, int> uform_vram_shape_t;

struct uform_vram_product_t {
    cublasLtMatmulDesc_t description = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algorithm;
    ~uform_vram_product_t() {
        if (description) cublasLtMatmulDescDestroy(description);
        if (a) cublasLtMatrixLayoutDestroy(a);
        if (b) cublasLtMatrixLayoutDestroy(b);
        if (c) cublasLtMatrixLayoutDestroy(c);
        if (d) cublasLtMatrixLayoutDestroy(d);
    }
};

struct uform_vram_products_t {
    std::map<uform_vram_shape_t, uform_vram_product_t*> planned;
    uform_hopper_encoder_t hopper = nullptr; /* the tensor-map encoder, where the library's Hopper kernels run */
};

enum { uform_vram_blas_workspace_k = 32 << 20 }; /* what cuBLASLt's Hopper kernels ask for at most */

/** Whether the library's Hopper kernel takes a product with a GELU epilogue: cuBLASLt ran GELU's gradient at twice
 *  a plain product's time, and GELU itself at 1.5 times. Elsewhere, or for a shape or operand it does not take,
 *  cuBLASLt does. */
bool uform_vram_hopper_takes(uform_vram_context_t* context, size_t m, size_t n, size_t k, void const* a, void const* b,
                             void const* d, void const* aux) {
    return ((uform_vram_products_t*)context->matmuls)->hopper && uform_hopper_fits(m, n, k) &&
           uform_hopper_aligned(a, b, d, aux);
}

/** The library's Hopper product on the context's stream: `d = epilogue(a x b^T)`, b given as (n, k). */
uform_status_t uform_vram_hopper_product(uform_vram_context_t* context, uform_hopper_epilogue_t epilogue, void* d,
                                         void* aux, void const* a, void const* b, size_t m, size_t n, size_t k,
                                         char const* call) {
    uform_hopper_encoder_t encode = ((uform_vram_products_t const*)context->matmuls)->hopper;
    return uform_vram_check(uform_hopper_product(encode, context->multiprocessors, context->stream,
                                                 uform_vram_dependent_launches, epilogue, (uform_bf16_t*)d,
                                                 (uform_bf16_t*)aux, (uform_bf16_t const*)a, (uform_bf16_t const*)b,
                                                 m, n, k),
                            call);
}

/** b (rows, columns) row-major into b^T, 32 x 32 tiles through shared memory. */
__global__ void uform_vram_transpose(uform_bf16_t* __restrict__ out, uform_bf16_t const* __restrict__ in, size_t rows,
                                     size_t columns) {
    uform_vram_chain();
    __shared__ uform_bf16_t tile[32][33];
    size_t row = blockIdx.y * 32 + threadIdx.y, column = blockIdx.x * 32 + threadIdx.x;
    for (int i = 0; i < 32; i += 8)
        if (row + i < rows && column < columns) tile[threadIdx.y + i][threadIdx.x] = in[(row + i) * columns + column];
    __syncthreads();
    row = blockIdx.x * 32 + threadIdx.y, column = blockIdx.y * 32 + threadIdx.x;
    for (int i = 0; i < 32; i += 8)
        if (row + i < columns && column < rows) out[(row + i) * rows + column] = tile[threadIdx.x][threadIdx.y + i];
}

uform_status_t uform_vram_blas(cublasStatus_t status, char const* call) {
    if (status == CUBLAS_STATUS_SUCCESS) return uform_status_success_k;
    return uform_vram_fail(NULL, status == CUBLAS_STATUS_ALLOC_FAILED ? uform_status_out_of_memory_k : uform_status_device_k,
                           "%s: %s", call, cublasLtGetStatusString(status));
}

/*  Tokens and masked positions change step to step, and a heuristic query costs the host up to milliseconds,
    while the device waits. So a size is rounded up to one of 16 steps an octave, the heuristic asked once for
    the rounded shape, and its choice checked for the shape itself; only where the check fails is the shape
    asked alone. Either way the algorithm is a function of the shape alone: runs and resumed runs repeat bits. */
size_t uform_vram_rounded(size_t size) {
    if (size <= 256) return size;
    size_t octave = 256;
    while (octave < size) octave <<= 1;
    size_t step = octave / 16;
    return (size + step - 1) / step * step;
}

enum { uform_vram_products_kept_k = 4096 }; /* past this many shapes the cache starts again: a choice never changes */

uform_status_t uform_vram_plan(uform_vram_context_t* context, uform_vram_shape_t const& shape,
                               uform_vram_product_t** planned);

/* The algorithm for `product`, of `shape`: the rounded shape's where it fits, else the heuristic's for this one. */
uform_status_t uform_vram_choose(uform_vram_context_t* context, uform_vram_shape_t const& shape,
                                 uform_vram_product_t* product, cublasLtMatmulPreference_t preference) {
    uform_vram_shape_t rounded = shape;
    std::get<0>(rounded) = uform_vram_rounded(std::get<0>(shape));
    std::get<1>(rounded) = uform_vram_rounded(std::get<1>(shape));
    std::get<2>(rounded) = uform_vram_rounded(std::get<2>(shape));
    if (rounded != shape) {
        uform_vram_product_t* neighbour;
        uform_status_t status = uform_vram_plan(context, rounded, &neighbour);
        if (status != uform_status_success_k) return status;
        cublasLtMatmulHeuristicResult_t checked;
        if (cublasLtMatmulAlgoCheck((cublasLtHandle_t)context->blas, product->description, product->a, product->b,
                                    product->c, product->d, &neighbour->algorithm, &checked) == CUBLAS_STATUS_SUCCESS &&
            checked.workspaceSize <= uform_vram_blas_workspace_k) {
            product->algorithm = neighbour->algorithm;
            return uform_status_success_k;
        }
    }
    cublasLtMatmulHeuristicResult_t heuristic;
    int found_count = 0;
    uform_status_t status = uform_vram_blas(
        cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)context->blas, product->description, product->a, product->b,
                                       product->c, product->d, preference, 1, &heuristic, &found_count),
        "cublasLtMatmulAlgoGetHeuristic");
    if (status == uform_status_success_k && !found_count)
        status = uform_vram_fail(NULL, uform_status_device_k,
                                 "cuBLASLt has no algorithm for a %zu x %zu x %zu product (transposed %d, %d, epilogue %d)",
                                 std::get<0>(shape), std::get<1>(shape), std::get<2>(shape), std::get<3>(shape),
                                 std::get<4>(shape), std::get<6>(shape));
    if (status == uform_status_success_k) product->algorithm = heuristic.algo;
    return status;
}

/* Plans one product: the operands as cuBLASLt sees them (b first), the epilogue, the algorithm. */
uform_status_t uform_vram_plan(uform_vram_context_t* context, uform_vram_shape_t const& shape,
                               uform_vram_product_t** planned) {
    auto& products = ((uform_vram_products_t*)context->matmuls)->planned;
    auto found = products.find(shape);
    if (found != products.end()) {
        *planned = found->second;
        return uform_status_success_k;
    }
    if (products.size() >= uform_vram_products_kept_k) {
        for (auto& kept : products) delete kept.second;
        products.clear();
    }
    size_t m, n, k;
    int a_transposed, b_transposed, float_output, epilogue, residual;
    std::tie(m, n, k, a_transposed, b_transposed, float_output, epilogue, residual) = shape;
    (void)residual;
    uform_vram_product_t* product = new (std::nothrow) uform_vram_product_t();
    if (!product) return uform_vram_fail(NULL, uform_status_out_of_memory_k, "no memory to plan a matrix product");
    cudaDataType_t output = float_output ? CUDA_R_32F : CUDA_R_16BF;
    cublasOperation_t op_b = b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
    uform_status_t status = uform_vram_blas(cublasLtMatmulDescCreate(&product->description, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                            "cublasLtMatmulDescCreate");
    /* cuBLASLt's first operand is b: (n, k) once transposed as asked; its second is a: (k, m). */
    if (status == uform_status_success_k)
        status = uform_vram_blas(cublasLtMatmulDescSetAttribute(product->description, CUBLASLT_MATMUL_DESC_TRANSA, &op_b,
                                                                sizeof(op_b)),
                                 "cublasLtMatmulDescSetAttribute (transa)");
    if (status == uform_status_success_k)
        status = uform_vram_blas(cublasLtMatmulDescSetAttribute(product->description, CUBLASLT_MATMUL_DESC_TRANSB, &op_a,
                                                                sizeof(op_a)),
                                 "cublasLtMatmulDescSetAttribute (transb)");
    if (status == uform_status_success_k && epilogue != uform_vram_plain_k) {
        cublasLtEpilogue_t chosen = epilogue == uform_vram_gelu_k ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_DGELU;
        int64_t aux_ld = (int64_t)n;
        cudaDataType_t aux_type = CUDA_R_16BF;
        status = uform_vram_blas(cublasLtMatmulDescSetAttribute(product->description, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                                &chosen, sizeof(chosen)),
                                 "cublasLtMatmulDescSetAttribute (epilogue)");
        if (status == uform_status_success_k)
            status = uform_vram_blas(cublasLtMatmulDescSetAttribute(product->description,
                                                                    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                                                    sizeof(aux_ld)),
                                     "cublasLtMatmulDescSetAttribute (aux ld)");
        if (status == uform_status_success_k)
            status = uform_vram_blas(cublasLtMatmulDescSetAttribute(product->description,
                                                                    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                                                    &aux_type, sizeof(aux_type)),
                                     "cublasLtMatmulDescSetAttribute (aux type)");
    }
    if (status == uform_status_success_k)
        status = uform_vram_blas(cublasLtMatrixLayoutCreate(&product->a, CUDA_R_16BF, b_transposed ? k : n,
                                                            b_transposed ? n : k, b_transposed ? k : n),
                                 "cublasLtMatrixLayoutCreate (b)");
    if (status == uform_status_success_k)
        status = uform_vram_blas(cublasLtMatrixLayoutCreate(&product->b, CUDA_R_16BF, a_transposed ? m : k,
                                                            a_transposed ? k : m, a_transposed ? m : k),
                                 "cublasLtMatrixLayoutCreate (a)");
    if (status == uform_status_success_k)
        status = uform_vram_blas(cublasLtMatrixLayoutCreate(&product->c, output, n, m, n), "cublasLtMatrixLayoutCreate (c)");
    if (status == uform_status_success_k)
        status = uform_vram_blas(cublasLtMatrixLayoutCreate(&product->d, output, n, m, n), "cublasLtMatrixLayoutCreate (d)");
    cublasLtMatmulPreference_t preference = nullptr;
    if (status == uform_status_success_k)
        status = uform_vram_blas(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
    size_t workspace = uform_vram_blas_workspace_k;
    if (status == uform_status_success_k)
        status = uform_vram_blas(cublasLtMatmulPreferenceSetAttribute(preference,
                                                                      CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                      &workspace, sizeof(workspace)),
                                 "cublasLtMatmulPreferenceSetAttribute");
    if (status == uform_status_success_k) status = uform_vram_choose(context, shape, product, preference);
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (status != uform_status_success_k) {
        delete product;
        return status;
    }
    products[shape] = product;
    *planned = product;
    return uform_status_success_k;
}

uform_status_t uform_vram_product(void* context_, void* d, void const* c, void const* a, void const* b, size_t m,
                                  size_t n, size_t k, int a_transposed, int b_transposed, int float_output,
                                  uform_vram_epilogue_t epilogue, void const* aux) {
    uform_vram_context_t* context = uform_vram(context_);
    if (!m || !n) return uform_status_success_k;
    size_t element = float_output ? sizeof(float) : sizeof(uform_bf16_t);
    if (!k) { /* nothing to multiply: d = c, or zero */
        if (c == d) return uform_status_success_k;
        cudaError_t error = c ? cudaMemcpyAsync(d, c, m * n * element, cudaMemcpyDeviceToDevice, context->stream)
                              : cudaMemsetAsync(d, 0, m * n * element, context->stream);
        return uform_vram_check(error, "an empty matrix product");
    }
    uform_vram_product_t* product;
    uform_vram_shape_t shape(m, n, k, a_transposed, b_transposed, float_output, (int)epilogue, c != nullptr);
    uform_status_t status = uform_vram_plan(context, shape, &product);
    if (status != uform_status_success_k) return status;
    if (epilogue != uform_vram_plain_k) {
        status = uform_vram_blas(cublasLtMatmulDescSetAttribute(product->description,
                                                                CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                                                sizeof(aux)),
                                 "cublasLtMatmulDescSetAttribute (aux pointer)");
        if (status != uform_status_success_k) return status;
    }
    float alpha = 1.0f, beta = c ? 1.0f : 0.0f;
    return uform_vram_blas(cublasLtMatmul((cublasLtHandle_t)context->blas, product->description, &alpha, b, product->a,
                                          a, product->b, &beta, c ? c : d, product->c, d, product->d,
                                          &product->algorithm, context->scratch[uform_vram_scratch_blas_k],
                                          uform_vram_blas_workspace_k, context->stream),
                           "cublasLtMatmul");
}

} // namespace

/* cuBLASLt's workspace, then the GELU backward product's operand transposed: (wide, hidden) bf16. */
size_t uform_vram_blas_scratch(uform_plan_t const* plan) {
    return uform_vram_blas_workspace_k + uform_mlp_ratio_k * plan->hidden * plan->hidden * sizeof(uform_bf16_t);
}

uform_status_t uform_vram_matmul_open(uform_vram_context_t* context) {
    uform_vram_products_t* products = new (std::nothrow) uform_vram_products_t();
    context->matmuls = products;
    if (!products) return uform_vram_fail(NULL, uform_status_out_of_memory_k, "no memory for cuBLASLt's plans");
    /* UFORM_HOPPER_PRODUCTS=0 keeps cuBLASLt's epilogue on Hopper too: to compare the two. */
    char const* wanted = getenv("UFORM_HOPPER_PRODUCTS");
    if (uform_hopper_ready(context->ordinal) && !(wanted && !strcmp(wanted, "0")))
        products->hopper = uform_hopper_encoder();
    cublasLtHandle_t handle = nullptr;
    uform_status_t status = uform_vram_blas(cublasLtCreate(&handle), "cublasLtCreate");
    context->blas = handle;
    return status;
}

void uform_vram_matmul_close(uform_vram_context_t* context) {
    uform_vram_products_t* products = (uform_vram_products_t*)context->matmuls;
    if (products) {
        for (auto& entry : products->planned) delete entry.second;
        delete products;
    }
    if (context->blas) cublasLtDestroy((cublasLtHandle_t)context->blas);
    context->matmuls = context->blas = nullptr;
}

uform_status_t uform_vram_matmul(void* context, void* d, void const* c, void const* a, void const* b, size_t m,
                                 size_t n, size_t k, int a_transposed, int b_transposed, uform_element_t d_element) {
    return uform_vram_product(context, d, c, a, b, m, n, k, a_transposed, b_transposed, d_element == uform_element_f32_k,
                              uform_vram_plain_k, nullptr);
}

uform_status_t uform_vram_matmul_gelu(void* context_, void* activated, void* up, void const* a, void const* b, size_t m,
                                      size_t n, size_t k) {
    uform_vram_context_t* context = uform_vram(context_);
    if (!m || !uform_vram_hopper_takes(context, m, n, k, a, b, activated, up))
        return uform_vram_product(context, activated, nullptr, a, b, m, n, k, 0, 1, 0, uform_vram_gelu_k, up);
    return uform_vram_hopper_product(context, uform_hopper_gelu_k, activated, up, a, b, m, n, k, "the GELU product");
}

uform_status_t uform_vram_matmul_gelu_backward(void* context_, void* d_up, void const* up, void const* a, void const* b,
                                               size_t m, size_t n, size_t k) {
    uform_vram_context_t* context = uform_vram(context_);
    /* The kernel takes b as (n, k): the weight transposed once a call into scratch sized for the MLP's. */
    bool fits_scratch = n * k <= uform_mlp_ratio_k * context->plan.hidden * context->plan.hidden;
    if (!m || !fits_scratch || !uform_vram_hopper_takes(context, m, n, k, a, nullptr /* b: transposed */, d_up, up))
        return uform_vram_product(context, d_up, nullptr, a, b, m, n, k, 0, 0, 0, uform_vram_gelu_backward_k, up);
    uform_bf16_t* transposed = (uform_bf16_t*)((char*)context->scratch[uform_vram_scratch_blas_k] +
                                               uform_vram_blas_workspace_k);
    uform_vram_launch(uform_vram_transpose, dim3((unsigned)((n + 31) / 32), (unsigned)((k + 31) / 32)), dim3(32, 8), 0,
        context->stream, transposed, (uform_bf16_t const*)b, k, n);
    uform_status_t status = uform_vram_launched("uform_vram_transpose");
    if (status != uform_status_success_k) return status;
    return uform_vram_hopper_product(context, uform_hopper_gelu_backward_k, d_up, (void*)up /* read */, a, transposed,
                                     m, n, k, "the GELU backward product");
}

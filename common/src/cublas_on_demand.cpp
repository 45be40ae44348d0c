// cublas_on_demand.cpp — the cuBLAS functions the GPU backend calls, defined here as forwarders
// that load cuBLAS on the first call.
//
// Why: a program that records cuBLAS as needed loads it (and cuBLASLt) at start, and their static
// initialisers cost about half a second of CPU per process. Every test program of Part II links
// this backend, and most of their runs, MPI ranks on CPU-only machines, never create it: with
// cuBLAS linked, each rank paid that half second for nothing. Here the library is opened when a
// CudaOps is first made (it calls cublasCreate), and not before.
//
// The definitions are hidden: they satisfy cuda_ops.cu's calls inside this library and are seen
// by no one else. The compiler holds each to its declaration in cublas_v2.h. A cuBLAS function the
// backend starts to call needs a line here, or the library does not link (undefined reference).
#pragma GCC visibility push(hidden)
#include <cublas_v2.h>
#pragma GCC visibility pop

#include <dlfcn.h>

#include <stdexcept>
#include <string>

namespace {

// The cuBLAS of the toolkit this library was built with (CMake passes its path).
void* cublas_library() {
  static void* const handle = [] {
    void* h = dlopen(K2C_CUBLAS_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (!h) throw std::runtime_error(std::string("cannot load cuBLAS (") + K2C_CUBLAS_LIBRARY + "): " + dlerror());
    return h;
  }();
  return handle;
}

// The library's own definition of `name`, found once; typed as the declaration in cublas_v2.h.
template <class Fn>
Fn* cublas_function(const char* name) {
  void* f = dlsym(cublas_library(), name);
  if (!f) throw std::runtime_error(std::string("cuBLAS has no ") + name + " (" + K2C_CUBLAS_LIBRARY + ")");
  return reinterpret_cast<Fn*>(f);
}

}  // namespace

// Each forwarder looks its function up on its first call and calls it from then on.
#define K2C_FORWARD(type, name, params, args)                          \
  extern "C" type name params {                                        \
    using Fn = type params;                                            \
    static Fn* const real = cublas_function<Fn>(#name);                \
    return real args;                                                  \
  }

K2C_FORWARD(cublasStatus_t, cublasCreate_v2, (cublasHandle_t* handle), (handle))
K2C_FORWARD(cublasStatus_t, cublasDestroy_v2, (cublasHandle_t handle), (handle))
K2C_FORWARD(cublasStatus_t, cublasSetStream_v2, (cublasHandle_t handle, cudaStream_t stream), (handle, stream))
K2C_FORWARD(cublasStatus_t, cublasSetMathMode, (cublasHandle_t handle, cublasMath_t mode), (handle, mode))
K2C_FORWARD(const char*, cublasGetStatusString, (cublasStatus_t status), (status))
K2C_FORWARD(cublasStatus_t, cublasSgemm_v2,
            (cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
             const float* alpha, const float* A, int lda, const float* B, int ldb, const float* beta, float* C,
             int ldc),
            (handle, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc))
K2C_FORWARD(cublasStatus_t, cublasGemmEx,
            (cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
             const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B, cudaDataType Btype,
             int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc, cublasComputeType_t compute,
             cublasGemmAlgo_t algo),
            (handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo))
K2C_FORWARD(cublasStatus_t, cublasGemmBatchedEx,
            (cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
             const void* alpha, const void* const A[], cudaDataType Atype, int lda, const void* const B[],
             cudaDataType Btype, int ldb, const void* beta, void* const C[], cudaDataType Ctype, int ldc,
             int batches, cublasComputeType_t compute, cublasGemmAlgo_t algo),
            (handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, batches, compute,
             algo))

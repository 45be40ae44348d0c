// slow_end.cu — witness_test.sh puts this where module 06's reference solution includes
// dispatch.h: the contract's overloads spin the GPU for about a millisecond before the reference's
// run<T>, so the outputs are right and the speed is a crawl (the reference lives in solutions/,
// which a handout does not ship, so neither does this softmax).
namespace k2c::softmax {
namespace {
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
}  // namespace

void softmax(Version v, const float* x, float* y, int rows, int cols, cudaStream_t stream) {
  spin<<<1, 1, 0, stream>>>(2000000);
  run(v, x, y, rows, cols, stream);
}
void softmax(Version v, const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
  spin<<<1, 1, 0, stream>>>(2000000);
  run(v, x, y, rows, cols, stream);
}
}  // namespace k2c::softmax

// tail_end.cu — witness_test.sh puts this where module 06's reference solution includes
// dispatch.h: the contract's overloads run the reference at the performance test's width (4,096
// columns) and do nothing at any other, so the timed kernel is right and fast and every other
// shape is left unwritten. With the forged report in front, only the grader's own check at shapes
// of its drawing can tell.
namespace k2c::softmax {
void softmax(Version v, const float* x, float* y, int rows, int cols, cudaStream_t stream) {
  if (cols == 4096) run(v, x, y, rows, cols, stream);
}
void softmax(Version v, const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
  if (cols == 4096) run(v, x, y, rows, cols, stream);
}
}  // namespace k2c::softmax

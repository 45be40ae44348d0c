// The stub of fake module 99_secret: graded when a submission lacks the file.
#include "fake_gemm.h"
#include "k2c/core/todo.h"

int k2c::gemm::answer() { K2C_TODO("return the answer"); }

// The fake course's reference solution: what a hostile submission tries to pass off as its own,
// through a symbolic link (module 91) or an #include that climbs out of the staging tree
// (module 92). copy_course leaves solutions/ out of every staging tree.
#include "fake_gemm.h"

int k2c::gemm::answer() { return 42; }

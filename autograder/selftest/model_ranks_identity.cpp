// model_ranks_identity.cpp — what k2c_model_ranks is, for the distributed test main it shares with
// the modules' test programs (k2c::testing::kProgram).
#include "k2c/testing/testing.h"

extern const k2c::testing::ProgramIdentity k2c::testing::kProgram = {"selftest", "solutions", K2C_RUBRIC_DEFAULT};

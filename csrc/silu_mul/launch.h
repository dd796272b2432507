// Launcher for silu_mul (contract in params.h). Returns a Status, never throws. CPU only: on CUDA the Python
// wrapper runs the torch reference.
#pragma once
#include "silu_mul/params.h"

namespace pyscore {

Status silu_mul_cpu(const SiluMulParams& params);

}  // namespace pyscore

// Launcher for rotary (contract in params.h). Returns a Status, never throws. CPU only: on CUDA the Python
// wrapper runs the torch reference.
#pragma once
#include "rotary/params.h"

namespace pyscore {

Status rotary_cpu(const RotaryParams& params);

}  // namespace pyscore

// Launcher for add_rms_norm (contract in params.h). Returns a Status, never throws. CPU only: on CUDA the
// Python wrapper runs the torch reference.
#pragma once
#include "add_rms_norm/params.h"

namespace pyscore {

Status add_rms_norm_cpu(const AddRmsNormParams& params);

}  // namespace pyscore

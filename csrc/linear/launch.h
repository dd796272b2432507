// Launcher for linear (contract in params.h). Returns a Status, never throws.
#pragma once
#include "linear/params.h"

namespace pyscore {

Status linear_cpu(const LinearParams& params);

}  // namespace pyscore

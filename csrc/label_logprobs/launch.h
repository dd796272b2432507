// Launchers for label_logprobs (contract in params.h). They return a Status, never throw.
#pragma once
#include "label_logprobs/params.h"

namespace pyscore {

Status label_logprobs_cpu(const LabelLogprobsParams& params);
Status label_logprobs_cuda(const LabelLogprobsParams& params, void* stream);

}  // namespace pyscore

// PLACEHOLDER (being replaced by the real kernel).
#include "label_logprobs/launch.h"
namespace pyscore {
Status label_logprobs_cuda(const LabelLogprobsParams& params, void* stream) { return kInvalidArgument; }
}  // namespace pyscore

// PLACEHOLDER (being replaced by the real kernel).
#include "label_logprobs/launch.h"
namespace pyscore {
Status label_logprobs_cpu(const LabelLogprobsParams& params) { return kInvalidArgument; }
}  // namespace pyscore

// PLACEHOLDER (being replaced by the real kernel).
#include "prefix_item_attention/launch.h"
namespace pyscore {
Status prefix_item_attention_cpu(const PrefixItemAttentionParams& params) { return kInvalidArgument; }
}  // namespace pyscore

// Internal: the drivers attention_forward picks between (not part of the public C++ API).
#pragma once
#include "attnfast.hpp"

namespace attnfast {

// Throws std::invalid_argument for params the kernels cannot run (prefill.cpp).
void check_params(const AttentionParams& p);

// Short queries (takes_decode_path): split-KV, GQA-grouped decode (decode.cpp).
// `p` has been checked by attention_forward.
void decode_forward(const AttentionParams& p);

// plan_attention's answer for checked params, from the code each driver runs by.
CallPlan plan_prefill(const AttentionParams& p);  // prefill.cpp
CallPlan plan_decode(const AttentionParams& p);   // decode.cpp

}  // namespace attnfast

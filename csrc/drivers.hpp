// Internal: the drivers attention_forward picks between (not part of the public C++ API).
#pragma once
#include "attnfast.hpp"

namespace attnfast {

// Short queries (Tq <= kDecodeMaxQueryRows): split-KV, GQA-grouped decode (decode.cpp).
// `p` has been checked by attention_forward.
void decode_forward(const AttentionParams& p);

}  // namespace attnfast

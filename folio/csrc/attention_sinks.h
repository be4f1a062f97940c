// Attention sinks (GPT-OSS) for the attention kernels (cpu_paged_attention.cpp, cpu_flash_prefill.cpp): a learned
// logit per query head that joins every softmax's denominator and weighs no value. In an online softmax it is exact
// and free: a row's sum of probabilities l, relative to its running max m (base 2), gains exp2(sink - m) once, when
// the row ends, before the accumulator is divided by it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace folio {

// The sinks (float32 [heads]) times log2(e), base 2 as the kernels keep their scores; empty where the layer has none.
inline std::vector<float> sinks_base2(const std::optional<at::Tensor>& sinks, int64_t heads) {
  std::vector<float> out;
  if (!sinks) return out;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                  sinks->size(0) == heads, "sinks must be float32 [num_heads]");
  const float* src = sinks->data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h) out.push_back(src[h] * 1.4426950408889634f);
  return out;
}

// A row's denominator: its sum l with its head's sink (sinks2: sinks_base2's data, null for none) added.
inline float with_sink(const float* sinks2, int head, float m, float l) {
  return sinks2 ? l + std::exp2(sinks2[head] - m) : l;
}

}  // namespace folio

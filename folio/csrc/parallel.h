// How folio's kernels spread work over threads: folio::parallel_for, folio::num_threads and folio::parallel_blocks.
//
// Normally these are at::parallel_for and at::get_num_threads (OpenMP). During batch-1 decode steps the decode
// threads run them instead (cpu_decode_threads.cpp, folio.platforms.decode_threads): threads of folio's own that
// stay awake between calls, so that in the gaps between linear layers (Python, norms, attention: 2-3 ms of a
// step, memory idle) a worker can pull the next layer's weights into its cache. OpenMP cannot: its worker waits
// in the barrier of the last parallel region until the next one starts.
//
// Each extension gets the decode threads' entry points once loaded (folio.csrc_build calls its
// `use_decode_threads` with their capsule); until then, or without them, everything runs on OpenMP.
#pragma once

#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>

namespace folio {

// A weight stream of a parallel_blocks call: block b's bytes are [base + b * stride, + stride).
struct BlockStream {
  const void* base;
  int64_t stride;
};

// The decode threads' entry points (filled in by cpu_decode_threads.cpp, which owns the threads).
struct DecodeThreads {
  // Threads of the current decode step (main thread included), or 0 outside such steps.
  int (*threads)();
  // fn(ctx, begin, end) over [begin, end) split as at::parallel_for splits it.
  void (*parallel_for)(int64_t begin, int64_t end, int64_t grain, void (*fn)(const void*, int64_t, int64_t),
                       const void* ctx);
  // fn(ctx, begin, end) over blocks [0, n) of the weight named `key`, whose streams the workers prefetch
  // before the call while the caller runs whatever comes between it and the previous blocks call.
  void (*parallel_blocks)(const void* key, int64_t n, const BlockStream* streams, int num_streams,
                          void (*fn)(const void*, int64_t, int64_t), const void* ctx);
};

inline const DecodeThreads*& decode_threads() {
  static const DecodeThreads* entry = nullptr;  // one per extension: set by use_decode_threads
  return entry;
}

inline int active_decode_threads() {
  const DecodeThreads* d = decode_threads();
  return d ? d->threads() : 0;
}

template <class F>
void call_range(const void* ctx, int64_t begin, int64_t end) {
  (*static_cast<const F*>(ctx))(begin, end);
}

inline int num_threads() {
  const int active = active_decode_threads();
  return active ? active : at::get_num_threads();
}

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (active_decode_threads())
    decode_threads()->parallel_for(begin, end, grain, &call_range<F>, &f);
  else
    at::parallel_for(begin, end, grain, f);
}

// Blocks [0, n) of one weight, one at least per call of f (a linear layer's column blocks): the decode threads
// prefetch the first blocks of each worker's share while the caller is between calls.
template <class F, size_t S>
void parallel_blocks(const void* key, int64_t n, const BlockStream (&streams)[S], const F& f) {
  if (active_decode_threads())
    decode_threads()->parallel_blocks(key, n, streams, static_cast<int>(S), &call_range<F>, &f);
  else
    at::parallel_for(0, n, 1, f);
}

// The extension's binding that folio.csrc_build calls with the decode threads' capsule.
inline void bind_decode_threads(pybind11::module_& m) {
  m.def("use_decode_threads", [](pybind11::capsule entry) {
    decode_threads() = static_cast<const DecodeThreads*>(entry.get_pointer());
  });
}

}  // namespace folio

// The decode threads: worker threads of folio's own that run folio's kernels' parallel loops (parallel.h)
// during batch-1 decode steps, in place of OpenMP's.
//
// A batch-1 decode step streams every weight once and spends 2-3 ms between the linear layers (Python, norms,
// rotary, attention, sampling), during which memory sits idle. OpenMP's worker spends those gaps waiting in the
// barrier of the last parallel region. These workers spend them pulling the first blocks of their share of the
// next linear layer into their cache (software prefetches: a stale weight address cannot fault). Having those
// blocks in cache, they finish their shares first and then take blocks from the end of the main thread's, one
// at a time, as many as that takes. Which layer comes next is learnt: each weight (its address) remembers the
// weight that was called after it.
//
// Between calls the workers spin (as OpenMP's do), and sleep after IDLE_SPIN_US without work; the main thread
// waits for their parts the same way (JOIN_SPIN_US; set_threads takes others, the tests none). The Python side
// (folio.platforms.decode_threads) turns them on for steps of one token and sets torch's own threads to one
// meanwhile, so that no OpenMP worker spins on the same cores; other steps run on OpenMP as before.
#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "parallel.h"

namespace {

using Fn = void (*)(const void*, int64_t, int64_t);

constexpr int MAX_THREADS = 256;
constexpr int MAX_STREAMS = 4;
// Bytes of its next share a worker prefetches in a gap, at most (a job that comes first stops it): Zen 4's L2.
constexpr int64_t PREFETCH_BYTES = 1 << 20;
// How long (by default) a worker spins without work before it sleeps until the next call or hint, and the main
// thread spins for the workers' parts before it sleeps until they are done. Sleeping hands the core to a thread
// the scheduler had parked when another process is busy on these cores. On 2 cores of an Emerald Rapids Xeon, the
// 0.5B Qwen2's batch-1 decode beside one busy-loop process took 689 ms a token with the main thread spinning until
// the end and workers spinning 2 ms; 103 ms with JOIN_SPIN_US; 82 ms with IDLE_SPIN_US 100 too (OpenMP: 70-81). On
// a quiet machine 36.1-36.7 ms, as before within the noise (1.05x OpenMP's time, before and after).
constexpr int64_t IDLE_SPIN_US = 100;
constexpr int64_t JOIN_SPIN_US = 50;
constexpr size_t MAX_WEIGHTS = 1 << 14;  // weights remembered (stale ones after a model is freed: forgotten)

// What a worker prefetches next, blocks [begin, end) of the streams: written by the main thread after a call,
// read by the worker when its generation moves. (A torn read could only prefetch wrong addresses, which costs
// bandwidth, not correctness.)
struct Hint {
  std::atomic<uint64_t> generation{0};
  folio::BlockStream streams[MAX_STREAMS];
  int count = 0;
  int64_t begin = 0, end = 0;
};

struct Weight {
  int64_t n = 0;
  folio::BlockStream streams[MAX_STREAMS];
  int num_streams = 0;
  int next = -1;  // the weight called after this one, last time
};

struct State {
  std::mutex mutex;  // the sleepers' and the error's
  std::condition_variable wake;
  std::condition_variable joined;       // the last part of a call is done
  std::atomic<bool> main_waiting{false};  // the main thread sleeps on `joined`
  std::atomic<int> threads{0};   // of the current decode steps (main included), 0: off
  std::atomic<int64_t> idle_spin_us{IDLE_SPIN_US}, join_spin_us{JOIN_SPIN_US};
  std::atomic<int> sleeping{0};
  std::atomic<bool> busy{false};  // a call in flight (another Python thread's call runs inline meanwhile)
  int workers = 0;                // started
  // the job: part t of the call is [bounds[t], bounds[t + 1]); with `steal`, the main thread's part is claimed
  // a block at a time, from the front by the main thread and from the back by workers done with their own
  std::atomic<uint64_t> generation{0};
  std::atomic<int> pending{0};
  int parts = 0;
  Fn fn = nullptr;
  const void* ctx = nullptr;
  int64_t bounds[MAX_THREADS + 1];
  bool steal = false;
  std::atomic<uint64_t> unclaimed{0};  // the main thread's part not yet claimed: end << 32 | begin
  std::exception_ptr error;
  Hint hints[MAX_THREADS];
  std::vector<Weight> weights;
  std::unordered_map<const void*, int> weight_index;
  int last_weight = -1;
};

State* state = new State;  // never destroyed: detached workers read it until the process ends
thread_local bool in_call = false;

// Software prefetches of blocks [begin, end), block by block (a weight freed since its address was learnt cannot
// fault), up to PREFETCH_BYTES; given up when a job comes.
void prefetch(State* s, const folio::BlockStream* streams, int count, int64_t begin, int64_t end, uint64_t job) {
  int64_t budget = PREFETCH_BYTES;
  for (int64_t b = begin; b < end && budget > 0; ++b)
    for (int r = 0; r < count; ++r) {
      const char* p = static_cast<const char*>(streams[r].base) + b * streams[r].stride;
      for (int64_t o = 0; o < streams[r].stride; o += 64) {
        if (o % 2048 == 0 && s->generation.load(std::memory_order_relaxed) != job) return;
        _mm_prefetch(p + o, _MM_HINT_T0);
      }
      budget -= streams[r].stride;
    }
}

// Claims one block of the main thread's part: its first (front) or its last; -1 when none is left.
int64_t claim(State* s, bool front) {
  uint64_t cur = s->unclaimed.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t begin = static_cast<int64_t>(cur & 0xffffffffu), end = static_cast<int64_t>(cur >> 32);
    if (begin >= end) return -1;
    const uint64_t next = front ? (cur & ~uint64_t{0xffffffffu}) | static_cast<uint64_t>(begin + 1)
                                : (static_cast<uint64_t>(end - 1) << 32) | static_cast<uint64_t>(begin);
    if (s->unclaimed.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return front ? begin : end - 1;
  }
}

// Part t of the current job (the main thread's is 0).
void run_part(State* s, int t) {
  if (s->steal && t == 0) {
    for (int64_t b; (b = claim(s, true)) >= 0;) s->fn(s->ctx, b, b + 1);
    return;
  }
  if (s->bounds[t] < s->bounds[t + 1]) s->fn(s->ctx, s->bounds[t], s->bounds[t + 1]);
  if (s->steal)
    for (int64_t b; (b = claim(s, false)) >= 0;) s->fn(s->ctx, b, b + 1);
}

// Worker `index` (1, 2, ...) of s, started when the calls so far were `seen`.
void work(State* s, int index, uint64_t seen) {
  uint64_t hint_seen = 0;
  Hint& hint = s->hints[index];
  auto idle_since = std::chrono::steady_clock::now();
  for (uint32_t spins = 0;; ++spins) {
    const uint64_t g = s->generation.load(std::memory_order_acquire);
    if (g != seen) {
      seen = g;
      if (index < s->parts) {
        in_call = true;
        try {
          run_part(s, index);
        } catch (...) {
          std::lock_guard<std::mutex> lock(s->mutex);
          if (!s->error) s->error = std::current_exception();
        }
        in_call = false;
        if (s->pending.fetch_sub(1) == 1 && s->main_waiting.load()) {  // seq_cst: see join
          std::lock_guard<std::mutex> lock(s->mutex);
          s->joined.notify_one();
        }
      }
      idle_since = std::chrono::steady_clock::now();
      continue;
    }
    const uint64_t h = hint.generation.load(std::memory_order_acquire);
    if (h != hint_seen) {
      hint_seen = h;
      folio::BlockStream streams[MAX_STREAMS];
      const int count = std::min(hint.count, MAX_STREAMS);
      std::copy(hint.streams, hint.streams + count, streams);
      prefetch(s, streams, count, hint.begin, hint.end, g);
      idle_since = std::chrono::steady_clock::now();
      continue;
    }
    if (spins % 1024 == 0 && std::chrono::steady_clock::now() - idle_since >=
                                 std::chrono::microseconds(s->idle_spin_us.load(std::memory_order_relaxed))) {
      std::unique_lock<std::mutex> lock(s->mutex);
      s->sleeping.fetch_add(1);
      s->wake.wait(lock, [&] { return s->generation.load() != seen || hint.generation.load() != hint_seen; });
      s->sleeping.fetch_sub(1);
      idle_since = std::chrono::steady_clock::now();
      continue;
    }
    _mm_pause();
  }
}

void wake_sleepers(State* s) {
  if (s->sleeping.load() > 0) {
    std::lock_guard<std::mutex> lock(s->mutex);
    s->wake.notify_all();
  }
}

// Waits until the workers' parts are done: spins join_spin_us, then sleeps. main_waiting is stored before pending is
// read, and a worker decrements pending before it reads main_waiting (all seq_cst), so either the main thread sees
// the last part done or the last worker sees it waiting and notifies under the mutex, which the main thread holds
// from its check until it sleeps.
void join(State* s) {
  const auto start = std::chrono::steady_clock::now();
  const auto spin = std::chrono::microseconds(s->join_spin_us.load(std::memory_order_relaxed));
  for (uint32_t spins = 0; s->pending.load(std::memory_order_acquire) > 0; ++spins) {
    if (spins % 64 != 0 || std::chrono::steady_clock::now() - start < spin) {
      _mm_pause();
      continue;
    }
    std::unique_lock<std::mutex> lock(s->mutex);
    s->main_waiting.store(true);
    s->joined.wait(lock, [&] { return s->pending.load() == 0; });
    s->main_waiting.store(false);
    return;
  }
}

// Runs part 0 here and parts 1.. on the workers (s->bounds set; `steal`: see State); returns once all are done,
// rethrowing an exception of any part.
void run(State* s, int parts, Fn fn, const void* ctx, bool steal) {
  s->fn = fn;
  s->ctx = ctx;
  s->parts = parts;
  s->steal = steal;
  s->unclaimed.store(static_cast<uint64_t>(s->bounds[1]) << 32 | static_cast<uint64_t>(s->bounds[0]),
                     std::memory_order_relaxed);
  s->error = nullptr;
  s->pending.store(parts - 1, std::memory_order_relaxed);
  s->generation.fetch_add(1);  // seq_cst: ordered before the sleepers' count is read
  wake_sleepers(s);
  in_call = true;
  std::exception_ptr mine;
  try {
    run_part(s, 0);
  } catch (...) {
    mine = std::current_exception();
  }
  in_call = false;
  join(s);
  if (!mine) mine = s->error;
  if (mine) std::rethrow_exception(mine);
}

// Takes the threads for one call: false when they are off, or busy with another thread's call, or this is a
// call from inside one (it then runs inline).
bool acquire(State* s) {
  if (in_call || s->threads.load(std::memory_order_relaxed) < 2) return false;
  bool expected = false;
  return s->busy.compare_exchange_strong(expected, true, std::memory_order_acquire);
}

struct Release {
  State* s;
  ~Release() { s->busy.store(false, std::memory_order_release); }
};

int threads() { return state->threads.load(std::memory_order_relaxed); }

// [begin, end) in `parts` chunks as at::parallel_for splits a range over its threads: bounds[0 .. parts].
void split(int64_t begin, int64_t end, int parts, int64_t* bounds) {
  const int64_t chunk = (end - begin + parts - 1) / parts;
  for (int64_t t = 0; t <= parts; ++t) bounds[t] = std::min(end, begin + t * chunk);
}

// As at::parallel_for splits a range over its threads (ATen/ParallelOpenMP.h), so that kernels whose results
// depend on the split (partial sums per thread) compute the same numbers either way.
void parallel_for(int64_t begin, int64_t end, int64_t grain, Fn fn, const void* ctx) {
  State* s = state;
  if (begin >= end) return;
  if (end - begin <= grain || !acquire(s)) return fn(ctx, begin, end);
  Release release{s};
  int64_t parts = s->threads.load(std::memory_order_relaxed);
  if (grain > 0) parts = std::min<int64_t>(parts, (end - begin + grain - 1) / grain);
  if (parts < 2) return fn(ctx, begin, end);
  split(begin, end, static_cast<int>(parts), s->bounds);
  run(s, static_cast<int>(parts), fn, ctx, false);
}

int remember(State* s, const void* key, int64_t n, const folio::BlockStream* streams, int num_streams) {
  auto found = s->weight_index.find(key);
  if (found == s->weight_index.end()) {
    if (s->weights.size() >= MAX_WEIGHTS) {
      s->weights.clear();
      s->weight_index.clear();
      s->last_weight = -1;
    }
    found = s->weight_index.emplace(key, static_cast<int>(s->weights.size())).first;
    s->weights.emplace_back();
  }
  Weight& w = s->weights[found->second];
  const int count = std::min(num_streams, MAX_STREAMS);
  bool same = w.n == n && w.num_streams == count;
  for (int i = 0; same && i < count; ++i)
    same = w.streams[i].base == streams[i].base && w.streams[i].stride == streams[i].stride;
  if (!same) {  // a new weight, or another at a freed one's address
    w.n = n;
    w.num_streams = count;
    std::copy(streams, streams + count, w.streams);
  }
  return found->second;
}

// Asks each worker to prefetch the first blocks of its part of weight `index`'s next call.
void hint_next(State* s, int index, int parts) {
  const Weight& w = s->weights[index];
  int64_t bounds[MAX_THREADS + 1];
  split(0, w.n, parts, bounds);
  for (int t = 1; t < parts; ++t) {
    Hint& hint = s->hints[t];
    std::copy(w.streams, w.streams + w.num_streams, hint.streams);
    hint.count = w.num_streams;
    hint.begin = bounds[t];
    hint.end = bounds[t + 1];
    hint.generation.fetch_add(1);
  }
  wake_sleepers(s);
}

void parallel_blocks(const void* key, int64_t n, const folio::BlockStream* streams, int num_streams, Fn fn,
                     const void* ctx) {
  State* s = state;
  if (n <= 0) return;
  if (n == 1 || !acquire(s)) return fn(ctx, 0, n);
  Release release{s};
  const int parts = static_cast<int>(std::min<int64_t>(s->threads.load(std::memory_order_relaxed), n));
  const int index = remember(s, key, n, streams, num_streams);
  if (s->last_weight >= 0 && s->last_weight != index) s->weights[s->last_weight].next = index;
  s->last_weight = index;
  split(0, n, parts, s->bounds);
  run(s, parts, fn, ctx, true);
  const int next = s->weights[index].next;
  if (next >= 0) hint_next(s, next, parts);
}

const folio::DecodeThreads entry{&threads, &parallel_for, &parallel_blocks};

// Turns the threads on for `count` threads in all (workers started as needed), or off (count < 2), with the
// spins before sleeping given.
void set_threads(int64_t count, int64_t idle_spin_us, int64_t join_spin_us) {
  State* s = state;
  s->idle_spin_us.store(std::max<int64_t>(0, idle_spin_us));
  s->join_spin_us.store(std::max<int64_t>(0, join_spin_us));
  count = std::min<int64_t>(count, MAX_THREADS);
  if (count < 2) {
    s->threads.store(0);
    return;
  }
  for (; s->workers < count - 1; ++s->workers) std::thread(work, s, s->workers + 1, s->generation.load()).detach();
  s->threads.store(static_cast<int>(count));
}

// A forked child has none of the parent's threads: it starts with the threads off and none started. (The old
// state is left as it is: its mutex may have been held by a thread that does not exist here.)
void after_fork_in_child() {
  state = new State;
  in_call = false;
}

pybind11::capsule capsule() { return pybind11::capsule(static_cast<const void*>(&entry), "folio.decode_threads"); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pthread_atfork(nullptr, nullptr, &after_fork_in_child);
  m.def("capsule", &capsule, "the entry points the kernels' parallel.h calls");
  m.def("set_threads", &set_threads,
        "threads in all for the decode steps to come (main included; < 2: off), and how many microseconds a worker "
        "without work and the main thread waiting for the workers spin before they sleep",
        pybind11::arg("count"), pybind11::arg("idle_spin_us") = IDLE_SPIN_US,
        pybind11::arg("join_spin_us") = JOIN_SPIN_US);
  m.def("threads", &threads, "threads of the current decode steps, 0 when off");
}

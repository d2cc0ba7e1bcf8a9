// Work shared between threads with stealing instead of one fixed share each.
//
// at::parallel_for hands each thread one equal range up front. On this shared machine the two
// cores rarely run at the same speed: one is often markedly slower than the other for a while (its
// sibling on the host is busy), and then the fast one finishes its share and waits. A profile of
// the default workload put the second thread in that wait for a sizeable part of the run, most of
// it while the first still ran its share of a matrix product (BENCHMARKS.md, "Speed work, every
// attempt (CPU, default model)"). Here a thread that is done takes work from the
// back of the others' shares, so a slow core simply ends up doing less. Which thread computes a
// chunk never changes what it computes.
#pragma once

#include <ATen/Parallel.h>
#include "cpu_ops.h"  // TM_CHECK

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tokenmill {

// [0, n) cut into one contiguous range of equal length per thread. A thread takes chunks from
// the front of its own range; when its range is done, it takes chunks from the back of the
// others', until nothing is left anywhere. Chunks are `chunk` items long, or for items too
// small to take one by one (chunk 0), three quarters of what is left of one's own range (so
// that it reads on in order, with few takes) and a 2 * threads-th of another's, at least two.
// Small chunks matter where they are cheap: a thread that stalls (its core taken away for a
// while) holds back only the chunk it has taken.
class StealingRanges {
 public:
  StealingRanges(int64_t n, int64_t threads, int64_t chunk)
      : threads_(std::max<int64_t>(1, threads)), chunk_(std::max<int64_t>(0, chunk)), ranges_(new Range[threads_]) {
    for (int64_t t = 0; t < threads_; ++t) ranges_[t].bounds.store(pack(n * t / threads_, n * (t + 1) / threads_));
  }

  // whether item i is still left in thread t's own range (it may yet be taken by another):
  // whether prefetching it is likely to serve thread t
  bool still_own(int64_t t, int64_t i) const {
    const uint64_t bounds = ranges_[t].bounds.load(std::memory_order_relaxed);
    return i >= static_cast<int64_t>(bounds >> 32) && i < static_cast<int64_t>(bounds & 0xFFFFFFFFu);
  }

  // the next chunk [begin, end) for thread t, or false when all are taken
  bool next(int64_t t, int64_t& begin, int64_t& end) {
    if (take(ranges_[t], true, begin, end)) return true;
    for (int64_t other = 1; other < threads_; ++other)
      if (take(ranges_[(t + other) % threads_], false, begin, end)) return true;
    return false;
  }

 private:
  struct alignas(64) Range {  // front and back of what is left, in one word
    std::atomic<uint64_t> bounds;
  };
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back);
  }

  bool take(Range& r, bool from_front, int64_t& begin, int64_t& end) {
    uint64_t bounds = r.bounds.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(bounds >> 32), back = static_cast<int64_t>(bounds & 0xFFFFFFFFu);
      if (front >= back) return false;
      const int64_t share = from_front ? (back - front) * 3 / 4 : (back - front) / (2 * threads_);
      const int64_t size = std::min(back - front, chunk_ > 0 ? chunk_ : std::max<int64_t>(2, share));
      begin = from_front ? front : back - size;
      end = begin + size;
      if (r.bounds.compare_exchange_weak(bounds, from_front ? pack(end, back) : pack(front, begin),
                                         std::memory_order_relaxed))
        return true;
    }
  }

  const int64_t threads_, chunk_;
  std::unique_ptr<Range[]> ranges_;
};

// One thread's view of the ranges: what a body takes its chunks from.
class ThreadChunks {
 public:
  ThreadChunks(StealingRanges& ranges, int64_t thread) : ranges_(ranges), thread_(thread) {}
  bool next(int64_t& begin, int64_t& end) { return ranges_.next(thread_, begin, end); }
  // whether item i comes next to this thread: in the chunk it works on (before `end`) or at the
  // front of what is left of its own range (never an i past the last item)
  bool comes_next(int64_t i, int64_t end) const { return i < end || ranges_.still_own(thread_, i); }

 private:
  StealingRanges& ranges_;
  const int64_t thread_;
};

// Runs body(chunks) on each thread of the team (once in all when called from inside a parallel
// region): the body sets up what a thread needs, then takes chunks of [0, n) (`chunk` items, or
// 0 as in StealingRanges) until none is left. Ranges that no thread starts on (a team smaller
// than asked for) are simply all stolen.
template <class Body>
void parallel_chunks(int64_t n, int64_t chunk, const Body& body) {
  TM_CHECK(n >= 0 && n <= 0xFFFFFFFFll, "parallel_chunks: n must fit in 32 bits");
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, n));
  if (threads == 1 || at::in_parallel_region()) {
    StealingRanges ranges(n, 1, std::max<int64_t>(1, n));
    ThreadChunks chunks(ranges, 0);
    body(chunks);
    return;
  }
  StealingRanges ranges(n, threads, chunk);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {  // one t per thread, unless the team is smaller
      ThreadChunks chunks(ranges, t);
      body(chunks);
    }
  });
}

}  // namespace tokenmill

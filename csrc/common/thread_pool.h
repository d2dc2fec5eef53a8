// A small persistent thread pool for the CPU kernels.
//
// Why not OpenMP: torch ships its own libgomp, and a second OpenMP runtime in
// the same process oversubscribes cores and has crashed on fork. Why not a
// thread per call: an optimizer step calls the kernel once per parameter, and
// spawning threads for a 1,000-element bias costs more than the update.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace offload {

class ThreadPool {
 public:
  // The process-wide pool (recreated in a forked child, whose threads are gone).
  static ThreadPool& instance();

  // Splits [0, n) into at most `num_threads` contiguous ranges whose bounds
  // are multiples of `align` (so SIMD kernels see aligned chunk starts) and
  // runs fn(begin, end) on each, the caller's thread taking the first range.
  // Returns when all ranges are done. Re-entrant calls, or calls made while
  // another thread holds the pool, run inline on the caller's thread.
  void parallel_for(size_t n, size_t align, int num_threads,
                    const std::function<void(size_t, size_t)>& fn);

  // Runs fn(i) for every i in [0, chunks) on at most `num_threads` threads,
  // each taking the next chunk not yet taken (Note [chunks taken in turn]).
  void parallel_chunks(size_t chunks, int num_threads, const std::function<void(size_t)>& fn);

  // Binds every worker, now and later, to `cores` (Linux; elsewhere a no-op): a
  // rank's block of its host's cores, where several ranks share the host (Note
  // [the node's share] in offload/node.py). Empty: unbound.
  void set_cores(const std::vector<int>& cores);

  // Each worker's CPU set, as the kernel reports it (for tests and reports).
  std::vector<std::vector<int>> worker_cores();

  ~ThreadPool();

 private:
  ThreadPool() = default;
  void ensure_workers(int count);
  void worker_loop(int index);
  void bind(std::thread& worker);

  std::mutex call_mutex_;  // one parallel_for at a time
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::vector<std::thread> workers_;
  std::vector<int> cores_;  // set_cores; guarded by call_mutex_
  // The current job, valid while pending_ > 0.
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  std::vector<std::pair<size_t, size_t>> ranges_;
  unsigned long generation_ = 0;
  int pending_ = 0;
  bool stopping_ = false;
};

}  // namespace offload

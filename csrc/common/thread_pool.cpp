#include "thread_pool.h"

#include <unistd.h>
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>

namespace offload {

ThreadPool& ThreadPool::instance() {
  // A forked child inherits the pool object but not its threads; leak the old
  // one (its mutexes may be held by threads that no longer exist) and build anew.
  static pid_t owner_pid = getpid();
  static ThreadPool* pool = new ThreadPool();
  if (getpid() != owner_pid) {
    owner_pid = getpid();
    pool = new ThreadPool();
  }
  return *pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::ensure_workers(int count) {
  while (static_cast<int>(workers_.size()) < count) {
    const int index = static_cast<int>(workers_.size());
    workers_.emplace_back([this, index] { worker_loop(index); });
    bind(workers_.back());
  }
}

void ThreadPool::bind(std::thread& worker) {
#ifdef __linux__
  if (cores_.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cores_) {
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  }
  pthread_setaffinity_np(worker.native_handle(), sizeof(set), &set);
#else
  (void)worker;
#endif
}

void ThreadPool::set_cores(const std::vector<int>& cores) {
  std::lock_guard<std::mutex> call(call_mutex_);
  cores_ = cores;
  for (auto& w : workers_) bind(w);
}

std::vector<std::vector<int>> ThreadPool::worker_cores() {
  std::lock_guard<std::mutex> call(call_mutex_);
  std::vector<std::vector<int>> out;
#ifdef __linux__
  for (auto& w : workers_) {
    cpu_set_t set;
    CPU_ZERO(&set);
    std::vector<int> cores;
    if (pthread_getaffinity_np(w.native_handle(), sizeof(set), &set) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &set)) cores.push_back(c);
      }
    }
    out.push_back(cores);
  }
#endif
  return out;
}

void ThreadPool::worker_loop(int index) {
  unsigned long seen = 0;
  for (;;) {
    std::pair<size_t, size_t> range;
    const std::function<void(size_t, size_t)>* job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Worker i runs range i + 1; range 0 belongs to the caller.
      work_cv_.wait(lock, [&] {
        return stopping_ || (generation_ != seen &&
                             static_cast<size_t>(index + 1) < ranges_.size());
      });
      if (stopping_) return;
      seen = generation_;
      range = ranges_[index + 1];
      job = job_;
    }
    (*job)(range.first, range.second);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(size_t n, size_t align, int num_threads,
                              const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  align = std::max<size_t>(align, 1);
  const size_t units = (n + align - 1) / align;
  const int threads = static_cast<int>(std::min<size_t>(std::max(num_threads, 1), units));
  std::unique_lock<std::mutex> call_lock(call_mutex_, std::try_to_lock);
  if (threads == 1 || !call_lock.owns_lock()) {
    fn(0, n);
    return;
  }
  std::vector<std::pair<size_t, size_t>> ranges;
  const size_t per = units / threads, extra = units % threads;
  size_t begin = 0;
  for (int t = 0; t < threads; ++t) {
    const size_t count = (per + (static_cast<size_t>(t) < extra ? 1 : 0)) * align;
    const size_t end = std::min(n, begin + count);
    ranges.emplace_back(begin, end);
    begin = end;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ensure_workers(threads - 1);
    ranges_ = std::move(ranges);
    job_ = &fn;
    pending_ = threads - 1;
    ++generation_;
  }
  work_cv_.notify_all();
  fn(ranges_[0].first, ranges_[0].second);
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

// Note [chunks taken in turn]
// parallel_for gives each thread one fixed range, so a call lasts as long as
// its slowest thread: one that shares its core (with the compute thread, with
// OpenMP threads still spinning after torch's last parallel region, with
// another process) holds the whole update up. On a 2-core Xeon, 16M fp32
// elements on 2 threads, about half of the timed steps ran at the 1-thread
// rate (0.88-0.97 Gparam/s against 1.43-1.68). Here threads take fixed-size
// chunks in turn from a shared counter instead, so a thread that runs slower
// simply takes fewer. The chunks' bounds depend on the chunk size alone,
// never on the thread count or on who took which, so whatever is computed
// per chunk and combined in chunk order (the gradient's sum of squares) is
// the same value on any number of threads.
void ThreadPool::parallel_chunks(size_t chunks, int num_threads, const std::function<void(size_t)>& fn) {
  if (chunks == 0) return;
  const int threads = static_cast<int>(std::min<size_t>(std::max(num_threads, 1), chunks));
  std::atomic<size_t> next{0};
  parallel_for(static_cast<size_t>(threads), 1, threads, [&](size_t, size_t) {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < chunks;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
    }
  });
}

}  // namespace offload

// Native asynchronous file I/O: one pread/pwrite of any size and alignment,
// split into aligned blocks and kept `queue_depth` deep in the kernel by
// `intra_op_parallelism` worker threads, each with its own AIO context.
//
// Note [aligned blocks and fragments]
// O_DIRECT needs the file offset, the length and the memory address aligned
// (we use kAlign = 4096, the largest logical block size in practice). A
// transfer [offset, offset + nbytes) is cut at aligned file offsets into:
//   - a head fragment, when `offset` is not aligned (< 4096 bytes),
//   - aligned blocks of at most `block_size` bytes, submitted through AIO,
//   - a tail fragment, when the end is not aligned (< 4096 bytes).
// Fragments go through a second, buffered descriptor with plain pread/pwrite;
// they never share a page with the aligned blocks, so the two paths do not
// race on the page cache. A block whose memory address is not aligned is
// staged through the slot's own aligned bounce buffer (one memcpy), so any
// tensor works and aligned tensors (the swap store's pool) pay no copy.
#pragma once

#include <linux/aio_abi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "aio_context.h"

namespace offload {
namespace aio {

constexpr uint64_t kAlign = 4096;

enum class IoOp : int { kRead = 0, kWrite = 1 };

const char* io_op_name(IoOp op);  // "pread" / "pwrite"

// The file a request works on: an O_DIRECT descriptor for the aligned blocks
// and, opened on first use, a buffered one for fragments. Closed with the
// object (RAII), i.e. when the request that opened it completes.
class OpenFile {
 public:
  // Throws IoFailure on failure.
  OpenFile(const std::string& path, IoOp op, bool refuse_direct);
  ~OpenFile();
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;

  int direct_fd() const { return direct_fd_; }
  int buffered_fd();  // -errno if it cannot be opened
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  IoOp op_;
  int direct_fd_ = -1;
  std::mutex mutex_;
  int buffered_fd_ = -1;
};

// Thrown by OpenFile: errno plus the step that failed.
struct IoFailure {
  int err;
  const char* stage;
};

// One pread or pwrite in flight. Completion and the first error are recorded
// here by the workers; Python reads them after wait() (see offload/aio/native.py).
class Request {
 public:
  Request(IoOp op, std::string path, uint64_t offset, uint64_t nbytes);

  bool done() const;
  void wait() const;  // callers release the GIL around it

  IoOp op() const { return op_; }
  const std::string& path() const { return path_; }
  uint64_t offset() const { return offset_; }
  uint64_t nbytes() const { return nbytes_; }
  // Valid once done(): errno of the first failure (0 if none), whether it was
  // a short read at end of file, the file offset and the step that failed.
  int error() const { return error_; }
  bool truncated() const { return truncated_; }
  uint64_t error_offset() const { return error_offset_; }
  std::string error_stage() const { return error_stage_; }

 private:
  friend class AioEngine;
  friend class Worker;
  void fail(int err, uint64_t file_offset, const char* stage, bool truncated = false);
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  void part_done();

  const IoOp op_;
  const std::string path_;
  const uint64_t offset_;
  const uint64_t nbytes_;
  std::shared_ptr<OpenFile> file_;  // dropped on completion: closes the fds promptly
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  int parts_pending_ = 0;
  std::atomic<bool> failed_{false};
  int error_ = 0;
  bool truncated_ = false;
  uint64_t error_offset_ = 0;
  std::string error_stage_;
};

// Deliberate failures for tests: the Nth aligned block or fragment of an op
// (counting from when the fault is armed) completes with -err, as if the
// kernel had reported it, and flows through the normal completion path.
struct FaultPlan {
  std::atomic<bool> armed{false};
  std::atomic<bool> refuse_direct{false};
  std::mutex mutex;
  IoOp op = IoOp::kRead;
  int err = 0;
  int countdown = 0;

  // Returns the errno to substitute for this completion, or 0.
  int take(IoOp completed_op);
};

class Worker;

class AioEngine {
 public:
  AioEngine(size_t block_size, int queue_depth, int intra_op_parallelism);
  ~AioEngine();  // finishes every queued transfer, then joins the workers
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // Opens `path` and queues the transfer; never throws for I/O failures: an
  // open error comes back as an already-completed request carrying it.
  std::shared_ptr<Request> submit(IoOp op, const std::string& path, char* buffer,
                                  uint64_t nbytes, uint64_t offset);

  size_t block_size() const { return block_size_; }
  int queue_depth() const { return queue_depth_; }
  int intra_op_parallelism() const { return static_cast<int>(workers_.size()); }

  void inject_fault(IoOp op, int err, int after_units);
  void set_refuse_direct(bool refuse) { faults_.refuse_direct = refuse; }
  void clear_faults();

 private:
  const size_t block_size_;
  const int queue_depth_;
  FaultPlan faults_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<unsigned> next_worker_{0};
};

}  // namespace aio
}  // namespace offload

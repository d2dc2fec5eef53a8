#include "aio_engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace offload {
namespace aio {
namespace {

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
uint64_t round_down(uint64_t x, uint64_t a) { return x / a * a; }

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<char, FreeDeleter>;

AlignedBuffer aligned_alloc_or_throw(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, bytes) != 0) throw std::bad_alloc();
  return AlignedBuffer(static_cast<char*>(p));
}

// Plain blocking pread/pwrite of the whole range. Returns 0, an errno, or
// -1 for a read that met end of file first (a truncated file).
int transfer_sync(int fd, IoOp op, char* buf, uint64_t len, uint64_t off) {
  while (len > 0) {
    const ssize_t n = op == IoOp::kRead ? ::pread(fd, buf, len, static_cast<off_t>(off))
                                        : ::pwrite(fd, buf, len, static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return op == IoOp::kRead ? -1 : EIO;
    buf += n;
    len -= static_cast<uint64_t>(n);
    off += static_cast<uint64_t>(n);
  }
  return 0;
}

}  // namespace

const char* io_op_name(IoOp op) { return op == IoOp::kRead ? "pread" : "pwrite"; }

// ---------------------------------------------------------------- OpenFile

OpenFile::OpenFile(const std::string& path, IoOp op, bool refuse_direct) : path_(path), op_(op) {
  // O_NOFOLLOW: a symlink at the name fails the open (ELOOP) rather than being
  // written through (Note [creating swap files] in offload/aio/swap_store.py).
  const int flags = (op == IoOp::kRead ? O_RDONLY : (O_WRONLY | O_CREAT)) | O_CLOEXEC | O_NOFOLLOW;
  if (refuse_direct) throw IoFailure{EINVAL, "open(O_DIRECT)"};
  direct_fd_ = ::open(path.c_str(), flags | O_DIRECT, 0600);
  if (direct_fd_ < 0) throw IoFailure{errno, "open(O_DIRECT)"};
}

OpenFile::~OpenFile() {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
}

int OpenFile::buffered_fd() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (buffered_fd_ < 0) {
    // The direct open already created the file, so no O_CREAT here.
    const int flags = (op_ == IoOp::kRead ? O_RDONLY : O_WRONLY) | O_CLOEXEC | O_NOFOLLOW;
    buffered_fd_ = ::open(path_.c_str(), flags);
    if (buffered_fd_ < 0) return -errno;
  }
  return buffered_fd_;
}

// ----------------------------------------------------------------- Request

Request::Request(IoOp op, std::string path, uint64_t offset, uint64_t nbytes)
    : op_(op), path_(std::move(path)), offset_(offset), nbytes_(nbytes) {}

bool Request::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return parts_pending_ == 0;
}

void Request::wait() const {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return parts_pending_ == 0; });
}

void Request::fail(int err, uint64_t file_offset, const char* stage, bool truncated) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failed_.load(std::memory_order_relaxed)) return;  // the first failure is the cause
  error_ = truncated ? 0 : err;
  truncated_ = truncated;
  error_offset_ = file_offset;
  error_stage_ = stage;
  failed_.store(true, std::memory_order_relaxed);
}

void Request::part_done() {
  std::shared_ptr<OpenFile> closing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--parts_pending_ > 0) return;
    closing = std::move(file_);
  }
  closing.reset();  // close before waking waiters: a waiter may rename the file
  cv_.notify_all();
}

// --------------------------------------------------------------- FaultPlan

int FaultPlan::take(IoOp completed_op) {
  if (!armed.load(std::memory_order_relaxed)) return 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (!armed.load(std::memory_order_relaxed) || completed_op != op) return 0;
  if (countdown-- > 0) return 0;
  armed.store(false, std::memory_order_relaxed);
  return err;
}

// ------------------------------------------------------------------ Worker

// A contiguous piece of one request, handled entirely by one worker.
struct Part {
  std::shared_ptr<Request> request;
  std::shared_ptr<OpenFile> file;
  char* buffer;     // memory for [offset, offset + nbytes)
  uint64_t offset;  // file offset
  uint64_t nbytes;
  uint64_t issued = 0;  // bytes handed to the kernel or done synchronously
  int in_flight = 0;    // aligned blocks submitted and not yet completed
};

// One worker thread, one AIO context, `queue_depth` slots. Blocks from the
// parts it holds are issued in order, so small requests queued back to back
// still keep the queue full.
class Worker {
 public:
  Worker(size_t block_size, int queue_depth, FaultPlan* faults)
      : block_size_(block_size), ctx_(static_cast<unsigned>(queue_depth)), faults_(faults),
        slots_(static_cast<size_t>(queue_depth)), events_(static_cast<size_t>(queue_depth)) {
    for (int i = queue_depth - 1; i >= 0; --i) free_slots_.push_back(i);
    thread_ = std::thread([this] { loop(); });
  }

  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void enqueue(std::unique_ptr<Part> part) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      incoming_.push_back(std::move(part));
    }
    cv_.notify_one();
  }

 private:
  struct Slot {
    iocb cb;
    Part* part = nullptr;
    char* user = nullptr;  // where the block's bytes live in the caller's buffer
    uint64_t length = 0;
    uint64_t offset = 0;
    AlignedBuffer bounce;  // allocated on first use: aligned tensors never need it
  };

  void loop() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !incoming_.empty() || !active_.empty(); });
        if (stopping_ && incoming_.empty() && active_.empty()) return;
        for (auto& p : incoming_) active_.push_back(std::move(p));
        incoming_.clear();
      }
      issue();
      if (in_flight_ > 0) reap();
      retire_finished_parts();
    }
  }

  // Fills free slots with the next blocks; fragments run inline.
  void issue() {
    batch_.clear();
    for (auto& part_ptr : active_) {
      Part& part = *part_ptr;
      if (part.request->failed()) part.issued = part.nbytes;  // stop issuing a failed request
      while (part.issued < part.nbytes && !free_slots_.empty()) {
        const uint64_t pos = part.offset + part.issued;
        const uint64_t end = part.offset + part.nbytes;
        char* user = part.buffer + part.issued;
        const uint64_t aligned_end = round_down(end, kAlign);
        if (pos % kAlign != 0 || pos >= aligned_end) {
          const uint64_t frag_end = pos % kAlign != 0 ? std::min(round_up(pos, kAlign), end) : end;
          run_fragment(part, user, frag_end - pos, pos);
          part.issued += frag_end - pos;
          continue;
        }
        const uint64_t length = std::min<uint64_t>(block_size_, aligned_end - pos);
        const int index = free_slots_.back();
        free_slots_.pop_back();
        Slot& slot = slots_[static_cast<size_t>(index)];
        slot.part = &part;
        slot.user = user;
        slot.length = length;
        slot.offset = pos;
        char* io_buf = user;
        if (reinterpret_cast<uintptr_t>(user) % kAlign != 0) {
          if (!slot.bounce) slot.bounce = aligned_alloc_or_throw(block_size_);
          io_buf = slot.bounce.get();
          if (part.request->op() == IoOp::kWrite) std::memcpy(io_buf, user, length);
        }
        std::memset(&slot.cb, 0, sizeof(slot.cb));
        slot.cb.aio_data = static_cast<uint64_t>(index);
        slot.cb.aio_lio_opcode = part.request->op() == IoOp::kRead ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
        slot.cb.aio_fildes = static_cast<uint32_t>(part.file->direct_fd());
        slot.cb.aio_buf = reinterpret_cast<uint64_t>(io_buf);
        slot.cb.aio_nbytes = length;
        slot.cb.aio_offset = static_cast<int64_t>(pos);
        batch_.push_back(&slot.cb);
        part.issued += length;
        ++part.in_flight;
        ++in_flight_;
      }
      if (free_slots_.empty()) break;
    }
    if (batch_.empty()) return;
    int submitted = 0;
    const int rc = ctx_.submit(batch_.data(), static_cast<int>(batch_.size()), &submitted);
    if (rc < 0) {
      // The kernel refused these outright: fail their requests, free their slots.
      for (size_t i = static_cast<size_t>(submitted); i < batch_.size(); ++i) {
        const int index = static_cast<int>(batch_[i]->aio_data);
        Slot& slot = slots_[static_cast<size_t>(index)];
        slot.part->request->fail(-rc, slot.offset, "io_submit");
        release(index);
      }
    }
  }

  void reap() {
    const int n = ctx_.get_events(1, events_.data(), static_cast<int>(events_.size()));
    if (n < 0) throw std::runtime_error(std::string("io_getevents: ") + std::strerror(-n));
    for (int i = 0; i < n; ++i) {
      const int index = static_cast<int>(events_[static_cast<size_t>(i)].data);
      Slot& slot = slots_[static_cast<size_t>(index)];
      Request& request = *slot.part->request;
      const IoOp op = request.op();
      long long res = events_[static_cast<size_t>(i)].res;
      if (const int injected = faults_->take(op)) res = -injected;
      char* io_buf = slot.bounce && reinterpret_cast<uintptr_t>(slot.user) % kAlign != 0
                         ? slot.bounce.get()
                         : slot.user;
      if (res < 0) {
        request.fail(static_cast<int>(-res), slot.offset, "completion");
      } else {
        uint64_t done = static_cast<uint64_t>(res);
        if (done < slot.length) {
          // Short transfer: end of file on a read, or a full disk on a write.
          // Finish synchronously so the real cause (ENOSPC, EOF) is reported.
          const int fd = done % kAlign == 0 ? slot.part->file->direct_fd()
                                            : slot.part->file->buffered_fd();
          const int rc = fd < 0 ? -fd
                                : transfer_sync(fd, op, io_buf + done, slot.length - done,
                                                slot.offset + done);
          if (rc != 0) {
            request.fail(rc, slot.offset + done, io_op_name(op), rc == -1);
          } else {
            done = slot.length;
          }
        }
        if (done == slot.length && op == IoOp::kRead && io_buf != slot.user) {
          std::memcpy(slot.user, io_buf, slot.length);
        }
      }
      --slot.part->in_flight;
      release(index);
    }
  }

  void run_fragment(Part& part, char* user, uint64_t length, uint64_t offset) {
    Request& request = *part.request;
    int rc = part.file->buffered_fd();
    if (rc >= 0) rc = transfer_sync(rc, request.op(), user, length, offset);
    else rc = -rc;
    if (rc == 0) {
      if (const int injected = faults_->take(request.op())) rc = injected;
    }
    if (rc != 0) request.fail(rc, offset, io_op_name(request.op()), rc == -1);
  }

  void release(int index) {
    slots_[static_cast<size_t>(index)].part = nullptr;
    free_slots_.push_back(index);
    --in_flight_;
  }

  void retire_finished_parts() {
    for (auto it = active_.begin(); it != active_.end();) {
      Part& part = **it;
      if (part.request->failed() && part.in_flight == 0) part.issued = part.nbytes;
      if (part.issued == part.nbytes && part.in_flight == 0) {
        std::shared_ptr<Request> request = std::move(part.request);
        part.file.reset();
        it = active_.erase(it);
        request->part_done();
      } else {
        ++it;
      }
    }
  }

  const size_t block_size_;
  AioContext ctx_;
  FaultPlan* faults_;
  std::vector<Slot> slots_;
  std::vector<int> free_slots_;
  std::vector<io_event> events_;
  std::vector<iocb*> batch_;
  int in_flight_ = 0;
  std::deque<std::unique_ptr<Part>> active_;  // worker thread only

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Part>> incoming_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after every member above exists
};

// --------------------------------------------------------------- AioEngine

AioEngine::AioEngine(size_t block_size, int queue_depth, int intra_op_parallelism)
    : block_size_(block_size), queue_depth_(queue_depth) {
  if (block_size == 0 || block_size % kAlign != 0) {
    throw std::invalid_argument("block_size must be a positive multiple of 4096, got " +
                                std::to_string(block_size));
  }
  if (queue_depth < 1) throw std::invalid_argument("queue_depth must be >= 1");
  if (intra_op_parallelism < 1) throw std::invalid_argument("intra_op_parallelism must be >= 1");
  for (int i = 0; i < intra_op_parallelism; ++i) {
    workers_.push_back(std::make_unique<Worker>(block_size, queue_depth, &faults_));
  }
}

AioEngine::~AioEngine() = default;  // each ~Worker drains its queue, then joins

void AioEngine::inject_fault(IoOp op, int err, int after_units) {
  std::lock_guard<std::mutex> lock(faults_.mutex);
  faults_.op = op;
  faults_.err = err;
  faults_.countdown = after_units;
  faults_.armed = true;
}

void AioEngine::clear_faults() {
  std::lock_guard<std::mutex> lock(faults_.mutex);
  faults_.armed = false;
  faults_.refuse_direct = false;
}

std::shared_ptr<Request> AioEngine::submit(IoOp op, const std::string& path, char* buffer,
                                           uint64_t nbytes, uint64_t offset) {
  auto request = std::make_shared<Request>(op, path, offset, nbytes);
  std::shared_ptr<OpenFile> file;
  try {
    file = std::make_shared<OpenFile>(path, op, faults_.refuse_direct.load());
  } catch (const IoFailure& failure) {
    request->fail(failure.err, offset, failure.stage);
    return request;  // parts_pending_ == 0: already done
  }
  if (nbytes == 0) return request;  // a write of nothing still created the file

  // Split into at most one part per worker, at aligned file offsets (so only
  // the first part can have a head fragment and only the last a tail), and
  // never into pieces smaller than a block.
  const uint64_t blocks = (nbytes + block_size_ - 1) / block_size_;
  const uint64_t parts = std::min<uint64_t>(workers_.size(), blocks);
  const uint64_t per_part = (blocks + parts - 1) / parts * block_size_;
  std::vector<std::unique_ptr<Part>> pieces;
  uint64_t start = offset;
  const uint64_t end = offset + nbytes;
  for (uint64_t i = 0; i < parts && start < end; ++i) {
    uint64_t stop = i + 1 == parts ? end : std::min(end, round_up(offset + (i + 1) * per_part, kAlign));
    auto part = std::make_unique<Part>();
    part->request = request;
    part->file = file;
    part->buffer = buffer + (start - offset);
    part->offset = start;
    part->nbytes = stop - start;
    pieces.push_back(std::move(part));
    start = stop;
  }
  {
    std::lock_guard<std::mutex> lock(request->mutex_);
    request->parts_pending_ = static_cast<int>(pieces.size());
    request->file_ = file;
  }
  const unsigned first = next_worker_.fetch_add(1);
  for (size_t i = 0; i < pieces.size(); ++i) {
    workers_[(first + i) % workers_.size()]->enqueue(std::move(pieces[i]));
  }
  return request;
}

}  // namespace aio
}  // namespace offload

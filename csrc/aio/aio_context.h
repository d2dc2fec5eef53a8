// Linux native AIO through raw system calls.
//
// Why syscall() and not libaio: the kernel ABI in <linux/aio_abi.h> ships with
// every kernel-headers package, while libaio's headers and library are an
// extra install that DeepSpeed users kept tripping over (missing or too old).
// With this file the extension builds with a C++ compiler alone.
#pragma once

#include <linux/aio_abi.h>

#include <cstddef>
#include <vector>

namespace offload {
namespace aio {

// One kernel AIO context, destroyed with its owner (RAII). Not thread-safe:
// each worker thread owns one.
class AioContext {
 public:
  // Throws std::system_error (with errno) if the kernel refuses, e.g. EAGAIN
  // when /proc/sys/fs/aio-max-nr is exhausted.
  explicit AioContext(unsigned max_events);
  ~AioContext();
  AioContext(const AioContext&) = delete;
  AioContext& operator=(const AioContext&) = delete;

  // Submits all of `iocbs`, retrying on EAGAIN/EINTR and partial submission.
  // Returns 0, or -errno from the first control block the kernel rejected
  // outright (those after it are not submitted; the count submitted is in
  // *submitted).
  int submit(iocb** iocbs, int count, int* submitted);

  // Waits for at least `min_events` completions (retrying EINTR); returns how
  // many were written to `events`, or -errno.
  int get_events(int min_events, io_event* events, int max_events);

 private:
  aio_context_t ctx_ = 0;
};

}  // namespace aio
}  // namespace offload

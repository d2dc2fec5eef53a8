#include "aio_context.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace offload {
namespace aio {

AioContext::AioContext(unsigned max_events) {
  if (syscall(SYS_io_setup, max_events, &ctx_) != 0) {
    throw std::system_error(errno, std::generic_category(), "io_setup");
  }
}

AioContext::~AioContext() {
  // io_destroy waits for in-flight requests; owners drain before destroying.
  syscall(SYS_io_destroy, ctx_);
}

int AioContext::submit(iocb** iocbs, int count, int* submitted) {
  *submitted = 0;
  while (*submitted < count) {
    const long n = syscall(SYS_io_submit, ctx_, count - *submitted, iocbs + *submitted);
    if (n > 0) {
      *submitted += static_cast<int>(n);
      continue;
    }
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    // n == 0 cannot happen for count > 0; a negative return names the first
    // iocb the kernel refused (bad fd, misaligned O_DIRECT buffer, ...).
    return n < 0 ? -errno : -EIO;
  }
  return 0;
}

int AioContext::get_events(int min_events, io_event* events, int max_events) {
  for (;;) {
    const long n = syscall(SYS_io_getevents, ctx_, min_events, max_events, events, nullptr);
    if (n >= 0) return static_cast<int>(n);
    if (errno != EINTR) return -errno;
  }
}

}  // namespace aio
}  // namespace offload

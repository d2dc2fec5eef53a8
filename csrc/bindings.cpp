// The one extension module, offload._C. Each native feature binds itself into
// its own submodule; this file only lists them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/cpu_features.h"
#include "common/thread_pool.h"

namespace py = pybind11;

namespace offload {
void bind_adam(py::module_& m);
void bind_aio(py::module_& m);
}  // namespace offload

PYBIND11_MODULE(_C, m) {
  m.doc() = "offload native kernels";
  m.def("detected_simd_level",
        [] { return std::string(offload::simd_level_name(offload::detected_simd_level())); },
        "Highest SIMD level this CPU and OS support: scalar, avx2 or avx512.");
  m.def("bind_kernel_threads", [](const std::vector<int>& cores) { offload::ThreadPool::instance().set_cores(cores); },
        py::arg("cores"),
        "Binds the kernels' worker threads, now and later, to these cores (Linux); [] unbinds.");
  m.def("kernel_thread_cores", [] { return offload::ThreadPool::instance().worker_cores(); },
        "Each kernel worker thread's cores, as the kernel reports them.");
  auto adam = m.def_submodule("adam", "Fused CPU Adam");
  offload::bind_adam(adam);
  auto aio = m.def_submodule("aio", "Native async file I/O (Linux AIO, O_DIRECT) and CRC-32C");
  offload::bind_aio(aio);
}

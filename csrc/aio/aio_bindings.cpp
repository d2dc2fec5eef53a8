// Python binding of the native async I/O engine and the CRC-32C kernel.
// Thin: addresses and sizes in, a Request out. Python (offload/aio/native.py)
// checks tensors and turns a failed Request into an exception naming the path
// and the operation. Waiting and checksumming release the GIL.
#include <pybind11/pybind11.h>

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "aio_engine.h"
#include "crc32c.h"

namespace py = pybind11;

namespace offload {
namespace {

aio::IoOp parse_op(const std::string& name) {
  if (name == "pread") return aio::IoOp::kRead;
  if (name == "pwrite") return aio::IoOp::kWrite;
  throw std::invalid_argument("unknown operation '" + name + "' (expected pread or pwrite)");
}

std::shared_ptr<aio::Request> submit(aio::AioEngine& engine, aio::IoOp op, uintptr_t address,
                                     uint64_t nbytes, const std::string& path, uint64_t offset) {
  py::gil_scoped_release release;  // open() can block on a slow disk
  return engine.submit(op, path, reinterpret_cast<char*>(address), nbytes, offset);
}

}  // namespace

void bind_aio(py::module_& m) {
  py::class_<aio::Request, std::shared_ptr<aio::Request>>(m, "Request")
      .def("done", &aio::Request::done)
      .def("wait", &aio::Request::wait, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("op", [](const aio::Request& r) { return aio::io_op_name(r.op()); })
      .def_property_readonly("path", &aio::Request::path)
      .def_property_readonly("offset", &aio::Request::offset)
      .def_property_readonly("nbytes", &aio::Request::nbytes)
      .def_property_readonly("error", &aio::Request::error)
      .def_property_readonly("truncated", &aio::Request::truncated)
      .def_property_readonly("error_offset", &aio::Request::error_offset)
      .def_property_readonly("error_stage", &aio::Request::error_stage);

  py::class_<aio::AioEngine>(m, "Engine")
      .def(py::init<size_t, int, int>(), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("intra_op_parallelism"))
      .def(
          "pwrite",
          [](aio::AioEngine& e, uintptr_t address, uint64_t nbytes, const std::string& path,
             uint64_t offset) { return submit(e, aio::IoOp::kWrite, address, nbytes, path, offset); },
          py::arg("address"), py::arg("nbytes"), py::arg("path"), py::arg("offset"),
          "Queue a write of [address, address + nbytes) to path at offset.")
      .def(
          "pread",
          [](aio::AioEngine& e, uintptr_t address, uint64_t nbytes, const std::string& path,
             uint64_t offset) { return submit(e, aio::IoOp::kRead, address, nbytes, path, offset); },
          py::arg("address"), py::arg("nbytes"), py::arg("path"), py::arg("offset"),
          "Queue a read of nbytes from path at offset into address.")
      .def_property_readonly("block_size", &aio::AioEngine::block_size)
      .def_property_readonly("queue_depth", &aio::AioEngine::queue_depth)
      .def_property_readonly("intra_op_parallelism", &aio::AioEngine::intra_op_parallelism)
      .def(
          "_inject_fault",
          [](aio::AioEngine& e, const std::string& op, int err, int after_units) {
            e.inject_fault(parse_op(op), err, after_units);
          },
          py::arg("op"), py::arg("errno"), py::arg("after_units") = 0,
          "Test hook: the Nth next block of op completes with -errno.")
      .def("_refuse_direct", &aio::AioEngine::set_refuse_direct,
           "Test hook: opening with O_DIRECT fails with EINVAL, as on a filesystem without it.")
      .def("_clear_faults", &aio::AioEngine::clear_faults);

  // Checksums take an address so that a tensor is hashed without a copy.
  m.def(
      "crc32c",
      [](uintptr_t address, size_t nbytes, uint32_t crc) {
        py::gil_scoped_release release;
        return aio::crc32c(crc, reinterpret_cast<const void*>(address), nbytes);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0);
  m.def(
      "crc32c_reference",
      [](uintptr_t address, size_t nbytes, uint32_t crc) {
        py::gil_scoped_release release;
        return aio::crc32c_reference(crc, reinterpret_cast<const void*>(address), nbytes);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0);
  m.def("crc32c_impl", [] { return std::string(aio::crc32c_impl_name()); });
}

}  // namespace offload

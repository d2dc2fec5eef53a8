// Python binding of the fused Adam kernel. Deliberately thin: it takes raw
// addresses and sizes (the Python side has already checked dtypes, devices,
// sizes and contiguity, see offload/ops/adam.py), so the extension never links
// against libtorch and builds with a C++ compiler and pybind11 alone.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adam_kernels.h"

namespace py = pybind11;

namespace offload {
namespace {

SimdLevel parse_level(const std::string& name) {
  if (name == "scalar") return SimdLevel::kScalar;
  if (name == "avx2") return SimdLevel::kAvx2;
  if (name == "avx512") return SimdLevel::kAvx512;
  throw std::invalid_argument("unknown SIMD level '" + name + "' (expected scalar, avx2 or avx512)");
}

ElementType parse_type(const std::string& name) {
  if (name == "float32") return ElementType::kFloat32;
  if (name == "bfloat16") return ElementType::kBFloat16;
  if (name == "float16") return ElementType::kFloat16;
  throw std::invalid_argument("unsupported element type '" + name + "'");
}

void update(uintptr_t master, uintptr_t grad, const std::string& grad_type, uintptr_t exp_avg,
            uintptr_t exp_avg_sq, uintptr_t out, const std::string& out_type, size_t n,
            double neg_step_size, double bias2_sqrt, double beta1, double beta2,
            double one_minus_beta1, double one_minus_beta2, double eps, double decay,
            bool adamw_mode, bool has_weight_decay, const std::string& simd_level,
            int num_threads) {
  // Scalars arrive as Python's doubles and are rounded to fp32 here, once,
  // as ATen rounds a Python scalar for a fp32 op (Note [bitwise torch order]).
  const auto f = [](double x) { return static_cast<float>(x); };
  const AdamParams params{f(beta1),         f(beta2),      f(one_minus_beta1),
                          f(one_minus_beta2), f(eps),      f(neg_step_size),
                          f(bias2_sqrt),    f(decay),      adamw_mode,
                          has_weight_decay};
  const ElementType out_t = out ? parse_type(out_type) : ElementType::kBFloat16;
  if (out && out_t == ElementType::kFloat32) {
    throw std::invalid_argument("out must be bfloat16 or float16, got float32");
  }
  const AdamBuffers buffers{reinterpret_cast<float*>(master), reinterpret_cast<const void*>(grad),
                            parse_type(grad_type), reinterpret_cast<float*>(exp_avg),
                            reinterpret_cast<float*>(exp_avg_sq), reinterpret_cast<void*>(out),
                            out_t};
  const SimdLevel level = parse_level(simd_level);
  adam_kernel_for(level);  // throws, with the GIL held, if the CPU lacks the level
  py::gil_scoped_release release;
  adam_update(params, buffers, n, level, num_threads);
}

}  // namespace

void bind_adam(py::module_& m) {
  m.def("update", &update, py::arg("master"), py::arg("grad"), py::arg("grad_type"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"), py::arg("out_type"),
        py::arg("n"), py::arg("neg_step_size"), py::arg("bias2_sqrt"), py::arg("beta1"),
        py::arg("beta2"), py::arg("one_minus_beta1"), py::arg("one_minus_beta2"), py::arg("eps"),
        py::arg("decay"), py::arg("adamw_mode"),
        py::arg("has_weight_decay"), py::arg("simd_level"), py::arg("num_threads"),
        "Fused Adam/AdamW update over raw fp32 buffers (see adam_kernels.h).");
}

}  // namespace offload

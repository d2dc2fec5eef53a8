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

SqrtSource parse_sqrt(const std::string& name) {
  if (name == "ieee") return SqrtSource::kIeee;
  if (name == "mkl-avx512") return SqrtSource::kMklAvx512;
  if (name == "mkl-vml") return SqrtSource::kMklVml;
  if (name == "mkl-avx2") return SqrtSource::kMklAvx2;
  if (name == "mkl-sse") return SqrtSource::kMklSse;
  throw std::invalid_argument("unknown square root '" + name +
                              "' (expected ieee, mkl-avx512, mkl-avx2, mkl-sse or mkl-vml)");
}

AdamPass parse_pass(const std::string& name) {
  if (name == "fused") return AdamPass::kFused;
  if (name == "moments") return AdamPass::kMoments;
  if (name == "apply") return AdamPass::kApply;
  throw std::invalid_argument("unknown Adam pass '" + name + "' (expected fused, moments or apply)");
}

ElementType parse_type(const std::string& name) {
  if (name == "float32") return ElementType::kFloat32;
  if (name == "bfloat16") return ElementType::kBFloat16;
  if (name == "float16") return ElementType::kFloat16;
  throw std::invalid_argument("unsupported element type '" + name + "'");
}

double update(uintptr_t master, uintptr_t grad, const std::string& grad_type, uintptr_t exp_avg,
            uintptr_t exp_avg_sq, uintptr_t out, const std::string& out_type, size_t n,
            double neg_step_size, double bias2_sqrt, double beta1, double beta2,
            double one_minus_beta1, double one_minus_beta2, double eps, double decay,
            bool adamw_mode, bool has_weight_decay, const std::string& simd_level,
            int num_threads, const std::string& pass_name, const std::string& sqrt_name,
            uintptr_t root, bool grad_sq) {
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
  const AdamPass pass = parse_pass(pass_name);
  if (pass == AdamPass::kApply && root == 0 && n != 0) {
    throw std::invalid_argument("the apply pass needs root, the square roots torch computed");
  }
  // kMoments writes neither p nor its copy.
  const AdamBuffers buffers{reinterpret_cast<float*>(master), reinterpret_cast<const void*>(grad),
                            parse_type(grad_type), reinterpret_cast<float*>(exp_avg),
                            reinterpret_cast<float*>(exp_avg_sq),
                            pass == AdamPass::kMoments ? nullptr : reinterpret_cast<void*>(out),
                            out_t, reinterpret_cast<const float*>(root)};
  const SimdLevel level = parse_level(simd_level);
  const SqrtSource sqrt = parse_sqrt(sqrt_name);
  adam_kernel_for(level, pass, sqrt);  // throws, with the GIL held, if the CPU lacks the level
  double sum = 0.0;
  {
    py::gil_scoped_release release;
    adam_update(params, buffers, n, level, pass, sqrt, num_threads, grad_sq ? &sum : nullptr);
  }
  return sum;
}

// The kernel's own square root over a fp32 buffer (what the probe compares
// with torch.sqrt, Note [bitwise torch order]).
void sqrt_into(uintptr_t in, uintptr_t out, size_t n, const std::string& sqrt_name,
               const std::string& simd_level) {
  const SimdLevel level = parse_level(simd_level);
  const SqrtSource sqrt = parse_sqrt(sqrt_name);
  py::gil_scoped_release release;
  adam_sqrt(reinterpret_cast<const float*>(in), reinterpret_cast<float*>(out), n, level, sqrt);
}

}  // namespace

void bind_adam(py::module_& m) {
  m.def("update", &update, py::arg("master"), py::arg("grad"), py::arg("grad_type"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"), py::arg("out_type"),
        py::arg("n"), py::arg("neg_step_size"), py::arg("bias2_sqrt"), py::arg("beta1"),
        py::arg("beta2"), py::arg("one_minus_beta1"), py::arg("one_minus_beta2"), py::arg("eps"),
        py::arg("decay"), py::arg("adamw_mode"),
        py::arg("has_weight_decay"), py::arg("simd_level"), py::arg("num_threads"),
        py::arg("adam_pass"), py::arg("sqrt_source"), py::arg("root"), py::arg("grad_sq") = false,
        "Adam/AdamW update over raw fp32 buffers, whole (adam_pass='fused') or one half of "
        "the update split around torch's sqrt (see adam_kernels.h). Returns, with grad_sq, the "
        "sum of the gradient's squares (0.0 without, or for the apply pass).");
  m.def("bind_vml_sqrt", &bind_vml_sqrt, py::arg("library"),
        "Finds MKL's vsSqrt in `library` (already loaded by this process) for the mkl-vml "
        "square root; False if it is not there.");
  m.def("sqrt", &sqrt_into, py::arg("input"), py::arg("out"), py::arg("n"),
        py::arg("sqrt_source"), py::arg("simd_level"),
        "out[i] = the kernel's square root of input[i], as the fused update computes it.");
}

}  // namespace offload

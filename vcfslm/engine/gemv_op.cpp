// vcfslm::gemv(Tensor x, Tensor address, int out_features, Tensor? bias, int layout) -> Tensor:
// the GEMV as an op of PyTorch's dispatcher, so a compiled step reaches the kernel without
// Python (vcfslm.engine.gemv_op builds this file and says why that matters).
//
// No kernel lives here: vcfslm.engine.gemv and vcfslm.engine.dense_gemv load and check the
// kernel libraries, and hand their vcfslm_gemv_bf16 to this one (vcfslm_gemv_op_use), one per
// weight layout: 0, oneDNN's packed buffer (the AVX512-BF16 loop); 1, a plain row-major bf16
// matrix (the AVX2 loop). A benchmark that swaps a kernel library swaps what every compiled
// graph runs, without recompiling. `address` is a one-element int64 tensor holding the
// weight's address: an opaque oneDNN tensor has no storage to pass, and neither its memory
// nor a plain weight's ever moves. A tensor, not an int: an int
// would be a constant of every compiled graph, different in every process, so no graph could
// come from Inductor's cache; a tensor is an input like any other.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace {

using Kernel = int (*)(const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t, int, int64_t);

constexpr int kLayouts = 2;
std::atomic<Kernel> kernels[kLayouts] = {};
// 0: run; 1: run and add the kernel's own time to `kernel_ns`; 2: skip the kernel (an
// uninitialised output of the right shape). A benchmark's instruments: the time inside the
// kernel without a Python timer around it, and a step's cost without the weight stream.
std::atomic<int> mode{0};
std::atomic<int64_t> kernel_ns{0};

at::Tensor gemv(const at::Tensor& x, const at::Tensor& address, int64_t out_features,
                const std::optional<at::Tensor>& bias, int64_t layout) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "vcfslm::gemv takes a 2-D bf16 CPU input, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(address.numel() == 1 && address.scalar_type() == at::kLong && address.device().is_cpu(),
              "vcfslm::gemv takes the weight's address as a one-element int64 CPU tensor, got ", address.sizes(),
              " ", address.scalar_type());
  const int64_t weight = *address.data_ptr<int64_t>();
  TORCH_CHECK(layout >= 0 && layout < kLayouts, "vcfslm::gemv has no weight layout ", layout);
  const Kernel fn = kernels[layout].load();
  TORCH_CHECK(fn != nullptr, "vcfslm::gemv has no kernel for layout ", layout,
              ": vcfslm.engine.gemv_op did not attach one");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({xc.size(0), out_features}, xc.options());
  const int how = mode.load(std::memory_order_relaxed);
  if (how != 2) {
    const auto started = std::chrono::steady_clock::now();
    const int rc = fn(reinterpret_cast<const uint16_t*>(weight), reinterpret_cast<const uint16_t*>(xc.data_ptr()),
                      reinterpret_cast<uint16_t*>(y.data_ptr()), xc.size(0), out_features, xc.size(1),
                      at::get_num_threads(), 0);
    if (how == 1) {
      kernel_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - started).count();
    }
    TORCH_CHECK(rc == 0, "vcfslm GEMV refused rows=", xc.size(0), " n=", out_features, " k=", xc.size(1));
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace

extern "C" {

// The ABI this file implements; the loader refuses a library that answers otherwise.
int vcfslm_gemv_op_abi(void) { return 3; }

// -1 for a layout this file does not know.
int vcfslm_gemv_op_use(int layout, void* fn) {
  if (layout < 0 || layout >= kLayouts) return -1;
  kernels[layout].store(reinterpret_cast<Kernel>(fn));
  return 0;
}

void vcfslm_gemv_op_mode(int how) { mode.store(how); }

// The kernel time summed since the last call (mode 1 only), and zero again.
int64_t vcfslm_gemv_op_take_ns(void) { return kernel_ns.exchange(0); }

}  // extern "C"

TORCH_LIBRARY_FRAGMENT(vcfslm, m) {
  m.def("gemv(Tensor x, Tensor address, int out_features, Tensor? bias, int layout) -> Tensor");
}

TORCH_LIBRARY_IMPL(vcfslm, CPU, m) { m.impl("gemv", TORCH_FN(gemv)); }

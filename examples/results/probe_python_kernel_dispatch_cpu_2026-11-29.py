# CPU only (this project's 2-core machine, torch 2.13 CPU), 2026-11-29, a tenth session: the dispatcher's cost of
# an op whose kernel is a Python function against the same op with a C++ kernel (TORCH_LIBRARY_IMPL
# registered over it). Both kernels return an alias of x; 7 arguments as the twell ops take.
import time, torch
from torch.utils.cpp_extension import load_inline
lib = torch.library.Library("probe", "DEF")
lib.define("mlp(Tensor x, Tensor w1, Tensor w2, Tensor w3, Tensor? b1=None, Tensor? b2=None, Tensor? b3=None) -> Tensor")
def py_impl(x, w1, w2, w3, b1=None, b2=None, b3=None):
    return torch.ops.aten.alias(x)
lib.impl("mlp", py_impl, "CPU")
x = torch.randn(8, 16); w = torch.randn(16, 16)
op = torch.ops.probe.mlp.default
def bench(name):
    for _ in range(1000): op(x, w, w, w)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(50000): op(x, w, w, w)
        best = min(best, (time.perf_counter() - t) / 50000 * 1e6)
    print(f"{name}: {best:.2f} us/call")
with torch.inference_mode():
    bench("python CPU kernel")
src = r'''
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor mlp_cpp(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3,
                   const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& b2, const c10::optional<at::Tensor>& b3) {
  return x.alias();
}
TORCH_LIBRARY_IMPL(probe, CPU, m) { m.impl("mlp", &mlp_cpp); }
'''
t = time.time()
load_inline("probe_ext", cpp_sources=src, functions=None, verbose=False, is_python_module=False)
print(f"built in {time.time()-t:.0f}s")
with torch.inference_mode():
    bench("after C++ registration")

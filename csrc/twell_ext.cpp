// Python binding of the CUDA kernels. These are internal building blocks called from the
// implementation of the torch.ops.twell.* custom ops (twell_compile/kernels/twell_mlp.py), which owns
// the schemas, fake kernels and autograd; they are not ops of their own.

#include <torch/extension.h>

namespace twell {
void sparse_mlp_out(const c10::optional<at::Tensor>& x, const at::Tensor& packed, const at::Tensor& counts, const at::Tensor& dense, const at::Tensor& block_nnz,
                    const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                    const at::Tensor& w_down_t, const c10::optional<at::Tensor>& b_down, at::Tensor& out,
                    int64_t tile_n, int64_t splits, int64_t threads, int64_t thr_full, int64_t thr_last,
                    int64_t thr_heavy);
}  // namespace twell

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_mlp_out", &twell::sparse_mlp_out,
        "Fills the sparse-block rows of out from a TwELL-packed activation (see csrc/twell_sparse_mlp.cu)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("counts"),
        pybind11::arg("dense"), pybind11::arg("block_nnz"), pybind11::arg("w_up"), pybind11::arg("b_up"),
        pybind11::arg("w_down_t"), pybind11::arg("b_down"), pybind11::arg("out"), pybind11::arg("tile_n"),
        pybind11::arg("splits"), pybind11::arg("threads"), pybind11::arg("thr_full"),
        pybind11::arg("thr_last"), pybind11::arg("thr_heavy"));
}

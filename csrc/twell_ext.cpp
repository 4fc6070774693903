// Python binding of the CUDA kernels. These are internal building blocks called from the
// implementation of the torch.ops.twell.* custom ops (twell_compile/kernels/twell_mlp.py), which owns
// the schemas, fake kernels and autograd; they are not ops of their own.

#include <torch/extension.h>

namespace twell {
void sparse_mlp_out(const c10::optional<at::Tensor>& x, const at::Tensor& packed, const at::Tensor& counts, const at::Tensor& dense, const at::Tensor& block_nnz,
                    const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                    const at::Tensor& w_down_t, const c10::optional<at::Tensor>& b_down, at::Tensor& out,
                    int64_t tile_n, int64_t splits, int64_t threads, int64_t thr_full, int64_t thr_last,
                    int64_t thr_heavy, int64_t cluster);
void gate_twell_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                     at::Tensor& packed, at::Tensor& counts, at::Tensor& dense, at::Tensor& block_nnz, int64_t ctas,
                     int64_t cluster, int64_t tile_m);
void decode_gate_twell(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       at::Tensor& packed, at::Tensor& counts, at::Tensor& dense, at::Tensor& block_nnz,
                       int64_t cluster);
void decode_dense_gemv(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias, at::Tensor& c,
                       const at::Tensor& block_nnz, const c10::optional<at::Tensor>& gate_packed,
                       const c10::optional<at::Tensor>& gate_counts, int64_t thr_full, int64_t thr_last,
                       int64_t thr_heavy, int64_t cluster);
void dense_block_gemm(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias, at::Tensor& c,
                      const at::Tensor& block_nnz, const c10::optional<at::Tensor>& gate_packed,
                      const c10::optional<at::Tensor>& gate_counts, int64_t thr_full, int64_t thr_last,
                      int64_t thr_heavy, int64_t ctas, int64_t cluster, int64_t tile_m);
void rebuild_dense_gate(const at::Tensor& packed, const at::Tensor& counts, at::Tensor& dense,
                        const at::Tensor& block_nnz, int64_t thr_full, int64_t thr_last, int64_t thr_heavy);
}  // namespace twell

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_mlp_out", &twell::sparse_mlp_out,
        "Fills the sparse-block rows of out from a TwELL-packed activation (see csrc/twell_sparse_mlp.cu)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("counts"),
        pybind11::arg("dense"), pybind11::arg("block_nnz"), pybind11::arg("w_up"), pybind11::arg("b_up"),
        pybind11::arg("w_down_t"), pybind11::arg("b_down"), pybind11::arg("out"), pybind11::arg("tile_n"),
        pybind11::arg("splits"), pybind11::arg("threads"), pybind11::arg("thr_full"),
        pybind11::arg("thr_last"), pybind11::arg("thr_heavy"), pybind11::arg("cluster") = 1);
  m.def("gate_twell_gemm", &twell::gate_twell_gemm,
        "Gate GEMM relu(x W^T + b) written in the TwELL layout (see csrc/twell_gemm.cu)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("packed"),
        pybind11::arg("counts"), pybind11::arg("dense"), pybind11::arg("block_nnz"), pybind11::arg("ctas"),
        pybind11::arg("cluster") = 2, pybind11::arg("tile_m") = 128);
  m.def("decode_gate_twell", &twell::decode_gate_twell,
        "Gate GEMV relu(x W^T + b) of at most 64 rows in the TwELL layout (see csrc/twell_decode_gemv.cu)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("packed"),
        pybind11::arg("counts"), pybind11::arg("dense"), pybind11::arg("block_nnz"), pybind11::arg("cluster") = 0);
  m.def("decode_dense_gemv", &twell::decode_dense_gemv,
        "Dense-path GEMV of at most 64 rows, run only if their block is dense: c = a b^T + bias, or "
        "c = relu(gate) * (a b^T + bias) with the gate in the TwELL format (csrc/twell_decode_gemv.cu)",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("bias"), pybind11::arg("c"), pybind11::arg("block_nnz"),
        pybind11::arg("gate_packed"), pybind11::arg("gate_counts"), pybind11::arg("thr_full"), pybind11::arg("thr_last"),
        pybind11::arg("thr_heavy"), pybind11::arg("cluster") = 0);
  m.def("dense_block_gemm", &twell::dense_block_gemm,
        "Dense-path GEMM over the rows of dense blocks: c = a b^T + bias, or c = relu(gate) * (a b^T + bias) "
        "with the gate in the TwELL format (csrc/twell_gemm.cu)",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("bias"), pybind11::arg("c"), pybind11::arg("block_nnz"),
        pybind11::arg("gate_packed"), pybind11::arg("gate_counts"), pybind11::arg("thr_full"), pybind11::arg("thr_last"),
        pybind11::arg("thr_heavy"), pybind11::arg("ctas"), pybind11::arg("cluster") = 2,
        pybind11::arg("tile_m") = 128);
  m.def("rebuild_dense_gate", &twell::rebuild_dense_gate,
        "relu(gate) of the dense blocks' rows into dense, from the TwELL format (csrc/twell_gate_rebuild.cu)",
        pybind11::arg("packed"), pybind11::arg("counts"), pybind11::arg("dense"), pybind11::arg("block_nnz"),
        pybind11::arg("thr_full"), pybind11::arg("thr_last"), pybind11::arg("thr_heavy"));
}

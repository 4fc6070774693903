// Python binding of the CUDA kernels. These are internal building blocks called from the
// implementation of the torch.ops.twell.* custom ops (twell_compile/kernels/twell_mlp.py), which owns
// the schemas, fake kernels and autograd; they are not ops of their own.

#include <torch/extension.h>

#include <pybind11/stl.h>

#include "twell_entries.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_mlp_out", &twell::sparse_mlp_out,
        "Fills the sparse-block rows of out from a TwELL-packed activation (see csrc/twell_sparse_mlp.cu)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("counts"),
        pybind11::arg("dense"), pybind11::arg("block_nnz"), pybind11::arg("w_up"), pybind11::arg("b_up"),
        pybind11::arg("w_down_t"), pybind11::arg("b_down"), pybind11::arg("out"), pybind11::arg("tile_n"),
        pybind11::arg("splits"), pybind11::arg("threads"), pybind11::arg("thr_full"),
        pybind11::arg("thr_last"), pybind11::arg("thr_heavy"), pybind11::arg("cluster") = 1,
        pybind11::arg("gate_parts") = pybind11::none());
  m.def("sparse_entry_cluster", &twell::sparse_entry_cluster,
        "The cluster size an entry-split launch of M rows takes on the current device (16-byte rows)",
        pybind11::arg("M"), pybind11::arg("n_tiles"), pybind11::arg("D"), pybind11::arg("requested"),
        pybind11::arg("gated"), pybind11::arg("float16"));
  m.def("chunked_sparse_mlp_out", &twell::chunked_sparse_mlp_out,
        "Decides each 128-row block's path and fills the sparse blocks' rows of out with at most 256 active units, "
        "the weights streamed through shared memory in slices; lists the heavier rows for heavy_rows_mlp_out (see "
        "csrc/twell_sparse_chunked.cu)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("counts"), pybind11::arg("dense"),
        pybind11::arg("w_up_sliced"), pybind11::arg("b_up"), pybind11::arg("w_down_sliced"), pybind11::arg("b_down"),
        pybind11::arg("out"), pybind11::arg("decided"), pybind11::arg("heavy_rows"), pybind11::arg("counters"),
        pybind11::arg("tile_n"), pybind11::arg("thr_full"), pybind11::arg("thr_last"), pybind11::arg("thr_heavy"),
        pybind11::arg("ctas"));
  m.def("chunked_heavy_capacity", &twell::chunked_heavy_capacity,
        "Most heavy rows the chunked kernel lists for an M-row call", pybind11::arg("M"), pybind11::arg("thr_heavy"));
  m.def("heavy_rows_mlp_out", &twell::heavy_rows_mlp_out,
        "The listed heavy rows of out as a compact dense MLP (see csrc/twell_heavy_rows.cu)", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("counts"), pybind11::arg("dense"), pybind11::arg("heavy_rows"),
        pybind11::arg("heavy_count"), pybind11::arg("w_up"), pybind11::arg("b_up"), pybind11::arg("w_down"),
        pybind11::arg("b_down"), pybind11::arg("out"), pybind11::arg("ctas"), pybind11::arg("cluster") = 2,
        pybind11::arg("tile_m") = 128, pybind11::arg("down_tile_m") = 256, pybind11::arg("k_splits") = 0);
  m.def("sparse_mlp_fits", &twell::sparse_mlp_fits,
        "Whether the row-by-row sparse kernel's shared memory fits the current device for n_tiles tiles and D "
        "output columns", pybind11::arg("n_tiles"), pybind11::arg("D"));
  m.def("chunked_sparse_fits", &twell::chunked_sparse_fits,
        "Whether a shape fits the chunked sparse kernel on the current device", pybind11::arg("K"), pybind11::arg("F"),
        pybind11::arg("D"), pybind11::arg("element_size"), pybind11::arg("gated"));
  m.def("gate_twell_gemm", &twell::gate_twell_gemm,
        "Gate GEMM relu(x W^T + b) written in the TwELL layout (see csrc/twell_gemm.cu)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("packed"),
        pybind11::arg("counts"), pybind11::arg("dense"), pybind11::arg("block_nnz"), pybind11::arg("ctas"),
        pybind11::arg("cluster") = 2, pybind11::arg("tile_m") = 128, pybind11::arg("k_splits") = 0,
        pybind11::arg("split_arrivals") = pybind11::none());
  m.def("decode_gate_twell", &twell::decode_gate_twell,
        "Gate GEMV relu(x W^T + b) of at most 64 rows in the TwELL layout (see csrc/twell_decode_gemv.cu)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("packed"),
        pybind11::arg("counts"), pybind11::arg("dense"), pybind11::arg("block_nnz"), pybind11::arg("cluster") = 0,
        pybind11::arg("gate_parts") = pybind11::none());
  m.def("decode_dense_gemv", &twell::decode_dense_gemv,
        "Dense-path GEMV of at most 64 rows, run only if their block is dense: c = a b^T + bias, or "
        "c = relu(gate) * (a b^T + bias) with the gate in the TwELL format (csrc/twell_decode_gemv.cu)",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("bias"), pybind11::arg("c"), pybind11::arg("block_nnz"),
        pybind11::arg("gate_packed"), pybind11::arg("gate_counts"), pybind11::arg("thr_full"), pybind11::arg("thr_last"),
        pybind11::arg("thr_heavy"), pybind11::arg("cluster") = 0, pybind11::arg("gate_parts") = pybind11::none());
  m.def("dense_block_gemm", &twell::dense_block_gemm,
        "Dense-path GEMM over the rows of dense blocks: c = a b^T + bias, or c = relu(gate) * (a b^T + bias) "
        "with the gate in the TwELL format (csrc/twell_gemm.cu)",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("bias"), pybind11::arg("c"), pybind11::arg("block_nnz"),
        pybind11::arg("gate_packed"), pybind11::arg("gate_counts"), pybind11::arg("thr_full"), pybind11::arg("thr_last"),
        pybind11::arg("thr_heavy"), pybind11::arg("ctas"), pybind11::arg("cluster") = 2,
        pybind11::arg("tile_m") = 128, pybind11::arg("k_splits") = 0, pybind11::arg("split_arrivals") = pybind11::none());
  m.def("rebuild_dense_gate", &twell::rebuild_dense_gate,
        "relu(gate) of the dense blocks' rows into dense, from the TwELL format (csrc/twell_gate_rebuild.cu)",
        pybind11::arg("packed"), pybind11::arg("counts"), pybind11::arg("dense"), pybind11::arg("block_nnz"),
        pybind11::arg("thr_full"), pybind11::arg("thr_last"), pybind11::arg("thr_heavy"),
        pybind11::arg("gate_parts") = pybind11::none());
  m.def("cublas_mlp", &twell::cublas_mlp,
        "The MLP densely through PyTorch's GEMMs (cuBLAS) and one relu-times-up pass: (out, act), act the gate's "
        "pre-activation (gated) or relu(up) (non-gated) (csrc/twell_cublas_mlp.cu)",
        pybind11::arg("x"), pybind11::arg("w_act"), pybind11::arg("b_act"), pybind11::arg("w_up"),
        pybind11::arg("b_up"), pybind11::arg("w_down"), pybind11::arg("b_down"));
  pybind11::class_<twell::MlpPlan>(m, "MlpPlan", "Shape-derived launch choices of one twell MLP call (csrc/twell_entries.h)")
      .def(pybind11::init<>())
      .def_readwrite("cap", &twell::MlpPlan::cap)
      .def_readwrite("tile_n", &twell::MlpPlan::tile_n)
      .def_readwrite("decode_gate", &twell::MlpPlan::decode_gate)
      .def_readwrite("decode_dense", &twell::MlpPlan::decode_dense)
      .def_readwrite("gemv_cluster", &twell::MlpPlan::gemv_cluster)
      .def_readwrite("ctas", &twell::MlpPlan::ctas)
      .def_readwrite("gemm_cluster", &twell::MlpPlan::gemm_cluster)
      .def_readwrite("gate_gemm_tile_m", &twell::MlpPlan::gate_gemm_tile_m)
      .def_readwrite("gate_gemm_cluster", &twell::MlpPlan::gate_gemm_cluster)
      .def_readwrite("gemm_tile_m", &twell::MlpPlan::gemm_tile_m)
      .def_readwrite("down_gemm_tile_m", &twell::MlpPlan::down_gemm_tile_m)
      .def_readwrite("gemm_k_splits", &twell::MlpPlan::gemm_k_splits)
      .def_readwrite("sparse_splits", &twell::MlpPlan::sparse_splits)
      .def_readwrite("sparse_threads", &twell::MlpPlan::sparse_threads)
      .def_readwrite("sparse_cluster", &twell::MlpPlan::sparse_cluster)
      .def_readwrite("chunked", &twell::MlpPlan::chunked)
      .def_readwrite("thr_full", &twell::MlpPlan::thr_full)
      .def_readwrite("thr_last", &twell::MlpPlan::thr_last)
      .def_readwrite("thr_heavy", &twell::MlpPlan::thr_heavy)
      .def_readwrite("poison", &twell::MlpPlan::poison)
      .def_readwrite("poison_word", &twell::MlpPlan::poison_word)
      .def_readwrite("poison_count", &twell::MlpPlan::poison_count)
      .def_readwrite("programmatic", &twell::MlpPlan::programmatic)
      .def_readwrite("dense_path_branch", &twell::MlpPlan::dense_path_branch)
      .def_readwrite("gate_parts", &twell::MlpPlan::gate_parts);
  m.def("mlp_forward", &twell::mlp_forward,
        "The whole CUDA path of one twell MLP call in one host call (csrc/twell_mlp_forward.cpp): "
        "(out, counts, block_nnz), or None when an operand lacks contiguous 16-byte aligned rows",
        pybind11::arg("plan"), pybind11::arg("x"), pybind11::arg("w_act"), pybind11::arg("b_act"),
        pybind11::arg("w_up"), pybind11::arg("b_up"), pybind11::arg("w_down"), pybind11::arg("w_down_t"),
        pybind11::arg("b_down"), pybind11::arg("w_up_sliced") = pybind11::none(),
        pybind11::arg("w_down_sliced") = pybind11::none());
  m.def("grant_lease", &twell::grant_lease,
        "Lets the layer of w_act serve its next `calls` calls of this shape in C++ (csrc/twell_fast_call.cpp): "
        "the TwELL path with `plan` and w_down_t, or the cuBLAS route where plan is None, its served calls counted "
        "under `tag`; whether it was granted",
        pybind11::arg("x"), pybind11::arg("w_act"), pybind11::arg("b_act"), pybind11::arg("w_up"),
        pybind11::arg("b_up"), pybind11::arg("w_down"), pybind11::arg("b_down"), pybind11::arg("plan"),
        pybind11::arg("w_down_t"), pybind11::arg("calls"), pybind11::arg("tag") = -1);
  m.def("end_lease", &twell::end_lease,
        "Ends the lease of w_act's layer: (tag, calls it served); (-1, 0) without one", pybind11::arg("w_act"));
  m.def("revoke_lease", &twell::revoke_lease, "Drops the lease of w_act's layer", pybind11::arg("w_act"));
  m.def("revoke_all_leases", &twell::revoke_all_leases, "Drops every lease");
  m.def("lease_calls_left", &twell::lease_calls_left, "Calls the lease of w_act's layer may still serve (-1: none)",
        pybind11::arg("w_act"));
  m.def("fast_mlp", &twell::fast_mlp,
        "A twell MLP call served from its layer's lease: the output, or None where the lease does not cover it",
        pybind11::arg("x"), pybind11::arg("w_act"), pybind11::arg("b_act"), pybind11::arg("w_up"),
        pybind11::arg("b_up"), pybind11::arg("w_down"), pybind11::arg("b_down"));
}

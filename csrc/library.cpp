// The one registration of every pyg_quant op schema.  Backends add their
// kernels with TORCH_LIBRARY_IMPL in csrc/<op>.cpp; fake (meta) kernels live in
// pyg_quant/ops/__init__.py so that torch.compile traces through.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(pyg_quant, m) {
  m.def("quantize_pack(Tensor x, Tensor lo, Tensor inv_scale, int bits, bool col_layout, Tensor? noise) -> Tensor");
  m.def(
      "quantize_pack_ranges(Tensor x, int bits, int dim, bool col_layout, Tensor? noise, bool row_codes=False, "
      "Tensor? col_keys=None, bool code_sums=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fake_quantize(Tensor x, Tensor? lo, Tensor? hi, int bits, int dim, Tensor? noise, bool with_mask, "
      "bool random_noise=False, Generator? generator=None) -> (Tensor, Tensor)");
  m.def("mse_range(Tensor x, int dim, int bits, float[] grid) -> (Tensor, Tensor)");
  m.def("unpack_codes(Tensor planes, int rows, int cols, bool col_layout) -> Tensor");
  m.def("dequantize(Tensor planes, int rows, int cols, bool col_layout, Tensor lo, Tensor scale, int dim) -> Tensor");
  m.def("packed_code_sums(Tensor planes) -> Tensor");
  m.def("pack_row_codes(Tensor planes, int cols, bool col_layout) -> Tensor");
  m.def("planes_from_row_codes(Tensor row_codes, int rows, int cols, int bits) -> Tensor");
  m.def("bitmm_int(Tensor a_planes, Tensor b_planes, int rows, int cols, bool wide) -> Tensor");
  m.def(
      "bitmm_affine(Tensor product, Tensor row_sums, Tensor col_sums, Tensor a_lo, Tensor a_scale, Tensor b_lo, "
      "Tensor b_scale, int k, Tensor? bias, bool relu) -> Tensor");
  m.def(
      "bit_spmm_int(Tensor window_ptr, Tensor tile_col, Tensor tile_bits, Tensor res_ptr, Tensor res_col, "
      "Tensor? res_val, Tensor x_planes, int rows, int cols, bool wide, Tensor? x_codes=None) -> Tensor");
  m.def(
      "bit_spmm_affine(Tensor window_ptr, Tensor tile_col, Tensor tile_bits, Tensor res_ptr, Tensor res_col, "
      "Tensor? res_val, Tensor x_planes, Tensor lo, Tensor scale, Tensor row_sums, Tensor? self_weight, "
      "Tensor? row_scale, Tensor? bias, bool relu, int rows, int cols, bool wide, Tensor? x_codes=None) -> Tensor");
  m.def(
      "tile_plan(Tensor keys, Tensor sums, int num_rows, int num_cols, int min_tile_nnz, int planes) -> (Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "expand_tiles(Tensor tile_key, Tensor row_count, Tensor entry_col, Tensor? entry_val, Tensor res_row, "
      "Tensor? res_val, int num_rows, int num_cols, int planes) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "quant_mlp(Tensor x, Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, Tensor[] weight_sums, "
      "Tensor?[] bias, int[] act_bits, int[] weight_bits, bool[] relu, Tensor? row_scale=None) -> Tensor");
  m.def(
      "quant_mlp_keys(Tensor x, Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, "
      "Tensor[] weight_sums, Tensor?[] bias, int[] act_bits, int[] weight_bits, bool[] relu, "
      "Tensor? row_scale=None) -> (Tensor, Tensor)");
  m.def(
      "quant_mlp_planes(Tensor planes, int rows, int cols, bool col_layout, Tensor lo, Tensor scale, int dim, "
      "Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, Tensor[] weight_sums, Tensor?[] bias, "
      "int[] act_bits, int[] weight_bits, bool[] relu, Tensor? row_scale=None) -> Tensor");
  m.def(
      "quant_mlp_planes_keys(Tensor planes, int rows, int cols, bool col_layout, Tensor lo, Tensor scale, int dim, "
      "Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, Tensor[] weight_sums, Tensor?[] bias, "
      "int[] act_bits, int[] weight_bits, bool[] relu, Tensor? row_scale=None) -> (Tensor, Tensor)");
  m.def(
      "quant_mlp_row_codes(Tensor x, Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, "
      "Tensor[] weight_sums, Tensor?[] bias, int[] act_bits, int[] weight_bits, bool[] relu, Tensor? row_scale, "
      "Tensor out_lo, Tensor out_inv_scale, int out_bits) -> Tensor");
  m.def(
      "quant_mlp_planes_row_codes(Tensor planes, int rows, int cols, bool col_layout, Tensor lo, Tensor scale, "
      "int dim, Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, Tensor[] weight_sums, "
      "Tensor?[] bias, int[] act_bits, int[] weight_bits, bool[] relu, Tensor? row_scale, Tensor out_lo, "
      "Tensor out_inv_scale, int out_bits) -> Tensor");
  m.def(
      "expand_csr(Tensor tile_key, Tensor row_count, Tensor entry_col, Tensor? entry_val, Tensor res_row, "
      "Tensor res_col, Tensor? res_val, int num_rows, int num_cols) -> (Tensor, Tensor, Tensor, Tensor)");
}

// Importing pyg_quant._C loads this library, which runs the registrations above.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

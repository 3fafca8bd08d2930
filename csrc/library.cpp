// The one registration of every pyg_quant op schema and of its backends' kernels (one translation unit, so that
// <torch/library.h> is compiled once).  Fake (meta) kernels live in pyg_quant/ops/__init__.py so that
// torch.compile traces through.
#include <Python.h>
#include <torch/library.h>

#include "cpu/bitmm_cpu.h"
#include "cpu/csr_pair_cpu.h"
#include "cpu/degree_cpu.h"
#include "cpu/expand_cpu.h"
#include "cpu/fake_quantize_cpu.h"
#include "cpu/quant_mlp_cpu.h"
#include "cpu/quantize_cpu.h"
#include "cpu/spmm_cpu.h"
#include "cpu/tile_plan_cpu.h"
#include "autograd.h"
#include "conv_eval.h"
#include "csr_product.h"
#include "ema_range.h"
#include "expand_wire.h"
#include "mlp_weight_codes.h"
#include "qat_linear.h"
#include "quant_mlp_keys.h"
#ifdef WITH_CUDA
#include "cuda/bitmm_cuda.h"
#include "cuda/csr_pair_cuda.h"
#include "cuda/degree_cuda.h"
#include "cuda/expand_cuda.h"
#include "cuda/fake_quantize_cuda.h"
#include "cuda/mlp_weight_codes_cuda.h"
#include "cuda/quant_mlp_cuda.h"
#include "cuda/quantize_cuda.h"
#include "cuda/spmm_cuda.h"
#endif

TORCH_LIBRARY(pyg_quant, m) {
  m.def("quantize_pack(Tensor x, Tensor lo, Tensor inv_scale, int bits, bool col_layout, Tensor? noise) -> Tensor");
  m.def(
      "quantize_pack_ranges(Tensor x, int bits, int dim, bool col_layout, Tensor? noise, bool row_codes=False, "
      "Tensor? col_keys=None, bool code_sums=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fake_quantize(Tensor x, Tensor? lo, Tensor? hi, int bits, int dim, Tensor? noise, bool with_mask, "
      "bool random_noise=False, Generator? generator=None) -> (Tensor, Tensor)");
  m.def("mse_range(Tensor x, int dim, int bits, float[] grid) -> (Tensor, Tensor)");
  m.def("csr_product(Tensor y, Tensor adj, Tensor? adj_t=None) -> Tensor");
  m.def(
      "csr_pair(Tensor rows, Tensor cols, Tensor? values, Tensor? keep, Tensor? row_scale, Tensor? diag, "
      "int num_rows, int num_cols, ScalarType dtype, bool transpose=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("degree_inv_sqrt(Tensor dst, Tensor? keep, Tensor? count, Tensor? diag, int num_nodes) -> (Tensor, Tensor)");
  m.def(
      "ema_range(Tensor x, Tensor stored_lo, Tensor stored_hi, float momentum, int dim, float[] grid, int grid_bits) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "ema_fake_quantize(Tensor x, Tensor stored_lo, Tensor stored_hi, float momentum, int dim, float[] grid, "
      "int grid_bits, int bits, bool with_mask, bool random_noise=False, Generator? generator=None) -> (Tensor, "
      "Tensor, Tensor, Tensor)");
  m.def(
      "qat_linear(Tensor x, Tensor weight, Tensor? bias, int x_bits, bool x_random, Generator? x_generator, "
      "int weight_bits, bool weight_random, Generator? weight_generator) -> Tensor");
  m.def("pack_codes(Tensor codes, int bits, bool col_layout) -> Tensor");
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
      "quant_mlp_quantized(Tensor planes, int rows, int cols, bool col_layout, Tensor lo, Tensor scale, int dim, "
      "Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, Tensor[] weight_sums, Tensor?[] bias, "
      "int[] act_bits, int[] weight_bits, bool[] relu, Tensor? row_scale=None) -> Tensor");
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
      "gin_conv_eval(Tensor window_ptr, Tensor tile_col, Tensor tile_bits, Tensor res_ptr, Tensor res_col, "
      "Tensor? res_val, Tensor row_sums, bool wide, Tensor x_planes, Tensor? x_codes, Tensor lo, Tensor scale, "
      "Tensor self_weight, Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, Tensor[] weight_sums, "
      "Tensor?[] bias, int[] act_bits, int[] weight_bits, bool[] relu, int out_bits, int out_dim) -> Tensor[]");
  m.def(
      "gcn_conv_eval(Tensor window_ptr, Tensor tile_col, Tensor tile_bits, Tensor res_ptr, Tensor res_col, "
      "Tensor? res_val, Tensor row_sums, Tensor diag, Tensor deg_inv_sqrt, Tensor? bias, int act_bits, bool wide, "
      "Tensor x, Tensor? x_lo, Tensor? x_scale, int x_rows, Tensor[] weight_codes, Tensor[] weight_lo, "
      "Tensor[] weight_scale, Tensor[] weight_sums, Tensor?[] weight_bias, int[] mlp_act_bits, int[] weight_bits, "
      "bool[] relu, int out_bits, int out_dim) -> Tensor[]");
  m.def(
      "qat_gcn_conv_eval(Tensor window_ptr, Tensor tile_col, Tensor tile_bits, Tensor res_ptr, Tensor res_col, "
      "Tensor? res_val, Tensor row_sums, Tensor diag, Tensor deg_inv_sqrt, Tensor? bias, int agg_bits, bool wide, "
      "Tensor? agg_keys, Tensor x, Tensor? x_lo, Tensor? x_scale, int x_rows, int x_cols, bool x_col_layout, "
      "int x_dim, Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, Tensor[] weight_sums, "
      "Tensor?[] weight_bias, int[] act_bits, int[] weight_bits, bool[] relu) -> Tensor");
  m.def(
      "qat_gcn_conv_eval_quantized(Tensor window_ptr, Tensor tile_col, Tensor tile_bits, Tensor res_ptr, "
      "Tensor res_col, Tensor? res_val, Tensor row_sums, Tensor diag, Tensor deg_inv_sqrt, Tensor? bias, "
      "int agg_bits, bool wide, Tensor? agg_keys, Tensor x, Tensor? x_lo, Tensor? x_scale, int x_rows, int x_cols, "
      "bool x_col_layout, int x_dim, Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, "
      "Tensor[] weight_sums, Tensor?[] weight_bias, int[] act_bits, int[] weight_bits, bool[] relu) -> Tensor");
  m.def(
      "qat_gin_conv_eval(Tensor window_ptr, Tensor tile_col, Tensor tile_bits, Tensor res_ptr, Tensor res_col, "
      "Tensor? res_val, Tensor row_sums, Tensor? diag, bool wide, Tensor x, Tensor? x_lo, Tensor? x_scale, "
      "Tensor? x_codes, int x_cols, int x_dim, int agg_bits, Tensor? agg_keys, Tensor one_plus_eps, "
      "Tensor[] weight_codes, Tensor[] weight_lo, Tensor[] weight_scale, Tensor[] weight_sums, Tensor?[] bias, "
      "int[] act_bits, int[] weight_bits, bool[] relu) -> Tensor");
  m.def(
      "expand_csr(Tensor tile_key, Tensor row_count, Tensor entry_col, Tensor? entry_val, Tensor res_row, "
      "Tensor res_col, Tensor? res_val, int num_rows, int num_cols) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("expand_wire(Tensor buffer, int[] parts, int num_rows, int num_cols, int planes, bool tiles) -> Tensor[]");
  m.def("mlp_weight_codes(Tensor[] weights, int[] bits) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) {
  // quantize_pack, quantize_pack_ranges, unpack_codes, dequantize, packed_code_sums, pack_row_codes and
  // planes_from_row_codes
  m.impl("quantize_pack", &pyg_quant::quantize_pack_cpu);
  m.impl("unpack_codes", &pyg_quant::unpack_codes_cpu);
  m.impl("dequantize", &pyg_quant::dequantize_cpu);
  m.impl("packed_code_sums", &pyg_quant::packed_code_sums_cpu);
  m.impl("pack_row_codes", &pyg_quant::pack_row_codes_cpu);
  m.impl("planes_from_row_codes", &pyg_quant::planes_from_row_codes_cpu);
  m.impl("quantize_pack_ranges", &pyg_quant::quantize_pack_ranges_cpu);
  // fake_quantize, mse_range and ema_range (pyg_quant.qat's quantizers, range search and static range step)
  m.impl("fake_quantize", &pyg_quant::fake_quantize_cpu);
  m.impl("mse_range", &pyg_quant::mse_range_cpu);
  m.impl("ema_range", &pyg_quant::ema_range_cpu);
  // bitmm_int and bitmm_affine
  m.impl("bitmm_int", &pyg_quant::bitmm_int_cpu);
  m.impl("bitmm_affine", &pyg_quant::bitmm_affine_cpu);
  // bit_spmm_int and bit_spmm_affine
  m.impl("bit_spmm_int", &pyg_quant::bit_spmm_int_cpu);
  m.impl("bit_spmm_affine", &pyg_quant::bit_spmm_affine_cpu);
  // tile_plan and pack_codes (CPU only: loader-side ops; on other devices the torch reference runs)
  m.impl("tile_plan", &pyg_quant::tile_plan_cpu);
  m.impl("pack_codes", &pyg_quant::pack_codes_cpu);
  // csr_pair (a float aggregation's M and Mᵀ in CSR from an edge list), degree_inv_sqrt (GCN's degrees of one)
  m.impl("csr_pair", &pyg_quant::csr_pair_cpu);
  m.impl("degree_inv_sqrt", &pyg_quant::degree_inv_sqrt_cpu);
  // expand_tiles, expand_csr and expand_wire (CompactAdjacency, or its wire form, -> BitAdjacency tensors)
  m.impl("expand_tiles", &pyg_quant::expand_tiles_cpu);
  m.impl("expand_csr", &pyg_quant::expand_csr_cpu);
  m.impl("expand_wire", &pyg_quant::expand_wire<&pyg_quant::expand_tiles_cpu, &pyg_quant::expand_csr_cpu>);
  // quant_mlp (a chain of QuantLinear bit layers in one op)
  m.impl("quant_mlp", &pyg_quant::mlp<&pyg_quant::quant_mlp_cpu>);
  m.impl("quant_mlp_keys", &pyg_quant::mlp_keys<&pyg_quant::quant_mlp_cpu>);
  m.impl("quant_mlp_planes", &pyg_quant::mlp_planes<&pyg_quant::quant_mlp_planes_cpu>);
  m.impl("quant_mlp_planes_keys", &pyg_quant::mlp_planes_keys<&pyg_quant::quant_mlp_planes_cpu>);
  m.impl("mlp_weight_codes",
         &pyg_quant::mlp_weight_codes<&pyg_quant::quantize_pack_ranges_cpu, &pyg_quant::unpack_codes_cpu>);
  // quant_mlp_quantized and qat_gcn_conv_eval_quantized (CPU only: on other devices the torch reference runs)
  m.impl("quant_mlp_quantized", &pyg_quant::mlp_planes<&pyg_quant::quant_mlp_quantized_cpu>);
  m.impl("quant_mlp_row_codes", &pyg_quant::quant_mlp_row_codes_cpu);
  m.impl("quant_mlp_planes_row_codes", &pyg_quant::quant_mlp_planes_row_codes_cpu);
  // gin_conv_eval and gcn_conv_eval (a layer's eval forward on a BitAdjacency in one op)
  m.impl("gin_conv_eval", &pyg_quant::gin_conv_eval<&pyg_quant::bit_spmm_affine_cpu, &pyg_quant::quant_mlp_cpu,
                                                    &pyg_quant::quantize_pack_ranges_cpu>);
  m.impl("gcn_conv_eval",
         &pyg_quant::gcn_conv_eval<&pyg_quant::bit_spmm_affine_cpu, &pyg_quant::quant_mlp_cpu,
                                   &pyg_quant::quant_mlp_planes_cpu, &pyg_quant::quantize_pack_ranges_cpu>);
  // qat_gcn_conv_eval and qat_gin_conv_eval (a converted QAT layer's eval forward on a BitAdjacency in one op)
  m.impl("qat_gcn_conv_eval",
         &pyg_quant::qat_gcn_conv_eval<&pyg_quant::bit_spmm_affine_cpu, &pyg_quant::quant_mlp_cpu,
                                       &pyg_quant::quant_mlp_planes_cpu, &pyg_quant::quantize_pack_ranges_cpu,
                                       &pyg_quant::quantize_pack_stored_ranges_cpu>);
  m.impl("qat_gcn_conv_eval_quantized",
         &pyg_quant::qat_gcn_conv_eval<&pyg_quant::bit_spmm_affine_cpu, &pyg_quant::quant_mlp_cpu,
                                       &pyg_quant::quant_mlp_quantized_cpu, &pyg_quant::quantize_pack_ranges_cpu,
                                       &pyg_quant::quantize_pack_stored_ranges_cpu>);
  m.impl("qat_gin_conv_eval",
         &pyg_quant::qat_gin_conv_eval<&pyg_quant::bit_spmm_affine_cpu, &pyg_quant::quant_mlp_cpu,
                                       &pyg_quant::quantize_pack_ranges_cpu,
                                       &pyg_quant::quantize_pack_stored_ranges_cpu, &pyg_quant::dequantize_cpu>);
}

// The gradients of fake_quantize (the straight-through estimator), csr_product (Aᵀ·dY) and qat_linear (the
// straight-through linear's), for every backend.
TORCH_LIBRARY_IMPL(pyg_quant, Autograd, m) {
  m.impl("fake_quantize", &pyg_quant::fake_quantize_autograd);
  m.impl("csr_product", &pyg_quant::csr_product_autograd);
  m.impl("qat_linear", &pyg_quant::qat_linear_autograd);
}

// Forwards built from other ops, for every backend: a CSR product (ours for float32 on CUDA, else torch's) and
// qat_linear's two fake quantizations and linear.
TORCH_LIBRARY_IMPL(pyg_quant, CompositeExplicitAutograd, m) {
  m.impl("csr_product", &pyg_quant::csr_product);
  m.impl("qat_linear", &pyg_quant::qat_linear);
}

// Ops composed of other ops, whose gradients are their parts' (every backend, torch.compile included).
TORCH_LIBRARY_IMPL(pyg_quant, CompositeImplicitAutograd, m) {
  m.impl("ema_fake_quantize", &pyg_quant::ema_fake_quantize);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_quant, CUDA, m) {
  m.impl("quantize_pack", &pyg_quant::quantize_pack_cuda);
  m.impl("unpack_codes", &pyg_quant::unpack_codes_cuda);
  m.impl("dequantize", &pyg_quant::dequantize_cuda);
  m.impl("packed_code_sums", &pyg_quant::packed_code_sums_cuda);
  m.impl("pack_row_codes", &pyg_quant::pack_row_codes_cuda);
  m.impl("planes_from_row_codes", &pyg_quant::planes_from_row_codes_cuda);
  m.impl("quantize_pack_ranges", &pyg_quant::quantize_pack_ranges_cuda);
  m.impl("fake_quantize", &pyg_quant::fake_quantize_cuda);
  m.impl("mse_range", &pyg_quant::mse_range_cuda);
  m.impl("ema_range", &pyg_quant::ema_range_cuda);
  m.impl("bitmm_int", &pyg_quant::bitmm_int_cuda);
  m.impl("bitmm_affine", &pyg_quant::bitmm_affine_cuda);
  m.impl("bit_spmm_int", &pyg_quant::bit_spmm_int_cuda);
  m.impl("bit_spmm_affine", &pyg_quant::bit_spmm_affine_cuda);
  m.impl("expand_tiles", &pyg_quant::expand_tiles_cuda);
  m.impl("expand_csr", &pyg_quant::expand_csr_cuda);
  m.impl("expand_wire", &pyg_quant::expand_wire<&pyg_quant::expand_tiles_cuda, &pyg_quant::expand_csr_cuda>);
  m.impl("csr_pair", &pyg_quant::csr_pair_cuda);
  m.impl("degree_inv_sqrt", &pyg_quant::degree_inv_sqrt_cuda);
  m.impl("quant_mlp", &pyg_quant::mlp<&pyg_quant::quant_mlp_cuda>);
  m.impl("quant_mlp_keys", &pyg_quant::mlp_keys<&pyg_quant::quant_mlp_cuda>);
  m.impl("quant_mlp_planes", &pyg_quant::mlp_planes<&pyg_quant::quant_mlp_planes_cuda>);
  m.impl("quant_mlp_planes_keys", &pyg_quant::mlp_planes_keys<&pyg_quant::quant_mlp_planes_cuda>);
  m.impl("mlp_weight_codes", &pyg_quant::mlp_weight_codes_cuda);
  m.impl("quant_mlp_row_codes", &pyg_quant::quant_mlp_row_codes_cuda);
  m.impl("quant_mlp_planes_row_codes", &pyg_quant::quant_mlp_planes_row_codes_cuda);
  m.impl("gin_conv_eval", &pyg_quant::gin_conv_eval<&pyg_quant::bit_spmm_affine_cuda, &pyg_quant::quant_mlp_cuda,
                                                    &pyg_quant::quantize_pack_ranges_cuda>);
  m.impl("gcn_conv_eval",
         &pyg_quant::gcn_conv_eval<&pyg_quant::bit_spmm_affine_cuda, &pyg_quant::quant_mlp_cuda,
                                   &pyg_quant::quant_mlp_planes_cuda, &pyg_quant::quantize_pack_ranges_cuda>);
  m.impl("qat_gcn_conv_eval",
         &pyg_quant::qat_gcn_conv_eval<&pyg_quant::bit_spmm_affine_cuda, &pyg_quant::quant_mlp_cuda,
                                       &pyg_quant::quant_mlp_planes_cuda, &pyg_quant::quantize_pack_ranges_cuda,
                                       &pyg_quant::quantize_pack_stored_ranges_cuda>);
  m.impl("qat_gin_conv_eval",
         &pyg_quant::qat_gin_conv_eval<&pyg_quant::bit_spmm_affine_cuda, &pyg_quant::quant_mlp_cuda,
                                       &pyg_quant::quantize_pack_ranges_cuda,
                                       &pyg_quant::quantize_pack_stored_ranges_cuda, &pyg_quant::dequantize_cuda>);
}
#endif

// Importing pyg_quant._C loads this library, which runs the registrations above.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

#include <torch/extension.h>

#include "kernels.h"

// PIE_PRODUCTS_ONLY: the products alone, as kernels.variant builds them for another instruction set
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_pack", &skinny_pack, "a [N, K] weight in skinny_linear's column blocks");
  m.def("skinny_linear", &skinny_linear, "x @ W.T + b for few rows of x, from skinny_pack's blocks");
  m.def("skinny_block", &skinny_block, "the output columns of one of skinny_linear's blocks");
  m.def("block_linear", &block_linear, "x @ W.T + b over a weight in its file's blocks, packed by blocks.py");
  m.def("block_dense", &block_dense, "a packed block weight widened to float32 [N, K]");
  m.def("block_gather", &block_gather, "rows of a packed block weight widened to float32 (an embedding)");
  m.def("q8_block", &q8_block, "the output columns of one of q8_linear's blocks");
#ifndef PIE_PRODUCTS_ONLY
  m.def("paged_attention", &paged_attention, "paged attention of short query windows (CPU, float32)");
  m.def("residual_norm", &residual_norm, "(x + delta, RMSNorm(x + delta) * weight), row by row");
  m.def("rope_store", &rope_store, "RoPE on q and k; k and v written to the pool's slots; returns q [T, heads, D]");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up from [gate | up]");
  m.def("layer_stack", &layer_stack, "the Llama layer stack over packed products, for short windows");
#endif
}

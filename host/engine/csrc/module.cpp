#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention of short query windows (CPU, float32)");
  m.def("layer_stack", &layer_stack, "the Llama layer stack over packed products, for short windows");
}

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale);
torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("small_m_linear", &small_m_linear, "x W^T + b for 1 <= M <= 8 (CPU)");
}

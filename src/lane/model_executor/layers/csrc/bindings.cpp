#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale);
torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
void rms_norm_(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);
void sinkhorn_(torch::Tensor comb, int64_t iters, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("small_m_linear", &small_m_linear, "x W^T + b for 1 <= M <= 8 (CPU)");
  m.def("rms_norm_", &rms_norm_, "in-place (residual add +) RMSNorm (CPU)");
  m.def("rotary_", &rotary_, "in-place rotate-half rope (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU)");
  m.def("sinkhorn_", &sinkhorn_, "in-place Sinkhorn normalisation of [T, n, n] float32 (CPU)");
}

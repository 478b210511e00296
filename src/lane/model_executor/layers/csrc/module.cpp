// The Python module over the kernels: each function takes the kernel's arguments as
// Python ints (pointers, sizes, dtype codes) and floats, with METH_FASTCALL, so a call
// costs a fraction of a microsecond (ctypes: about two). Only Python.h: compiles fast.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <tuple>

extern "C" {
void lane_paged_decode_attention(const void*, const void*, const void*, int, const int64_t*,
                                 const int32_t*, void*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                 int64_t, float, int);
void lane_paged_prefill_attention(const void*, const void*, const void*, int, const int64_t*, int64_t, void*,
                                  int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
void lane_cache_write(const void*, const void*, int64_t, int64_t, void*, void*, const int64_t*, int, int64_t, int64_t,
                      int64_t, int64_t);
void lane_paged_decode_attention_q8(const void*, const void*, const void*, const float*, const float*, const float*,
                                    int, int, const int64_t*, const int32_t*, void*, int64_t, int64_t, int64_t,
                                    int64_t, int64_t, int64_t, float, int);
void lane_cache_write_q8(const void*, const void*, int64_t, int64_t, void*, void*, float*, float*, const int64_t*, int,
                         int, int64_t, int64_t, int64_t, int64_t);
void lane_llama_decode_layers(const int64_t*, const int64_t*, void*, void*, int, const int64_t*, const int64_t*,
                              const int64_t*, const int32_t*, int64_t, int64_t, const int64_t*, int64_t, int64_t,
                              float, float, double*, int);
void lane_small_m_linear(const void*, int, const void*, int, const void*, void*, int64_t, int64_t,
                         int64_t, int);
void lane_rms_norm_(void*, void*, const void*, int, int64_t, int64_t, float, int);
void lane_rotary_(void*, int, int64_t, int64_t, int64_t, int64_t, const int64_t*, const float*,
                  const float*, int64_t, int);
void lane_silu_and_mul(const void*, void*, int, int64_t, int64_t, int);
void lane_argmax_rows(const void*, int, int64_t*, int64_t, int64_t, int);
void lane_sinkhorn_(float*, int64_t, int64_t, int64_t, float, int);
void lane_dequant_ggml(const void*, int, int64_t, void*, int, int);
void lane_quantize_rows_q8(const void*, int, int8_t*, float*, float*, int64_t, int64_t);
void lane_quant_block_dots(const int8_t*, const void*, int, int32_t*, int64_t, int64_t, int64_t);
void lane_quant_linear(const void*, int, const void*, int, const float*, void*, int, int64_t, int64_t, int64_t, int);
void lane_repack_x8(const uint8_t*, int, uint8_t*, int64_t, int64_t);
void lane_x8_supports(int, int32_t*);
void lane_x8_amx(int, int64_t, int64_t*);
void lane_x8_silu_mul(const void*, const uint8_t*, int, const float*, void*, int64_t, int64_t, int64_t, int, int64_t*);
void lane_bf16_amx(int, int64_t*);
void lane_x8_bf16_amx(int, int64_t*);
void lane_attention_amx(int, int64_t*);
void lane_attention_dpbf16(int, int64_t*);
void lane_quant_x8_block_dots(const int8_t*, const uint8_t*, int, int32_t*, int64_t, int64_t, int64_t);
void lane_quant_x8_linear(const void*, int, const uint8_t*, int, const float*, void*, int, int64_t, int64_t, int64_t,
                          int);
void lane_quant_x8_linear_int8(const void*, int, const uint8_t*, int, const float*, void*, int, int64_t, int64_t, int64_t,
                          int);
void lane_dequant_ggml_x8(const void*, int, int64_t, int64_t, void*, int, int);
void lane_dequant_x8_rows(const void*, int, const int64_t*, int64_t, int64_t, void*, int);
void lane_quantize_per_token_int8(const void*, int, int8_t*, float*, int64_t, int64_t, int);
void lane_int8_scale(const int32_t*, const float*, const float*, const float*, void*, int, int64_t, int64_t, int);
void lane_int8_w8a8(const int8_t*, const float*, const int8_t*, const float*, const int32_t*, const float*,
                    int32_t*, void*, int, int64_t, int64_t, int64_t, int);
void lane_int8_w8a16(const void*, int, const int8_t*, const float*, const float*, void*, int64_t, int64_t,
                     int64_t, int);
void lane_int8_dequant(const int8_t*, const float*, void*, int, int64_t, int64_t, int64_t, int);
void lane_bind_threads(const int32_t*, int, int32_t*);
void lane_dequant_kquant(const void*, int, int64_t, void*, int, int);
void lane_quantize_rows_q8k(const void*, int, int8_t*, float*, int16_t*, int64_t, int64_t);
void lane_kquant_sub_dots(const int8_t*, const void*, int, int32_t*, int64_t, int64_t, int64_t);
void lane_kquant_linear(const void*, int, const void*, int, const float*, void*, int, int64_t, int64_t, int64_t, int);
void lane_shm_attach(void*, int, int64_t);
void lane_shm_layout(int, int64_t, int64_t*);
void lane_shm_barrier(void*, int, int, int64_t, double, int32_t*);
void lane_shm_all_reduce(void*, int, int, int64_t, int64_t, const void*, void*, int64_t, int, int64_t, double, int32_t*);
void lane_shm_reduce_scatter(void*, int, int, int64_t, int64_t, const void*, int64_t, int64_t, int64_t, void*, int,
                             int64_t, double, int32_t*);
void lane_shm_all_gather(void*, int, int, int64_t, int64_t, const void*, int64_t, void*, int64_t, double, int32_t*);
void lane_shm_all_to_all(void*, int, int, int64_t, int64_t, const void*, int64_t, const int64_t*, const int64_t*, void*,
                         double, int32_t*);
}

namespace {

template <typename T>
void get(PyObject* o, T*& v) {  // a pointer: an int (Tensor.data_ptr()), or None for null
  v = static_cast<T*>(o == Py_None ? nullptr : PyLong_AsVoidPtr(o));
}
void get(PyObject* o, int64_t& v) { v = PyLong_AsLongLong(o); }
void get(PyObject* o, int& v) { v = static_cast<int>(PyLong_AsLong(o)); }
void get(PyObject* o, float& v) { v = static_cast<float>(PyFloat_AsDouble(o)); }
void get(PyObject* o, double& v) { v = PyFloat_AsDouble(o); }

// Parse every argument by the kernel's own parameter types, then run it without the GIL.
template <typename... A>
PyObject* invoke(void (*fn)(A...), PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != static_cast<Py_ssize_t>(sizeof...(A))) {
    PyErr_Format(PyExc_TypeError, "expected %d arguments, got %zd", static_cast<int>(sizeof...(A)), nargs);
    return nullptr;
  }
  std::tuple<A...> values;
  Py_ssize_t i = 0;
  std::apply([&](auto&... v) { (get(args[i++], v), ...); }, values);
  if (PyErr_Occurred()) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  std::apply(fn, values);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

template <auto Fn>
PyObject* wrap(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return invoke(Fn, args, nargs);
}

#define LANE_DEF(name) {#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(wrap<name>)), METH_FASTCALL, nullptr}
PyMethodDef methods[] = {
    LANE_DEF(lane_paged_decode_attention), LANE_DEF(lane_paged_prefill_attention), LANE_DEF(lane_cache_write), LANE_DEF(lane_paged_decode_attention_q8), LANE_DEF(lane_cache_write_q8),
    LANE_DEF(lane_llama_decode_layers), LANE_DEF(lane_small_m_linear), LANE_DEF(lane_rms_norm_),
    LANE_DEF(lane_rotary_), LANE_DEF(lane_silu_and_mul), LANE_DEF(lane_argmax_rows), LANE_DEF(lane_sinkhorn_),
    LANE_DEF(lane_dequant_ggml), LANE_DEF(lane_quantize_rows_q8), LANE_DEF(lane_quant_block_dots),
    LANE_DEF(lane_quant_linear), LANE_DEF(lane_quantize_per_token_int8), LANE_DEF(lane_int8_scale),
    LANE_DEF(lane_int8_w8a8), LANE_DEF(lane_int8_w8a16), LANE_DEF(lane_int8_dequant), LANE_DEF(lane_bind_threads),
    LANE_DEF(lane_dequant_kquant), LANE_DEF(lane_quantize_rows_q8k),
    LANE_DEF(lane_kquant_sub_dots), LANE_DEF(lane_kquant_linear), LANE_DEF(lane_repack_x8), LANE_DEF(lane_x8_supports), LANE_DEF(lane_x8_amx), LANE_DEF(lane_bf16_amx), LANE_DEF(lane_x8_bf16_amx), LANE_DEF(lane_x8_silu_mul), LANE_DEF(lane_attention_amx), LANE_DEF(lane_attention_dpbf16),
    LANE_DEF(lane_quant_x8_block_dots), LANE_DEF(lane_quant_x8_linear), LANE_DEF(lane_quant_x8_linear_int8), LANE_DEF(lane_dequant_ggml_x8), LANE_DEF(lane_dequant_x8_rows),
    LANE_DEF(lane_shm_attach), LANE_DEF(lane_shm_layout), LANE_DEF(lane_shm_barrier), LANE_DEF(lane_shm_all_reduce),
    LANE_DEF(lane_shm_reduce_scatter), LANE_DEF(lane_shm_all_gather), LANE_DEF(lane_shm_all_to_all),
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "lane_kernels", "lane's CPU kernels", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_lane_kernels() { return PyModule_Create(&module); }

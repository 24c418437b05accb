// gguf_blocks.cpp — the CPython module of kiln's GGUF block kernels (kiln_gguf_blocks_ext).
//
// The kernels are in gguf_blocks.h (fp32 activations) and gguf_qdot.h (8-bit activations,
// integer dot products), shared with the decode step; this file parses the arguments
// (plain integers: data pointers and sizes, checked by gguf_blocks.py) and runs them
// without the GIL. Built with plain g++ like woq.cpp (no torch headers), loaded and
// cached by gguf_blocks.py. A build for another ISA than the machine's widest (AVX2 on an
// AVX-512 CPU) is its own module, KILN_GGUF_EXT (-D): CPython keeps one single-phase module
// per name, so two builds under one name would overwrite each other's functions.
#include <Python.h>

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "gguf_q8.h"
#include "gguf_qdot.h"
#include "kiln_py.h"

#ifndef KILN_GGUF_EXT
#define KILN_GGUF_EXT kiln_gguf_blocks_ext
#endif
#define KILN_GGUF_CAT2(a, b) a##b
#define KILN_GGUF_CAT(a, b) KILN_GGUF_CAT2(a, b)
#define KILN_GGUF_STR2(a) #a
#define KILN_GGUF_STR(a) KILN_GGUF_STR2(a)

namespace {

using kpy::read_ints;

// Refuses a type the kernels do not decode (the wrapper checks first; this keeps a direct
// call from reading garbage).
bool known_type(int64_t type) {
  int64_t elems, bytes;
  if (kgguf::block_shape(static_cast<int>(type), elems, bytes)) return true;
  PyErr_Format(PyExc_ValueError, "ggml type %lld has no kiln block kernel",
               static_cast<long long>(type));
  return false;
}

// mm(type, x, M, K, N, w, y): y (M, N) = x (M, K) @ dequant(w).T
PyObject* py_mm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[7];
  if (!read_ints(args, nargs, 7, v, "mm") || !known_type(v[0])) return nullptr;
  const kgguf::Args a{reinterpret_cast<const float*>(v[1]), v[2], v[3], v[4],
                      reinterpret_cast<const uint8_t*>(v[5]), static_cast<int>(v[0]), nullptr,
                      reinterpret_cast<float*>(v[6])};
  Py_BEGIN_ALLOW_THREADS
  kgguf::drive(a);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// qmm(type, x, M, K, N, w, y): the same product with x quantized to 8-bit blocks (gguf_q8.h)
PyObject* py_qmm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[7];
  if (!read_ints(args, nargs, 7, v, "qmm") || !known_type(v[0])) return nullptr;
  return kpy::run_released([&] {
    kgguf::QBuffer buffer;
    const kgguf::QActs x = buffer.quantize(reinterpret_cast<const float*>(v[1]), v[2], v[3]);
    kgguf::qd::drive(kgguf::qd::Args{x, v[2], v[3], v[4], reinterpret_cast<const uint8_t*>(v[5]),
                                     static_cast<int>(v[0]), reinterpret_cast<float*>(v[6])});
  });
}

// quantize(x, M, K, q, d): x (M, K) -> int8 q (M, K) and float scales d (M, K / 32), the
// activation blocks qmm multiplies with (for the tests' reference).
PyObject* py_quantize(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[5];
  if (!read_ints(args, nargs, 5, v, "quantize")) return nullptr;
  return kpy::run_released([&] {
    kgguf::QBuffer buffer;
    const kgguf::QActs x = buffer.quantize(reinterpret_cast<const float*>(v[0]), v[1], v[2]);
    std::memcpy(reinterpret_cast<int8_t*>(v[3]), x.q, static_cast<size_t>(v[1] * v[2]));
    std::memcpy(reinterpret_cast<float*>(v[4]), x.d, sizeof(float) * v[1] * x.nb);
  });
}

// dequantize(type, w, rows, K, out): out (rows, K) float32 = the rows' values
PyObject* py_dequantize(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[5];
  if (!read_ints(args, nargs, 5, v, "dequantize") || !known_type(v[0])) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  kgguf::dequantize(static_cast<int>(v[0]), reinterpret_cast<const uint8_t*>(v[1]), v[2], v[3],
                    reinterpret_cast<float*>(v[4]));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_lanes(PyObject*, PyObject*) { return PyLong_FromLong(kgguf::W); }
PyObject* py_dot_isa(PyObject*, PyObject*) { return PyUnicode_FromString(kgguf::kDotIsa); }

PyMethodDef kMethods[] = {
    {"mm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_mm)), METH_FASTCALL,
     "mm(type, x, M, K, N, w, y): y = x @ dequant(w).T (pointers)"},
    {"qmm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_qmm)), METH_FASTCALL,
     "qmm(type, x, M, K, N, w, y): y = q8(x) @ dequant(w).T (pointers)"},
    {"quantize", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_quantize)),
     METH_FASTCALL, "quantize(x, M, K, q, d): x's 8-bit blocks (pointers)"},
    {"dequantize", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_dequantize)),
     METH_FASTCALL, "dequantize(type, w, rows, K, out): out = dequant(w) (pointers)"},
    {"lanes", py_lanes, METH_NOARGS, "float lanes per vector (16: AVX-512, 8: AVX2)"},
    {"dot_isa", py_dot_isa, METH_NOARGS, "the integer dot product: avx512_vnni, avx_vnni, avx2"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, KILN_GGUF_STR(KILN_GGUF_EXT),
                       "kiln GGUF block kernels", -1, kMethods, nullptr, nullptr, nullptr,
                       nullptr};

}  // namespace

PyMODINIT_FUNC KILN_GGUF_CAT(PyInit_, KILN_GGUF_EXT)() { return PyModule_Create(&kModule); }

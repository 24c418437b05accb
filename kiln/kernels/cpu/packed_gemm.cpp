// packed_gemm.cpp — the CPython module of kiln's prefill GEMMs on packed weights
// (kiln_packed_gemm_ext). The kernels are in packed_gemm.h; this file parses the arguments
// (plain integers: data pointers and sizes, checked by packed_gemm.py) and runs them without
// the GIL. gguf_qgemm.h adds the GGUF GEMM with 8-bit activations. Built with plain g++ like woq.cpp; a build for another ISA than the machine's
// widest (AVX2 on an AVX-512 CPU) is its own module, KILN_PG_EXT (-D), as gguf_blocks.cpp.
#include <Python.h>

#include <cstdint>
#include <new>

#include "gguf_qgemm.h"
#include "kiln_py.h"
#include "packed_gemm.h"

#ifndef KILN_PG_EXT
#define KILN_PG_EXT kiln_packed_gemm_ext
#endif
#define KILN_PG_CAT2(a, b) a##b
#define KILN_PG_CAT(a, b) KILN_PG_CAT2(a, b)
#define KILN_PG_STR2(a) #a
#define KILN_PG_STR(a) KILN_PG_STR2(a)

namespace {

using kpy::read_ints;
using kpy::run_released;

const float* fptr(int64_t v) { return reinterpret_cast<const float*>(v); }
float* out_ptr(int64_t v) { return reinterpret_cast<float*>(v); }

// int4(x, M, K, N, g, w, y, block_rows): w woq.h's INT4 panels
PyObject* py_int4(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[8];
  if (!read_ints(args, nargs, 8, v, "int4")) return nullptr;
  const kpg::Int4Panels dec{reinterpret_cast<const uint8_t*>(v[5]), v[2], v[3], v[4]};
  return run_released([&] { kpg::drive(dec, fptr(v[0]), v[1], v[2], v[3], out_ptr(v[6]), v[7]); });
}

// int8(x, M, K, N, w, scale, y, block_rows): w woq.h's INT8 panels, scale (panels * W,)
PyObject* py_int8(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[8];
  if (!read_ints(args, nargs, 8, v, "int8")) return nullptr;
  const kpg::Int8Panels dec{reinterpret_cast<const int8_t*>(v[4]), fptr(v[5]), v[2], v[3]};
  return run_released([&] { kpg::drive(dec, fptr(v[0]), v[1], v[2], v[3], out_ptr(v[6]), v[7]); });
}

// The GGUF entry points' arguments (type, x, M, K, N, w, y, block_rows), the type checked,
// then gemm(type, w, x, M, K, N, y, block_rows) without the GIL.
template <class Gemm>
PyObject* gguf_call(PyObject* const* args, Py_ssize_t nargs, const char* name, Gemm gemm) {
  int64_t v[8];
  if (!read_ints(args, nargs, 8, v, name)) return nullptr;
  int64_t elems, bytes;
  if (!kgguf::block_shape(static_cast<int>(v[0]), elems, bytes)) {
    PyErr_Format(PyExc_ValueError, "ggml type %lld has no kiln block kernel",
                 static_cast<long long>(v[0]));
    return nullptr;
  }
  return run_released([&] {
    gemm(static_cast<int>(v[0]), reinterpret_cast<const uint8_t*>(v[5]), fptr(v[1]), v[2], v[3],
         v[4], out_ptr(v[6]), v[7]);
  });
}

// gguf(type, x, M, K, N, w, y, block_rows): w a GGUF tensor's blocks (N, row bytes)
PyObject* py_gguf(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return gguf_call(args, nargs, "gguf", kpg::gguf);
}

// gguf_q8(type, x, M, K, N, w, y, block_rows): the same with x quantized to 8-bit blocks
// (gguf_qgemm.h)
PyObject* py_gguf_q8(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return gguf_call(args, nargs, "gguf_q8", kpg::q8::gguf);
}

// block_shape(type): (elements, bytes) per block of the ggml type, or None
PyObject* py_block_shape(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[1];
  if (!read_ints(args, nargs, 1, v, "block_shape")) return nullptr;
  int64_t elems, bytes;
  if (!kgguf::block_shape(static_cast<int>(v[0]), elems, bytes)) Py_RETURN_NONE;
  return Py_BuildValue("(LL)", static_cast<long long>(elems), static_cast<long long>(bytes));
}

PyObject* py_lanes(PyObject*, PyObject*) { return PyLong_FromLong(kpg::W); }

PyMethodDef kMethods[] = {
    {"int4", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_int4)), METH_FASTCALL,
     "int4(x, M, K, N, g, w, y, block_rows): y = x @ dequant(w).T (pointers)"},
    {"int8", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_int8)), METH_FASTCALL,
     "int8(x, M, K, N, w, scale, y, block_rows): y = x @ dequant(w).T (pointers)"},
    {"gguf", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_gguf)), METH_FASTCALL,
     "gguf(type, x, M, K, N, w, y, block_rows): y = x @ dequant(w).T (pointers)"},
    {"gguf_q8", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_gguf_q8)),
     METH_FASTCALL, "gguf_q8(type, x, M, K, N, w, y, block_rows): y = q8(x) @ dequant(w).T"},
    {"block_shape", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_block_shape)),
     METH_FASTCALL, "block_shape(type): (elements, bytes) per block, or None"},
    {"lanes", py_lanes, METH_NOARGS, "float lanes per vector (16: AVX-512, 8: AVX2)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, KILN_PG_STR(KILN_PG_EXT),
                       "kiln prefill GEMMs on packed weights", -1, kMethods, nullptr, nullptr,
                       nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC KILN_PG_CAT(PyInit_, KILN_PG_EXT)() { return PyModule_Create(&kModule); }

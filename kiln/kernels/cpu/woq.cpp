// woq.cpp — the CPython module of kiln's weight-only quantized matmuls (kiln_woq_ext).
//
// The kernels are in woq.h (shared with the decode step); this file only parses the
// arguments (plain integers: data pointers and sizes, checked by woq.py) and runs them
// without the GIL. Built with plain g++ (no torch headers: builds in a few seconds and a
// call costs ~0.1 us), loaded and cached by woq.py.
#include <Python.h>

#include <cstdint>
#include <new>
#include <vector>

#include "kiln_py.h"
#include "woq.h"

namespace {

using woq::Int4Args;
using woq::Int4Block;
using woq::Int8Args;
using woq::Int8Block;

using kpy::read_ints;
using kpy::run_released;

// int8_mm(x, M, K, N, w, scale, y)
PyObject* py_int8_mm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[7];
  if (!read_ints(args, nargs, 7, v, "int8_mm")) return nullptr;
  const Int8Args a{reinterpret_cast<const float*>(v[0]), v[1], v[2], v[3],
                   reinterpret_cast<const int8_t*>(v[4]), reinterpret_cast<const float*>(v[5]),
                   reinterpret_cast<float*>(v[6])};
  return run_released([&] { woq::drive<Int8Block>(a); });
}

// int4_mm(x, M, K, N, g, w, y)
PyObject* py_int4_mm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[7];
  if (!read_ints(args, nargs, 7, v, "int4_mm")) return nullptr;
  Int4Args a{reinterpret_cast<const float*>(v[0]), v[1], v[2], v[3], v[4],
             reinterpret_cast<const uint8_t*>(v[5]), reinterpret_cast<float*>(v[6]), nullptr};
  return run_released([&] {
    const std::vector<float> xsum = woq::group_sums(a.x, a.M, a.K, a.g);
    a.xsum = xsum.data();
    woq::drive<Int4Block>(a);
  });
}

PyObject* py_lanes(PyObject*, PyObject*) { return PyLong_FromLong(woq::W); }

PyMethodDef kMethods[] = {
    {"int8_mm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_int8_mm)),
     METH_FASTCALL, "int8_mm(x, M, K, N, w, scale, y): y = x @ dequant(w).T (pointers)"},
    {"int4_mm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_int4_mm)),
     METH_FASTCALL, "int4_mm(x, M, K, N, g, w, y): y = x @ dequant(w).T (pointers)"},
    {"lanes", py_lanes, METH_NOARGS, "float lanes per vector (panel width W)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "kiln_woq_ext", "kiln weight-only matmuls", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_kiln_woq_ext() { return PyModule_Create(&kModule); }

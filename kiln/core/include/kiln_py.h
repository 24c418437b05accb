// kiln_py.h — what kiln's hand-written CPython extensions (the weight-only kernels, the decode
// step) share at their Python boundary. Include after <Python.h>.
#pragma once
#include <Python.h>

#include <cstdint>
#include <new>

namespace kpy {

// Reads exactly `want` integer arguments (data pointers and sizes; the Python side checks the
// tensors they come from) into `out`. False, with a Python TypeError / OverflowError set, if
// the count is wrong or an argument is not an integer.
inline bool read_ints(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, int64_t* out,
                      const char* name) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s expects %zd integer arguments, got %zd", name, want,
                 nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < want; ++i) {
    out[i] = PyLong_AsLongLong(args[i]);
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// Runs f() without the GIL and returns None; a failed allocation inside f (a kernel's scratch
// buffers) becomes a Python MemoryError.
template <class F>
PyObject* run_released(F&& f) {
  bool ok = true;
  Py_BEGIN_ALLOW_THREADS
  try {
    f();
  } catch (const std::bad_alloc&) {
    ok = false;
  }
  Py_END_ALLOW_THREADS
  if (!ok) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

}  // namespace kpy

// runtime.cpp — kiln's CPU runtime extension: loads generated programs and runs them.
//
// Built once per machine (build.py: load_runtime). A generated program is a shared library
// exporting `kiln_entry` (ABI in kiln_rt.h). `Program` dlopens it once, keeps the
// parameters and a 64-byte-aligned scratch arena alive, and `Program.run(inputs)` is one
// call: check the inputs, allocate the outputs, fill the buffer table, call kiln_entry.
//
// Buffer table passed to kiln_entry: inputs, outputs, params, arena base.
// Thread pool: the program's parallel loops go to at::parallel_for (torch's one pool).
// Externs: library / PyTorch calls the program cannot do itself are Python callables
// registered with the shapes and dtypes of their inputs; the program calls them through
// KilnRuntime::extern_call on the calling thread (the GIL is held for the whole run; an
// extern must not be called from inside a parallel task).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "kiln_rt.h"

namespace {

using Shape = std::vector<int64_t>;
using EntryFn = int (*)(void* const*, const KilnRuntime*);

std::string shape_str(c10::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// One registered extern: fn(*inputs) -> Tensor; the output check is optional.
struct Extern {
  py::object fn;
  std::vector<Shape> in_shapes;
  std::vector<at::ScalarType> in_dtypes;
  bool check_out = false;
  Shape out_shape;
  at::ScalarType out_dtype = at::kFloat;
};

Extern parse_extern(size_t index, const py::handle& item) {
  auto spec = item.cast<py::tuple>();
  if (spec.size() != 3 && spec.size() != 5)
    throw py::value_error("extern " + std::to_string(index) +
                          ": expected (fn, input_shapes, input_dtypes[, output_shape, "
                          "output_dtype]), got a tuple of " +
                          std::to_string(spec.size()));
  Extern ex;
  ex.fn = py::reinterpret_borrow<py::object>(spec[0]);
  if (!PyCallable_Check(ex.fn.ptr()))
    throw py::type_error("extern " + std::to_string(index) + ": fn is not callable");
  ex.in_shapes = spec[1].cast<std::vector<Shape>>();
  ex.in_dtypes = spec[2].cast<std::vector<at::ScalarType>>();
  if (ex.in_shapes.size() != ex.in_dtypes.size())
    throw py::value_error("extern " + std::to_string(index) +
                          ": input_shapes and input_dtypes differ in length");
  if (spec.size() == 5) {
    ex.check_out = true;
    ex.out_shape = spec[3].cast<Shape>();
    ex.out_dtype = spec[4].cast<at::ScalarType>();
  }
  return ex;
}

class Program {
 public:
  Program(const std::string& so_path, const std::vector<at::Tensor>& params, int64_t arena_bytes,
          std::vector<Shape> input_shapes, std::vector<at::ScalarType> input_dtypes,
          std::vector<Shape> output_shapes, std::vector<at::ScalarType> output_dtypes,
          const py::list& externs)
      : so_path_(so_path),
        in_shapes_(std::move(input_shapes)),
        in_dtypes_(std::move(input_dtypes)),
        out_shapes_(std::move(output_shapes)),
        out_dtypes_(std::move(output_dtypes)) {
    if (in_shapes_.size() != in_dtypes_.size() || out_shapes_.size() != out_dtypes_.size())
      throw py::value_error("Program: shapes and dtypes differ in length");
    if (arena_bytes < 0) throw py::value_error("Program: arena_bytes must be >= 0");
    for (size_t i = 0; i < externs.size(); ++i) externs_.push_back(parse_extern(i, externs[i]));
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].device().is_cpu())
        throw py::value_error("Program: param " + std::to_string(i) + " is not on the CPU");
      params_.push_back(params[i].contiguous());  // the program indexes params densely
    }
    const size_t bytes = (static_cast<size_t>(arena_bytes) + 63) / 64 * 64 + 64;
    arena_ = std::aligned_alloc(64, bytes);
    if (!arena_) throw std::bad_alloc();
    handle_ = dlopen(so_path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle_) {
      std::free(arena_);
      throw std::runtime_error("Program: cannot load " + so_path + ": " + dlerror());
    }
    entry_ = reinterpret_cast<EntryFn>(dlsym(handle_, "kiln_entry"));
    if (!entry_) {
      dlclose(handle_);
      std::free(arena_);
      throw std::runtime_error("Program: " + so_path + " has no kiln_entry symbol");
    }
    const size_t n_in = in_shapes_.size(), n_out = out_shapes_.size();
    buffers_.assign(n_in + n_out + params_.size() + 1, nullptr);
    for (size_t i = 0; i < params_.size(); ++i) buffers_[n_in + n_out + i] = params_[i].data_ptr();
    buffers_.back() = arena_;
  }

  ~Program() {
    if (handle_) dlclose(handle_);
    std::free(arena_);
  }
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;

  // The hot path, kept free of pybind11's generic casters: inputs are read straight from
  // the list/tuple, outputs are allocated without the dispatcher and wrapped directly.
  py::list run(const py::handle& inputs) {
    const size_t n_in = in_shapes_.size(), n_out = out_shapes_.size();
    PyObject* seq = inputs.ptr();
    if (!PyList_Check(seq) && !PyTuple_Check(seq))
      throw py::type_error("Program.run: inputs must be a list or tuple of tensors");
    PyObject** items = PySequence_Fast_ITEMS(seq);
    const size_t got = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq));
    if (got != n_in)
      throw py::value_error("Program.run: expected " + std::to_string(n_in) + " inputs, got " +
                            std::to_string(got));
    for (size_t i = 0; i < n_in; ++i) {
      if (!THPVariable_Check(items[i]))
        throw py::type_error("Program.run: input " + std::to_string(i) + " is not a Tensor");
      const at::Tensor& t = THPVariable_Unpack(items[i]);
      check_input(i, t);
      buffers_[i] = t.data_ptr();
    }
    py::list result(n_out);
    for (size_t j = 0; j < n_out; ++j) {
      at::Tensor out = at::detail::empty_cpu(out_shapes_[j], out_dtypes_[j], false, std::nullopt);
      buffers_[n_in + j] = out.data_ptr();
      PyList_SET_ITEM(result.ptr(), j, THPVariable_Wrap(std::move(out)));
    }
    const KilnRuntime rt{this, &parallel_for_cb, &extern_call_cb,
                         static_cast<int32_t>(at::get_num_threads())};
    const int rc = entry_(buffers_.data(), &rt);
    keep_.clear();
    if (pending_) {
      std::exception_ptr e = pending_;
      pending_ = nullptr;
      std::rethrow_exception(e);  // the extern's own Python exception
    }
    if (rc != 0)
      throw std::runtime_error("kiln program " + so_path_ + " failed: kiln_entry returned " +
                               std::to_string(rc));
    return result;
  }

  size_t num_inputs() const { return in_shapes_.size(); }
  size_t num_outputs() const { return out_shapes_.size(); }
  size_t num_params() const { return params_.size(); }
  const std::string& so_path() const { return so_path_; }

 private:
  void check_input(size_t i, const at::Tensor& t) const {
    const std::string name = "Program.run: input " + std::to_string(i);
    if (!t.defined()) throw py::value_error(name + " is None");
    if (t.sizes() != c10::IntArrayRef(in_shapes_[i]))
      throw py::value_error(name + " has shape " + shape_str(t.sizes()) + ", expected " +
                            shape_str(in_shapes_[i]));
    if (t.scalar_type() != in_dtypes_[i])
      throw py::value_error(name + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                            ", expected " + c10::toString(in_dtypes_[i]));
    if (!t.device().is_cpu()) throw py::value_error(name + " is not on the CPU");
    if (!t.is_contiguous())
      throw py::value_error(name + " is not contiguous (call .contiguous() first)");
  }

  static void parallel_for_cb(int64_t begin, int64_t end, int64_t grain, kiln_task_fn fn,
                              void* task_ctx) {
    at::parallel_for(begin, end, grain, [fn, task_ctx](int64_t b, int64_t e) {
      fn(task_ctx, b, e);
    });
  }

  // Runs extern `index`; on any error records it for run() to raise and returns nullptr.
  static void* extern_call_cb(void* ctx, int32_t index, void* const* inputs) {
    auto* self = static_cast<Program*>(ctx);
    try {
      if (!PyGILState_Check())
        throw std::runtime_error("extern called without the GIL (from a parallel task?)");
      if (index < 0 || static_cast<size_t>(index) >= self->externs_.size())
        throw std::runtime_error("extern index " + std::to_string(index) + " out of range");
      const Extern& ex = self->externs_[index];
      py::tuple args(ex.in_shapes.size());
      for (size_t i = 0; i < ex.in_shapes.size(); ++i)
        args[i] = py::cast(
            at::from_blob(inputs[i], ex.in_shapes[i], at::TensorOptions().dtype(ex.in_dtypes[i])));
      py::object result = ex.fn(*args);
      if (!THPVariable_Check(result.ptr()))
        throw py::type_error("extern " + std::to_string(index) + " returned " +
                             std::string(py::str(py::type::of(result))) + ", not a Tensor");
      at::Tensor out = THPVariable_Unpack(result.ptr());
      if (!out.device().is_cpu())
        throw py::value_error("extern " + std::to_string(index) + " returned a non-CPU tensor");
      if (ex.check_out &&
          (out.sizes() != c10::IntArrayRef(ex.out_shape) || out.scalar_type() != ex.out_dtype))
        throw py::value_error("extern " + std::to_string(index) + " returned " +
                              shape_str(out.sizes()) + " " + c10::toString(out.scalar_type()) +
                              ", expected " + shape_str(ex.out_shape) + " " +
                              c10::toString(ex.out_dtype));
      self->keep_.push_back(out.contiguous());  // alive until run() returns
      return self->keep_.back().data_ptr();
    } catch (...) {
      if (!self->pending_) self->pending_ = std::current_exception();
      return nullptr;
    }
  }

  std::string so_path_;
  std::vector<Shape> in_shapes_;
  std::vector<at::ScalarType> in_dtypes_;
  std::vector<Shape> out_shapes_;
  std::vector<at::ScalarType> out_dtypes_;
  std::vector<Extern> externs_;
  std::vector<at::Tensor> params_;
  void* arena_ = nullptr;
  void* handle_ = nullptr;
  EntryFn entry_ = nullptr;
  std::vector<void*> buffers_;     // inputs, outputs, params, arena (reused by every run)
  std::vector<at::Tensor> keep_;   // extern results of the current run
  std::exception_ptr pending_;     // first extern error of the current run
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kiln CPU runtime: loads generated programs (kiln_entry) and runs them";
  py::class_<Program>(m, "Program")
      .def(py::init<const std::string&, const std::vector<at::Tensor>&, int64_t,
                    std::vector<Shape>, std::vector<at::ScalarType>, std::vector<Shape>,
                    std::vector<at::ScalarType>, const py::list&>(),
           py::arg("so_path"), py::arg("params"), py::arg("arena_bytes"),
           py::arg("input_shapes"), py::arg("input_dtypes"), py::arg("output_shapes"),
           py::arg("output_dtypes"), py::arg("externs") = py::list(),
           "Load a generated program. externs: list of (fn, input_shapes, input_dtypes) or "
           "(fn, input_shapes, input_dtypes, output_shape, output_dtype) tuples.")
      .def("run", &Program::run, py::arg("inputs"),
           "Run the program on a list/tuple of contiguous CPU inputs; returns the outputs "
           "(list of new tensors).")
      .def_property_readonly("num_inputs", &Program::num_inputs)
      .def_property_readonly("num_outputs", &Program::num_outputs)
      .def_property_readonly("num_params", &Program::num_params)
      .def_property_readonly("so_path", &Program::so_path);
}

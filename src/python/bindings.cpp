// flce._flce: the compiled half of the Python package.
//
// It takes plain descriptors, not numpy arrays or torch tensors: each tensor
// is a tuple (data pointer as int, dtype name, shape, strides in elements,
// device name, device index). The Python layer (flce/__init__.py) builds
// them from whatever array type it was given, so this module links neither
// numpy nor libtorch and works for any array library that exposes a pointer.
//
// Every call validates through the C++ library; its Status comes back as
// (error, backend, ...) and the Python layer raises ValueError with the
// message verbatim. Malformed descriptors (wrong Python types, unknown dtype names)
// raise TypeError here, because they are mistakes in the caller's types, not
// in the values of a problem.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstdint>
#include <string>

#include "flce/flce.h"

namespace py = pybind11;

namespace {

flce::Dtype parse_dtype(const std::string& name, const std::string& arg) {
  for (flce::Dtype d : {flce::Dtype::f32, flce::Dtype::f64, flce::Dtype::bf16, flce::Dtype::f16,
                        flce::Dtype::i32, flce::Dtype::i64}) {
    if (name == flce::dtype_name(d)) return d;
  }
  throw py::type_error(arg + ": dtype '" + name +
                       "' is not one of f32, f64, bf16, f16, i32, i64");
}

int64_t as_int(py::handle h, const std::string& what) {
  // bool is an int subclass in Python; a shape of True is a bug, not a 1.
  if (!py::isinstance<py::int_>(h) || py::isinstance<py::bool_>(h))
    throw py::type_error(what + ": expected an int, got " +
                         std::string(py::str(py::type::handle_of(h).attr("__name__"))));
  try {
    return h.cast<int64_t>();
  } catch (const py::cast_error&) {
    throw py::value_error(what + " = " + std::string(py::str(h)) + ": does not fit in 64 bits");
  }
}

std::string as_str(py::handle h, const std::string& what) {
  if (!py::isinstance<py::str>(h))
    throw py::type_error(what + ": expected a str, got " +
                         std::string(py::str(py::type::handle_of(h).attr("__name__"))));
  return h.cast<std::string>();
}

// (data, dtype, shape, strides, device, device_index) -> flce::Tensor.
flce::Tensor parse_tensor(const std::string& name, py::handle desc) {
  if (!py::isinstance<py::tuple>(desc) || py::len(desc) != 6)
    throw py::type_error(name +
                         ": expected a descriptor (data, dtype, shape, strides, device, index)");
  py::tuple t = py::reinterpret_borrow<py::tuple>(desc);
  flce::Tensor out;
  const int64_t address = as_int(t[0], name + " data");
  if (address < 0)
    throw py::value_error(name + ": data pointer " + std::to_string(address) + " < 0");
  out.data = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
  out.dtype = parse_dtype(as_str(t[1], name + " dtype"), name);
  if (!py::isinstance<py::tuple>(t[2]) || !py::isinstance<py::tuple>(t[3]))
    throw py::type_error(name + ": shape and strides must be tuples");
  py::tuple shape = t[2].cast<py::tuple>(), strides = t[3].cast<py::tuple>();
  if (py::len(shape) > 2 || py::len(shape) != py::len(strides))
    throw py::value_error(name + ": flce takes 0-D, 1-D or 2-D tensors; got " +
                         std::to_string(py::len(shape)) + " dimensions");
  out.ndim = int(py::len(shape));
  for (int d = 0; d < out.ndim; ++d) {
    out.shape[d] = as_int(shape[d], name + " shape");
    out.stride[d] = as_int(strides[d], name + " strides");
  }
  const std::string device = as_str(t[4], name + " device");
  if (device == "cpu") {
    out.device = flce::Device::cpu;
  } else if (device == "cuda") {
    out.device = flce::Device::cuda;
  } else {
    throw py::type_error(name + ": device '" + device + "' is not cpu or cuda");
  }
  const int64_t index = as_int(t[5], name + " device index");
  if (index < 0 || index > INT_MAX)
    throw py::value_error(name + ": device index " + std::to_string(index) + " is out of range");
  out.device_index = int(index);
  return out;
}

// Every tensor field of Problem, by the name the Python layer uses.
flce::Tensor* field(flce::Problem& p, const std::string& name) {
  if (name == "x") return &p.x;
  if (name == "w") return &p.w;
  if (name == "bias") return &p.bias;
  if (name == "logits") return &p.logits;
  if (name == "labels") return &p.labels;
  if (name == "token_weights") return &p.token_weights;
  if (name == "class_weights") return &p.class_weights;
  if (name == "loss") return &p.loss;
  if (name == "lse") return &p.lse;
  if (name == "logprob") return &p.logprob;
  if (name == "argmax") return &p.argmax;
  if (name == "entropy") return &p.entropy;
  if (name == "zloss") return &p.zloss;
  if (name == "grad_loss") return &p.grad_loss;
  if (name == "grad_lse") return &p.grad_lse;
  if (name == "grad_entropy") return &p.grad_entropy;
  if (name == "grad_x") return &p.grad_x;
  if (name == "grad_w") return &p.grad_w;
  if (name == "grad_bias") return &p.grad_bias;
  if (name == "grad_logits") return &p.grad_logits;
  return nullptr;
}

template <typename E>
E parse_enum(const std::string& arg, const std::string& value,
             std::initializer_list<std::pair<const char*, E>> names) {
  std::string list;
  for (auto& [n, e] : names) {
    if (value == n) return e;
    if (!list.empty()) list += ", ";  // (a "" : ", " temporary drew GCC 12's LTO warning)
    list += n;
  }
  throw py::value_error(arg + ": '" + value + "' is not one of " + list);
}

double as_double(py::handle h, const std::string& what) {
  // As as_int: a bool is not a number here (softcap=True is not a softcap of 1).
  if ((!py::isinstance<py::float_>(h) && !py::isinstance<py::int_>(h)) ||
      py::isinstance<py::bool_>(h))
    throw py::type_error(what + ": expected a number, got " +
                         std::string(py::str(py::type::handle_of(h).attr("__name__"))));
  if (py::isinstance<py::int_>(h)) {  // 10**400 has no double: an error, not pybind11's cast's
    const double d = PyLong_AsDouble(h.ptr());
    if (d == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::value_error(what + ": an integer of " +
                            std::to_string(py::len(py::str(h))) + " digits is beyond float64");
    }
    return d;
  }
  return h.cast<double>();
}

flce::Problem parse_problem(const py::dict& tensors, const py::dict& options) {
  flce::Problem p;
  for (auto item : tensors) {
    const std::string name = as_str(item.first, "tensor name");
    flce::Tensor* f = field(p, name);
    if (f == nullptr) throw py::value_error(name + ": not an argument of flce::Problem");
    if (!item.second.is_none()) *f = parse_tensor(name, item.second);
  }
  flce::Options& o = p.options;
  for (auto item : options) {
    const std::string key = as_str(item.first, "option name");
    py::handle v = item.second;
    if (key == "logit_scale") {
      o.logit_scale = as_double(v, key);
    } else if (key == "softcap") {
      o.softcap = as_double(v, key);
    } else if (key == "ignore_index") {
      o.ignore_index = as_int(v, key);
    } else if (key == "label_smoothing") {
      o.label_smoothing = as_double(v, key);
    } else if (key == "z_loss") {
      o.z_loss = as_double(v, key);
    } else if (key == "reduction") {
      o.reduction = parse_enum<flce::Reduction>(key, as_str(v, key),
                                                {{"none", flce::Reduction::none},
                                                 {"sum", flce::Reduction::sum},
                                                 {"mean", flce::Reduction::mean}});
    } else if (key == "grad_logits_dtype") {
      o.grad_logits_dtype = parse_enum<flce::GradLogitsDtype>(
          key, as_str(v, key),
          {{"f32", flce::GradLogitsDtype::f32}, {"storage", flce::GradLogitsDtype::storage}});
    } else if (key == "filter_eps") {  // a number >= 0, or "auto"
      if (py::isinstance<py::str>(v) && as_str(v, key) != "auto")
        throw py::value_error("filter_eps = " + std::string(py::repr(v)) +
                              ": must be a number >= 0 (0 turns filtering off) or 'auto'");
      o.filter_eps = py::isinstance<py::str>(v) ? flce::kFilterEpsAuto : as_double(v, key);
      if (!py::isinstance<py::str>(v) && o.filter_eps < 0)  // -1 is the C++ API's auto
        throw py::value_error("filter_eps = " + std::string(py::str(v)) +
                              ": must be >= 0 (0 turns filtering off) or 'auto'");
    } else if (key == "w_layout") {
      p.w_layout = parse_enum<flce::WeightLayout>(
          key, as_str(v, key), {{"vh", flce::WeightLayout::vh}, {"hv", flce::WeightLayout::hv}});
    } else {
      throw py::value_error(key + ": not an option of flce");
    }
  }
  return p;
}

flce::RunConfig parse_config(const py::dict& config) {
  flce::RunConfig c;
  for (auto item : config) {
    const std::string key = as_str(item.first, "config name");
    if (item.second.is_none()) continue;
    if (key == "backend") {
      c.backend = as_str(item.second, key);
    } else if (key == "gemm") {
      c.gemm = as_str(item.second, key);
    } else if (key == "threads") {
      const int64_t threads = as_int(item.second, key);
      if (threads < 0 || threads > INT_MAX)  // else flce's validate_config checks it
        throw py::value_error("threads = " + std::to_string(threads) +
                              ": must be in [0, 4096] (0: the backend's default)");
      c.threads = int(threads);
    } else if (key == "stream") {  // a cudaStream_t as int (torch's .cuda_stream)
      c.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(as_int(item.second, key)));
    } else if (key == "workspace") {  // (pointer, bytes) of caller-owned scratch
      if (!py::isinstance<py::tuple>(item.second) || py::len(item.second) != 2)
        throw py::type_error("workspace: expected (pointer, bytes)");
      py::tuple w = item.second.cast<py::tuple>();
      const int64_t address = as_int(w[0], "workspace");
      if (address < 0)
        throw py::value_error("workspace: pointer " + std::to_string(address) + " < 0");
      c.workspace = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
      const int64_t bytes = as_int(w[1], "workspace bytes");
      if (bytes < 0) throw py::value_error("workspace: " + std::to_string(bytes) + " bytes");
      c.workspace_bytes = size_t(bytes);
    } else {
      throw py::value_error(key + ": not a setting of flce::RunConfig");
    }
  }
  return c;
}

flce::Pass parse_pass(const std::string& pass) {
  return parse_enum<flce::Pass>("pass", pass,
                                {{"forward", flce::Pass::forward},
                                 {"backward", flce::Pass::backward},
                                 {"loss_and_grad", flce::Pass::loss_and_grad}});
}

// One call of the library. The descriptors are parsed while holding the GIL;
// the computation runs without it, so other Python threads keep going.
py::tuple run(const std::string& pass_name, const py::dict& tensors, const py::dict& options,
              const py::dict& config) {
  const flce::Pass pass = parse_pass(pass_name);
  const flce::Problem problem = parse_problem(tensors, options);
  const flce::RunConfig cfg = parse_config(config);
  flce::Status status;
  {
    py::gil_scoped_release release;
    switch (pass) {
      case flce::Pass::forward: status = flce::forward(problem, cfg); break;
      case flce::Pass::backward: status = flce::backward(problem, cfg); break;
      case flce::Pass::loss_and_grad: status = flce::loss_and_grad(problem, cfg); break;
    }
  }
  return py::make_tuple(status.error, status.backend,
                        py::make_tuple(status.stats.grad_blocks, status.stats.grad_blocks_skipped),
                        status.declined);
}

py::tuple workspace_size(const std::string& pass_name, const py::dict& tensors,
                         const py::dict& options, const py::dict& config) {
  const flce::Pass pass = parse_pass(pass_name);
  const flce::Problem problem = parse_problem(tensors, options);
  const flce::RunConfig cfg = parse_config(config);
  size_t bytes = 0;
  const flce::Status status = flce::workspace_size(problem, pass, cfg, &bytes);
  return py::make_tuple(status.error, status.backend, bytes);
}

}  // namespace

PYBIND11_MODULE(_flce, m) {
  m.doc() = "flce's C++ library behind plain tensor descriptors; use the `flce` package.";
  m.def("run", &run, py::arg("pass_"), py::arg("tensors"), py::arg("options"),
        py::arg("config"),
        "Runs one pass ('forward', 'backward', 'loss_and_grad') on descriptors; returns "
        "(error, backend, (grad_blocks, grad_blocks_skipped), declined), error empty on "
        "success; declined: with no backend named, why those tried before `backend` declined.");
  m.def("workspace_size", &workspace_size, py::arg("pass_"), py::arg("tensors"),
        py::arg("options"), py::arg("config"),
        "Returns (error, backend, bytes): the scratch bytes the chosen backend needs.");
  m.def(
      "backends",
      [] {
        py::list out;
        for (const auto& b : flce::list_backends()) out.append(py::make_tuple(b.name, b.description));
        return out;
      },
      "The backends as (name, description), in the order they are tried.");
  m.def("version", [] { return std::string(flce::version()); });
}

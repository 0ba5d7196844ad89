#include "cuda/cublas_library.h"

#include <dlfcn.h>

namespace flce::cuda {
namespace {

struct Loaded {
  CublasLibrary functions{};
  std::string problem;  // "" once every function is resolved
};

// dlsym into `*slot`; false (and the problem set) if the symbol is missing.
template <typename F>
bool resolve(void* handle, const char* name, F* slot, std::string* problem) {
  *slot = reinterpret_cast<F>(dlsym(handle, name));
  if (*slot == nullptr) *problem = std::string("symbol ") + name + " is missing";
  return *slot != nullptr;
}

Loaded load() {
  Loaded l;
  // The soname of the cuBLAS this was compiled against, found as the dynamic
  // linker finds libraries (the run path of the object holding flce: the
  // executable, or the Python extension; LD_LIBRARY_PATH; the system's
  // cache), then at the path CMake found at build time.
  const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string error = handle == nullptr ? dlerror() : "";
#ifdef FLCE_CUBLAS_PATH
  if (handle == nullptr) handle = dlopen(FLCE_CUBLAS_PATH, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) error += std::string("; ") + dlerror();
#endif
  if (handle == nullptr) {
    l.problem = error;
    return l;
  }
  CublasLibrary& f = l.functions;
  std::string& p = l.problem;
  resolve(handle, "cublasCreate_v2", &f.create, &p) &&
      resolve(handle, "cublasDestroy_v2", &f.destroy, &p) &&
      resolve(handle, "cublasSetStream_v2", &f.set_stream, &p) &&
      resolve(handle, "cublasSetMathMode", &f.set_math_mode, &p) &&
      resolve(handle, "cublasGemmEx", &f.gemm_ex, &p) &&
      resolve(handle, "cublasGetStatusString", &f.status_string, &p);
  return l;  // never closed: handles made from it live until the process ends
}

const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace

const CublasLibrary* cublas_library() {
  return loaded().problem.empty() ? &loaded().functions : nullptr;
}

std::string cublas_problem() {
  const std::string& p = loaded().problem;
  if (p.empty()) return "";
  return "cuBLAS (libcublas.so." + std::to_string(CUBLAS_VER_MAJOR) +
         ") cannot be loaded: " + p + " (install it, or put its directory on LD_LIBRARY_PATH)";
}

}  // namespace flce::cuda

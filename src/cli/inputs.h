// What `flce run` and `flce eval` share: user-facing failures, pointing API
// errors at the flag they came from, and reading .npy inputs.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cli/args.h"
#include "flce/flce.h"
#include "io/npy.h"

namespace flce::cuda {
class DeviceProblem;
}

namespace flce::cli {

// An error for the user, printed as "flce <command>: error: <message>".
struct Failure {
  std::string message;
};
void check(const std::string& error);  // throws Failure unless empty

// Prefixes an API error ("softcap = -1: ...") with the flag it came from
// and, for files, the file: "--softcap: softcap = -1: ...".
std::string explain_api_error(const std::string& error, const Args& args);

// The files the given flags name: those whose placeholder is a .npy file
// ("X.npy"), in `flags`' order.
std::vector<std::string> input_files(const Args& args, const std::vector<Flag>& flags);

// Throws Failure when one of `outputs` (file names) in `dir` is a file an
// input flag names: the commit would put the output in its place
// (`--x Q/grad_x.npy --out Q --grad`).
void refuse_outputs_over_inputs(const Args& args, const std::vector<Flag>& flags,
                                const std::string& dir, const std::vector<std::string>& outputs);

// Whether the backend named by config (or FLCE_BACKEND) reads device memory.
bool wants_device(const RunConfig& config);

// Runs `pass` on a problem of host arrays. For a device backend (cuda) the
// arrays are copied to GPU 0, and the outputs copied back, around the call.
Status call_on_host_arrays(const Problem& host, Pass pass, const RunConfig& config);

// forward() on host arrays for a series of calls that share W and the bias
// (`flce eval`'s blocks): as call_on_host_arrays, except that on a device
// backend W and the bias are copied to the GPU once, at the first call, and
// kept for the later ones (whose w and bias must be the same arrays).
class ForwardOnHostBlocks {
 public:
  ForwardOnHostBlocks();
  ~ForwardOnHostBlocks();
  Status operator()(const Problem& host, const RunConfig& config);

 private:
  std::unique_ptr<cuda::DeviceProblem> head_;
  const void* head_w_ = nullptr;  // the host arrays head_ holds copies of
  const void* head_bias_ = nullptr;
};

// --filter-eps E|auto into *out (kFilterEpsAuto for auto); leaves *out
// unchanged when absent. Negative numbers are errors here, since -1 is the
// API's auto.
std::string get_filter_eps(const Args& args, double* out);

// The storage dtypes of --dtype, by index (f32, bf16, f16); -1 = as stored.
Dtype storage_dtype(int index);

io::NpyArray make_array(Dtype dtype, std::vector<int64_t> shape);
// A copy of `a` with every element converted (rounded) to `dtype`.
io::NpyArray convert(const io::NpyArray& a, Dtype dtype);
// A contiguous view of a 0-D, 1-D or 2-D array.
Tensor view_of(io::NpyArray& a);

// The file of --flag, 0-D to 2-D.
io::NpyArray load_npy(const Args& args, const char* flag);
// x, W, bias or logits: a float array, rounded to --dtype (index `storage`) when given.
io::NpyArray load_storage(const Args& args, const char* flag, int storage);
// Weights and cotangents: float32 or float64 as given; float16 widened exactly.
io::NpyArray load_real(const Args& args, const char* flag);
// Labels: int32 or int64.
io::NpyArray load_labels(const Args& args);

}  // namespace flce::cli

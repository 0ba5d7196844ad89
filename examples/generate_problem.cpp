// Writes a random LM-head problem as .npy files: x [N, H], w [V, H] and
// labels [N] (int64, with --ignored rows set to -100). Used by the demo.
//   generate_problem --n 64 --h 256 --v 32000 [--ignored 8] [--seed 1] --out DIR
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>
#include <random>
#include <string>
#include <system_error>

#include "io/npy.h"

namespace {

flce::io::NpyArray array_of(flce::Dtype dtype, std::vector<int64_t> shape, const void* data) {
  flce::io::NpyArray a;
  a.dtype = dtype;
  a.shape = std::move(shape);
  const auto* bytes = static_cast<const unsigned char*>(data);
  a.bytes.assign(bytes, bytes + a.numel() * flce::dtype_size(dtype));
  return a;
}

bool save(const std::string& path, const flce::io::NpyArray& a) {
  const std::string error = flce::io::write_npy(path, a);
  if (!error.empty()) std::fprintf(stderr, "generate_problem: %s\n", error.c_str());
  return error.empty();
}

int generate(long long n, long long h, long long v, long long ignored, long long seed,
             const std::string& out);

}  // namespace

constexpr const char* kUsage =
    "usage: generate_problem --n N --h H --v V [--ignored K] [--seed S] --out DIR\n";

int main(int argc, char** argv) {
  long long n = 0, h = 0, v = 0, ignored = 0, seed = 1;
  std::string out;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") return std::fputs(kUsage, stdout), 0;
    if (i + 1 == argc) return std::fprintf(stderr, "generate_problem: %s needs a value\n", argv[i]), 2;
    long long* target = flag == "--n" ? &n : flag == "--h" ? &h : flag == "--v" ? &v
                      : flag == "--ignored" ? &ignored : flag == "--seed" ? &seed : nullptr;
    if (std::strncmp(argv[i + 1], "--", 2) == 0)  // `--out --n 4`: a forgotten value
      return std::fprintf(stderr, "generate_problem: %s needs a value (got '%s')\n", argv[i], argv[i + 1]), 2;
    if (flag == "--out") out = argv[i + 1];
    else if (target) {
      char* end = nullptr;
      errno = 0;
      *target = std::strtoll(argv[i + 1], &end, 10);
      if (*argv[i + 1] == '\0' || *end != '\0' || errno == ERANGE)
        return std::fprintf(stderr, "generate_problem: %s = '%s' is not a 64-bit integer\n", argv[i], argv[i + 1]), 2;
    }
    else return std::fprintf(stderr, "generate_problem: unknown option %s\n", argv[i]), 2;
  }
  if (n < 1 || h < 1 || v < 1 || ignored < 0 || ignored > n || out.empty()) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  long long xn = 0, wn = 0;
  if (__builtin_mul_overflow(n, h, &xn) || __builtin_mul_overflow(v, h, &wn) || xn > (1LL << 40) ||
      wn > (1LL << 40))
    return std::fprintf(stderr, "generate_problem: --n %lld x --h %lld or --v %lld x --h is more "
                        "than 2^40 floats\n", n, h, v), 2;
  try {
    return generate(n, h, v, ignored, seed, out);
  } catch (const std::bad_alloc&) {
    return std::fprintf(stderr, "generate_problem: out of memory for x [%lld, %lld] and w [%lld, %lld]\n",
                        n, h, v, h), 2;
  }
}

namespace {

int generate(long long n, long long h, long long v, long long ignored, long long seed,
             const std::string& out) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n * h), w(v * h);
  for (float& e : x) e = normal(rng);
  const float w_scale = 2.0f / std::sqrt(float(h));  // logits of order 2
  for (float& e : w) e = w_scale * normal(rng);
  std::vector<int64_t> labels(n);
  for (long long i = 0; i < n; ++i) labels[i] = i < ignored ? -100 : int64_t(rng() % v);
  std::error_code made;
  std::filesystem::create_directories(out, made);
  if (made) {
    std::fprintf(stderr, "generate_problem: --out %s: %s\n", out.c_str(), made.message().c_str());
    return 2;
  }
  const bool ok = save(out + "/x.npy", array_of(flce::Dtype::f32, {n, h}, x.data())) &&
                  save(out + "/w.npy", array_of(flce::Dtype::f32, {v, h}, w.data())) &&
                  save(out + "/labels.npy", array_of(flce::Dtype::i64, {n}, labels.data()));
  if (ok) std::printf("wrote x [%lld, %lld], w [%lld, %lld], labels [%lld] to %s\n", n, h, v, h, n, out.c_str());
  return ok ? 0 : 2;
}

}  // namespace

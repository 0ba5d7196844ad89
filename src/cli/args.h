// A small command-line parser: --name VALUE and --switch flags, each known
// in advance; anything else is an error that names it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace flce::cli {

struct Flag {
  const char* name;  // without the leading "--"
  const char* value; // placeholder shown in --help ("X.npy"); nullptr for a switch
  const char* help;
};

class Args {
 public:
  // Parses argv[first..argc). Returns "" or an error naming the bad argument.
  std::string parse(int argc, char** argv, int first, const std::vector<Flag>& flags);

  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string get(const std::string& name, const std::string& fallback = "") const;

  // Typed getters: leave *out unchanged when the flag is absent; return an
  // error such as "--softcap: 'abc' is not a number".
  std::string get_double(const std::string& name, double* out) const;
  std::string get_int(const std::string& name, int64_t* out) const;
  // *out = index of the value in `choices`.
  std::string get_choice(const std::string& name, const std::vector<std::string>& choices,
                         int* out) const;

 private:
  std::map<std::string, std::string> values_;
};

// "  --name VALUE   help" lines for a usage text.
std::string describe_flags(const std::vector<Flag>& flags);

}  // namespace flce::cli

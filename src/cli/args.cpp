#include "cli/args.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace flce::cli {

std::string Args::parse(int argc, char** argv, int first, const std::vector<Flag>& flags) {
  const bool has_help = std::any_of(flags.begin(), flags.end(),
                                    [](const Flag& f) { return std::string(f.name) == "help"; });
  for (int i = first; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" && has_help) {  // as `flce -h` and `flce backends -h` take it
      values_["help"] = "";
      continue;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2)
      return "unexpected argument '" + arg + "' (options start with --; see --help)";
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) value = name.substr(eq + 1), name = name.substr(0, eq);
    const Flag* flag = nullptr;
    for (const Flag& f : flags)
      if (name == f.name) flag = &f;
    if (flag == nullptr) return "unknown option '--" + name + "' (see --help)";
    if (values_.count(name) && name != "help")  // -h --help asks once
      return "--" + name + ": given more than once";
    if (flag->value == nullptr) {
      if (inline_value) return "--" + name + ": takes no value (got '" + value + "')";
    } else if (!inline_value) {
      if (i + 1 >= argc) return "--" + name + ": missing its value " + flag->value;
      // `--out --grad` is a forgotten value, not a directory named "--grad";
      // a value that does start with -- can be given as --out=--grad.
      const std::string next = argv[i + 1];
      if (next.rfind("--", 0) == 0)
        return "--" + name + ": missing its value " + flag->value + " (the next argument is '" +
               next + "'; write --" + name + "=" + next + " if that is the value)";
      value = argv[++i];
    }
    if (flag->value != nullptr && value.empty())
      return "--" + name + ": empty value '' (expected " + flag->value + ")";
    values_[name] = value;
  }
  return "";
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

std::string Args::get_double(const std::string& name, double* out) const {
  if (!has(name)) return "";
  const std::string text = get(name);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || *end != '\0')
    return "--" + name + ": '" + text + "' is not a number";  // strtod skips leading spaces
  // ERANGE: overflow, or underflow, which a subnormal survives but a 0 from
  // nonzero text (1e-400) does not: that would turn an option off unasked.
  if (errno == ERANGE && (std::fabs(v) > 1 || v == 0))
    return "--" + name + ": '" + text + "' is out of range";
  *out = v;
  return "";
}

std::string Args::get_int(const std::string& name, int64_t* out) const {
  if (!has(name)) return "";
  const std::string text = get(name);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || *end != '\0')
    return "--" + name + ": '" + text + "' is not an integer";
  if (errno == ERANGE) return "--" + name + ": '" + text + "' is out of the 64-bit range";
  *out = v;
  return "";
}

std::string Args::get_choice(const std::string& name, const std::vector<std::string>& choices,
                             int* out) const {
  if (!has(name)) return "";
  const std::string text = get(name);
  std::string list;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (text == choices[i]) {
      *out = int(i);
      return "";
    }
    list += (i ? "|" : "") + choices[i];
  }
  return "--" + name + ": '" + text + "' is not one of " + list;
}

std::string describe_flags(const std::vector<Flag>& flags) {
  std::string s;
  for (const Flag& f : flags) {
    std::string left = std::string("  --") + f.name + (f.value ? std::string(" ") + f.value : "");
    if (left.size() < 28) left.resize(28, ' ');
    else left += "\n" + std::string(28, ' ');
    s += left + f.help + "\n";
  }
  return s;
}

}  // namespace flce::cli

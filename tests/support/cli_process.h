// tests/support/cli_process.h: running the `flce` binary (FLCE_CLI_PATH) from
// a test, with its output captured: to files, on a pseudo-terminal, or left
// running for a test that signals it.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace flce_test {

using CliArgs = std::vector<std::string>;  // what follows the binary's name

struct CliResult {
  int code = -1;  // exit status; -1 when killed by a signal
  std::string out, err;
};

// s in single quotes for sh, any ' inside escaped.
std::string shell_quote(const std::string& s);

// The whole file's bytes ("" when it cannot be read).
std::string slurp(const std::string& path);

// Runs the binary with `args` through sh: stdout and stderr to files in
// `scratch` (not a terminal), stdin from /dev/null; `env` ("NAME=value
// ...") is put in front through env(1).
CliResult run_cli(const CliArgs& args, const std::string& scratch, const std::string& env = "");

// Runs the binary on a pseudo-terminal (stdout and stderr both on it) and
// returns everything it printed; *code is the exit status, -1 if signalled.
std::string run_cli_on_terminal(const CliArgs& args, int* code);

// Starts the binary with stdin and stdout on /dev/null and stderr into
// `err_file` (/dev/null when empty); its pid, or -1. The caller waits for it.
pid_t spawn_cli(const CliArgs& args, const std::string& err_file = "");

}  // namespace flce_test

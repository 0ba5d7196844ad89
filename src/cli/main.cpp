// The `flce` command: run | backends | --help | --version.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/bench.h"
#include "cli/eval.h"
#include "cli/run.h"
#include "flce/flce.h"

namespace {

const char* kUsage =
    "usage: flce <command> [options]\n\n"
    "commands:\n"
    "  run        compute loss, lse, per-row outputs and gradients from .npy files\n"
    "  eval       stream a large data set (memory-mapped .npy) through the forward pass:\n"
    "             mean loss, perplexity, accuracy, entropy; per-token outputs\n"
    "  bench      time a generated problem against its GEMMs (one JSON line)\n"
    "  backends   list the backends in the order they are tried\n\n"
    "  flce --version     print the version\n"
    "  flce <command> --help\n\n"
    "The environment variable FLCE_BACKEND forces a backend by name.\n";

int list_backends_command(int argc, char** argv) {
  if (argc == 3 && (std::strcmp(argv[2], "--help") == 0 || std::strcmp(argv[2], "-h") == 0)) {
    std::puts("usage: flce backends\n\nLists the backends in the order they are tried, each\n"
              "with what it is or why it declines on this machine.");
    return 0;
  }
  if (argc > 2) {
    std::fprintf(stderr, "flce backends: error: takes no arguments\n");
    return 2;
  }
  for (const flce::BackendInfo& b : flce::list_backends())
    std::printf("%-12s %s\n", b.name.c_str(), b.description.c_str());
  return 0;
}

int dispatch(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string command = argv[1];
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (command == "--version") {
    std::printf("flce %s\n", flce::version());
    return 0;
  }
  if (command == "run") return flce::cli::run_command(argc, argv, 2);
  if (command == "eval") return flce::cli::eval_command(argc, argv, 2);
  if (command == "bench") return flce::cli::bench_command(argc, argv, 2);
  if (command == "backends") return list_backends_command(argc, argv);
  std::fprintf(stderr, "flce: error: unknown command '%s' (see flce --help)\n", command.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const int status = dispatch(argc, argv);
  // A report that did not reach stdout (a full disk) is a failure even where
  // the work itself succeeded. (A closed pipe ends the process with SIGPIPE
  // at the first write, as for other command-line tools.)
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "flce: error: writing standard output: %s\n",
                 errno ? std::strerror(errno) : "write failed");
    return 2;
  }
  return status;
}

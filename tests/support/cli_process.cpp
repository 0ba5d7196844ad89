#include "support/cli_process.h"

#include <fcntl.h>
#include <pty.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iterator>

namespace flce_test {
namespace {

// The CLI's argv for execv, FLCE_CLI_PATH first (the strings outlive the
// pointers).
struct CliArgv {
  std::vector<std::string> storage;
  std::vector<char*> argv;
  explicit CliArgv(const CliArgs& args) : storage{FLCE_CLI_PATH} {
    storage.insert(storage.end(), args.begin(), args.end());
    for (std::string& s : storage) argv.push_back(s.data());
    argv.push_back(nullptr);
  }
};

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

}  // namespace

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

CliResult run_cli(const CliArgs& args, const std::string& scratch, const std::string& env) {
  std::string cmd;
  if (!env.empty()) cmd.append("env ").append(env).append(" ");
  cmd += shell_quote(FLCE_CLI_PATH);
  for (const std::string& a : args) cmd.append(" ").append(shell_quote(a));
  const std::string o = scratch + "/stdout.txt", e = scratch + "/stderr.txt";
  cmd.append(" >").append(shell_quote(o)).append(" 2>").append(shell_quote(e));
  cmd.append(" </dev/null");
  const int status = std::system(cmd.c_str());
  CliResult r;
  if (status != -1) r.code = exit_code(status);
  r.out = slurp(o);
  r.err = slurp(e);
  return r;
}

std::string run_cli_on_terminal(const CliArgs& args, int* code) {
  CliArgv cli(args);
  *code = -1;
  int master = -1;
  const pid_t pid = ::forkpty(&master, nullptr, nullptr, nullptr);
  if (pid == 0) {
    ::execv(FLCE_CLI_PATH, cli.argv.data());
    ::_exit(127);
  }
  std::string text;
  if (pid < 0) return text;
  char buf[4096];
  for (;;) {
    const ssize_t got = ::read(master, buf, sizeof buf);
    if (got > 0) text.append(buf, size_t(got));
    else if (got < 0 && errno == EINTR) continue;
    else break;  // EIO once the child has exited and the terminal closed
  }
  ::close(master);
  int status = 0;
  ::waitpid(pid, &status, 0);
  *code = exit_code(status);
  return text;
}

pid_t spawn_cli(const CliArgs& args, const std::string& err_file) {
  CliArgv cli(args);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_RDWR);
    const int err =
        err_file.empty() ? null : ::open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(null, 0);
    ::dup2(null, 1);
    ::dup2(err, 2);
    ::execv(FLCE_CLI_PATH, cli.argv.data());
    ::_exit(127);
  }
  return pid;
}

}  // namespace flce_test

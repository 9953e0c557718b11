#pragma once
// Child processes for the integration tests: real sparrow-server / sparrow-client
// binaries on loopback, started with fork/exec, output to a log file, stopped with
// a signal (SIGTERM for a clean stop, SIGKILL for a crash).

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace sparrow::testing {

class Process {
 public:
  // Starts `argv[0]` with the given arguments; stdout and stderr go to `log_path`.
  Process(std::vector<std::string> argv, std::string log_path) : log_path_(std::move(log_path)) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
      }
      std::vector<char*> args;
      for (std::string& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
  }
  ~Process() {
    if (running()) {
      signal(SIGKILL);
      wait(std::chrono::seconds(10));
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  bool running() {
    if (pid_ <= 0 || status_) return false;
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = st;
      return false;
    }
    return true;
  }

  void signal(int sig) {
    if (running()) ::kill(pid_, sig);
  }

  // Waits for the process to exit; its exit code (128 + signal when killed), or
  // nullopt on timeout.
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (running()) {
      if (std::chrono::steady_clock::now() > until) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!status_) return std::nullopt;
    if (WIFEXITED(*status_)) return WEXITSTATUS(*status_);
    if (WIFSIGNALED(*status_)) return 128 + WTERMSIG(*status_);
    return -1;
  }

  // Waits until the process is one of ours and can take `sig`: its launcher
  // (core/launcher.cc) has blocked it or the program has a handler for it
  // (SigBlk or SigCgt in /proc/PID/status). Before that instant the child is
  // still between fork and the launcher's first instruction, where no program
  // can handle a signal; on a loaded machine that window can outlast a test's
  // 50 ms. False after `timeout` or when the process has ended.
  bool wait_signal_ready(int sig, std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    const unsigned long long bit = 1ULL << (sig - 1);
    // Before its exec the child is a copy of this test program, whose caught
    // signals (doctest's handlers, SIGTERM among them) it inherits: its mask
    // says nothing about the program yet. Only after the exec (its exe is no
    // longer ours) does a blocked or caught bit mean the program took over.
    char self[4096] = {0};
    const ssize_t self_n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    while (running()) {
      char exe[4096] = {0};
      const ssize_t exe_n = ::readlink(("/proc/" + std::to_string(pid_) + "/exe").c_str(), exe, sizeof exe - 1);
      if (exe_n <= 0 || (self_n > 0 && std::string(exe, exe_n) == std::string(self, self_n))) {
        if (std::chrono::steady_clock::now() >= until) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      std::ifstream in("/proc/" + std::to_string(pid_) + "/status");
      std::string line;
      unsigned long long mask = 0;
      while (std::getline(in, line))
        if (line.rfind("SigBlk:", 0) == 0 || line.rfind("SigCgt:", 0) == 0)
          mask |= std::stoull(line.substr(7), nullptr, 16);
      if (mask & bit) return true;
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }

  std::string log() const {
    std::ifstream in(log_path_);
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
  }

  // Polls the log until it contains `text`.
  bool wait_for_log(const std::string& text, std::chrono::milliseconds timeout) {
    return wait_for_any_log({text}, timeout) == 0;
  }

  // Polls the log until it contains one of `texts`; the index of the first
  // found (in `texts` order), or -1 after the timeout.
  int wait_for_any_log(const std::vector<std::string>& texts, std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const std::string text = log();
      for (size_t i = 0; i < texts.size(); ++i)
        if (text.find(texts[i]) != std::string::npos) return static_cast<int>(i);
      if (std::chrono::steady_clock::now() >= until) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
  std::string log_path_;
};

}  // namespace sparrow::testing

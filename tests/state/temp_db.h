#pragma once
// A database path unique to one test case (test cases run in parallel in one
// directory, each in a process of its own), removed with its -wal/-shm/-journal
// files before and after.

#include <unistd.h>

#include <cstdio>
#include <string>

namespace sparrow::state::testing {

class TempDb {
 public:
  explicit TempDb(const std::string& name)
      : path_("sparrow_state_test_" + name + "_" + std::to_string(::getpid()) + ".db") {
    remove_all();
  }
  ~TempDb() { remove_all(); }
  TempDb(const TempDb&) = delete;
  TempDb& operator=(const TempDb&) = delete;
  const std::string& path() const { return path_; }

 private:
  void remove_all() {
    for (const char* suffix : {"", "-wal", "-shm", "-journal"}) std::remove((path_ + suffix).c_str());
  }
  std::string path_;
};

}  // namespace sparrow::state::testing

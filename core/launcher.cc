// The launcher of a Sparrow program (cmake/program.cmake; docs/cli.md,
// "Signals"). build/bin/PROGRAM is this executable: it links only libc, so it
// starts in about a millisecond; it blocks SIGINT and SIGTERM and execs the
// program itself, build/libexec/PROGRAM. The signal mask and any pending
// signal are kept across execve, so a signal that arrives while the dynamic
// loader maps the program's ~300 shared libraries (0.2-0.3 s) stays pending,
// and the program's .preinit_array code (core/cli.h) installs its handlers and
// unblocks the two, which delivers it. Without the launcher such a signal met
// the kernel's default action and killed the program.
//
// Plain C library calls only (it loads nothing beyond the C and C++ runtimes).

#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifndef SPARROW_PROGRAM
#error "SPARROW_PROGRAM must name the program (cmake/program.cmake)"
#endif

int main(int, char** argv) {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  sigprocmask(SIG_BLOCK, &stop, nullptr);

  // <directory of this executable>/../libexec/PROGRAM
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) {
    fprintf(stderr, "%s: cannot find its own executable (/proc/self/exe): %s\n", SPARROW_PROGRAM, strerror(errno));
    return 1;
  }
  path[n] = '\0';
  char* slash = strrchr(path, '/');
  const char rel[] = "/../libexec/" SPARROW_PROGRAM;
  if (!slash || static_cast<size_t>(slash - path) + sizeof rel > sizeof path) {
    fprintf(stderr, "%s: executable path too long: %s\n", SPARROW_PROGRAM, path);
    return 1;
  }
  memcpy(slash, rel, sizeof rel);
  execv(path, argv);
  fprintf(stderr, "%s: cannot start %s: %s (is the build complete?)\n", SPARROW_PROGRAM, path, strerror(errno));
  return 1;
}

# Cross-compiles for 64-bit ARM Linux (arm64) with Debian's cross compiler
# (g++-aarch64-linux-gnu; scripts/setup.sh --arm64). Only the LibTorch-free
# lite runtime and, with the arm64 libraries installed, the networked lite
# client build this way (docs/lite.md, "arm64"):
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DSPARROW_LITE_ONLY=ON
# With qemu-user installed, ctest runs the arm64 binaries under qemu-aarch64.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Libraries come from arm64 folders only: the cross compiler's own
# (/usr/aarch64-linux-gnu: libc, libstdc++) and Debian's multiarch ones
# (/usr/lib/aarch64-linux-gnu), where the :arm64 packages of ZeroMQ,
# libsodium, spdlog, fmt, toml++ and FlatBuffers install (scripts/setup.sh
# --arm64). "/" is a root so that those multiarch paths are searched as they
# are; the host's x86-64 libraries stay out of reach because CMake's
# lib/<arch> folders are the target's (lib/aarch64-linux-gnu), never
# lib/x86_64-linux-gnu. Programs (flatc) are the host's. Headers and CMake
# package files may come from the host as well: what the build finds that way
# (Eigen, CLI11, doctest, cppzmq's zmq.hpp) is header-only and the same on
# every architecture.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# pkg-config (libzmq, libsodium) reads the arm64 .pc files, never the host's:
# a host libzmq.pc would hand the cross linker x86-64 libraries. A
# PKG_CONFIG_LIBDIR already set (another sysroot) is kept. Without the arm64
# packages nothing is found and the device build is the lite runtime only.
if(NOT DEFINED ENV{PKG_CONFIG_LIBDIR})
  set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)
endif()

# ctest, and doctest's test discovery at build time, run arm64 programs
# through qemu-user with the cross compiler's libraries as the root. qemu
# falls back to the host's paths for what that root lacks: the multiarch
# libraries (libzmq...) load from /usr/lib/aarch64-linux-gnu. With the
# multiarch libc6:arm64 installed too (a dependency of those packages), the
# guest's loader would find that libc (another Debian revision) before the
# root's and pair it with the root's ld-linux: LD_LIBRARY_PATH keeps libc,
# libm, libstdc++ and libgcc_s those the binaries were linked against.
find_program(SPARROW_QEMU_AARCH64 qemu-aarch64)
if(SPARROW_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${SPARROW_QEMU_AARCH64} -L /usr/aarch64-linux-gnu
                                    -E LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib)
endif()

# GCC notes that C++17 changed how std::pair is passed on aarch64 (GCC 10.1);
# everything here is built by one compiler, so the note is noise.
set(CMAKE_CXX_FLAGS_INIT "-Wno-psabi")

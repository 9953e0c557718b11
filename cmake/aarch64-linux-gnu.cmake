# Cross-compiles for 64-bit ARM Linux (arm64) with Debian's cross compiler
# (g++-aarch64-linux-gnu; scripts/setup.sh --arm64). Only the LibTorch-free
# lite runtime builds this way (docs/lite.md, "arm64"):
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DSPARROW_LITE_ONLY=ON
# With qemu-user installed, ctest runs the arm64 binaries under qemu-aarch64.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Libraries and programs come from the arm64 sysroot only. Headers and CMake
# package files may come from the host as well: what the lite build finds
# that way (Eigen, CLI11, doctest) is header-only and the same on every
# architecture.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# ctest, and doctest's test discovery at build time, run arm64 programs
# through qemu-user with the cross compiler's libraries as the root.
find_program(SPARROW_QEMU_AARCH64 qemu-aarch64)
if(SPARROW_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${SPARROW_QEMU_AARCH64} -L /usr/aarch64-linux-gnu)
endif()

# GCC notes that C++17 changed how std::pair is passed on aarch64 (GCC 10.1);
# everything here is built by one compiler, so the note is noise.
set(CMAKE_CXX_FLAGS_INIT "-Wno-psabi")

#pragma once
// SPARROW_SIMD_CLONES: compile a vectorisable loop for AVX-512, AVX2 and the
// x86-64 baseline, and let the loader pick one (GCC function
// multi-versioning), so the binary still runs on any x86-64 but uses the wide
// registers where the CPU has them. Elsewhere (Clang, other architectures) it
// expands to nothing and the loop is compiled for the baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPARROW_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SPARROW_SIMD_CLONES
#endif

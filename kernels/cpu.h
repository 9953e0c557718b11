#pragma once
// The one place that asks the CPU what it has, and the one override that
// limits which kernel variants run. Every kernel with vectorised variants
// (kernels/*_avx2.cc, *_avx512.cc) picks through isa_enabled(); nothing else
// calls __builtin_cpu_supports.
//
// Variants are ordered: reference (portable C++ or Eigen compiled for the
// architecture's baseline, on every CPU) < avx2 (AVX2 + FMA) < avx512
// (AVX-512 F, VL, DQ, BW). A kernel runs the best variant it has that is
// enabled; a kernel without an avx2 variant runs its reference under "avx2".
//
// The override: SPARROW_KERNELS=reference|avx2|avx512|auto in the environment,
// read once at the first kernel call (auto, or unset: the best this CPU has).
// A variant the CPU lacks, or an unknown name, throws sparrow::ConfigError
// naming the variable. Tests force a variant in-process with ScopedIsa.
//
// Not covered: loops marked SPARROW_SIMD_CLONES (kernels/simd.h) are cloned
// by the compiler and picked by the loader; they compute the same values in
// every clone up to float rounding of vectorised sums.

#include <string>
#include <vector>

namespace sparrow::kernels {

enum class Isa { kReference = 0, kAvx2 = 1, kAvx512 = 2 };

// What the CPU has, probed once (all false off x86-64).
struct CpuFeatures {
  bool avx2_fma = false;  // AVX2 and FMA
  bool avx512 = false;    // AVX-512 F, VL, DQ and BW
};
const CpuFeatures& cpu_features();

// "reference", "avx2", "avx512".
const char* isa_name(Isa isa);

// The variants this CPU can run, reference first.
std::vector<Isa> supported_isas();

// The best variant kernels may run now: the CPU's best, lowered by
// SPARROW_KERNELS or a ScopedIsa.
Isa max_isa();

// Whether a kernel may run its `isa` variant now.
inline bool isa_enabled(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(max_isa()); }

// Whether kernels may call an optimised library (libxsmm, the BLAS), which
// detects the CPU on its own: false only while the reference is forced
// (SPARROW_KERNELS=reference or ScopedIsa(kReference)); then they run the
// portable reference (gemm.h's) instead. On a CPU without AVX2, where the
// reference is all there is, the libraries still run.
bool libraries_enabled();

// Forces max_isa() to `isa` until destroyed (then restores the previous
// setting). For tests and benchmarks: not safe while another thread runs
// kernels. Throws sparrow::Error when the CPU lacks `isa`.
class ScopedIsa {
 public:
  explicit ScopedIsa(Isa isa);
  ~ScopedIsa();
  ScopedIsa(const ScopedIsa&) = delete;
  ScopedIsa& operator=(const ScopedIsa&) = delete;

 private:
  Isa previous_;
  bool previous_forced_;
};

// Throws sparrow::Error when this CPU lacks an instruction set that code was
// compiled for (`avx2_fma`, `avx512f`: the -m flags of the caller's file;
// see SPARROW_KERNELS_REQUIRE_BUILD_ISA), naming `build` and how to rebuild,
// instead of dying of SIGILL mid-step.
void require_build_isa(bool avx2_fma, bool avx512f, const char* build, const char* rebuild_hint);

}  // namespace sparrow::kernels

// require_build_isa for the instruction sets the including file is compiled for.
#if defined(__AVX512F__)
#define SPARROW_KERNELS_BUILD_AVX512F true
#else
#define SPARROW_KERNELS_BUILD_AVX512F false
#endif
#if defined(__AVX2__) || defined(__FMA__)
#define SPARROW_KERNELS_BUILD_AVX2_FMA true
#else
#define SPARROW_KERNELS_BUILD_AVX2_FMA false
#endif
#define SPARROW_KERNELS_REQUIRE_BUILD_ISA(build, hint) \
  ::sparrow::kernels::require_build_isa(SPARROW_KERNELS_BUILD_AVX2_FMA, SPARROW_KERNELS_BUILD_AVX512F, build, hint)

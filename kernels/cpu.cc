#include "kernels/cpu.h"

#include <atomic>
#include <cstdlib>

#include "core/error.h"

namespace sparrow::kernels {
namespace {

CpuFeatures probe() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = f.avx2_fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
#endif
  return f;
}

Isa best_isa() {
  const CpuFeatures& f = cpu_features();
  return f.avx512 ? Isa::kAvx512 : f.avx2_fma ? Isa::kAvx2 : Isa::kReference;
}

bool supported(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(best_isa()); }

std::string supported_list() {
  std::string s;
  for (Isa i : supported_isas()) s += (s.empty() ? "" : ", ") + std::string(isa_name(i));
  return s;
}

// Whether the reference was asked for (not merely all the CPU has).
std::atomic<bool>& forced_reference() {
  static std::atomic<bool> v{false};
  return v;
}

Isa from_environment() {
  const char* env = std::getenv("SPARROW_KERNELS");
  const std::string v = env ? env : "";
  if (v == "reference") forced_reference().store(true);
  if (v.empty() || v == "auto") return best_isa();
  for (Isa i : {Isa::kReference, Isa::kAvx2, Isa::kAvx512})
    if (v == isa_name(i)) {
      SPARROW_CHECK_T(ConfigError, supported(i),
                      "SPARROW_KERNELS=" << v << ": this CPU cannot run it (it can: " << supported_list() << ")");
      return i;
    }
  SPARROW_CHECK_T(ConfigError, false, "SPARROW_KERNELS=" << v << " is not one of reference, avx2, avx512, auto");
  return Isa::kReference;
}

// -1 until the first max_isa(); then the variant as an int.
std::atomic<int>& current() {
  static std::atomic<int> v{-1};
  return v;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = probe();
  return f;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kReference:
      return "reference";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> v{Isa::kReference};
  if (supported(Isa::kAvx2)) v.push_back(Isa::kAvx2);
  if (supported(Isa::kAvx512)) v.push_back(Isa::kAvx512);
  return v;
}

Isa max_isa() {
  int v = current().load(std::memory_order_relaxed);
  if (v < 0) {
    // Read once; a bad value throws at every call until fixed (nothing is cached).
    v = static_cast<int>(from_environment());
    int expected = -1;
    current().compare_exchange_strong(expected, v);
    v = current().load(std::memory_order_relaxed);
  }
  return static_cast<Isa>(v);
}

bool libraries_enabled() {
  max_isa();  // reads the environment once
  return !forced_reference().load(std::memory_order_relaxed);
}

ScopedIsa::ScopedIsa(Isa isa) : previous_(max_isa()), previous_forced_(forced_reference().load()) {
  SPARROW_CHECK_T(
      Error, supported(isa),
      "kernel variant " << isa_name(isa) << " needs a CPU feature this one lacks (it can: " << supported_list() << ")");
  current().store(static_cast<int>(isa));
  forced_reference().store(isa == Isa::kReference);
}

ScopedIsa::~ScopedIsa() {
  current().store(static_cast<int>(previous_));
  forced_reference().store(previous_forced_);
}

void require_build_isa(bool avx2_fma, bool avx512f, const char* build, const char* rebuild_hint) {
  const CpuFeatures& f = cpu_features();
#if defined(__x86_64__) || defined(__i386__)
  SPARROW_CHECK_T(Error, !avx512f || f.avx512, build << " needs AVX-512 and this CPU lacks it: " << rebuild_hint);
  SPARROW_CHECK_T(Error, !avx2_fma || f.avx2_fma,
                  build << " needs AVX2 and FMA and this CPU lacks them: " << rebuild_hint);
#else
  (void)f, (void)avx2_fma, (void)avx512f, (void)build, (void)rebuild_hint;
#endif
}

}  // namespace sparrow::kernels

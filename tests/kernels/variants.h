#pragma once
// Running a test body once per kernel variant this CPU has (kernels/cpu.h):
// reference always, avx2 and avx512 where the CPU has them. The variants this
// CPU lacks are named once per test binary (a doctest MESSAGE), so a run on
// an older CPU says plainly what it did not test.

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kernels/cpu.h"

namespace sparrow::kernels::testing {

inline std::vector<Isa> variants_to_test() {
  static const bool said = [] {
    std::string skipped;
    const std::vector<Isa> have = supported_isas();
    for (Isa i : {Isa::kReference, Isa::kAvx2, Isa::kAvx512}) {
      bool found = false;
      for (Isa h : have) found = found || h == i;
      if (!found) skipped += (skipped.empty() ? "" : ", ") + std::string(isa_name(i));
    }
    if (!skipped.empty()) MESSAGE("kernel variants skipped on this CPU (it lacks them): " << skipped);
    return true;
  }();
  (void)said;
  return supported_isas();
}

// f() once per variant, under ScopedIsa; the variant is in every failure's context.
template <typename F>
void for_each_variant(F&& f) {
  for (Isa isa : variants_to_test()) {
    ScopedIsa scoped(isa);
    INFO("kernel variant " << isa_name(isa));
    f(isa);
  }
}

}  // namespace sparrow::kernels::testing

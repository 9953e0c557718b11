#pragma once
// libsodium's one-time initialisation, for the files of sparrow_secagg.
#include <sodium.h>

#include "core/error.h"

namespace sparrow::secagg {

inline void init_sodium() {
  static const int ok = sodium_init();
  SPARROW_CHECK(ok >= 0, "secagg: libsodium failed to initialise");
}

}  // namespace sparrow::secagg

#pragma once
// Include this instead of <doctest/doctest.h> in every test. Debian's LibTorch
// pulls in glog, whose CHECK/CHECK_EQ/... macros silently replace doctest's when
// ATen is included after doctest: a failing CHECK then aborts the whole binary
// instead of being reported. Including ATen first and dropping glog's macros
// before doctest defines its own keeps doctest's semantics everywhere.

#include <ATen/ATen.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LE
#undef CHECK_LT
#undef CHECK_GE
#undef CHECK_GT
#undef CHECK_NOTNULL

#include <doctest/doctest.h>

#pragma once
// The products and the QR of act_math.h on Eigen, written once and compiled
// once per instruction set: act_math.cc builds the baseline variant and, on
// x86-64, act_math_avx2.cc an AVX2 + FMA one (1.7x on a rank-256 streaming
// basis over 64 x 3136 activations), which act_math.cc picks on a CPU that
// has them. Private to those two files.
//
// A file that includes this first defines SPARROW_ACT_MATH_NS (the namespace
// of its variant) and renames Eigen's namespace by macro: Eigen is all inline
// templates, and two copies with the same symbol names compiled for different
// instruction sets would be merged by the linker into one, which could hand
// AVX2 code to a CPU without it (or mix our copy with sparrow_lite's, which
// is built with its own flags).

#include <Eigen/Core>
#include <Eigen/Householder>
#include <Eigen/QR>
#include <cstdint>

namespace sparrow::edge::flat::detail::SPARROW_ACT_MATH_NS {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMajor>;
using Map = Eigen::Map<RowMajor>;

}  // namespace

void matmul(const float* a, const float* b, int64_t n, int64_t k, int64_t m, float* out) {
  Map(out, n, m).noalias() = ConstMap(a, n, k) * ConstMap(b, k, m);
}

void matmul_tn(const float* a, const float* b, int64_t k, int64_t n, int64_t m, float* out) {
  Map(out, n, m).noalias() = ConstMap(a, k, n).transpose() * ConstMap(b, k, m);
}

void matmul_nt(const float* a, const float* b, int64_t n, int64_t k, int64_t m, float* out) {
  Map(out, n, m).noalias() = ConstMap(a, n, k) * ConstMap(b, m, k).transpose();
}

void orthonormalize(float* a, int64_t n, int64_t r) {
  // Column-major for the QR: Eigen's Householder kernels work on columns.
  Eigen::MatrixXf m = ConstMap(a, n, r);
  Eigen::HouseholderQR<Eigen::Ref<Eigen::MatrixXf>> qr(m);
  Eigen::MatrixXf q = Eigen::MatrixXf::Identity(n, r);
  q.applyOnTheLeft(qr.householderQ());
  Map(a, n, r) = q;
}

}  // namespace sparrow::edge::flat::detail::SPARROW_ACT_MATH_NS

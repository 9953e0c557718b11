#pragma once
// Counter-based random numbers: value i of stream `key` is a pure function of
// (key, i). Results do not depend on thread count or iteration order, are the
// same on every party that knows the key (PowerSGD's Q, random-k indices), and
// are the same on CPU and GPU. The mixer is SplitMix64's finaliser, which passes
// BigCrush when used this way (Steele et al., "Fast splittable PRNGs", 2014).

#include <cmath>
#include <cstdint>
#include <string_view>

namespace sparrow::rng {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element i of stream `key`.
inline constexpr uint64_t at(uint64_t key, uint64_t i) { return mix64(key + (i + 1) * kGolden); }

// Derive a sub-stream key (e.g. seed → per-tensor → per-step).
inline constexpr uint64_t derive(uint64_t key, uint64_t tag) { return mix64(key ^ mix64(tag + kGolden)); }

// FNV-1a of a name, for deriving per-tensor keys from tensor names.
inline constexpr uint64_t hash_name(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}

// Uniform in [0, 1) with 24 random bits (exactly representable as float).
inline float uniform01(uint64_t key, uint64_t i) { return static_cast<float>(at(key, i) >> 40) * (1.0f / 16777216.0f); }

// Uniform integer in [0, n) (Lemire's multiply-shift; bias < n / 2^64).
inline uint64_t below(uint64_t key, uint64_t i, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(at(key, i)) * n) >> 64);
}

// Standard normal via Box–Muller on two 32-bit halves; deterministic per (key, i).
inline float normal(uint64_t key, uint64_t i) {
  const uint64_t r = at(key, i);
  const double u1 = (static_cast<double>(r >> 32) + 1.0) * (1.0 / 4294967296.0);  // (0, 1]
  const double u2 = static_cast<double>(r & 0xffffffffull) * (1.0 / 4294967296.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// A small sequential generator for code that draws a variable number of values.
class Stream {
 public:
  explicit Stream(uint64_t key) : key_(key) {}
  uint64_t next() { return at(key_, counter_++); }
  uint64_t below(uint64_t n) { return rng::below(key_, counter_++, n); }
  float uniform() { return uniform01(key_, counter_++); }

 private:
  uint64_t key_;
  uint64_t counter_ = 0;
};

}  // namespace sparrow::rng

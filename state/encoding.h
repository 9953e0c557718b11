#pragma once
// How a client state's float tensors are stored (the `state_encoding` key of
// sparrow-sim and sparrow-client). fp32 stores them bit for bit. bf16 stores
// the tensors whose precision only perturbs training, each float32 rounded to
// bfloat16 (round to nearest, ties to even), and widens them again on load:
// half the bytes of an error-feedback codec's state. docs/state.md, "Compact
// state", says which tensors and what it costs in accuracy.

#include <cstddef>
#include <cstdint>
#include <string>

namespace sparrow::state {

enum class Encoding : uint8_t { kFp32 = 0, kBf16 = 1 };

// Whether parse_encoding accepts `value` ("fp32" or "bf16"), for a config
// check that names its own key and where it was set.
bool valid_encoding(const std::string& value);
// Throws ConfigError naming `key` for anything but "fp32" or "bf16".
Encoding parse_encoding(const std::string& value, const std::string& key = "state_encoding");
const char* encoding_name(Encoding e);

// Compressor state slots that bf16 may store narrow: error-feedback residuals
// and DGC's momentum and accumulator. Any other slot (PowerSGD's warm-start
// factor `q`, a future codec's) keeps float32 until its effect is measured.
bool narrowable_slot(const std::string& slot);

// Whether every one of n float32 values has a bf16 form: false for NaN,
// +-inf and a finite value beyond bf16's range (it would round to infinity);
// `first_bad` gets the index of the first such value.
bool fits_bf16(const float* v, size_t n, size_t* first_bad);
// float32 -> bfloat16, round to nearest even, n values. Returns false (and
// leaves `out` partly written) when a value is NaN or infinite, or finite but
// beyond bfloat16's range (it would round to infinity). `first_bad` gets the
// index of that value.
bool to_bf16(const float* in, uint16_t* out, size_t n, size_t* first_bad);
// The same rounding in place: each float becomes the float32 value its bf16
// round trip gives. Checks every value first, so on false nothing changed.
bool round_to_bf16(float* v, size_t n, size_t* first_bad);
// bfloat16 -> float32 (exact).
void from_bf16(const uint16_t* in, float* out, size_t n);

}  // namespace sparrow::state

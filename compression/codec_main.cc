// sparrow-codec: the compression library from the command line.
//
//   sparrow-codec --method SPEC --in x.npy [--steps N] [--seed S] [--out last.npy] [--out-mean mean.npy]
//   sparrow-codec tour [--data DIR] [--batch B] [--seed S]
//
// The first form encodes x N times with persistent compressor state, sends each
// encoding through the wire format (serialise, verify, parse) and decodes it,
// then prints one JSON line. For acp it also plays the aggregator, feeding the
// shared factor back each round. Bad input: a message on stderr, exit status 2,
// nothing written.

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <iostream>

#include "core/cli.h"
#include "core/error_text.h"
#include "compression/compressor.h"
#include "compression/tour.h"
#include "core/json.h"
#include "core/idx.h"
#include "wire/roundtrip.h"
#include "core/error.h"
#include "core/npy.h"

namespace {

using namespace sparrow;
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
      continue;
    }
    out += c;
  }
  return out + "\"";
}

int run_codec(const std::string& method, const std::string& in, int steps, uint64_t seed, const std::string& out,
              const std::string& out_mean) {
  auto compressor = compression::make_compressor(method);
  npy::Array a = npy::read(in);
  at::Tensor x = at::from_blob(a.data.data(), a.shape, at::TensorOptions().dtype(at::kFloat)).clone();
  for (const float v : a.data)
    SPARROW_CHECK_T(FormatError, std::isfinite(v), "'" << in << "' contains NaN or infinity");

  wire::RoundTrip trip(*compressor, seed);
  at::Tensor sum = at::zeros_like(x);
  at::Tensor last;
  double encode_ms = 0, decode_ms = 0;
  size_t wire_bytes = 0;
  for (int step = 0; step < steps; ++step) {
    wire::RoundTripResult r = trip.step({{"x", x}});
    encode_ms += r.encode_ms;
    decode_ms += r.decode_ms;
    wire_bytes = r.wire_bytes;
    last = r.decoded.at(0);
    sum += last;
  }
  const double xnorm = x.norm().item<double>();
  const double err = (last - x).norm().item<double>();
  const double rel = xnorm > 0 ? err / xnorm : (err == 0 ? 0.0 : INFINITY);
  // Outputs are written only after everything succeeded; each write is atomic.
  if (!out.empty()) npy::write(out, a.shape, last.contiguous().data_ptr<float>());
  if (!out_mean.empty()) {
    at::Tensor mean = (sum / steps).contiguous();
    npy::write(out_mean, a.shape, mean.data_ptr<float>());
  }
  const double dense = 4.0 * static_cast<double>(x.numel());
  std::cout << "{\"method\":" << json_string(method) << ",\"elements\":" << x.numel()
            << ",\"dense_bytes\":" << static_cast<int64_t>(dense) << ",\"wire_bytes\":" << wire_bytes
            << ",\"ratio\":" << json_number(wire_bytes ? dense / static_cast<double>(wire_bytes) : 0.0)
            << ",\"steps\":" << steps << ",\"encode_ms\":" << json_number(encode_ms / steps)
            << ",\"decode_ms\":" << json_number(decode_ms / steps) << ",\"rel_error\":" << json_number(rel) << "}"
            << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sparrow-codec: encode a tensor with a Sparrow compressor through the wire format"};
  app.set_version_flag("--version", "sparrow-codec 0.1");
  std::string method, in, out, out_mean;
  int steps = 1;
  uint64_t seed = 0;
  app.add_option("--method", method, "compressor spec, e.g. dgc:ratio=0.001 or qsgd:levels=16");
  app.add_option("--in", in, "float32 C-order .npy input")->check(CLI::ExistingFile);
  app.add_option("--steps", steps, "encode/decode the input this many times with persistent state")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "run seed shared by encoder and decoder");
  app.add_option("--out", out, "write the last decoded tensor here (.npy)");
  app.add_option("--out-mean", out_mean, "write the mean of the decoded tensors here (.npy)");

  std::string data_dir = sparrow::core::kFashionMnistDir;
  int batch = 64;
  auto* tour = app.add_subcommand("tour", "every compressor on a real MLP gradient from Fashion-MNIST, as a table");
  tour->add_option("--data", data_dir, "MNIST-format dataset folder");
  tour->add_option("--batch", batch, "batch size of the gradient step")->check(CLI::PositiveNumber);
  tour->add_option("--seed", seed, "seed for the model and the compressors");

  std::string log_level = "warn";
  sparrow::cli::add_common_options(app, "sparrow-codec", &log_level);
  if (const int rc = sparrow::cli::parse(app, argc, argv); rc >= 0) return rc;
  sparrow::cli::setup_logging("sparrow-codec", log_level);
  return sparrow::cli::run_main([&] {
    if (*tour) return sparrow::compression::run_tour(data_dir, batch, seed, std::cout);
    if (method.empty() || in.empty()) {
      spdlog::error("event=usage_error msg=\"--method and --in are required (or use the 'tour' subcommand)\"");
      return sparrow::cli::kBadInput;
    }
    return run_codec(method, in, steps, seed, out, out_mean);
  });
}

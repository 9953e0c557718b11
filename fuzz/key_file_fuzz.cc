// libFuzzer target: the CurveZMQ certificate files an operator copies to a host
// (`.key` / `.key_secret`, ZeroMQ's format), as the server, the client, the
// cloud and the device read them. load_keypair and load_public_key must
// return keys or throw sparrow::Error (ConfigError); nothing else.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "wire/net.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("sparrow_fuzz_key_" + std::to_string(::getpid()));
  static const bool made = std::filesystem::create_directories(dir) || true;
  (void)made;
  const std::filesystem::path file = dir / "peer.key_secret";
  {
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    (void)sparrow::net::load_keypair(file.string());
  } catch (const sparrow::Error&) {
  }
  try {
    (void)sparrow::net::load_public_key(file.string());
  } catch (const sparrow::Error&) {
  }
  return 0;
}

// libFuzzer target: the allow-list file an operator writes (one Z85 key or a
// .key path per line, comments). load_allow_list must return keys or throw
// sparrow::Error (ConfigError); nothing else.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "wire/net.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A private folder: entries that name files resolve inside it.
  static const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("sparrow_fuzz_allow_" + std::to_string(::getpid()));
  static const bool made = std::filesystem::create_directories(dir) || true;
  (void)made;
  const std::filesystem::path list = dir / "allow.txt";
  {
    std::ofstream f(list, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    (void)sparrow::net::load_allow_list(list.string());
  } catch (const sparrow::Error&) {
  }
  return 0;
}

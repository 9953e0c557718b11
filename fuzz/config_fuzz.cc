// libFuzzer target: TOML config text, as `sparrow-sim --config` and
// `sparrow-server serve --config` read it. The parsers must return a config
// that passed validation or throw sparrow::Error (ConfigError naming the key
// or the TOML syntax error); nothing else. The first byte picks the parser.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "server/config.h"
#include "simulator/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] & 1)
      (void)sparrow::server::parse_server_config(text);
    else
      (void)sparrow::simulator::parse_config_string(text);
  } catch (const sparrow::Error&) {
  }
  return 0;
}

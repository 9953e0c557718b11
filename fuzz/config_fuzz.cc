// libFuzzer target: TOML config text, as `sparrow-sim --config`,
// `sparrow-server serve --config`, `sparrow-client --config`,
// `sparrow-edge serve --config` and `sparrow-edge --config` read it. The
// parsers must return a config that passed validation or throw sparrow::Error
// (ConfigError naming the key or the TOML syntax error); nothing else. The
// first byte picks the parser.
#include <cstddef>
#include <cstdint>
#include <string>

#include "client/session.h"
#include "core/error.h"
#include "edge/cloud.h"
#include "edge/device.h"
#include "server/config.h"
#include "simulator/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 5) {
      case 0:
        (void)sparrow::simulator::parse_config_string(text);
        break;
      case 1:
        (void)sparrow::server::parse_server_config(text);
        break;
      case 2:
        (void)sparrow::client::parse_session_config(text);
        break;
      case 3:
        (void)sparrow::edge::parse_cloud_config(text);
        break;
      default:
        (void)sparrow::edge::parse_device_config(text);
        break;
    }
  } catch (const sparrow::Error&) {
  }
  return 0;
}

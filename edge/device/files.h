#pragma once
// The split device's files and folders, checked before anything is loaded or
// connected, written once for sparrow-edge (edge::DeviceConfig) and
// sparrow-edge-lite (liteedge::DeviceConfig): both structs have these keys
// (config_keys.h). A bad path is a ConfigError that names its key (core/paths.h),
// so the two programs refuse the same config with the same message.

#include <string>

namespace sparrow::edge::device {

// The keys check_device_files reads.
struct DeviceFiles {
  std::string progress;  // "" = none; else a file that can be written
  std::string cloud_key, key;
  bool insecure = false;  // true: no key files are read
  std::string weights;    // "" = none; else a readable file
  std::string data;       // "folder:PATH" (PATH checked as `data`), "fashion-mnist..." (data_dir checked), else none
  std::string data_dir;
};

// ConfigError naming the key of the first bad path; then a warning
// (event=key_permissions) when the secret key file is readable by others.
void check_files(const DeviceFiles& files);

// The same, for either device's config.
template <class C>
void check_device_files(const C& c) {
  check_files(DeviceFiles{c.progress, c.cloud_key, c.key, c.insecure, c.weights, c.data, c.data_dir});
}

}  // namespace sparrow::edge::device

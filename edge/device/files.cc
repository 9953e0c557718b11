#include "edge/device/files.h"

#include <spdlog/spdlog.h>

#include "core/paths.h"

namespace sparrow::edge::device {

void check_files(const DeviceFiles& f) {
  if (!f.progress.empty()) core::check_file_path("progress", f.progress);
  if (!f.insecure) {
    core::check_input_file("cloud_key", f.cloud_key);
    core::check_input_file("key", f.key);
  }
  if (!f.weights.empty()) core::check_input_file("weights", f.weights);
  if (f.data.rfind("folder:", 0) == 0)
    core::check_data_folder("data", f.data.substr(7));
  else if (f.data.rfind("fashion-mnist", 0) == 0)
    core::check_data_folder("data_dir", f.data_dir);
  if (const std::string w = f.insecure ? "" : core::secret_file_warning("key", f.key); !w.empty())
    spdlog::warn("event=key_permissions msg=\"{}\"", w);
}

}  // namespace sparrow::edge::device

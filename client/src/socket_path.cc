#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "trainstream/client.h"

namespace trainstream {

std::string EmbeddedSocketPath() {
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    return std::string(xdg) + "/trainstream/trainstreamd.sock";
  }
  return "/tmp/trainstream-" + std::to_string(geteuid()) + "/trainstreamd.sock";
}

std::string DefaultSocketPath() {
  if (const char* env = std::getenv("TRAINSTREAM_SOCKET"); env != nullptr && *env != '\0')
    return env;
  static const char kSystem[] = "/run/trainstream/trainstreamd.sock";
  struct stat st {};
  if (stat(kSystem, &st) == 0 && S_ISSOCK(st.st_mode)) return kSystem;
  return EmbeddedSocketPath();
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
  }
  return 0;
}

}  // namespace trainstream

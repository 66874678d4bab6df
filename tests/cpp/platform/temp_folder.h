// A fresh folder under the system's temporary one for the platform seam's file
// tests, removed with its contents at the end of the test.
#pragma once

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <system_error>

namespace trainstream::platform::testing {

struct TempFolder {
  std::filesystem::path path;
  explicit TempFolder(const std::string& prefix) {
    std::random_device seed;
    path = std::filesystem::temp_directory_path() / (prefix + std::to_string(seed()));
    std::filesystem::create_directory(path);
  }
  ~TempFolder() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;

  // Writes `text` into the file `name` in the folder; returns its path.
  std::string Write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
    return (path / name).u8string();
  }
  std::string operator/(const std::string& name) const { return (path / name).u8string(); }
};

}  // namespace trainstream::platform::testing

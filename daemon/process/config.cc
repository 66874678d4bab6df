#include "process/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "trainstream/platform/default_endpoint.h"
#include "trainstream/platform/machine.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/threads.h"

namespace trainstream::daemon {
namespace {

std::string Trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

Status Invalid(const std::string& msg) { return Status(StatusCode::kInvalidArgument, msg); }

Status ParseUnsigned(const std::string& text, const std::string& field, uint64_t* out) {
  if (text.empty() || !std::all_of(text.begin(), text.end(), ::isdigit)) {
    return Invalid(field + ": expected a non-negative integer, got '" + text + "'");
  }
  errno = 0;
  unsigned long long v = std::strtoull(text.c_str(), nullptr, 10);
  if (errno == ERANGE) return Invalid(field + ": '" + text + "' is out of range");
  *out = v;
  return Status::Ok();
}

Status ParseBool(const std::string& text, const std::string& field, bool* out) {
  if (text == "true" || text == "yes" || text == "on" || text == "1") {
    *out = true;
  } else if (text == "false" || text == "no" || text == "off" || text == "0") {
    *out = false;
  } else {
    return Invalid(field + ": expected true or false, got '" + text + "'");
  }
  return Status::Ok();
}

}  // namespace

Status ParseBytes(const std::string& raw, const std::string& field, uint64_t* out) {
  const std::string text = Trim(raw);
  if (text.empty()) return Invalid(field + ": empty size");
  size_t end = 0;
  while (end < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[end])) || text[end] == '.')) {
    ++end;
  }
  if (end == 0) return Invalid(field + ": '" + text + "' does not start with a number");
  std::string unit = Trim(text.substr(end));
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.size() == 2 && unit[1] == 'B') unit.resize(1);          // "64GB" == "64G"
  if (unit.size() == 3 && unit.substr(1) == "IB") unit.resize(1);  // "64GiB"
  double mult = 1;
  if (unit.empty() || unit == "B") {
    mult = 1;
  } else if (unit == "K") {
    mult = 1024.0;
  } else if (unit == "M") {
    mult = 1024.0 * 1024;
  } else if (unit == "G") {
    mult = 1024.0 * 1024 * 1024;
  } else if (unit == "T") {
    mult = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return Invalid(field + ": unknown unit '" + unit + "' in '" + text +
                   "' (use bytes or a K, M, G or T suffix)");
  }
  char* stop = nullptr;
  const std::string number = text.substr(0, end);
  double v = std::strtod(number.c_str(), &stop);
  if (stop != number.c_str() + number.size() || !std::isfinite(v)) {
    return Invalid(field + ": '" + text + "' is not a number");
  }
  double bytes = v * mult;
  if (bytes < 0 || bytes >= 1.8e19) return Invalid(field + ": '" + text + "' is out of range");
  *out = static_cast<uint64_t>(bytes);
  return Status::Ok();
}

Status ParseBudget(const std::string& raw, uint64_t ram_bytes, uint64_t* out) {
  const std::string text = Trim(raw);
  if (!text.empty() && text.back() == '%') {
    char* stop = nullptr;
    const std::string number = Trim(text.substr(0, text.size() - 1));
    double pct = std::strtod(number.c_str(), &stop);
    if (number.empty() || stop != number.c_str() + number.size() || !std::isfinite(pct) ||
        pct <= 0 || pct > 100) {
      return Invalid("budget: '" + text + "' must be a percentage in (0, 100]");
    }
    *out = static_cast<uint64_t>(static_cast<double>(ram_bytes) * pct / 100.0);
    return Status::Ok();
  }
  Status s = ParseBytes(text, "budget", out);
  if (s.ok() && *out == 0) return Invalid("budget: must be > 0");
  return s;
}

Status ParseConfigText(const std::string& text, const std::string& origin, DaemonConfig* config) {
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    const std::string where = origin + ":" + std::to_string(lineno);
    size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    line = Trim(line);
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == std::string::npos)
      return Invalid(where + ": expected `key = value`, got '" + line + "'");
    std::string key = Trim(line.substr(0, eq));
    std::string value = Trim(line.substr(eq + 1));
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') {
      value = value.substr(1, value.size() - 2);
    }
    const std::string field = where + ": " + key;
    Status s;
    uint64_t n = 0;
    if (key == "socket") {
      config->socket_path = value;
    } else if (key == "shm_dir") {
      config->shm_dir = value;
    } else if (key == "budget") {
      uint64_t ignored = 0;
      s = ParseBudget(value, 1ull << 40, &ignored);  // syntax check; resolved at startup
      if (s.ok()) config->budget = value;
    } else if (key == "log_level") {
      static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
      bool known = false;
      for (const char* l : kLevels) known = known || value == l;
      if (!known) {
        s = Invalid(field + ": unknown level '" + value +
                    "' (trace, debug, info, warn, error, critical, off)");
      } else {
        config->log_level = value;
      }
    } else if (key == "threads") {
      s = ParseUnsigned(value, field, &n);
      if (s.ok() && n > 4096) s = Invalid(field + ": at most 4096");
      if (s.ok()) config->threads = static_cast<unsigned>(n);
    } else if (key == "load_threads") {
      s = ParseUnsigned(value, field, &n);
      if (s.ok() && n > 4096) s = Invalid(field + ": at most 4096 (0: one per available CPU)");
      if (s.ok()) config->load_threads = static_cast<unsigned>(n);
    } else if (key == "idle_exit") {
      s = ParseUnsigned(value, field, &n);
      if (s.ok()) config->idle_exit_s = n;
    } else if (key == "allow_group") {
      config->allow_group = value;
    } else if (key == "admin_group") {
      config->admin_group = value;
    } else if (key == "max_region_bytes") {
      s = ParseBytes(value, field, &n);
      if (s.ok() && n == 0) s = Invalid(field + ": must be > 0");
      if (s.ok()) config->max_region_bytes = n;
    } else if (key == "max_connections_per_uid") {
      s = ParseUnsigned(value, field, &n);
      if (s.ok() && n > 1000000) s = Invalid(field + ": at most 1000000 (0: no cap)");
      if (s.ok()) config->max_connections_per_uid = static_cast<uint32_t>(n);
    } else if (key == "recovery_grace") {
      s = ParseUnsigned(value, field, &n);
      if (s.ok() && n > 7 * 24 * 3600) s = Invalid(field + ": at most 604800 (a week; 0: off)");
      if (s.ok()) config->recovery_grace_s = n;
    } else if (key == "lock_memory") {
      s = ParseBool(value, field, &config->lock_memory);
    } else {
      s = Invalid(where + ": unknown key '" + key + "'");
    }
    if (!s.ok()) {
      // Messages from the helpers name only the field; make sure the location is there.
      std::string msg = s.message();
      if (msg.rfind(origin, 0) != 0) msg = where + ": " + msg;
      return Invalid(msg);
    }
  }
  return Status::Ok();
}

Status LoadConfigFile(const std::string& path, DaemonConfig* config) {
  std::ifstream in(path);
  if (!in) {
    const int err = errno;
    return platform::ErrnoStatus(StatusCode::kNotFound, "cannot read config file " + path, err);
  }
  std::stringstream buf;
  buf << in.rdbuf();
  return ParseConfigText(buf.str(), path, config);
}

std::string DefaultDaemonSocket() { return platform::DefaultDaemonEndpoint(); }

uint64_t PhysicalRamBytes() { return platform::PhysicalMemoryBytes(); }

unsigned AvailableCpus() {
  const size_t allowed = platform::AllowedCpus().size();
  if (allowed > 0) return static_cast<unsigned>(allowed);
  const unsigned online = std::thread::hardware_concurrency();
  return online > 0 ? online : 1;
}

unsigned BaseLoadThreads(const DaemonConfig& config, unsigned requested) {
  const unsigned most = config.load_threads != 0 ? config.load_threads : AvailableCpus();
  return requested != 0 ? std::min(requested, most) : most;
}

}  // namespace trainstream::daemon

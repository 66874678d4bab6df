// trainstream-bench-control: how fast is the control plane?
//   Ping            one unary RPC round trip over the unix socket
//   Attach          open a session stream until Attached + the control region is mapped
//   Detach          cancel the stream (the daemon reclaims asynchronously)
//   AllocateRegion  create + fallocate + map a region of --region-bytes
//   FreeRegion      unmap + unlink it
// Starts its own trainstreamd (next to this binary) on a temporary socket unless
// --socket is given. Prints a table, or JSON with --json.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "trainstream/client.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  std::string name;
  size_t n = 0;
  double mean_us = 0, p50_us = 0, p99_us = 0, min_us = 0, per_s = 0;
};

Stats Summarise(const std::string& name, std::vector<double> us) {
  Stats s;
  s.name = name;
  s.n = us.size();
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  double sum = 0;
  for (double v : us) sum += v;
  s.mean_us = sum / us.size();
  s.p50_us = us[us.size() / 2];
  s.p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  s.min_us = us.front();
  s.per_s = 1e6 / s.mean_us;
  return s;
}

double Micros(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

int Die(const trainstream::Status& s) {
  std::fprintf(stderr, "trainstream-bench-control: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Control-plane benchmark for trainstreamd"};
  std::string socket;
  int pings = 2000, attaches = 100, regions = 300;
  uint64_t region_bytes = 1 << 20;
  bool json = false;
  app.add_option("--socket", socket,
                 "Use a running daemon (default: start one on a temporary socket)");
  app.add_option("--pings", pings, "Ping round trips (default 2000)");
  app.add_option("--attaches", attaches, "Attach/detach cycles (default 100)");
  app.add_option("--regions", regions, "Region allocate/free cycles (default 300)");
  app.add_option("--region-bytes", region_bytes, "Bytes per region (default 1 MiB)");
  app.add_flag("--json", json, "Print JSON");
  CLI11_PARSE(app, argc, argv);

  pid_t daemon_pid = -1;
  std::string tmp_dir, shm_dir;
  if (socket.empty()) {
    char t1[] = "/tmp/tsbench-XXXXXX";
    char t2[] = "/dev/shm/tsbench-XXXXXX";
    tmp_dir = mkdtemp(t1);
    shm_dir = mkdtemp(t2);
    socket = tmp_dir + "/trainstreamd.sock";
    const std::string daemon_bin =
        (std::filesystem::path(std::filesystem::canonical("/proc/self/exe")).parent_path() /
         "trainstreamd")
            .string();
    daemon_pid = fork();
    if (daemon_pid == 0) {
      execl(daemon_bin.c_str(), daemon_bin.c_str(), "--foreground", "--socket", socket.c_str(),
            "--shm-dir", shm_dir.c_str(), "--log-level", "warn", "--budget", "8G",
            static_cast<char*>(nullptr));
      std::perror("exec trainstreamd");
      _exit(127);
    }
  }
  std::unique_ptr<trainstream::Client> client;
  trainstream::Status s;
  // Wait for readiness by polling (no fixed sleep).
  const auto give_up = Clock::now() + std::chrono::seconds(30);
  do {
    s = trainstream::Client::Connect(socket, 200, &client);
    trainstream::PingResult pr;
    if (s.ok()) s = client->Ping(&pr);
  } while (!s.ok() && Clock::now() < give_up);
  if (!s.ok()) return Die(s);

  std::vector<Stats> results;
  std::vector<double> us;
  trainstream::PingResult pr;
  for (int i = 0; i < 50; ++i) client->Ping(&pr);  // warm up
  for (int i = 0; i < pings; ++i) {
    auto t0 = Clock::now();
    s = client->Ping(&pr);
    us.push_back(Micros(t0, Clock::now()));
    if (!s.ok()) return Die(s);
  }
  results.push_back(Summarise("Ping", us));

  std::vector<double> attach_us, detach_us;
  for (int i = 0; i < attaches; ++i) {
    std::unique_ptr<trainstream::Session> session;
    auto t0 = Clock::now();
    s = client->Attach({"bench", 0, 0, 0}, &session);
    auto t1 = Clock::now();
    if (!s.ok()) return Die(s);
    session->Detach();
    auto t2 = Clock::now();
    attach_us.push_back(Micros(t0, t1));
    detach_us.push_back(Micros(t1, t2));
  }
  results.push_back(Summarise("Attach", attach_us));
  results.push_back(Summarise("Detach", detach_us));

  std::unique_ptr<trainstream::Session> session;
  s = client->Attach({"bench-regions", 0, 0, 0}, &session);
  if (!s.ok()) return Die(s);
  std::vector<double> alloc_us, free_us;
  for (int i = 0; i < regions; ++i) {
    std::unique_ptr<trainstream::MappedRegion> region;
    auto t0 = Clock::now();
    s = session->AllocateRegion(region_bytes, "bench", &region);
    auto t1 = Clock::now();
    if (!s.ok()) return Die(s);
    const uint64_t id = region->info().region_id;
    region.reset();
    auto t2 = Clock::now();
    s = session->FreeRegion(id, nullptr);
    auto t3 = Clock::now();
    if (!s.ok()) return Die(s);
    alloc_us.push_back(Micros(t0, t1));
    free_us.push_back(Micros(t2, t3));
  }
  results.push_back(Summarise("AllocateRegion", alloc_us));
  results.push_back(Summarise("FreeRegion", free_us));
  session.reset();
  client.reset();

  if (daemon_pid > 0) {
    kill(daemon_pid, SIGTERM);
    int st = 0;
    waitpid(daemon_pid, &st, 0);
    std::filesystem::remove_all(tmp_dir);
    std::filesystem::remove_all(shm_dir);
  }

  if (json) {
    nlohmann::json out;
    out["region_bytes"] = region_bytes;
    out["cpus"] = std::thread::hardware_concurrency();
    for (const auto& r : results) {
      out["results"][r.name] = {{"n", r.n},           {"mean_us", r.mean_us}, {"p50_us", r.p50_us},
                                {"p99_us", r.p99_us}, {"min_us", r.min_us},   {"per_s", r.per_s}};
    }
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("trainstreamd control plane (%u CPUs, regions of %llu bytes)\n",
                std::thread::hardware_concurrency(), static_cast<unsigned long long>(region_bytes));
    std::printf("%-16s %7s %10s %10s %10s %10s %10s\n", "operation", "n", "mean us", "p50 us",
                "p99 us", "min us", "per s");
    for (const auto& r : results) {
      std::printf("%-16s %7zu %10.1f %10.1f %10.1f %10.1f %10.0f\n", r.name.c_str(), r.n, r.mean_us,
                  r.p50_us, r.p99_us, r.min_us, r.per_s);
    }
  }
  return 0;
}

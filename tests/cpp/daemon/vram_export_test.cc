// VramExporter (share_vram's seam to CUDA), one case per machine kind, each its own
// ctest entry that is skipped, with the reason, where it cannot run:
//   [vram-refused]  built without CUDA, or no NVIDIA GPU: every request is refused
//                   with FAILED_PRECONDITION naming why;
//   [vram-gpu]      built with CUDA on a machine with a GPU: it resolves devices,
//                   refuses unknown ones and exports an allocation with a 64-byte
//                   IPC handle.
// Which case applies is read from the machine (the driver's /proc entries), not
// from the exporter's answer, so an exporter that refuses on a GPU host fails.
#include "base/vram_export.h"

#include <filesystem>
#include <string>
#include <vector>

#include "catch_compat.h"

using trainstream::daemon::base::VramAllocation;
using trainstream::daemon::base::VramDevice;
using trainstream::daemon::base::VramExporter;

namespace {

// The NVIDIA driver lists each GPU it drives here.
bool MachineHasNvidiaGpu() {
  std::error_code ec;
  const std::filesystem::path gpus = "/proc/driver/nvidia/gpus";
  return std::filesystem::is_directory(gpus, ec) &&
         std::filesystem::directory_iterator(gpus, ec) != std::filesystem::directory_iterator();
}

}  // namespace

TEST_CASE("VramExporter refuses every request, naming why, without CUDA or a GPU",
          "[vram-refused]") {
  if (VramExporter::built_with_cuda() && MachineHasNvidiaGpu()) {
    TS_SKIP("built with CUDA on a machine with a GPU: nothing here is refused ([vram-gpu] runs)");
  }
  VramExporter vram;
  VramDevice first;
  first.index = 0;
  int device = -1;
  std::string bus;
  const trainstream::Status st = vram.Resolve(first, &device, &bus);
  CHECK(st.code() == trainstream::StatusCode::kFailedPrecondition);
  CHECK(st.message().find("share_vram") != std::string::npos);
  const std::string why =
      VramExporter::built_with_cuda() ? "no usable CUDA device" : "built without CUDA";
  CHECK(st.message().find(why) != std::string::npos);
  // Asking again gives the same answer (no sticky state), by bus id too.
  VramDevice by_bus;
  by_bus.pci_bus_id = "0000:01:00.0";
  const trainstream::Status again = vram.Resolve(by_bus, &device, &bus);
  CHECK(again.code() == trainstream::StatusCode::kFailedPrecondition);
  CHECK(device == -1);
  vram.Free(VramAllocation{});  // nothing allocated: a no-op
}

TEST_CASE("VramExporter resolves, refuses unknown devices and exports on a GPU", "[vram-gpu]") {
  if (!VramExporter::built_with_cuda()) TS_SKIP("this build has no CUDA");
  if (!MachineHasNvidiaGpu()) TS_SKIP("no NVIDIA GPU on this machine (/proc/driver/nvidia/gpus)");
  VramExporter vram;
  VramDevice first;
  first.index = 0;
  int device = -1;
  std::string bus;
  REQUIRE(vram.Resolve(first, &device, &bus).ok());
  CHECK(device == 0);
  CHECK(!bus.empty());
  VramDevice missing;
  missing.index = 4096;
  CHECK(vram.Resolve(missing, &device, &bus).code() == trainstream::StatusCode::kInvalidArgument);
  VramDevice bad_bus;
  bad_bus.pci_bus_id = "ffff:ff:1f.7";
  CHECK(vram.Resolve(bad_bus, &device, &bus).code() == trainstream::StatusCode::kInvalidArgument);
  std::vector<unsigned char> host(1 << 20, 0x5a);
  VramAllocation a;
  REQUIRE(vram.Export(0, host.data(), host.size(), &a).ok());
  CHECK(a.ptr != nullptr);
  CHECK(a.bytes == host.size());
  CHECK(a.ipc_handle.size() == 64);
  vram.Free(a);
  // Far more than any GPU holds: RESOURCE_EXHAUSTED, and the exporter still works.
  VramAllocation huge;
  CHECK(vram.Export(0, host.data(), uint64_t{1} << 50, &huge).code() ==
        trainstream::StatusCode::kResourceExhausted);
  REQUIRE(vram.Export(0, host.data(), host.size(), &a).ok());
  vram.Free(a);
}

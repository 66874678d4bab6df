// VramExporter (share_vram's seam to CUDA): without CUDA or a GPU every request is
// refused with FAILED_PRECONDITION naming why; with a GPU it resolves devices,
// refuses unknown ones and exports an allocation with a 64-byte IPC handle.
#include "base/vram_export.h"

#include <string>
#include <vector>

#include "catch_compat.h"

using trainstream::daemon::base::VramAllocation;
using trainstream::daemon::base::VramDevice;
using trainstream::daemon::base::VramExporter;

TEST_CASE("VramExporter resolves, refuses and exports as documented", "[vram]") {
  VramExporter vram;
  VramDevice first;
  first.index = 0;
  int device = -1;
  std::string bus;
  const trainstream::Status st = vram.Resolve(first, &device, &bus);
  if (!st.ok()) {
    // No CUDA in this build, or no GPU / driver on this machine.
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
    return;
  }
  REQUIRE(VramExporter::built_with_cuda());
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

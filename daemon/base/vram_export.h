// VramExporter: the daemon's one seam to CUDA (docs/base-cache.md, "share_vram").
//
// Note [CUDA in the daemon only on request]. trainstreamd runs on machines without
// a GPU and must not touch CUDA there: nothing in this class runs until a session
// asks for a VRAM copy (ShareBaseVram). Built with CUDA (vram_export_cuda.cc, linked
// to the static CUDA runtime, which loads the driver only when first called), the
// first request initializes CUDA; built without it (vram_export_none.cc), every
// request is refused with FAILED_PRECONDITION saying so. Every CUDA call happens
// under one mutex: the daemon's gRPC threads never race on the current device.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "trainstream/status.h"

namespace trainstream::daemon::base {

// Which GPU a client means: by PCI bus id (stable across processes whatever their
// CUDA_VISIBLE_DEVICES), else by the daemon's device index.
struct VramDevice {
  std::string pci_bus_id;
  int index = -1;
};

// One device allocation holding a copy of a base segment.
struct VramAllocation {
  int device = -1;
  std::string pci_bus_id;
  void* ptr = nullptr;  // device pointer in the daemon's CUDA context
  uint64_t bytes = 0;
  std::string ipc_handle;  // cudaIpcMemHandle_t bytes (64)
  double copy_seconds = 0;
};

class VramExporter {
 public:
  VramExporter() = default;
  VramExporter(const VramExporter&) = delete;
  VramExporter& operator=(const VramExporter&) = delete;

  // True when this daemon was built with CUDA (says nothing about a GPU).
  static bool built_with_cuda();

  // The daemon's index and PCI bus id of `want`. Initializes CUDA on first use.
  // FAILED_PRECONDITION: built without CUDA, or no usable device / driver.
  // INVALID_ARGUMENT: no such device.
  Status Resolve(const VramDevice& want, int* device, std::string* pci_bus_id);
  // Allocates `bytes` on `device`, copies them from `host` and exports the
  // allocation. RESOURCE_EXHAUSTED when the device lacks the memory. On failure
  // nothing stays allocated. The caller frees a returned allocation with Free.
  Status Export(int device, const void* host, uint64_t bytes, VramAllocation* out);
  // Frees an allocation Export returned (processes that opened its handle keep
  // their mapping until they close it).
  void Free(const VramAllocation& allocation);

 private:
  std::mutex mu_;  // serialises every CUDA call (the current device is per thread)
};

}  // namespace trainstream::daemon::base

// VramExporter with the CUDA runtime (Note [CUDA in the daemon only on request],
// vram_export.h). Nothing here runs before the first ShareBaseVram request.
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <string>

#include "base/vram_export.h"

namespace trainstream::daemon::base {
namespace {

std::string Describe(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// Builds the status for a failed CUDA call and clears the thread's last error so
// the next request starts clean (the daemon stays healthy after any failure).
Status Failed(StatusCode code, const std::string& what, cudaError_t err) {
  cudaGetLastError();
  return Status(code, what + " (" + Describe(err) + ")");
}

std::string BusId(int device) {
  char buf[32] = {};
  if (cudaDeviceGetPCIBusId(buf, sizeof(buf), device) != cudaSuccess) {
    cudaGetLastError();
    return "?";
  }
  return buf;
}

std::string DeviceList(int count) {
  std::string out;
  for (int i = 0; i < count; ++i) out += (i ? ", " : "") + std::to_string(i) + "=" + BusId(i);
  return out;
}

}  // namespace

bool VramExporter::built_with_cuda() { return true; }

Status VramExporter::Resolve(const VramDevice& want, int* device, std::string* pci_bus_id) {
  std::lock_guard<std::mutex> lock(mu_);
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    const std::string why = err != cudaSuccess ? Describe(err) : "0 devices";
    cudaGetLastError();
    return Status(
        StatusCode::kFailedPrecondition,
        "share_vram: trainstreamd sees no usable CUDA device (cudaGetDeviceCount: " + why +
            "); the daemon runs where there is no GPU or driver, or its "
            "CUDA_VISIBLE_DEVICES hides them; load the base without share_vram");
  }
  int dev = want.index;
  if (!want.pci_bus_id.empty()) {
    err = cudaDeviceGetByPCIBusId(&dev, want.pci_bus_id.c_str());
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Status(StatusCode::kInvalidArgument,
                    "pci_bus_id: trainstreamd has no CUDA device with PCI bus id '" +
                        want.pci_bus_id.substr(0, 64) + "' (it sees " + DeviceList(count) + ")");
    }
  } else if (dev < 0 || dev >= count) {
    return Status(StatusCode::kInvalidArgument,
                  "device: trainstreamd has no CUDA device " + std::to_string(dev) + " (it sees " +
                      std::to_string(count) + ": " + DeviceList(count) + ")");
  }
  *device = dev;
  *pci_bus_id = BusId(dev);
  return Status::Ok();
}

Status VramExporter::Export(int device, const void* host, uint64_t bytes, VramAllocation* out) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto started = std::chrono::steady_clock::now();
  const std::string where = "device " + std::to_string(device) + " (" + BusId(device) + ")";
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return Failed(StatusCode::kUnavailable, "cannot use " + where, err);
  void* ptr = nullptr;
  err = cudaMalloc(&ptr, bytes);
  if (err != cudaSuccess) {
    size_t free_bytes = 0, total_bytes = 0;
    cudaGetLastError();
    cudaMemGetInfo(&free_bytes, &total_bytes);
    cudaGetLastError();
    const StatusCode code =
        err == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted : StatusCode::kInternal;
    return Failed(code,
                  "share_vram: cannot allocate " + std::to_string(bytes) +
                      " bytes for the base on " + where + ": " + std::to_string(free_bytes) +
                      " of " + std::to_string(total_bytes) + " bytes free",
                  err);
  }
  // The segment is ordinary (pageable) shared memory: the runtime stages the copy.
  err = cudaMemcpy(ptr, host, bytes, cudaMemcpyHostToDevice);
  cudaIpcMemHandle_t handle{};
  if (err == cudaSuccess) err = cudaIpcGetMemHandle(&handle, ptr);
  if (err != cudaSuccess) {
    Status st = Failed(StatusCode::kInternal,
                       "share_vram: copying the base to " + where + " or exporting it failed", err);
    cudaFree(ptr);
    cudaGetLastError();
    return st;
  }
  out->device = device;
  out->pci_bus_id = BusId(device);
  out->ptr = ptr;
  out->bytes = bytes;
  out->ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  out->copy_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return Status::Ok();
}

void VramExporter::Free(const VramAllocation& allocation) {
  if (allocation.ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  cudaError_t err = cudaSetDevice(allocation.device);
  if (err == cudaSuccess) err = cudaFree(allocation.ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    spdlog::warn("share_vram: freeing {} bytes on device {} failed: {}", allocation.bytes,
                 allocation.device, Describe(err));
  }
}

}  // namespace trainstream::daemon::base

// The client half of share_vram (docs/base-cache.md): open the CUDA IPC handle of
// a base's VRAM copy that trainstreamd exported, as a CUDA uint8 tensor. The
// handle bytes arrive from trainstream._control as a Python bytes object; no gRPC
// here. Messages are built without iostreams: Note [No iostreams in _C] (check.h).
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "check.h"

#ifdef TRAINSTREAM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#endif

namespace py = pybind11;

namespace trainstream::python {
namespace {

#ifdef TRAINSTREAM_WITH_CUDA
std::string CudaError(cudaError_t err) {
  cudaGetLastError();  // leave no error behind for torch's next check
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

void CheckDevice(int64_t device) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  TS_CHECK(err == cudaSuccess, "no usable CUDA device in this process (", CudaError(err), ")");
  TS_CHECK(device >= 0 && device < count, "device ", device, " is not a CUDA device here (", count,
           " visible)");
}
#else
[[noreturn]] void NoCuda() {
  throw std::runtime_error(
      "trainstream._C was built without CUDA: it cannot open a shared VRAM base (share_vram)");
}
#endif

// The PCI bus id of `device` as cudaDeviceGetPCIBusId writes it: how the daemon,
// whose device indices may differ (CUDA_VISIBLE_DEVICES), finds the same GPU.
std::string PciBusId(int64_t device) {
#ifdef TRAINSTREAM_WITH_CUDA
  CheckDevice(device);
  char buf[32] = {};
  cudaError_t err = cudaDeviceGetPCIBusId(buf, sizeof(buf), static_cast<int>(device));
  TS_CHECK(err == cudaSuccess, "cudaDeviceGetPCIBusId(", device, ") failed (", CudaError(err), ")");
  return buf;
#else
  (void)device;
  NoCuda();
#endif
}

// Opens `handle` (a cudaIpcMemHandle_t from another process) on `device` and
// returns a uint8 tensor of `nbytes` viewing it. The mapping is closed
// (cudaIpcCloseMemHandle) when the last tensor sharing this storage dies; the
// exporting process owns the memory and must keep it while it is used.
torch::Tensor OpenIpcHandle(const py::bytes& handle, int64_t nbytes, int64_t device) {
#ifdef TRAINSTREAM_WITH_CUDA
  const std::string raw = handle;
  TS_CHECK(raw.size() == sizeof(cudaIpcMemHandle_t), "a CUDA IPC handle has ",
           sizeof(cudaIpcMemHandle_t), " bytes, got ", raw.size());
  TS_CHECK(nbytes > 0, "nbytes must be > 0, got ", nbytes);
  CheckDevice(device);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, raw.data(), sizeof(h));
  void* ptr = nullptr;
  {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    TS_CHECK(err == cudaSuccess, "cudaIpcOpenMemHandle on device ", device, " failed (",
             CudaError(err),
             "); the handle must come from another process (not this one) and name memory "
             "that process still holds");
  }
  const int dev = static_cast<int>(device);
  auto close = [dev](void* p) {
    // May run late (interpreter exit): never throw, restore the current device.
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    if (cudaSetDevice(dev) == cudaSuccess) cudaIpcCloseMemHandle(p);
    if (previous >= 0) cudaSetDevice(previous);
    cudaGetLastError();
  };
  auto options = torch::TensorOptions()
                     .dtype(torch::kByte)
                     .device(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device)));
  return torch::from_blob(ptr, {nbytes}, close, options);
#else
  (void)handle;
  (void)nbytes;
  (void)device;
  NoCuda();
#endif
}

}  // namespace

void RegisterVramBindings(py::module_& m) {
  m.def("cuda_pci_bus_id", &PciBusId, py::arg("device"),
        "PCI bus id of a CUDA device of this process (e.g. '0000:19:00.0').");
  m.def("open_ipc_handle", &OpenIpcHandle, py::arg("handle"), py::arg("nbytes"), py::arg("device"),
        "A CUDA uint8 tensor of `nbytes` viewing the memory another process exported with "
        "cudaIpcGetMemHandle; closed when the last view dies.");
}

}  // namespace trainstream::python

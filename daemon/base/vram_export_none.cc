// VramExporter for a daemon built without CUDA: every request is refused
// (Note [CUDA in the daemon only on request], vram_export.h).
#include "base/vram_export.h"

namespace trainstream::daemon::base {
namespace {

Status NotBuilt() {
  return Status(StatusCode::kFailedPrecondition,
                "share_vram: this trainstreamd was built without CUDA "
                "(TRAINSTREAM_WITH_CUDA=OFF or no CUDA toolkit at build time), so it "
                "cannot place a base on a GPU; rebuild it with the CUDA toolkit, or load "
                "the base without share_vram");
}

}  // namespace

bool VramExporter::built_with_cuda() { return false; }

Status VramExporter::Resolve(const VramDevice&, int*, std::string*) { return NotBuilt(); }

Status VramExporter::Export(int, const void*, uint64_t, VramAllocation*) { return NotBuilt(); }

void VramExporter::Free(const VramAllocation&) {}

}  // namespace trainstream::daemon::base

// trainstream._control: the control-plane client (gRPC) for Python, over
// libtrainstream_client. No torch here (docs/design.md, "Why gRPC and libtorch never share a shared
// object"): mapped regions are handed to Python as integer addresses, which trainstream._C turns
// into tensors.
#include <pybind11/eval.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "trainstream/client.h"

namespace py = pybind11;

namespace trainstream::python {
namespace {

// Python exception classes, one per status code, made in module init.
py::dict& ErrorTypes() {
  static py::dict* types = new py::dict();  // leaked: lives as long as the interpreter
  return *types;
}

[[noreturn]] void Raise(const Status& status) {
  const char* name = StatusCodeName(status.code());
  py::object type = ErrorTypes().contains(name) ? ErrorTypes()[name] : ErrorTypes()["INTERNAL"];
  PyErr_SetString(type.ptr(), status.message().c_str());
  throw py::error_already_set();
}

void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

// A dtype field of a request: a name wire::ParseDType accepts, else ValueError.
DType DTypeOrThrow(const char* field, const std::string& name) {
  DType dtype;
  if (!wire::ParseDType(name, &dtype)) {
    throw py::value_error(std::string(field) + " must be one of " + std::string(wire::kDTypeNames) +
                          "; got '" + name + "'");
  }
  return dtype;
}

// A mapped region, shared between the Python object and anything that holds it.
struct PyRegion {
  std::shared_ptr<MappedRegion> region;

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(region->data()); }
  uintptr_t base_address() const { return address() - region->info().offset; }
};

py::dict BaseInfoDict(const BaseInfo& b) {
  py::dict d;
  d["key"] = b.key;
  d["path"] = b.path;
  d["format"] = b.format;
  d["block_size"] = b.block_size;
  d["owner_uid"] = b.owner_uid;
  d["segment_name"] = b.segment_name;
  d["segment_bytes"] = b.segment_bytes;
  d["source_bytes"] = b.source_bytes;
  d["tensors"] = b.tensors;
  d["quantized_tensors"] = b.quantized_tensors;
  d["refcount"] = b.refcount;
  d["sessions"] = b.sessions;
  d["load_seconds"] = b.load_seconds;
  d["scratch_peak_bytes"] = b.scratch_peak_bytes;
  d["load_threads"] = b.load_threads;
  d["allocate_seconds"] = b.allocate_seconds;
  d["cached"] = b.cached;
  d["vram_copies"] = b.vram_copies;
  d["vram_bytes"] = b.vram_bytes;
  return d;
}

// Progress callbacks run on the calling thread with the GIL released around
// the RPC: take it back for the Python callable.
BaseProgressFn WrapProgress(const py::object& progress) {
  if (progress.is_none()) return nullptr;
  return [progress](const BaseProgress& p) {
    py::gil_scoped_acquire gil;
    progress(p.bytes_read, p.bytes_total, p.tensors_done, p.tensors_total);
  };
}

BaseLoadOptions LoadOptions(const std::string& path, const std::string& format, uint32_t block_size,
                            uint32_t threads) {
  BaseLoadOptions o;
  o.path = path;
  o.format = format;
  o.block_size = block_size;
  o.threads = threads;
  return o;
}

template <typename T>
T GetOr(const py::dict& d, const char* key, T fallback) {
  return d.contains(key) ? d[key].cast<T>() : fallback;
}

}  // namespace
}  // namespace trainstream::python

using namespace trainstream;          // NOLINT: module body only
using namespace trainstream::python;  // NOLINT

PYBIND11_MODULE(_control, m) {
  m.doc() = "TrainStream control-plane client (gRPC over a unix socket)";

  // Error classes: each derives from trainstream.errors.TrainStreamError and from
  // the builtin a Python user expects. The package (its __init__ has run, or is
  // running, before any submodule loads) provides errors.py, which imports
  // nothing: no torch comes in here. Loaded outside the package, the base is
  // RuntimeError, as it always was.
  py::exec(R"(
def _error_base():
    import importlib
    package = __name__.rpartition(".")[0]
    if not package:
        return RuntimeError
    return importlib.import_module(package + ".errors").TrainStreamError

class ControlError(_error_base()):
    """An error answered by (or about) the TrainStream daemon."""
class InvalidArgument(ControlError, ValueError): pass
class NotFound(ControlError, LookupError): pass
class AlreadyExists(ControlError): pass
class PermissionDenied(ControlError, PermissionError): pass
class ResourceExhausted(ControlError, MemoryError): pass
class FailedPrecondition(ControlError): pass
class Unavailable(ControlError, ConnectionError): pass
class DeadlineExceeded(ControlError, TimeoutError): pass
class Internal(ControlError): pass
del _error_base
)",
           m.attr("__dict__"));
  auto& types = ErrorTypes();
  types["INVALID_ARGUMENT"] = m.attr("InvalidArgument");
  types["NOT_FOUND"] = m.attr("NotFound");
  types["ALREADY_EXISTS"] = m.attr("AlreadyExists");
  types["PERMISSION_DENIED"] = m.attr("PermissionDenied");
  types["RESOURCE_EXHAUSTED"] = m.attr("ResourceExhausted");
  types["FAILED_PRECONDITION"] = m.attr("FailedPrecondition");
  types["UNAVAILABLE"] = m.attr("Unavailable");
  types["DEADLINE_EXCEEDED"] = m.attr("DeadlineExceeded");
  types["INTERNAL"] = m.attr("Internal");

  m.def("default_socket_path", &DefaultSocketPath);
  m.def("embedded_socket_path", &EmbeddedSocketPath);

  py::class_<PyRegion>(m, "Region")
      .def_property_readonly("address", &PyRegion::address,
                             "Address of the region's first byte in this process")
      .def_property_readonly("base_address", &PyRegion::base_address,
                             "Address of the segment's first byte (slot offsets count from here)")
      .def_property_readonly("size", [](const PyRegion& r) { return r.region->size(); })
      .def_property_readonly("region_id",
                             [](const PyRegion& r) { return r.region->info().region_id; })
      .def_property_readonly("segment_name",
                             [](const PyRegion& r) { return r.region->info().segment_name; })
      .def_property_readonly("offset", [](const PyRegion& r) { return r.region->info().offset; })
      .def_property_readonly("segment_size",
                             [](const PyRegion& r) { return r.region->info().segment_size; })
      .def_property_readonly("read_only",
                             [](const PyRegion& r) { return r.region->info().read_only; });

  py::class_<Session>(m, "Session")
      .def_property_readonly("id", &Session::id)
      .def_property_readonly("shm_dir", &Session::shm_dir)
      .def_property_readonly(
          "control",
          [](py::object self) {
            // The control mapping belongs to the Session; the Region keeps the
            // Session alive through a no-op deleter tied to `self`.
            Session& s = self.cast<Session&>();
            MappedRegion* raw = &s.control();
            auto keep = std::make_shared<py::object>(self);
            return PyRegion{std::shared_ptr<MappedRegion>(raw, [keep](MappedRegion*) mutable {
              py::gil_scoped_acquire gil;
              keep.reset();
            })};
          })
      .def(
          "register_parameters",
          [](Session& s, const py::list& groups, const py::list& params,
             const std::string& moment_dtype, double max_grad_norm, uint64_t seed,
             const std::string& weights_checksum, uint32_t threads, uint64_t grad_pool_bytes) {
            RegisterOptions options;
            options.grad_pool_bytes = grad_pool_bytes;
            options.weights_checksum = weights_checksum;
            for (auto g : groups) {
              auto d = g.cast<py::dict>();
              AdamWHyperParams h;
              h.lr = GetOr(d, "lr", h.lr);
              h.beta1 = GetOr(d, "beta1", h.beta1);
              h.beta2 = GetOr(d, "beta2", h.beta2);
              h.eps = GetOr(d, "eps", h.eps);
              h.weight_decay = GetOr(d, "weight_decay", h.weight_decay);
              options.groups.push_back(h);
            }
            options.moment_dtype = DTypeOrThrow("moment_dtype", moment_dtype);
            options.max_grad_norm = max_grad_norm;
            options.seed = seed;
            options.threads = threads;
            std::vector<ParameterSpec> specs;
            for (auto p : params) {
              auto d = p.cast<py::dict>();
              ParameterSpec spec;
              spec.param_id = d["param_id"].cast<uint64_t>();
              spec.name = GetOr<std::string>(d, "name", "");
              spec.shape = d["shape"].cast<std::vector<int64_t>>();
              spec.dtype = DTypeOrThrow("dtype", d["dtype"].cast<std::string>());
              spec.grad_dtype =
                  DTypeOrThrow("grad_dtype",
                               GetOr<std::string>(d, "grad_dtype", d["dtype"].cast<std::string>()));
              spec.group = GetOr<uint32_t>(d, "group", 0);
              specs.push_back(std::move(spec));
            }
            Registration reg;
            Status st;
            {
              py::gil_scoped_release release;
              st = s.RegisterParameters(options, specs, &reg);
            }
            Check(st);
            py::list slots;
            for (const auto& slot : reg.slots) {
              py::dict d;
              d["param_id"] = slot.param_id;
              d["grad_offset"] = slot.grad_offset;
              d["param_offset"] = slot.param_offset;
              d["numel"] = slot.numel;
              d["sum_offset"] = slot.sum_offset;
              d["grad_pool_offset"] = reg.grad_pool_offset;
              d["grad_pool_bytes"] = reg.grad_pool_bytes;
              slots.append(d);
            }
            return py::make_tuple(PyRegion{std::shared_ptr<MappedRegion>(std::move(reg.staging))},
                                  slots);
          },
          py::arg("groups"), py::arg("params"), py::arg("moment_dtype") = "float32",
          py::arg("max_grad_norm") = 0.0, py::arg("seed") = 0, py::arg("weights_checksum") = "",
          py::arg("threads") = 0, py::arg("grad_pool_bytes") = 0)
      .def(
          "allocate_region",
          [](Session& s, uint64_t bytes, const std::string& label) {
            std::unique_ptr<MappedRegion> region;
            Status st;
            {
              py::gil_scoped_release release;
              st = s.AllocateRegion(bytes, label, &region);
            }
            Check(st);
            return PyRegion{std::shared_ptr<MappedRegion>(std::move(region))};
          },
          py::arg("bytes"), py::arg("label") = "")
      .def("free_region",
           [](Session& s, uint64_t region_id) {
             uint64_t freed = 0;
             Check(s.FreeRegion(region_id, &freed));
             return freed;
           })
      .def(
          "load_base",
          [](Session& s, const std::string& path, const std::string& format, uint32_t block_size,
             py::object progress, uint32_t threads) {
            BaseInfo info;
            std::unique_ptr<MappedRegion> mapped;
            Status st;
            {
              py::gil_scoped_release release;
              st = s.LoadBase(LoadOptions(path, format, block_size, threads),
                              WrapProgress(progress), &info, &mapped);
            }
            Check(st);
            return py::make_tuple(BaseInfoDict(info),
                                  PyRegion{std::shared_ptr<MappedRegion>(std::move(mapped))});
          },
          py::arg("path"), py::arg("format") = "", py::arg("block_size") = 0,
          py::arg("progress") = py::none(), py::arg("threads") = 0,
          "Loads (or finds) a base, takes this session's reference and maps it read-only: "
          "(info dict, Region)")
      .def(
          "release_base",
          [](Session& s, const std::string& key) {
            Status st;
            {
              py::gil_scoped_release release;
              st = s.ReleaseBase(key);
            }
            Check(st);
          },
          py::arg("key"))
      .def(
          "share_base_vram",
          [](Session& s, const std::string& key, const std::string& pci_bus_id, int32_t device) {
            VramShare share;
            Status st;
            {
              py::gil_scoped_release release;
              st = s.ShareBaseVram(key, pci_bus_id, device, &share);
            }
            Check(st);
            py::dict d;
            d["ipc_handle"] = py::bytes(share.ipc_handle);
            d["bytes"] = share.bytes;
            d["device"] = share.device;
            d["pci_bus_id"] = share.pci_bus_id;
            d["cached"] = share.cached;
            d["copy_seconds"] = share.copy_seconds;
            d["holders"] = share.holders;
            return d;
          },
          py::arg("key"), py::arg("pci_bus_id") = "", py::arg("device") = -1,
          "The base `key` (held by this session) copied once to a GPU by the daemon: a dict "
          "with the CUDA IPC handle (bytes), its size, the device and whether it was cached")
      .def("alive",
           [](const Session& s) {
             std::string why;
             bool alive = s.alive(&why);
             return py::make_tuple(alive, why);
           })
      .def_property_readonly(
          "end_kind",
          [](const Session& s) {
            switch (s.end_kind()) {
              case SessionEnd::kNone:
                return "none";
              case SessionEnd::kDaemonGone:
                return "daemon_gone";
              case SessionEnd::kShutdown:
                return "shutdown";
              case SessionEnd::kEnded:
                return "ended";
              case SessionEnd::kDetached:
                return "detached";
            }
            return "none";
          },
          "How the session ended: none (attached), daemon_gone (the daemon died), shutdown, "
          "ended (by the daemon), detached")
      .def_property_readonly(
          "recovery_token", [](const Session& s) { return py::bytes(s.recovery_token()); },
          "The secret that resumes this session's optimizer state after a daemon restart "
          "(bytes; empty when recovery is off)")
      .def_property_readonly(
          "resumed",
          [](const Session& s) -> py::object {
            const ResumedState* r = s.resumed();
            if (r == nullptr) return py::none();
            py::dict d;
            d["completed_step"] = r->completed_step;
            d["completed_grad_norm"] = r->completed_grad_norm;
            d["completed_status"] = r->completed_status;
            d["completed_params_updated"] = r->completed_params_updated;
            d["restored_subchunks"] = r->restored_subchunks;
            d["rolled_forward"] = r->rolled_forward;
            d["waited_s"] = r->waited_s;
            py::list regs;
            for (const auto& reg : r->registrations) {
              py::dict rd;
              rd["segment_name"] = reg.staging.segment_name;
              rd["segment_size"] = reg.staging.segment_size;
              rd["grad_pool_offset"] = reg.grad_pool_offset;
              rd["grad_pool_bytes"] = reg.grad_pool_bytes;
              py::list params;
              for (size_t i = 0; i < reg.params.size(); ++i) {
                py::dict p;
                p["param_id"] = reg.params[i].param_id;
                p["applied_step"] = reg.params[i].applied_step;
                p["skipped"] = reg.params[i].skipped;
                p["torch_step"] = reg.params[i].torch_step;
                p["grad_offset"] = reg.slots[i].grad_offset;
                p["param_offset"] = reg.slots[i].param_offset;
                p["numel"] = reg.slots[i].numel;
                params.append(p);
              }
              rd["params"] = params;
              regs.append(rd);
            }
            d["registrations"] = regs;
            return d;
          },
          "Attached with resume_token: the optimizer state taken over (a dict), else None")
      .def("detach", [](Session& s) {
        py::gil_scoped_release release;
        s.Detach();
      });

  py::class_<Client>(m, "Client")
      .def_static(
          "connect",
          [](const std::string& socket_path, int timeout_ms) {
            std::unique_ptr<Client> client;
            Status st;
            {
              py::gil_scoped_release release;
              st = Client::Connect(socket_path, timeout_ms, &client);
            }
            Check(st);
            return client;
          },
          py::arg("socket_path"), py::arg("timeout_ms") = 2000)
      .def_property_readonly("socket_path", &Client::socket_path)
      .def("ping",
           [](Client& c) {
             PingResult r;
             Check(c.Ping(&r));
             py::dict d;
             d["version"] = r.version;
             d["protocol_version"] = r.protocol_version;
             d["pid"] = r.pid;
             d["uptime_s"] = r.uptime_s;
             return d;
           })
      .def("status_json",
           [](Client& c) {
             std::string out;
             Check(c.StatusJson(&out));
             return out;
           })
      .def(
          "shutdown",
          [](Client& c, bool drain, bool discard_state) {
            if (drain && discard_state)
              throw py::value_error("shutdown: drain and discard_state exclude each other");
            ShutdownResult r;
            Check(c.Shutdown(drain           ? ShutdownMode::kDrain
                             : discard_state ? ShutdownMode::kDiscardState
                                             : ShutdownMode::kKeepState,
                             &r));
            return r.sessions;
          },
          py::arg("drain") = false, py::arg("discard_state") = false)
      .def(
          "load_base",
          [](Client& c, const std::string& path, const std::string& format, uint32_t block_size,
             py::object progress, uint32_t threads) {
            BaseInfo info;
            Status st;
            {
              py::gil_scoped_release release;
              st = c.LoadBase(LoadOptions(path, format, block_size, threads),
                              WrapProgress(progress), &info);
            }
            Check(st);
            return BaseInfoDict(info);
          },
          py::arg("path"), py::arg("format") = "", py::arg("block_size") = 0,
          py::arg("progress") = py::none(), py::arg("threads") = 0)
      .def("list_bases",
           [](Client& c) {
             std::vector<BaseInfo> bases;
             Check(c.ListBases(&bases));
             py::list out;
             for (const auto& b : bases) out.append(BaseInfoDict(b));
             return out;
           })
      .def(
          "drop_base",
          [](Client& c, const std::string& key) {
            uint64_t freed = 0;
            Check(c.DropBase(key, &freed));
            return freed;
          },
          py::arg("key"))
      .def(
          "attach",
          [](Client& c, const std::string& job, int rank, int local_rank, const py::object& group,
             const py::bytes& resume_token) {
            AttachOptions options;
            options.job = job;
            options.resume_token = resume_token;
            options.rank = rank;
            options.local_rank = local_rank;
            if (!group.is_none()) {
              // {"key", "local_rank", "local_world_size", "node_rank", "nnodes",
              //  "world_size", "timeout_s"}: GroupOptions (client.h).
              auto d = group.cast<py::dict>();
              options.group.key = d["key"].cast<std::string>();
              options.group.local_rank = d["local_rank"].cast<int32_t>();
              options.group.local_world_size = d["local_world_size"].cast<int32_t>();
              options.group.node_rank = GetOr<int32_t>(d, "node_rank", 0);
              options.group.nnodes = GetOr<int32_t>(d, "nnodes", 1);
              options.group.world_size = d["world_size"].cast<int32_t>();
              options.group.timeout_s = GetOr<double>(d, "timeout_s", 60.0);
            }
            std::unique_ptr<Session> session;
            Status st;
            {
              py::gil_scoped_release release;
              st = c.Attach(options, &session);
            }
            Check(st);
            return session;
          },
          py::arg("job") = "", py::arg("rank") = -1, py::arg("local_rank") = -1,
          py::arg("group") = py::none(), py::arg("resume_token") = py::bytes(""));
}

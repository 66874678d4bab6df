// trainstream_testing: a test-only torch extension (tests/python/ext/CMakeLists.txt).
// AdamW on torch CPU tensors: the kernel (kernels/adamw.h) for one contiguous
// tensor, and the daemon's multi-threaded AdamWEngine (daemon/optimizer), so the
// Python tests can compare both with torch.optim.AdamW. Every entry point takes
// isa="auto"|"scalar"|"avx2"|"avx512". Users never load this module: trainstream._C
// carries no daemon code (python/CMakeLists.txt).
#include <torch/extension.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "check.h"
#include "torch_dtype.h"
#include "trainstream/kernels/adamw.h"
#include "trainstream/kernels/cpu_features.h"
#include "trainstream/optimizer/adamw_engine.h"
#include "trainstream/optimizer/worker_pool.h"

namespace trainstream::python {
namespace {

namespace tk = trainstream::kernels;

tk::Isa IsaOrThrow(const std::string& name) {
  if (name == "auto") return tk::BestIsa();
  tk::Isa isa;
  if (!tk::ParseIsa(name, &isa)) {
    throw pybind11::value_error("unknown isa '" + name +
                                "': use 'auto', 'scalar', 'avx2' or 'avx512'");
  }
  if (!tk::IsaSupported(isa)) {
    throw pybind11::value_error("isa '" + name + "' is not supported by this CPU");
  }
  return isa;
}

tk::DType DTypeOf(const torch::Tensor& t, const char* what) {
  TS_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TS_CHECK(t.is_contiguous(), what, " must be contiguous");
  return ToDType(t.scalar_type(), what);
}

// One AdamW step on whole tensors, single-threaded. `step` is torch's
// state['step'] after its increment (1 on the first call).
void AdamWStep(torch::Tensor master, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
               torch::Tensor grad, std::optional<torch::Tensor> param_out, int64_t step, double lr,
               double beta1, double beta2, double eps, double weight_decay, double grad_scale,
               int64_t seed, int64_t param_key, const std::string& isa_name) {
  const tk::Isa isa = IsaOrThrow(isa_name);
  TS_CHECK(DTypeOf(master, "master") == tk::DType::kFloat32, "master must be float32");
  const tk::DType md = DTypeOf(exp_avg, "exp_avg");
  TS_CHECK(md != tk::DType::kFloat16, "moments must be float32 or bfloat16");
  TS_CHECK(DTypeOf(exp_avg_sq, "exp_avg_sq") == md, "exp_avg and exp_avg_sq dtypes differ");
  const int64_t n = master.numel();
  TS_CHECK(exp_avg.numel() == n && exp_avg_sq.numel() == n && grad.numel() == n,
           "all tensors must have master's numel");
  TS_CHECK(step >= 1, "step counts from 1");
  tk::AdamWRange r;
  r.master = master.data_ptr<float>();
  r.exp_avg = exp_avg.data_ptr();
  r.exp_avg_sq = exp_avg_sq.data_ptr();
  r.grad = grad.data_ptr();
  r.numel = static_cast<size_t>(n);
  r.grad_dtype = DTypeOf(grad, "grad");
  r.moment_dtype = md;
  if (param_out.has_value()) {
    TS_CHECK(param_out->numel() == n, "param_out must have master's numel");
    r.param_dtype = DTypeOf(*param_out, "param_out");
    r.param_out = param_out->data_ptr();
  }
  const auto scalars =
      tk::ComputeAdamWStepScalars(tk::AdamWHyperParams{lr, beta1, beta2, eps, weight_decay},
                                  static_cast<uint64_t>(step), static_cast<float>(grad_scale));
  pybind11::gil_scoped_release release;
  tk::AdamWUpdate(r, scalars,
                  tk::RoundingKey{static_cast<uint64_t>(seed), static_cast<uint64_t>(param_key),
                                  static_cast<uint64_t>(step), 0},
                  isa);
}

double GradSumSquares(torch::Tensor grad, const std::string& isa_name) {
  const tk::Isa isa = IsaOrThrow(isa_name);
  const tk::DType dt = DTypeOf(grad, "grad");
  return tk::GradSumSquares(grad.data_ptr(), dt, static_cast<size_t>(grad.numel()), isa);
}

torch::Tensor StochasticRoundBf16(torch::Tensor x, int64_t seed, int64_t param_key, int64_t step,
                                  int64_t element_offset, bool high_bits) {
  TS_CHECK(DTypeOf(x, "x") == tk::DType::kFloat32, "x must be float32");
  torch::Tensor out = torch::empty_like(x, x.options().dtype(at::kBFloat16));
  tk::StochasticRoundToBf16(
      x.data_ptr<float>(), reinterpret_cast<uint16_t*>(out.data_ptr()),
      static_cast<size_t>(x.numel()),
      tk::RoundingKey{static_cast<uint64_t>(seed), static_cast<uint64_t>(param_key),
                      static_cast<uint64_t>(step), static_cast<uint64_t>(element_offset)},
      high_bits);
  return out;
}

namespace to = trainstream::optimizer;

// Owns a pool and an engine, keeps the bound tensors alive, and collects step
// results for Python (callbacks run on worker threads, never into Python).
class PyAdamWEngine {
 public:
  PyAdamWEngine(unsigned threads, const std::string& moment_dtype, double max_grad_norm,
                int64_t seed, bool skip_nonfinite_step, const std::string& isa,
                int64_t chunk_elems) {
    to::EngineOptions opt;
    if (!tk::ParseDType(moment_dtype, &opt.moment_dtype) ||
        opt.moment_dtype == tk::DType::kFloat16) {
      throw pybind11::value_error(
          "moment_dtype must be 'fp32' or 'bf16' (or float32, bfloat16), got '" + moment_dtype +
          "'");
    }
    opt.max_grad_norm = max_grad_norm;
    opt.seed = static_cast<uint64_t>(seed);
    opt.skip_nonfinite_step = skip_nonfinite_step;
    opt.isa = IsaOrThrow(isa);
    opt.chunk_elems = static_cast<size_t>(chunk_elems);
    pool_ = std::make_unique<to::WorkerPool>(to::WorkerPoolOptions{threads, false});
    engine_ = std::make_unique<to::AdamWEngine>(pool_.get(), opt);
    engine_->SetCallbacks(nullptr, [this](const to::StepResult& r) {
      std::lock_guard<std::mutex> lock(mu_);
      results_.push_back(r);
    });
  }
  ~PyAdamWEngine() {
    engine_.reset();  // waits for in-flight work before the tensors go
  }

  void AddParam(int64_t id, torch::Tensor master, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                torch::Tensor grad_slot, torch::Tensor param_slot) {
    to::ParamBinding b;
    b.param_id = static_cast<uint64_t>(id);
    b.numel = static_cast<size_t>(master.numel());
    TS_CHECK(DTypeOf(master, "master") == tk::DType::kFloat32, "master must be float32");
    TS_CHECK(DTypeOf(exp_avg, "exp_avg") == engine_->options().moment_dtype &&
                 DTypeOf(exp_avg_sq, "exp_avg_sq") == engine_->options().moment_dtype,
             "moments must have the engine's moment dtype");
    b.param_dtype = DTypeOf(param_slot, "param_slot");
    b.grad_dtype = DTypeOf(grad_slot, "grad_slot");
    TS_CHECK(exp_avg.numel() == master.numel() && exp_avg_sq.numel() == master.numel() &&
                 grad_slot.numel() == master.numel() && param_slot.numel() == master.numel(),
             "all tensors must have master's numel");
    b.master = master.data_ptr<float>();
    b.exp_avg = exp_avg.data_ptr();
    b.exp_avg_sq = exp_avg_sq.data_ptr();
    b.grad_slot = grad_slot.data_ptr();
    b.param_slot = param_slot.data_ptr();
    Check(engine_->AddParam(b));
    keep_alive_.insert(keep_alive_.end(), {master, exp_avg, exp_avg_sq, grad_slot, param_slot});
  }

  void Init() {
    pybind11::gil_scoped_release release;
    Check(engine_->Init());
  }

  void Submit(int64_t id, int64_t step, double lr, double beta1, double beta2, double eps,
              double wd) {
    Check(engine_->SubmitGrad(static_cast<uint64_t>(id), static_cast<uint64_t>(step),
                              tk::AdamWHyperParams{lr, beta1, beta2, eps, wd}));
  }

  void StepEnd(int64_t step) { Check(engine_->StepEnd(static_cast<uint64_t>(step))); }

  // Waits for all work and returns (and forgets) the finished steps' results.
  pybind11::list Wait() {
    {
      pybind11::gil_scoped_release release;
      engine_->WaitIdle();
    }
    std::vector<to::StepResult> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done.swap(results_);
    }
    pybind11::list out;
    for (const auto& r : done) {
      pybind11::dict d;
      d["step"] = r.step;
      d["grad_norm"] = r.grad_norm;
      d["skipped_nonfinite"] = r.skipped_nonfinite;
      d["params_updated"] = r.params_updated;
      d["nonfinite_params"] = r.nonfinite_params;
      d["error"] = r.error.message();
      out.append(d);
    }
    return out;
  }

  pybind11::tuple ExportState(int64_t id) {
    const size_t n = engine_->ParamNumel(static_cast<uint64_t>(id));
    TS_CHECK(n > 0, "unknown parameter ", id);
    auto opts = torch::TensorOptions().dtype(at::kFloat);
    torch::Tensor m = torch::empty({static_cast<int64_t>(n)}, opts);
    torch::Tensor a = torch::empty_like(m), s = torch::empty_like(m);
    uint64_t step = 0;
    Check(engine_->ExportState(static_cast<uint64_t>(id), m.data_ptr<float>(), a.data_ptr<float>(),
                               s.data_ptr<float>(), &step));
    return pybind11::make_tuple(m, a, s, step);
  }

  void ImportState(int64_t id, torch::Tensor master, torch::Tensor exp_avg,
                   torch::Tensor exp_avg_sq, int64_t step) {
    const size_t n = engine_->ParamNumel(static_cast<uint64_t>(id));
    for (const torch::Tensor* t : {&master, &exp_avg, &exp_avg_sq}) {
      TS_CHECK(DTypeOf(*t, "state") == tk::DType::kFloat32 && static_cast<size_t>(t->numel()) == n,
               "state tensors must be float32 with the parameter's numel");
    }
    Check(engine_->ImportState(static_cast<uint64_t>(id), master.data_ptr<float>(),
                               exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                               static_cast<uint64_t>(step)));
  }

  unsigned threads() const { return pool_->size(); }
  bool deferred() const { return engine_->deferred(); }

 private:
  static void Check(const trainstream::Status& st) {
    if (!st.ok()) throw pybind11::value_error(st.message());
  }
  std::unique_ptr<to::WorkerPool> pool_;
  std::unique_ptr<to::AdamWEngine> engine_;
  std::vector<torch::Tensor> keep_alive_;
  std::mutex mu_;
  std::vector<to::StepResult> results_;  // Guarded by mu_
};

}  // namespace

void RegisterAdamWBindings(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("adamw_step", &AdamWStep, "One AdamW step (torch.optim.AdamW math) on CPU tensors",
        py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"),
        py::arg("param_out") = py::none(), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale") = 1.0,
        py::arg("seed") = 0, py::arg("param_key") = 0, py::arg("isa") = "auto");
  m.def("adamw_grad_sumsq", &GradSumSquares, py::arg("grad"), py::arg("isa") = "auto");
  m.def("adamw_stochastic_round_bf16", &StochasticRoundBf16, py::arg("x"), py::arg("seed"),
        py::arg("param_key"), py::arg("step"), py::arg("element_offset") = 0,
        py::arg("high_bits") = false);
  m.def("adamw_isa_supported", [](const std::string& name) {
    tk::Isa isa;
    return tk::ParseIsa(name, &isa) && tk::IsaSupported(isa);
  });
  m.def("adamw_best_isa", [] { return std::string(tk::IsaName(tk::BestIsa())); });
  m.def("adamw_cpu_has_avx512_bf16", &tk::CpuHasAvx512Bf16);
  py::class_<PyAdamWEngine>(m, "AdamWEngine")
      .def(py::init<unsigned, const std::string&, double, int64_t, bool, const std::string&,
                    int64_t>(),
           py::arg("threads") = 0, py::arg("moment_dtype") = "fp32", py::arg("max_grad_norm") = 0.0,
           py::arg("seed") = 0, py::arg("skip_nonfinite_step") = false, py::arg("isa") = "auto",
           py::arg("chunk_elems") = 65536)
      .def("add_param", &PyAdamWEngine::AddParam, py::arg("param_id"), py::arg("master"),
           py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad_slot"), py::arg("param_slot"))
      .def("init", &PyAdamWEngine::Init)
      .def("submit", &PyAdamWEngine::Submit, py::arg("param_id"), py::arg("step"), py::arg("lr"),
           py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"))
      .def("step_end", &PyAdamWEngine::StepEnd, py::arg("step"))
      .def("wait", &PyAdamWEngine::Wait)
      .def("export_state", &PyAdamWEngine::ExportState, py::arg("param_id"))
      .def("import_state", &PyAdamWEngine::ImportState, py::arg("param_id"), py::arg("master"),
           py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("step"))
      .def_property_readonly("threads", &PyAdamWEngine::threads)
      .def_property_readonly("deferred", &PyAdamWEngine::deferred);
}

}  // namespace trainstream::python

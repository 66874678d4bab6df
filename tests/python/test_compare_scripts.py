"""benchmarks/compare.py and benchmarks/quality.py at --tiny on the CPU: the
head-to-head runs each engine in its own process and reports what it measured, or why
an engine could not run; quality.py trains its small model on the standard library's
sources and measures every format's perplexity before and after LoRA. The full runs
are the GPU host's (docs/benchmarks-compare.md); these check the scripts end to end."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
ENGINES = "stock,trainstream,trainstream_nf4,trainstream_gpu_bf16,deepspeed_zero2,bnb_qlora"


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def compare(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    # The suite's PYTHONPATH (the built package); each TrainStream engine starts its own
    # daemon from the build tree (TRAINSTREAM_BUILD_DIR), so no socket is shared.
    proc = subprocess.run(
        [sys.executable, str(BENCH / "compare.py"), "--tiny", "--scenarios", "full1.5b,lora14b",
         "--engines", ENGINES, "--steps", "3", "--warmup", "1", "--live", "--out", str(out),
         "--timeout", "240"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, f"compare.py exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    doc = json.loads((out / "results.json").read_text())
    return out, doc, proc


def _result(doc, scenario, engine):
    found = [r for r in doc["results"] if r["scenario"] == scenario and r["engine"] == engine]
    assert len(found) == 1, (scenario, engine, found)
    return found[0]


def test_compare_records_the_machine_and_scenarios(compare):
    _, doc, _ = compare
    m = doc["machine"]
    assert m["cpu_cores"] >= 1 and m["ram_bytes"] > 0 and m["torch"], m
    assert set(doc["scenarios"]) == {"full1.5b", "lora14b"}
    full, lora = doc["scenarios"]["full1.5b"], doc["scenarios"]["lora14b"]
    assert full["trained_params"] == full["params"] > 0
    assert 0 < lora["trained_params"] < lora["params"]
    assert (full["lr"], lora["lr"]) == (2e-5, 2e-4)  # the same rates as every engine's
    assert doc["command"].startswith("python benchmarks/compare.py --tiny")


def test_compare_engines_that_run_report_positive_figures(compare):
    _, doc, _ = compare
    ran = [r for r in doc["results"] if r["status"] == "ok"]
    names = {(r["scenario"], r["engine"]) for r in ran}
    expected = {("full1.5b", "stock"), ("full1.5b", "trainstream"), ("lora14b", "stock"),
                ("lora14b", "trainstream"), ("lora14b", "trainstream_nf4")}
    assert expected <= names, [(r["scenario"], r["engine"], r["status"], r.get("reason")) for r in doc["results"]]
    for r in ran:
        assert r["step_s"] > 0 and len(r["step_times"]) == 3 and all(t > 0 for t in r["step_times"]), r
        assert r["step_s"] == sorted(r["step_times"])[1]  # the median of the measured steps
        assert r["warmup_steps"] >= 1 and len(r["losses"]) == r["warmup_steps"] + 3
        assert all(math.isfinite(v) for v in r["losses"]), r["losses"]
        assert r["host_bytes"] > 0 and r["host_own_bytes"] > 0 and r["samples"] >= 1, r
        assert r["trained_params"] > 0 and r["host_bytes_per_trained_param"] > 0
        assert r["wall_s"] > 0


def test_compare_trainstream_trains_and_counts_its_daemon(compare):
    _, doc, _ = compare
    for scenario, engine in (("full1.5b", "trainstream"), ("lora14b", "trainstream"),
                             ("lora14b", "trainstream_nf4")):
        r = _result(doc, scenario, engine)
        assert r["status"] == "ok", r.get("reason")
        assert r["losses"][-1] < r["losses"][0], r["losses"]  # the same batch every step
        # Its own daemon's shared memory is part of its host figure.
        assert 0 < r["daemon_shm_bytes"] < r["host_bytes"]
        assert r["still_adapting"] is False
        assert r["report"]["optimizer_mode"] in ("cpu", "gpu")
    assert _result(doc, "lora14b", "trainstream_nf4")["info"]["base"] == "load_model(quantize='nf4')"
    # Which matmul the quantized linears ran (on the CPU every format dequantizes; on
    # Hopper FP8 may take the tensor cores): none for a bf16 base.
    paths = _result(doc, "lora14b", "trainstream_nf4")["report"]["matmul_paths"]
    assert set(paths) == {"dequantize-bf16"} and paths["dequantize-bf16"] >= 4, paths
    assert _result(doc, "full1.5b", "trainstream")["report"]["matmul_paths"] == {}
    # No FP8 tensor-core copies on the CPU, so none to check against their weights.
    assert _result(doc, "lora14b", "trainstream_nf4")["report"]["fp8_copies"] == {"fresh": 0, "stale": 0}
    # The same model, data and learning rate: the first loss is the same for stock and
    # TrainStream on the full fine-tune (same checkpoint, same batch).
    a, b = _result(doc, "full1.5b", "stock"), _result(doc, "full1.5b", "trainstream")
    assert abs(a["losses"][0] - b["losses"][0]) < 1e-3, (a["losses"], b["losses"])


def test_compare_lists_engines_that_cannot_run_with_the_reason(compare):
    out, doc, _ = compare
    for scenario in ("full1.5b", "lora14b"):
        ds = _result(doc, scenario, "deepspeed_zero2")
        if not _installed("deepspeed"):
            assert ds["status"] == "not installed", ds
            assert ds["reason"].startswith("not installed: ModuleNotFoundError") and "deepspeed" in ds["reason"]
    if not _cuda():
        gpu = _result(doc, "full1.5b", "trainstream_gpu_bf16")
        assert gpu["status"] == "needs CUDA" and gpu["reason"].startswith("needs CUDA"), gpu
    bnb = _result(doc, "lora14b", "bnb_qlora")
    if not _installed("bitsandbytes"):
        assert bnb["status"] == "not installed" and "bitsandbytes" in bnb["reason"], bnb
    # Adapter-only engines are not a full fine-tune: listed as such, never dropped.
    na = _result(doc, "full1.5b", "trainstream_nf4")
    assert na["status"] == "n/a" and "adapters" in na["reason"]
    na = _result(doc, "lora14b", "trainstream_gpu_bf16")
    assert na["status"] == "n/a" and "full fine-tunes only" in na["reason"]
    md = (out / "results.md").read_text()
    assert "| engine | step time |" in md and "Engines that did not run:" in md
    assert "DeepSpeed ZeRO-2" in md and "optimizer_mode='gpu'" in md


def test_compare_live_streams_steps_and_memory(compare):
    _, doc, proc = compare
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    steps = [r for r in records if r["type"] == "step"]
    memory = [r for r in records if r["type"] == "memory"]
    assert memory and all(r["host"] > 0 for r in memory)
    for r in doc["results"]:
        if r["status"] == "ok":
            mine = [s for s in steps if (s["scenario"], s["engine"]) == (r["scenario"], r["engine"])]
            assert [s["loss"] for s in mine] == r["losses"]


def test_compare_charts_and_readme(compare):
    out, doc, _ = compare
    charts = doc["charts"]
    if _installed("matplotlib"):
        for name in ("step_time.png", "peak_vram.png", "host_per_param.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert charts["error"].startswith("not drawn: matplotlib not installed")
    text = subprocess.run([sys.executable, str(BENCH / "compare.py"), "--readme", str(out / "results.json")],
                          capture_output=True, text=True, timeout=120, check=True).stdout
    assert text.startswith("## Against other libraries (benchmarks/compare.py)")
    assert "Machine:" in text and "python benchmarks/compare.py --tiny" in text
    assert "**lora14b**: LoRA r=16" in text and "TrainStream's best" in text


def test_fp8_copy_check_finds_a_copy_that_no_longer_matches_its_weight():
    # The FP8 engines' report counts tensor-core copies against a rebuild from the
    # weight (the slow FP8 fit on the H100 of 2026-12-07: a stale copy is one candidate cause).
    sys.path.insert(0, str(BENCH))
    import torch
    from headtohead.measure import fp8_copies_checked
    from trainstream.frozen.quantization import QuantLinear
    q = QuantLinear.from_linear(torch.nn.Linear(64, 32).requires_grad_(False), "fp8")
    model = torch.nn.Sequential(q, QuantLinear.from_linear(torch.nn.Linear(32, 16).requires_grad_(False), "nf4"))
    assert fp8_copies_checked(model) == {"fresh": 0, "stale": 0}   # no copy built yet
    q._fp8_weight(torch.device("cpu"))
    assert fp8_copies_checked(model) == {"fresh": 1, "stale": 0}
    kept = q._fp8_cache
    kept[1].view(torch.uint8)[3, 5] ^= 1                         # one code changed
    assert fp8_copies_checked(model) == {"fresh": 0, "stale": 1}
    assert q._fp8_cache is kept                                  # the check leaves the copy in place


def test_merge_keeps_the_later_result_of_a_run():
    sys.path.insert(0, str(BENCH))
    from headtohead import report
    a = {"command": "a", "machine": {}, "scenarios": {"s": {}}, "engines": {"e": "E"},
         "results": [{"scenario": "s", "engine": "e", "capped": True, "status": "oom", "reason": "x"}]}
    b = {"command": "b", "machine": {}, "scenarios": {"s": {}}, "engines": {"e": "E"},
         "results": [{"scenario": "s", "engine": "e", "capped": True, "status": "ok", "step_s": 1.0},
                     {"scenario": "s", "engine": "e", "capped": False, "status": "ok", "step_s": 2.0}]}
    m = report.merge([a, b])
    assert m["commands"] == ["a", "b"]
    assert sorted((r["capped"], r["status"]) for r in m["results"]) == [(False, "ok"), (True, "ok")]
    with pytest.raises(ValueError, match="nothing to merge"):
        report.merge([])


def test_merge_keeps_runs_of_different_gpus_in_tables_of_their_own():
    # Note [One machine per table]: an H100 run and an H200 run of one scenario are two
    # tables (and two chart panels), each named by its GPU, and neither replaces the other.
    sys.path.insert(0, str(BENCH))
    from headtohead import report

    def run(gpu, step):
        return {"command": gpu, "machine": {"gpu": gpu, "cpu_cores": 16},
                "scenarios": {"s": {"kind": "lora", "params": 10, "batch": 1, "seq": 8}},
                "engines": {"e": "E"},
                "results": [{"scenario": "s", "engine": "e", "label": "E", "capped": True,
                             "cap_gib": 24, "status": "ok", "step_s": step, "losses": [2.0, 1.0]}]}
    m = report.merge([run("NVIDIA H200", 1.0), run("NVIDIA H100 80GB HBM3", 2.0)])
    assert sorted(r["step_s"] for r in m["results"]) == [1.0, 2.0]
    assert list(m["machines"]) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    groups = list(report.groups(m))
    assert [[r["machine_name"] for r in g[2]] for g in groups] == [["NVIDIA H200"], ["NVIDIA H100 80GB HBM3"]]
    text = report.markdown(m)
    assert "24 GiB VRAM cap, on NVIDIA H200" in text and "24 GiB VRAM cap, on NVIDIA H100 80GB HBM3" in text
    assert "Machine: NVIDIA H200 (" in text and "Machine: NVIDIA H100 80GB HBM3 (" in text
    missing = dict(run("NVIDIA H100 80GB HBM3", 2.0), results=[
        {"scenario": "s", "engine": "u", "label": "U", "capped": True, "status": "not installed",
         "reason": "No module named 'u'"}])
    assert report.not_run(report.merge([run("NVIDIA H200", 1.0), missing])) == [
        "U, on NVIDIA H100 80GB HBM3: No module named 'u'"]
    # Merging the merged document again changes nothing; one machine reads as before.
    again = report.merge([m])
    assert [len(g[2]) for g in report.groups(again)] == [1, 1]
    one = report.merge([run("NVIDIA H200", 1.0), run("NVIDIA H200", 3.0)])
    assert [r["step_s"] for r in one["results"]] == [3.0]
    assert ", on " not in report.markdown(one) and report.markdown(one).count("Machine:") == 1


def test_checkpoint_tokenizer_has_a_pad_token_of_its_own(tmp_path):
    # Unsloth's fix_pad_token refuses a tokenizer whose pad is its end of text and
    # which has no pad-named special token (seen on the H200: "Could not find a valid
    # pad token"). Qwen2.5's own tokenizer has <|fim_pad|>; ours has it too, and
    # len(tokenizer) stays the model's vocabulary (nothing to resize).
    sys.path.insert(0, str(BENCH))
    from headtohead.scenarios import write_tokenizer
    from transformers import AutoTokenizer
    write_tokenizer(str(tmp_path), 1000)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 1000
    assert tok.pad_token == "<|fim_pad|>" and tok.pad_token_id == 999
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 998
    assert {str(t) for t in tok.added_tokens_decoder.values()} >= {"<|fim_pad|>", "<|endoftext|>"}


def test_quality_measures_every_format_before_and_after_lora(tmp_path):
    out = tmp_path / "quality.json"
    proc = subprocess.run([sys.executable, str(BENCH / "quality.py"), "--tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["corpus"]["heldout_bytes"] > 0 and doc["corpus"]["pretrain_bytes"] > doc["corpus"]["heldout_bytes"]
    losses = doc["model"]["pretrain_losses"]
    assert losses[-1][1] < losses[0][1] - 1.0, losses  # the model learned the text
    rows = {r["format"]: r for r in doc["formats"]}
    assert set(rows) == {"bf16", "int8", "nf4", "fp8", "nvfp4"}, rows
    bf16 = rows["bf16"]
    assert bf16["vs_bf16_before"] == 0 and bf16["vs_bf16_after"] == 0 and bf16["matmul_paths"] == {}
    for name, r in rows.items():
        assert "error" not in r, r
        assert 1.0 < r["ppl_before"] < 256 and 1.0 < r["ppl_after"] < 256, r  # better than uniform bytes
        assert r["ppl_after"] < r["ppl_before"], r  # the fine-tune helps on held-out text
        assert r["lora_loss_last"] < r["lora_loss_first"], r
        if name != "bf16":
            assert r["state_bytes"] < bf16["state_bytes"], (name, r["state_bytes"], bf16["state_bytes"])
            assert set(r["matmul_paths"]) == {"dequantize-bf16"}, r  # a CPU run dequantizes
            assert abs(r["vs_bf16_before"]) < 0.5, r  # a quantized base, not a broken one
    assert "| base format | perplexity before LoRA |" in proc.stdout


def _readme_results():
    """readme_results.py, benchmarks/results/index.json, and every head-to-head run merged."""
    sys.path.insert(0, str(BENCH))
    sys.path.insert(0, str(BENCH / "headtohead"))
    import readme_results
    index = readme_results.load_index()
    return readme_results, index, readme_results.select(index)


def test_all_runs_leave_out_what_the_index_says():
    # Every head-to-head run on every host is in benchmarks/results/index.json: the first
    # H200 run of 2026-12-02 (13:36-13:57 UTC) left its models in eval mode, so its
    # checkpointed runs were not checkpointed, and its TrainStream ran before the loss fix:
    # neither may count; every result names the file it came from.
    readme_results, index, doc = _readme_results()
    assert doc["results"]
    assert {r["scenario"] for r in doc["results"]} <= set(index["scenarios"])
    for r in doc["results"]:
        if r["source"].startswith("h200-2026-12-02-13"):
            assert not r["engine"].endswith("_ckpt") and not r["engine"].startswith("trainstream"), r
    keys = [(r["scenario"], r["engine"], r.get("capped"), r["machine_name"]) for r in doc["results"]]
    assert len(keys) == len(set(keys))
    for r in doc["results"]:  # each result names the GPU of the file it came from
        assert ("H100" in r["machine_name"]) == r["source"].startswith("h100-"), r["source"]
    # A file named with a host label keeps its results in tables of that host alone.
    hosts = {os.path.basename(e["file"]): e["host"] for e in index["files"] if isinstance(e, dict)}
    assert hosts, "index.json labels no host"
    for r in doc["results"]:
        host = hosts.get(r["source"])
        assert r["machine_name"].endswith(f", {host}") if host else "," not in r["machine_name"], r
    labelled = {r["machine_name"] for r in doc["results"] if r["source"] in hosts}
    assert labelled and labelled <= set(doc["machines"])
    text = readme_results.report.markdown(doc)
    for name in labelled:
        assert f"Machine of the tables on {name}:" in text and f", on {name}" in text


def _coverage():
    sys.path.insert(0, str(BENCH))
    from headtohead import coverage
    return coverage


def _doc(*results):
    keys = ("scenario", "engine", "capped", "status", "wall_s", "reason")
    return {"results": [dict(zip(keys, r)) for r in results]}


def test_coverage_counts_a_cell_once_an_engine_reached_an_outcome_in_it():
    coverage = _coverage()
    doc = _doc(("full1.5b", "stock", True, "oom", 20.0), ("full1.5b", "stock", False, "ok", 21.0),
               ("full1.5b", "fsdp2_offload", True, "not installed", 1.0),
               ("full1.5b", "deepspeed_zero2", True, "timeout", 130.0, "timed out after 120.0 s (3 steps done)"),
               ("full1.5b", "deepspeed_zero3", True, "error", 5.0, "import deepspeed: No module named 'deepspeed'"),
               ("full1.5b", "torchao_offload", True, "timeout", 120.0, "timed out after 120.0 s (0 steps done)"),
               ("full1.5b", "torchao_offload_ckpt", True, "error", 9.0,
                "error in setup: ModuleNotFoundError: No module named 'trainstream'"),
               ("full1.5b", "trainstream", True, "error", 3.0, "trainstreamd did not start: log in /tmp/x"),
               ("full1.5b", "trainstream_ckpt", True, "error", 30.0, "error in setup: RuntimeError: bad shape"))
    cells = coverage.unmeasured(doc, ["full1.5b", "lora14b"])
    assert ("full1.5b", "stock", True) not in cells and ("full1.5b", "stock", False) not in cells
    assert ("full1.5b", "deepspeed_zero2", True) not in cells        # timed out training: an outcome
    assert ("full1.5b", "trainstream_ckpt", True) not in cells       # its own error: an outcome
    # What only says the host lacked something, or the timeout was too short, stays open:
    for engine in ("fsdp2_offload", "deepspeed_zero3", "torchao_offload", "torchao_offload_ckpt", "trainstream"):
        assert ("full1.5b", engine, True) in cells, engine
    assert not [c for c in cells if c[0] == "full1.5b" and c[1] in ("bnb_qlora", "unsloth")]
    assert ("lora14b", "bnb_qlora", True) in cells and ("lora14b", "trainstream_nf4", False) in cells
    assert not [c for c in cells if c[0] == "lora14b" and c[1] == "trainstream_gpu_bf16"]
    lines = coverage.lines(doc, cells)
    assert lines[0].startswith("`full1.5b`, capped: ") and "FSDP2" in lines[0]
    assert not any("Stock PyTorch, fused AdamW;" in line for line in lines if "full1.5b" in line)


def test_coverage_plans_each_open_cell_once_within_a_call():
    coverage = _coverage()
    from headtohead.engines import ENGINES, parse_engines
    doc = _doc(("lora14b", "deepspeed_zero3", True, "ok", 141.0), ("lora14b", "fsdp2_offload", True, "ok", 99.0),
               ("lora14b", "trainstream", True, "ok", 69.0), ("lora14b_2k", "torchao_offload", True, "oom", 8.0),
               ("lora14b_2k", "unsloth", True, "oom", 170.0))
    cells = coverage.unmeasured(doc, ["lora14b", "lora14b_2k"])
    calls = coverage.plan(doc, cells, call_s=300)
    parts = [p for c in calls for p in c["parts"]]
    planned = [(p["scenario"], e, p["capped"]) for p in parts for e in p["engines"]]
    assert sorted(planned) == sorted(cells)
    walls = coverage.wall_estimates(doc)
    assert coverage.estimate(walls, "lora14b", "deepspeed_zero3") == 141.0
    assert coverage.estimate(walls, "lora14b", "trainstream_nf4") == 69.0        # its auto's
    assert coverage.estimate(walls, "lora14b_2k", "fsdp2_offload") == 99.0       # the 512-token run's
    # A run out of memory in setup says little of the engine's wall where it trains:
    assert coverage.estimate(walls, "lora14b_2k", "torchao_offload") == coverage.GUESS_S
    assert coverage.estimate(walls, "lora14b_2k", "torchao_offload_ckpt") == coverage.GUESS_S
    assert coverage.estimate(walls, "lora14b_2k", "unsloth") == 170.0             # but bounds it below
    assert coverage.estimate(walls, "lora14b_2k", "bnb_qlora") == coverage.GUESS_S
    # Parts share calls where they fit: fewer calls than runs, none over its limit.
    packed = coverage.plan(doc, cells)
    assert len(packed) < sum(len(c["parts"]) for c in packed)
    for c in calls + packed:
        limit = 300 if c in calls else 540
        engines = [e for p in c["parts"] for e in p["engines"]]
        assert len(engines) == 1 or c["estimate_s"] <= limit, c
        assert 1 <= len(c["parts"]) <= coverage.MAX_PARTS
        assert c["estimate_s"] == pytest.approx(
            coverage.SETUP_S + (coverage.LEAN_S if c["lean"] else 0.0) + coverage.PART_S * (len(c["parts"]) - 1)
            + sum(coverage.estimate(walls, p["scenario"], e) for p in c["parts"] for e in p["engines"]))
        assert c["lean"] == any(e.startswith("trainstream") for e in engines)
        # A call without the build runs no engine that imports the package.
        assert c["lean"] or not any("trainstream" in ENGINES[e].needs for e in engines), c
        lean = coverage.LEAN_S if c["lean"] else 0.0
        assert coverage.compare_timeout(c) + coverage.SETUP_S + lean + coverage.MARGIN_S == coverage.CALL_LIMIT_S
        cmd = coverage.command(c)
        assert ('STAGES="lean compare"' in cmd) == c["lean"]
        runs = cmd.split('COMPARE_ARGS="')[1].split('"')[0].split(";")   # as gpu-check.sh splits them
        assert len(runs) == len(c["parts"])
        for run, p in zip(runs, c["parts"]):
            assert ("--uncapped" in run) != p["capped"] and f"--scenarios {p['scenario']} " in run
            assert [e.name for e in parse_engines(run.split("--engines ")[1].strip())] == p["engines"]
            assert f"--timeout {p['timeout_s']}" in run and p["timeout_s"] >= 60
    # An anchor runs first in each part of a scenario and cap where it has a step time.
    anchored = coverage.plan(doc, cells, call_s=300, anchors=["trainstream", "stock"])
    parts = [p for c in anchored for p in c["parts"]]
    assert sorted((p["scenario"], e, p["capped"]) for p in parts for e in p["engines"]
                  if not (p["scenario"] == "lora14b" and p["capped"] and e == "trainstream")) == sorted(cells)
    for p in parts:  # stock has no step time here, so it anchors nothing
        if p["scenario"] == "lora14b" and p["capped"]:
            assert p["engines"][0] == "trainstream" and len(p["engines"]) > 1, p
    assert sum(e == "stock" for p in parts for e in p["engines"]) == sum(e == "stock" for _, e, _ in cells)


def test_compare_runs_puts_each_of_several_runs_in_its_own_folder(tmp_path):
    # coverage.py packs several compare.py runs into one device call: gpu-check.sh's
    # COMPARE_ARGS holds them separated by ';' and scripts/compare-runs.sh runs them.
    # Each lands in compare-<n>/, within one COMPARE_TIMEOUT, and leaves only its
    # results.json (a call returns 8 files).
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (fake / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", OUT=str(out), COMPARE_TIMEOUT="300",
               CKPT_DIR=str(tmp_path / "ckpt"),
               COMPARE_ARGS="--tiny --scenarios full1.5b --engines stock --timeout 120 ; "
                            "--tiny --scenarios lora14b --uncapped --engines stock --timeout 120")
    done = subprocess.run(["bash", str(REPO / "scripts" / "compare-runs.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr + (out / "compare.log").read_text()
    got = []
    for n in (1, 2):
        assert not (out / f"compare-{n}" / "results.md").exists()
        doc = json.loads((out / f"compare-{n}" / "results.json").read_text())
        got += [(r["scenario"], r["engine"], r["capped"], r["status"]) for r in doc["results"]]
    assert got == [("full1.5b", "stock", True, "ok"), ("lora14b", "stock", False, "ok")]
    assert not (out / "compare").exists()
    log = (out / "compare.log").read_text()
    assert log.count("== compare ") == 2 and "s left)" in log


def test_compare_runs_skips_empty_runs_and_stops_at_its_deadline(tmp_path):
    # A stand-in compare.py (python3 on PATH) that records its arguments: a trailing or
    # doubled ';' adds no run (an empty one would start compare.py with its defaults,
    # every scenario and engine), a newline is a space, a run cut by COMPARE_TIMEOUT
    # and a run left no time fail the call.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\necho "$*" >> "$OUT/calls"\n'
                                  'case "$*" in *slow*) sleep 30;; esac\n')
    (fake / "python3").chmod(0o755)
    script = str(REPO / "scripts" / "compare-runs.sh")

    def run(args, timeout="60", name="out"):
        out = tmp_path / name
        env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", OUT=str(out),
                   COMPARE_TIMEOUT=timeout, COMPARE_ARGS=args)
        done = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=120)
        calls = (out / "calls").read_text().splitlines() if (out / "calls").exists() else []
        return done, [c.split("--no-charts ")[1].strip() for c in calls], out

    done, calls, out = run("--scenarios a\n--engines x ; ;  ; --scenarios b ;")
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls == ["--scenarios a --engines x", "--scenarios b"]
    done, calls, out = run("--scenarios a --slow ; --scenarios b", timeout="2", name="cut")
    assert done.returncode == 1 and calls == ["--scenarios a --slow"]
    log = (out / "compare.log").read_text()
    assert "cut by COMPARE_TIMEOUT" in log and "COMPARE_TIMEOUT spent before this run" in log
    done, calls, _ = run("--scenarios a", timeout="8m", name="bad")
    assert done.returncode == 2 and "accepted whole seconds" in done.stderr and not calls


def test_fp8_fit_diagnostic_trains_both_arms_from_one_start(tmp_path):
    # benchmarks/base/diag_fp8_fit.py (the FP8 fit found on the H100 of 2026-12-07): on the CPU both arms
    # dequantize, so from the same start they must give the same losses; on Hopper the
    # first arm takes the FP8 tensor cores and the difference is the finding's measure.
    out = tmp_path / "diag.json"
    proc = subprocess.run([sys.executable, str(BENCH / "base" / "diag_fp8_fit.py"), "--tiny", "--layers", "2",
                           "--steps", "5", "--seq", "64", "--json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    a, b = doc["module"], doc["dequantize"]
    assert len(a["losses"]) == 5 and a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert a["losses"][-1] < a["losses"][0]
    assert a["matmul_paths"] == b["matmul_paths"] == {"dequantize-bf16": 14}   # 2 blocks x 7 linears
    lin = a["linears"]
    assert len(lin) == 14 and {n.split(".")[0] for n in lin} == {"0", "1"}   # both blocks probed
    assert all(0 < r["rel_err_vs_dequantized"] < 0.01 for r in lin.values()), lin  # bf16 rounding
    assert not lin["0.self_attn.q_proj"]["input_requires_grad"]     # embeddings are frozen
    assert lin["1.self_attn.q_proj"]["input_requires_grad"] and lin["1.self_attn.q_proj"]["bias"]
    assert "step  module   dequantize" in proc.stdout


def test_fp8_fit_diagnostic_emulates_the_tensor_core_path_on_the_cpu(tmp_path):
    # --emulate-fp8: the first arm takes QuantLinear's FP8 path without FP8 tensor cores
    # (row-wise scaled_mm in fp32, eager activation rounding), so the path's arithmetic
    # is checked here: every linear on it, about e4m3's rounding error, a fit that
    # follows the dequantized one.
    out = tmp_path / "diag.json"
    proc = subprocess.run([sys.executable, str(BENCH / "base" / "diag_fp8_fit.py"), "--tiny", "--emulate-fp8",
                           "--layers", "2", "--steps", "5", "--seq", "64", "--json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    a, b = doc["module"], doc["dequantize"]
    assert a["matmul_paths"] == {"fp8-scaled-mm-rowwise": 14} and b["matmul_paths"] == {"dequantize-bf16": 14}
    errs = [r["rel_err_vs_dequantized"] for r in a["linears"].values()]
    assert len(errs) == 14 and all(0.01 < e < 0.05 for e in errs), errs   # e4m3 activations
    assert all(r["rel_err_vs_dequantized"] < 0.01 for r in b["linears"].values())
    assert a["losses"] != b["losses"] and a["losses"][-1] < a["losses"][0]
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 0.01, (a["losses"], b["losses"])
    bad = subprocess.run([sys.executable, str(BENCH / "base" / "diag_fp8_fit.py"), "--hidden", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--hidden 0: accepted 1 or more" in bad.stderr


def test_fp8_path_through_load_model_and_wrap_keeps_its_copies_fresh(tmp_path):
    # The FP8 path, emulated (benchmarks/base/emulate_fp8), through compare.py's
    # trainstream_fp8 engine: the daemon's shared base (load_model), PEFT and wrap(). Every
    # linear takes the path, and after the run every tensor-core copy still equals one
    # rebuilt from its weight (a stale copy would train on other weights than the backward's).
    out = tmp_path / "cmp"
    path = os.pathsep.join([str(BENCH / "base" / "emulate_fp8"), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(BENCH / "compare.py"), "--tiny", "--scenarios", "lora14b", "--engines",
         "trainstream_fp8", "--steps", "3", "--warmup", "1", "--no-charts", "--out", str(out),
         "--timeout", "240"],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = _result(json.loads((out / "results.json").read_text()), "lora14b", "trainstream_fp8")
    assert r["status"] == "ok", r.get("reason")
    paths, copies = r["report"]["matmul_paths"], r["report"]["fp8_copies"]
    assert set(paths) == {"fp8-scaled-mm-rowwise"} and paths["fp8-scaled-mm-rowwise"] >= 4, paths
    assert copies == {"fresh": paths["fp8-scaled-mm-rowwise"], "stale": 0}, copies
    assert r["losses"][-1] < r["losses"][0], r["losses"]


def test_readme_results_are_one_run_of_one_host_and_the_readme_holds_them():
    # README.md's results section is exactly what readme_results.py makes of the run the
    # index names (one GPU, one date, every scenario), with a chart per scenario from the
    # same run: a README edited by hand, or an index pointed at another run without
    # regenerating (readme_results.py --write), fails here.
    readme_results, index, _ = _readme_results()
    run = readme_results.readme_run(index)
    assert set(run["scenarios"]) == set(index["scenarios"]), run["scenarios"]
    assert len(run["machines"]) == 1, run["machines"]
    for rel in index["readme"]["files"]:
        assert os.path.basename(rel).startswith(index["readme"]["name"] + "-"), rel
    quality = readme_results.report.load(str(REPO / index["quality"]))
    text = readme_results.section(index, run, quality)
    readme = (REPO / "README.md").read_text()
    assert f"{readme_results.BEGIN}\n{text}{readme_results.END}" in readme, \
        "README.md's results section is stale: run benchmarks/headtohead/readme_results.py --write"
    assert readme.count(readme_results.BEGIN) == 1
    for sc in run["scenarios"]:
        png = REPO / readme_results.CHARTS / f"{index['readme']['name']}-{sc}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({readme_results.CHARTS}/{png.name})" in text


def test_readme_run_refuses_files_of_two_hosts():
    readme_results, index, _ = _readme_results()
    other = next(e if isinstance(e, str) else e["file"] for e in index["files"]
                 if "h100-" in (e if isinstance(e, str) else e["file"]))
    mixed = dict(index, readme=dict(index["readme"], files=index["readme"]["files"] + [other]))
    with pytest.raises(ValueError, match="one host's"):
        readme_results.readme_run(mixed)



"""compare.py's outputs from its results JSON: the Markdown tables, the PNG charts
(matplotlib) and the README's results section. Everything here reads the JSON only, so
results from several GPU-host calls can be merged and rendered later, anywhere."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

GIB = 2**30
STATUS_SHORT = {"oom": "out of memory", "timeout": "timed out", "killed": "killed",
                "error": "error", "not installed": "not installed", "needs CUDA": "needs CUDA"}


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def machine_name(m: Optional[dict]) -> str:
    """A machine's short name in tables and chart titles: its GPU's ("no GPU" without
    one, "an undescribed machine" when the run could not describe it)."""
    if not m or m.get("error"):
        return "an undescribed machine"
    return m.get("gpu") or "no GPU"


def merge(docs: List[dict]) -> dict:
    """One document from several runs: the first's machine and command (the others'
    commands listed too); a result of a later document replaces an earlier one of the
    same scenario, engine, cap and machine. Each result keeps the name of the machine it
    ran on (``machine_name``; ``machines`` maps each name to its description), so runs
    on different GPUs stay in tables of their own (Note [One machine per table])."""
    if not docs:
        raise ValueError("nothing to merge: give at least one results.json")
    out = dict(docs[0])
    out["commands"] = [d.get("command") for d in docs]
    out["scenarios"], out["engines"], out["machines"] = {}, {}, {}
    keyed: Dict[tuple, dict] = {}
    for d in docs:
        out["scenarios"].update(d.get("scenarios", {}))
        out["engines"].update(d.get("engines", {}))
        for r in d.get("results", []):
            name = r.get("machine_name") or machine_name(d.get("machine"))
            out["machines"].setdefault(name, (d.get("machines") or {}).get(name, d.get("machine", {})))
            keyed[(r["scenario"], r["engine"], r.get("capped"), name)] = dict(r, machine_name=name)
    out["results"] = list(keyed.values())
    return out


# Note [One machine per table]
# Step times from two kinds of GPU are not comparable (the device tool gives an H100 host
# or an H200 one), so a merged document never puts them in one table or chart panel:
# groups() splits each scenario and cap by the GPU its results ran on, and the headings
# name it once a document holds more than one. Hosts of one kind are grouped together
# although they differ too (two H100 hosts by up to 10-15% on the 7B step:
# docs/staging-pool.md); each results file names its host's measured PCIe and cores.
# Where one host ran visibly faster than another of its GPU (the H200 of 2026-12-06 ran
# Unsloth's 512-token step, which never nears the cap, 1.6x as fast as that of 2026-12-04),
# benchmarks/results/index.json names that host's files with a label, and their tables
# stand apart ("NVIDIA H200, <label>"). A document of one machine reads as it always did.
def _machines(doc: dict) -> List[str]:
    """The machines of a merged document, in the order merge() met them (none for one
    run's results.json, which names no machine per result)."""
    return list(doc.get("machines") or {})


def _on(doc: dict, name: Optional[str]) -> str:
    """", on <GPU>" where the document holds several machines, else nothing."""
    return f", on {name}" if name and len(_machines(doc)) > 1 else ""


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GIB:.1f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def one_line(r: dict) -> str:
    head = f"{r['scenario']:<11} {r['engine']:<22} {'cap' if r.get('capped') else 'free':<4}"
    if r["status"] != "ok":
        return f"{head} {_outcome(r, None)[:200]}"
    return (f"{head} {r['step_s']:.4f} s/step, VRAM {_gib(r.get('peak_vram_bytes'))} GiB (NVML "
            f"{_gib(r.get('peak_nvml_bytes'))}), host {_gib(r.get('host_bytes'))} GiB, loss "
            f"{r['losses'][0]} -> {r['losses'][-1]}")


def groups(doc: dict):
    """(scenario, capped, [results run]) in the document's scenario order, one group per
    machine as well where the results ran on several (Note [One machine per table])."""
    order = list(doc.get("scenarios", {}))
    seen = {}
    for r in doc["results"]:
        if r["status"] == "n/a":
            continue
        seen.setdefault((r["scenario"], bool(r.get("capped")), r.get("machine_name")), []).append(r)
    for sc in order:
        for m in _machines(doc) + [None]:  # a machine's capped and uncapped tables together
            for capped in (True, False):
                if (sc, capped, m) in seen:
                    yield sc, capped, seen.pop((sc, capped, m))


def _outcome(r: dict, fastest: Optional[float]) -> str:
    if r["status"] == "ok":
        if not fastest:
            return "ran"
        ratio = r["step_s"] / fastest
        text = "fastest" if ratio <= 1.0 + 1e-9 else f"{ratio:.2f}x the fastest"
        if r.get("still_adapting"):
            text += " (still adapting when measured)"
        if r.get("within_cap") is False:
            text += " (torch's peak above the cap)"
        return text
    reason = _short_reason(r.get("reason", ""))
    return reason if reason.startswith(STATUS_SHORT.get(r["status"], "\0")) else \
        f"{STATUS_SHORT.get(r['status'], r['status'])}: {reason}"


def _short_reason(reason: str) -> str:
    """torch's out-of-memory message without its boilerplate (what was asked is kept;
    the whole message stays in the results file)."""
    for cut in (" GPU 0 has a total capacity", " Including non-PyTorch memory"):
        if cut in reason:
            reason = reason[:reason.index(cut)]
    return reason


def _cap_text(doc: dict, capped: bool, results: List[dict]) -> str:
    on = _on(doc, results[0].get("machine_name") if results else None)
    if not capped:
        return "uncapped" + on
    cap = next((r.get("cap_gib") for r in results if r.get("cap_gib")), None)
    return (f"{cap:g} GiB VRAM cap" if cap else "capped") + on


def table(doc: dict, sc: str, capped: bool, results: List[dict]) -> str:
    info = doc.get("scenarios", {}).get(sc, {})
    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: r["step_s"])
    rest = [r for r in results if r["status"] != "ok"]
    fastest = ok[0]["step_s"] if ok else None
    what = "full fine-tune" if info.get("kind") == "full" else "LoRA r=16"
    # TrainStream warms up until it stops adapting, so runs differ in steps: the loss
    # is compared at the step every run of the table reached.
    common = min((len(r["losses"]) for r in ok if r.get("losses")), default=0)
    lines = [f"**{sc}**: {what}, {_count(info.get('params', 0))} parameters, batch "
             f"{info.get('batch')}x{info.get('seq')}, {_cap_text(doc, capped, results)}", "",
             "| engine | step time | peak VRAM GiB (torch / NVML) | host GiB (B per trained param) | "
             f"loss, step 1 -> {common} | outcome |", "|---|---|---|---|---|---|"]
    for r in ok + rest:
        if r["status"] == "ok":
            per = r.get("host_bytes_per_trained_param")
            host = _gib(r.get("host_bytes")) + (f" ({per:.1f})" if per is not None else "")
            lines.append(f"| {r['label']} | {r['step_s']:.3f} s | {_gib(r.get('peak_vram_bytes'))} / "
                         f"{_gib(r.get('peak_nvml_bytes'))} | {host} | {r['losses'][0]} -> "
                         f"{r['losses'][common - 1]} | {_outcome(r, fastest)} |")
        else:
            lines.append(f"| {r.get('label', r['engine'])} | - | {_gib(r.get('peak_vram_bytes'))} / "
                         f"{_gib(r.get('peak_nvml_bytes'))} | - | - | "
                         f"{_outcome(r, fastest).replace('|', '/')[:300]} |")
    return "\n".join(lines)


def trainstream_against_peers(results: List[dict]) -> Optional[str]:
    """TrainStream's fastest run against the fastest peer's, one line (None when
    either did not run)."""
    ok = [r for r in results if r["status"] == "ok"]
    ours = min((r for r in ok if r["engine"].startswith("trainstream")), key=lambda r: r["step_s"],
               default=None)
    peer = min((r for r in ok if not r["engine"].startswith("trainstream")), key=lambda r: r["step_s"],
               default=None)
    if ours is None or peer is None:
        return None
    ratio = ours["step_s"] / peer["step_s"]
    verdict = "faster" if ratio < 1 else "slower"
    return (f"TrainStream's best ({ours['label']}, {ours['step_s']:.3f} s) is {ratio:.2f}x the best "
            f"peer's step ({peer['label']}, {peer['step_s']:.3f} s): {verdict}")


def machine_lines(doc: dict) -> List[str]:
    """The machine line, or one per machine (each starts with its GPU, the name its
    tables' headings use) where the document holds several."""
    names = _machines(doc)
    if len(names) <= 1:
        return [machine_line(doc.get("machine", {}))]
    lines = []
    for name in names:
        m = doc["machines"].get(name, {})
        # A host told apart from others of its GPU says which tables are its.
        heading = "Machine" if name == machine_name(m) else f"Machine of the tables on {name}"
        lines.append(machine_line(m, heading))
    return lines


def markdown(doc: dict) -> str:
    parts = [f"Command: `{doc.get('command', '')}`", "", *_paragraphs(machine_lines(doc))]
    for sc, capped, results in groups(doc):
        parts += [table(doc, sc, capped, results), ""]
        line = trainstream_against_peers(results)
        if line:
            parts += [line, ""]
    missing = not_run(doc)
    if missing:
        parts += ["Engines that did not run:", ""] + [f"- {m}" for m in missing] + [""]
    return "\n".join(parts)


def host_lacked(r: dict) -> bool:
    """A result that says only what its host lacked: the engine not installed, no CUDA,
    an import error."""
    return r["status"] in ("not installed", "needs CUDA") or (
        r["status"] == "error" and r.get("reason", "").startswith("import "))


def not_run(doc: dict) -> List[str]:
    """One line per engine that could not run at all (not installed, needs CUDA, an
    import error), with the reason; an engine counted once (once per GPU where the
    document holds several: Note [One machine per table])."""
    out, seen = [], set()
    for r in doc["results"]:
        if host_lacked(r):
            key = (r["engine"], r.get("machine_name"))
            if key not in seen:
                seen.add(key)
                out.append(f"{r.get('label', r['engine'])}{_on(doc, r.get('machine_name'))}: "
                           f"{r.get('reason', r['status'])}")
    return out


def _paragraphs(lines: List[str]) -> List[str]:
    out: List[str] = []
    for line in lines:
        out += [line, ""]
    return out


def machine_line(m: dict, heading: str = "Machine") -> str:
    if not m or m.get("error"):
        return f"{heading}: not described ({m.get('error', 'no record') if m else 'no record'})"
    gpu = (f"{m['gpu']} ({m.get('vram_bytes', 0) / 1e9:.0f} GB), driver {m.get('driver', '?')}"
           if m.get("gpu") else "no GPU")
    pcie = (f"; pinned PCIe H2D {m['pcie_h2d_gb_s']} GB/s, D2H {m['pcie_d2h_gb_s']} GB/s"
            if m.get("pcie_h2d_gb_s") else "")
    return (f"{heading}: {gpu}; {m.get('cpu', '?')}, {m.get('cpu_cores')} cores; "
            f"{m.get('ram_bytes', 0) / GIB:.0f} GiB RAM{pcie}; torch {m.get('torch')} "
            f"(CUDA {m.get('cuda')}), Python {m.get('python')}")


def charts(doc: dict, out: str) -> Dict[str, str]:
    """step_time.png, peak_vram.png and host_per_param.png in ``out``: one panel per
    scenario and cap, one bar per engine (a failed engine's bar is empty and labelled
    with why). Returns {name: file} or {"error": why} when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return {"error": f"not drawn: matplotlib not installed: {e}"}
    panels = list(groups(doc))
    if not panels:
        return {"error": "not drawn: no results"}
    metrics = {"step_time.png": ("step time (s)", lambda r: r.get("step_s")),
               "peak_vram.png": ("peak VRAM, torch allocated (GiB)",
                                 lambda r: (r.get("peak_vram_bytes") or 0) / GIB or None),
               "host_per_param.png": ("host bytes per trained parameter",
                                      lambda r: r.get("host_bytes_per_trained_param"))}
    files = {}
    for name, (xlabel, value) in metrics.items():
        # Each panel as tall as its engines need.
        heights = [0.9 + 0.28 * len(p[2]) for p in panels]
        fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.4 + sum(heights)), squeeze=False,
                                 gridspec_kw={"height_ratios": heights})
        for ax, (sc, capped, results) in zip(axes[:, 0], panels):
            results = sorted(results, key=lambda r: (r["status"] != "ok", r.get("step_s") or 0))
            labels = [r.get("label", r["engine"]) for r in results]
            # A failed run keeps its peak VRAM reading (where it ran out, say), hatched.
            values = [value(r) if r["status"] == "ok" or name == "peak_vram.png" else None
                      for r in results]
            colors = ["#d62728" if r["engine"].startswith("trainstream") else "#1f77b4" for r in results]
            bars = ax.barh(range(len(results)), [v or 0 for v in values], color=colors)
            top = max([v for v in values if v] or [1.0])
            for i, (r, v) in enumerate(zip(results, values)):
                if r["status"] != "ok":
                    bars[i].set_hatch("//")
                    bars[i].set_alpha(0.5)
                status = STATUS_SHORT.get(r["status"], r["status"])
                text = (f"{v:.3g}" if r["status"] == "ok" else f"{status} ({v:.3g})") if v else \
                    ("no reading" if r["status"] == "ok" else status)
                ax.text((v or 0) + top * 0.01, i, text, va="center", fontsize=7)
            ax.set_yticks(range(len(results)), labels, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlim(0, top * 1.25)
            ax.set_title(f"{sc}, {_cap_text(doc, capped, results)}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=110)
        plt.close(fig)
        files[name.split(".")[0]] = name
    return files


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.1%}"


def quality_table(q: dict) -> str:
    lines = [f"Perplexity on held-out text ({q.get('corpus', {}).get('description', '')}), "
             f"{q.get('model', {}).get('params', 0) / 1e6:.1f}M-parameter Qwen2-shaped model trained "
             f"in the script; LoRA r={q.get('lora', {}).get('r')} for "
             f"{q.get('lora', {}).get('steps')} steps on every base", "",
             "| base format | perplexity before LoRA | vs bf16 | after LoRA | vs bf16 |", "|---|---|---|---|---|"]
    for row in q.get("formats", []):
        if row.get("error"):
            lines.append(f"| {row['format']} | error: {row['error'][:200]} | | | |")
            continue
        lines.append(f"| {row['format']} | {row['ppl_before']:.3f} | {_pct(row.get('vs_bf16_before'))} | "
                     f"{row['ppl_after']:.3f} | {_pct(row.get('vs_bf16_after'))} |")
    return "\n".join(lines)


FAIRNESS = ("Each engine ran in a fresh process on the same random-weight checkpoint, batch, "
            "learning rate and loop; step time is the median of the same number of steps after "
            "the warm-up (for TrainStream, after it stopped adapting); peak VRAM is over the whole "
            "run; host memory is the process's own (PSS less shared pages) plus the daemon's "
            "shared memory. docs/benchmarks-compare.md has the rules.")


def readme(doc: dict, quality: Optional[dict], charts_prefix: str,
           unmeasured: Optional[List[str]] = None) -> str:
    """The README's results section, made from the JSON alone (``unmeasured``: the
    lines of coverage.py naming what no run has measured yet)."""
    cmds = doc.get("commands") or [doc.get("command")]
    parts = ["## Against other libraries (benchmarks/compare.py)", "",
             *_paragraphs(machine_lines(doc)),
             "Reproduce with" + (" (one command per device call):" if len(cmds) > 1 else ":"), "",
             "```bash", *[c for c in cmds if c], "```", "", FAIRNESS, ""]
    for sc, capped, results in groups(doc):
        parts += [table(doc, sc, capped, results), ""]
        line = trainstream_against_peers(results)
        if line:
            parts += [line, ""]
    files = doc.get("charts") or {}
    for key, title in (("step_time", "Step time"), ("peak_vram", "Peak VRAM"),
                       ("host_per_param", "Host memory per trained parameter")):
        if key in files:
            parts += [f"![{title}]({charts_prefix}{files[key]})", ""]
    missing = not_run(doc)
    if missing:
        parts += ["Could not run here:", ""] + [f"- {m}" for m in missing] + [""]
    if unmeasured:
        parts += ["Not measured yet on any host (`python benchmarks/headtohead/coverage.py` prints "
                  "the device calls that would measure them):", ""] + [f"- {m}" for m in unmeasured] + [""]
    if quality:
        parts += ["### Quality of each quantized base (benchmarks/quality.py)", "", quality_table(quality), ""]
    return "\n".join(parts)

"""README.md's results from the one run that benchmarks/results/index.json names under
"readme": one table and one chart per scenario, every figure from one host in one run
(Note [One machine per table], report.py), and the quality table from the run "quality"
names.

    PYTHONPATH=/tmp/mpl python benchmarks/headtohead/readme_results.py

prints the README's results section on stdout and draws the charts into
benchmarks/results/charts/ (matplotlib). tests/python/test_compare_scripts.py checks that
README.md holds exactly this section, so a README edited by hand, or an index pointed at
another run without regenerating, fails there.

The index also lists every head-to-head run on every host ("files", with the results
left out and why): coverage.py reads those, to say which cells no host has measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
from headtohead import report  # noqa: E402

INDEX = os.path.join(REPO, "benchmarks", "results", "index.json")
BEGIN = "<!-- BEGIN results: made by benchmarks/headtohead/readme_results.py from benchmarks/results/index.json -->"
END = "<!-- END results -->"
CHARTS = "benchmarks/results/charts"


def load_index(path: str = INDEX) -> dict:
    with open(path) as f:
        return json.load(f)


def _left_out(name: str, engine: str, rules: List[dict]) -> str:
    for rule in rules:
        if rule["file"] not in name:
            continue
        suffix, prefix = rule.get("engine_suffix"), rule.get("engine_prefix")
        if (suffix and engine.endswith(suffix)) or (prefix and engine.startswith(prefix)):
            return rule["why"]
    return ""


def select(index: dict, root: str = REPO) -> dict:
    """Every head-to-head run on every host, merged (what coverage.py counts): each named
    file's results less the rules' left-outs, each result keeping its file's name under
    ``source``. A file named as ``{"file": path, "host": label}`` ran on a host kept apart
    from the others of its GPU: its results' machine is "<GPU>, <label>"."""
    docs = []
    for entry in index["files"]:
        rel, host = (entry, None) if isinstance(entry, str) else (entry["file"], entry["host"])
        doc = report.load(os.path.join(root, rel))
        name = os.path.basename(rel)
        machine = report.machine_name(doc.get("machine")) + (f", {host}" if host else "")
        kept = []
        for r in doc["results"]:
            wanted = r["scenario"] in index.get("scenarios", [r["scenario"]])
            if wanted and not _left_out(name, r["engine"], index.get("left_out", [])):
                kept.append(dict(r, source=name, machine_name=machine))
        docs.append(dict(doc, results=kept))
    return report.merge(docs)


def readme_run(index: dict, root: str = REPO) -> dict:
    """The README's run: its files merged into one document. Raises ValueError where
    they are not one host's (one GPU, one date) or name no file."""
    run = index["readme"]
    docs = [report.load(os.path.join(root, rel)) for rel in run["files"]]
    if not docs:
        raise ValueError("index.json's readme run names no file")
    gpus = {report.machine_name(d.get("machine")) for d in docs}
    dates = {d.get("created", "")[:10] for d in docs}
    if len(gpus) != 1 or len(dates) != 1:
        raise ValueError(f"the README's run must be one host's: its files ran on {sorted(gpus)} "
                         f"on {sorted(dates)}")
    return report.merge(docs)


def _rows(results: List[dict]) -> Dict[str, Dict[bool, dict]]:
    """engine -> {capped: result}, in the order: fastest under the cap first, then what
    failed under the cap, then what ran uncapped only."""
    by: Dict[str, Dict[bool, dict]] = {}
    for r in results:
        if r["status"] != "n/a":
            by.setdefault(r["engine"], {})[bool(r.get("capped"))] = r

    def key(item):
        capped = item[1].get(True)
        if capped and capped["status"] == "ok":
            return (0, capped["step_s"])
        return (1 if capped else 2, 0.0)
    return dict(sorted(by.items(), key=key))


def _step(r: Optional[dict]) -> str:
    if r is None:
        return "-"
    if r["status"] == "ok":
        return f"{r['step_s']:.3f}"
    return report.STATUS_SHORT.get(r["status"], r["status"])


def scenario_table(doc: dict, sc: str) -> List[str]:
    info = doc["scenarios"][sc]
    results = [r for r in doc["results"] if r["scenario"] == sc]
    cap = next((r.get("cap_gib") for r in results if r.get("capped") and r.get("cap_gib")), 24)
    rows = _rows(results)
    ok = [r[True]["step_s"] for r in rows.values() if True in r and r[True]["status"] == "ok"]
    fastest = min(ok) if ok else None
    what = ("full fine-tune, fp32 weights" if info.get("kind") == "full"
            else "LoRA r=16 on a bf16 base")
    lines = [f"**{sc}**: {what}, {report._count(info.get('params', 0))} parameters, batch "
             f"{info.get('batch')}x{info.get('seq')}", "",
             f"| engine | s/step, {cap:g} GiB cap | x fastest | peak VRAM GiB | host B/param | "
             "s/step, uncapped |", "|---|---|---|---|---|---|"]
    for engine, by_cap in rows.items():
        c, u = by_cap.get(True), by_cap.get(False)
        label = (c or u).get("label", engine)
        if engine.startswith("trainstream"):
            label = f"**{label}**"
        ratio = f"{c['step_s'] / fastest:.2f}" if c and c["status"] == "ok" and fastest else "-"
        ran = c if c and c["status"] == "ok" else None
        vram = report._gib(ran.get("peak_vram_bytes")) if ran else "-"
        per = ran.get("host_bytes_per_trained_param") if ran else None
        lines.append(f"| {label} | {_step(c)} | {ratio} | {vram} | "
                     f"{'-' if per is None else f'{per:.1f}'} | {_step(u)} |")
    return lines


def section(index: dict, doc: dict, quality: Optional[dict]) -> str:
    """README.md's results section, from the README's run (readme_run()) alone."""
    run = index["readme"]
    m = doc.get("machine", {})
    parts = [f"All figures below: one {report.machine_name(m)} host "
             f"({m.get('vram_bytes', 0) / report.GIB:.0f} GiB, {m.get('cpu_cores')} cores, "
             f"{m.get('ram_bytes', 0) / report.GIB:.0f} GiB RAM, PCIe {m.get('pcie_h2d_gb_s')} GB/s), "
             f"{run['date']}, {run['about']} "
             "Random-weight Qwen2.5-shaped models, the same loop and learning rate for every "
             "engine; the median step after warm-up. Bold rows are TrainStream. "
             "[benchmarks/results/](benchmarks/results/README.md) has the run's files and "
             "every other run; [docs/benchmarks-compare.md](docs/benchmarks-compare.md) the rules.", ""]
    for sc in doc["scenarios"]:
        parts += scenario_table(doc, sc)
        parts += ["", f"![{sc}]({CHARTS}/{run['name']}-{sc}.png)", ""]
    if quality:
        parts += [f"Quality of each quantized base ({quality.get('gpu', 'no GPU')}, "
                  f"{quality.get('created', '')[:10]}, `benchmarks/quality.py`):", "",
                  report.quality_table(quality), ""]
    return "\n".join(parts)


def chart(doc: dict, sc: str, path: str) -> None:
    """One scenario's step times: a bar per engine under the cap (red: TrainStream), and
    the uncapped step beside it where it ran; a failed engine's bar is empty and says why."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = _rows([r for r in doc["results"] if r["scenario"] == sc])
    labels = [(c.get(True) or c.get(False)).get("label", e) for e, c in rows.items()]
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.42 * len(rows)))
    top = max([r["step_s"] for c in rows.values() for r in c.values() if r["status"] == "ok"] or [1.0])
    for i, (engine, by_cap) in enumerate(rows.items()):
        ours = engine.startswith("trainstream")
        for capped, dy, shade in ((True, -0.18, 1.0), (False, 0.18, 0.45)):
            r = by_cap.get(capped)
            if r is None:
                continue
            v = r["step_s"] if r["status"] == "ok" else 0.0
            ax.barh(i + dy, v, height=0.34, color="#d62728" if ours else "#1f77b4", alpha=shade)
            text = f"{v:.3f}" if r["status"] == "ok" else report.STATUS_SHORT.get(r["status"], r["status"])
            ax.text(v + top * 0.01, i + dy, text + ("" if capped else " (uncapped)"), va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.35)
    ax.set_xlabel("seconds per step (lower is better); pale: uncapped", fontsize=8)
    ax.set_title(f"{sc}, {report.machine_name(doc.get('machine'))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default=INDEX)
    ap.add_argument("--no-charts", action="store_true", help="print the section only")
    ap.add_argument("--write", action="store_true", help="replace README.md's section with it")
    args = ap.parse_args()
    index = load_index(args.index)
    doc = readme_run(index)
    if not args.no_charts:
        out = os.path.join(REPO, CHARTS)
        os.makedirs(out, exist_ok=True)
        for sc in doc["scenarios"]:
            chart(doc, sc, os.path.join(out, f"{index['readme']['name']}-{sc}.png"))
    quality = report.load(os.path.join(REPO, index["quality"])) if index.get("quality") else None
    text = section(index, doc, quality)
    if args.write:
        readme = os.path.join(REPO, "README.md")
        with open(readme) as f:
            old = f.read()
        head, _, rest = old.partition(BEGIN)
        _, _, tail = rest.partition(END)
        if not rest or END not in rest:
            sys.exit(f"README.md lacks the markers {BEGIN!r} ... {END!r}")
        with open(readme, "w") as f:
            f.write(f"{head}{BEGIN}\n{text}{END}{tail}")
    print(text)


if __name__ == "__main__":
    main()

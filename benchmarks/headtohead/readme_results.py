"""README.md's head-to-head section from the results files that
docs/benchmarks/sources.json names (issue 22): merges them (a later result replaces an
earlier one of the same scenario, engine, cap and GPU; runs on different GPUs get tables
of their own: Note [One machine per table], report.py), leaves out the results that file
names with its reasons, writes docs/benchmarks/results.json, results.md and the charts,
and prints the README section on stdout.

    PYTHONPATH=/tmp/mpl python benchmarks/headtohead/readme_results.py [--quality q.json]

The section ends with the cells no run has measured yet (coverage.py), so the README's
list of what is missing changes with the results files, like its tables.
"""
import argparse
import json
import os
import sys
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
from headtohead import coverage, report  # noqa: E402


def _left_out(name: str, engine: str, rules: List[dict]) -> str:
    for rule in rules:
        if rule["file"] not in name:
            continue
        suffix, prefix = rule.get("engine_suffix"), rule.get("engine_prefix")
        if (suffix and engine.endswith(suffix)) or (prefix and engine.startswith(prefix)):
            return rule["why"]
    return ""


def select(sources: dict, root: str = REPO) -> dict:
    """The merged document: every named file's results less the rules' left-outs
    (each result keeps its file's name under ``source``). A file named as
    ``{"file": path, "host": label}`` ran on a host whose tables are kept apart from
    other hosts of its GPU: its results' machine is "<GPU>, <label>" (Note [One machine
    per table], report.py)."""
    docs = []
    for entry in sources["files"]:
        rel, host = (entry, None) if isinstance(entry, str) else (entry["file"], entry["host"])
        doc = report.load(os.path.join(root, rel))
        name = os.path.basename(rel)
        machine = report.machine_name(doc.get("machine")) + (f", {host}" if host else "")
        kept = []
        for r in doc["results"]:
            wanted = r["scenario"] in sources.get("scenarios", [r["scenario"]])
            if wanted and not _left_out(name, r["engine"], sources.get("left_out", [])):
                kept.append(dict(r, source=name, machine_name=machine))
        docs.append(dict(doc, results=kept))
    return report.merge(docs)


def section(sources: dict, doc: dict, quality: Optional[dict], charts_prefix: str) -> str:
    """README.md's section: the tables of ``doc`` (select()'s), the quality table and
    the cells no run has measured yet."""
    cells = coverage.unmeasured(doc, sources.get("scenarios", list(doc.get("scenarios", {}))))
    return report.readme(doc, quality, charts_prefix, coverage.lines(doc, cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", default=os.path.join(REPO, "docs", "benchmarks", "sources.json"))
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks"))
    ap.add_argument("--quality", default=None,
                    help="quality.py's JSON, as a table too (default: the one sources.json names)")
    ap.add_argument("--charts-prefix", default="docs/benchmarks/")
    args = ap.parse_args()
    with open(args.sources) as f:
        sources = json.load(f)
    doc = select(sources)
    os.makedirs(args.out, exist_ok=True)
    doc["charts"] = report.charts(doc, args.out)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(report.markdown(doc))
    quality_file = args.quality or (os.path.join(REPO, sources["quality"]) if sources.get("quality") else None)
    quality = report.load(quality_file) if quality_file else None
    print(section(sources, doc, quality, args.charts_prefix))


if __name__ == "__main__":
    main()

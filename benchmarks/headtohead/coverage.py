"""What the head-to-head has not measured yet, and the device calls that would measure it.

A cell is one scenario, engine and cap (24 GiB or uncapped). It counts as measured once
some run reached an outcome in it on any host: a step time, or running out of memory or
time, or an error in the engine's own code. "not installed" and "needs CUDA" say nothing
about the engine, so they leave the cell open; "n/a" cells (an adapter-only engine in a
full fine-tune) are never open. Every head-to-head run on every host counts
(benchmarks/results/index.json, "files"), and

    python benchmarks/headtohead/coverage.py [--call-s 540] [--anchor stock,trainstream_nf4]

prints them with the scripts/gpu-check.sh commands that would close them: one compare.py
run per scenario and cap, split where the engines' past wall times (the slowest seen in
that scenario, or a guess where none ran) would not fit one device call, and the runs
packed into as few calls as hold them (a call's COMPARE_ARGS then names several runs,
separated by ';'; scripts/compare-runs.sh).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
from headtohead.engines import ENGINES, parse_engines  # noqa: E402
from headtohead.report import host_lacked  # noqa: E402
from headtohead.scenarios import SCENARIOS  # noqa: E402

GUESS_S = 150.0       # an engine's wall time where neither it nor a sibling ever ran
SETUP_S = 40.0        # each call's own cost: wheels installed, the machine measured
LEAN_S = 150.0        # the "lean" build of the package, for calls with TrainStream engines
CALL_LIMIT_S = 600    # the device tool's limit on one command
MARGIN_S = 30.0       # compare.py stops this long before the limit, so its logs come back
PART_S = 15.0         # each further compare.py run in a call: the machine measured again
MAX_PARTS = 4         # compare.py runs a call holds (each returns a results file; 8 come back)
CAPS = ((True, "capped"), (False, "uncapped"))

Cell = Tuple[str, str, bool]   # scenario, engine, capped


def _decisive(r: dict) -> bool:
    """Whether a result says how the engine fares: not what its host lacked
    (report.host_lacked; also a setup that found no module, such as a host without the
    built package, or a daemon that did not start), not "n/a", not a timeout before the
    first step (a --timeout too short for the setup)."""
    reason = r.get("reason", "")
    if host_lacked(r):
        return False
    if r["status"] == "error":
        return not ("ModuleNotFoundError" in reason or reason.startswith("trainstreamd did not start"))
    return r["status"] in ("ok", "oom", "timeout", "killed") and "(0 steps done)" not in reason


def unmeasured(doc: dict, scenarios: List[str]) -> List[Cell]:
    """The open cells of ``scenarios``, in scenario, cap and engine-table order."""
    done = {(r["scenario"], r["engine"], bool(r.get("capped"))) for r in doc["results"] if _decisive(r)}
    out = []
    for sc in scenarios:
        kind = SCENARIOS[sc].kind
        for capped, _ in CAPS:
            out += [(sc, e.name, capped) for e in ENGINES.values()
                    if kind in e.kinds and (sc, e.name, capped) not in done]
    return out


Walls = Dict[Tuple[str, str, bool], float]


def _groups(cells: List[Cell]):
    """(scenario, capped, cap name, engines) for each scenario and cap with open cells,
    in the cells' order."""
    for sc in dict.fromkeys(c[0] for c in cells):
        for capped, cap in CAPS:
            engines = [e for s, e, c in cells if s == sc and c == capped]
            if engines:
                yield sc, capped, cap, engines


def wall_estimates(doc: dict) -> Walls:
    """(scenario, engine, trained) -> the slowest wall time of its runs, either cap:
    trained=True over the runs that measured a step time, False over the others (an
    engine out of memory in setup under the cap says little of its wall uncapped)."""
    out: Walls = {}
    for r in doc["results"]:
        if r.get("wall_s"):
            key = (r["scenario"], r["engine"], r["status"] == "ok")
            out[key] = max(out.get(key, 0.0), float(r["wall_s"]))
    return out


def _sibling(engine: str) -> str:
    """The same library with checkpointing toggled (TrainStream's formats: its auto)."""
    if engine.endswith("_ckpt"):
        return engine[:-len("_ckpt")]
    if engine.startswith("trainstream_"):
        return "trainstream"
    return engine + "_ckpt"


def estimate(walls: Walls, scenario: str, engine: str) -> float:
    """An engine's expected wall time in a scenario, from runs that measured a step time:
    its own there (either cap), else its sibling's (checkpointing toggled), else its own
    in a scenario of the same kind and model; else GUESS_S, or its own slowest failed run
    there where that took longer."""
    for key in ((scenario, engine, True), (scenario, _sibling(engine), True)):
        if key in walls:
            return walls[key]
    sc = SCENARIOS[scenario]
    alike = [w for (s, e, ok), w in walls.items() if ok and e == engine and s != scenario
             and SCENARIOS[s].size == sc.size and SCENARIOS[s].kind == sc.kind]
    return max(alike) if alike else max(GUESS_S, walls.get((scenario, engine, False), 0.0))


def _lean(part: dict) -> bool:
    """Whether a part runs a TrainStream engine (its call builds the package first)."""
    return any(ENGINES[e].trainstream for e in part["engines"])


def _part_cost(part: dict) -> float:
    """A part alone in a call: the call's setup, the lean build where it needs one, and
    its engines."""
    return SETUP_S + (LEAN_S if _lean(part) else 0.0) + part["estimate_s"]


def _splits(walls: Walls, sc: str, capped: bool, todo: List[str], refs: List[str],
            call_s: float) -> List[dict]:
    """One scenario and cap's open engines as compare.py runs ("parts"), each alone
    within ``call_s``, each beginning with ``refs``."""
    parts: List[dict] = []
    for e in todo:
        wall = estimate(walls, sc, e)
        last = parts[-1] if parts else None
        if last is None or (len(last["engines"]) > len(refs) and _part_cost(
                dict(last, engines=last["engines"] + [e], estimate_s=last["estimate_s"] + wall)) > call_s):
            last = {"scenario": sc, "capped": capped, "engines": list(refs),
                    "estimate_s": sum(estimate(walls, sc, a) for a in refs)}
            parts.append(last)
        last["engines"].append(e)
        last["estimate_s"] += wall
    for part in parts:
        part["timeout_s"] = int(max(60.0, 1.5 * max(estimate(walls, sc, e) for e in part["engines"])))
    return parts


def plan(doc: dict, cells: List[Cell], call_s: float = 540.0, anchors: Sequence[str] = ()) -> List[dict]:
    """Device calls that run ``cells``. Each scenario and cap is one compare.py run (a
    "part"), split where its engines' estimated walls would not fit ``call_s`` alone;
    the parts are then packed into as few calls as fit ``call_s``: largest first, each
    into the first call with room, at most MAX_PARTS a call (each part's results file
    is one of the files a call returns).

    A part: scenario, capped, engines, estimate_s (its engines), timeout_s (per engine:
    1.5x the slowest estimate, at least 60 s). A call: parts, lean (a TrainStream engine
    among them: the package is built first), estimate_s (setup, the build, the parts'
    engines, and PART_S for each part after the first). ``anchors``: engines each part
    runs first, where they already have a step time in its scenario and cap, so that
    parts landing on different hosts share a reference engine (Note [One machine per
    table], report.py)."""
    walls = wall_estimates(doc)
    ran = {(r["scenario"], r["engine"], bool(r.get("capped"))) for r in doc["results"] if r["status"] == "ok"}
    parts: List[dict] = []
    for sc, capped, _, todo in _groups(cells):
        refs = [a for a in anchors if a not in todo and (sc, a, capped) in ran]
        parts += _splits(walls, sc, capped, todo, refs, call_s)
    calls: List[dict] = []
    for part in sorted(parts, key=_part_cost, reverse=True):
        for call in calls:
            grown = (call["estimate_s"] + PART_S + part["estimate_s"]
                     + (LEAN_S if _lean(part) and not call["lean"] else 0.0))
            if len(call["parts"]) < MAX_PARTS and grown <= call_s:
                call["parts"].append(part)
                call["estimate_s"] = grown
                call["lean"] = call["lean"] or _lean(part)
                break
        else:
            calls.append({"parts": [part], "lean": _lean(part), "estimate_s": _part_cost(part)})
    return calls


def compare_timeout(call: dict) -> int:
    """gpu-check.sh's COMPARE_TIMEOUT for a call (its parts together): what the device's
    limit leaves after the lean build and the wheels, less a margin."""
    return int(CALL_LIMIT_S - MARGIN_S - SETUP_S - (LEAN_S if call["lean"] else 0.0))


def _args(part: dict) -> str:
    return (f'--scenarios {part["scenario"]}{"" if part["capped"] else " --uncapped"} '
            f'--timeout {part["timeout_s"]} --engines {",".join(part["engines"])}')


def command(call: dict) -> str:
    """The scripts/gpu-check.sh line of one call ("lean" first where a TrainStream
    engine is among them: it builds the package; on a warm host that built it, drop it).
    Its parts are COMPARE_ARGS's runs, separated by ';' (where there are several, each
    writes $OUT/compare-<n>/results.json)."""
    runs = " ; ".join(_args(p) for p in call["parts"])
    return (f'STAGES="{"lean " if call["lean"] else ""}compare" COMPARE_TIMEOUT={compare_timeout(call)} '
            f'COMPARE_ARGS="{runs}" bash scripts/gpu-check.sh   # about {call["estimate_s"]:.0f} s')


def lines(doc: dict, cells: List[Cell]) -> List[str]:
    """One README line per scenario and cap with open cells, naming the engines."""
    labels = {**{n: e.label for n, e in ENGINES.items()}, **doc.get("engines", {})}
    return [f"`{sc}`, {cap}: " + "; ".join(labels.get(e, e) for e in engines)
            for sc, _, cap, engines in _groups(cells)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default=os.path.join(REPO, "benchmarks", "results", "index.json"),
                    help="the results index whose \"files\" are every head-to-head run")
    ap.add_argument("--call-s", type=float, default=540.0,
                    help="seconds of engines one device call may hold (default 540)")
    ap.add_argument("--anchor", default="",
                    help="engines each call also runs first where they have a step time in its "
                         "scenario and cap (e.g. stock,trainstream_nf4), so calls on different "
                         "hosts share a reference")
    args = ap.parse_args()
    if not 60 <= args.call_s <= CALL_LIMIT_S - MARGIN_S:
        ap.error(f"--call-s {args.call_s:g}: accepted 60 to {CALL_LIMIT_S - MARGIN_S:g} (an engine's setup "
                 f"alone takes 10-40 s; the device tool stops a command at {CALL_LIMIT_S} s)")
    try:
        anchors = [e.name for e in parse_engines(args.anchor, "--anchor")] if args.anchor else []
    except ValueError as e:
        ap.error(str(e))
    from headtohead import readme_results
    index = readme_results.load_index(args.index)
    doc = readme_results.select(index)
    cells = unmeasured(doc, index["scenarios"])
    if not cells:
        print("every cell is measured")
        return
    print(f"{len(cells)} cells not measured on any host:")
    for line in lines(doc, cells):
        print(f"  {line}")
    calls = plan(doc, cells, args.call_s, anchors)
    print(f"\n{len(calls)} device calls, about {sum(c['estimate_s'] for c in calls) / 60:.0f} minutes "
          f"(carry [\".deps\", \".whl\"]):")
    for call in calls:
        print(command(call))


if __name__ == "__main__":
    main()

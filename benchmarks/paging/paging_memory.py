"""Host-memory readings of bench_paging.py: the host figure, and the planner's
MemoryError taken apart.

The host figure, ``host_bytes_per_trained_param``: the daemon's shared memory plus
this process's own memory, per trained parameter, beyond the model's activations and a
LoRA case's frozen base. Its parts (``host_bytes``, which add up to it exactly):

- one entry per label of the daemon's segments (``status.segments[]``: "control",
  "staging", "optimizer-state", ...), leaving out "activations" (activation pages) and
  the frozen base ("frozen base", "base <key>");
- "process own": this process's proportional set size less its shared-memory pages
  (``/proc/self/smaps_rollup``: Pss - Pss_Shmem, the way compare.py reads every
  engine), so a daemon page this process maps is counted once, by the daemon, never
  again as the process's RSS does; less the activation pages the process holds itself
  (pinned, when the daemon's budget refused them a region).

It replaces the two figures the benchmark printed before: memory_report's
``host_per_param`` total (daemon optimizer state + staging mapped + Private_Clean and
Private_Dirty, which also counted daemon pages only this process had touched; its
"process private memory" now reads Pss - Pss_Shmem as this does) and (budget.used +
those private pages), which counted activation pages and bases.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "headtohead"))
from measure import own_host_bytes, smaps_rollup  # noqa: E402 (compare.py's reading)

EXCLUDED_LABELS = ("activations", "frozen base")
OWN = "process own (PSS less shared memory)"


def _excluded(label: str) -> bool:
    return label in EXCLUDED_LABELS or label.startswith("base ")


def host_figure(status: Dict[str, Any], trained: int,
                base_session: Optional[int] = None) -> Dict[str, Any]:
    """The host figure (module docstring) from the daemon's ``status`` (its JSON) and
    this process's smaps, for ``trained`` parameters; every segment of ``base_session``
    (the session holding a frozen base) is left out."""
    from trainstream._native.host_memory import live_bytes_by_tag
    parts: Dict[str, int] = {}
    left_out: Dict[str, int] = {}
    others = {s["session_id"] for s in status.get("sessions", []) if s.get("pid") != os.getpid()}
    for seg in status.get("segments", []):
        if seg.get("session_id") in others:
            continue  # another process's (one the daemon has not reclaimed yet)
        label = seg.get("label") or seg.get("kind", "?")
        into = left_out if _excluded(label) or seg.get("session_id") == base_session \
            else parts
        into[f"daemon {label}"] = into.get(f"daemon {label}", 0) + int(seg["bytes"])
    # The activation arena's chunks, in the daemon's region or (its budget refused)
    # pinned process memory: only the latter is the process's own.
    in_daemon = left_out.get("daemon activations", 0)
    pinned_activations = max(0, live_bytes_by_tag().get("activations", 0) - in_daemon)
    parts[OWN] = max(0, own_host_bytes(smaps_rollup()) - pinned_activations)
    if pinned_activations:
        left_out["process pinned activations"] = pinned_activations
    total = sum(parts.values())
    return {"host_bytes": parts, "host_bytes_left_out": left_out, "host_total_bytes": total,
            "host_bytes_per_trained_param": round(total / trained, 3) if trained else None,
            "host_per_param_parts": {k: round(v / trained, 3) for k, v in parts.items()}
            if trained else {}}


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_AMOUNT = r"([\d.]+) (B|KiB|MiB|GiB)"


def _bytes(number: str, unit: str) -> float:
    return float(number) * _UNITS[unit]


def parse_memory_error(text: str) -> Dict[str, Any]:
    """The planner's MemoryError (memory/planner.py) taken apart: its total, each
    category's bytes (and bytes per trained parameter for the host's), and whether they
    add up (each figure is printed to 2 decimals, so the sums are compared within the
    rounding of the numbers summed)."""
    m = re.search(r"needs " + _AMOUNT + r"(?: = ([\d.]+) B per trained parameter \(([\d,]+)\))?"
                  r".*? \((.*?)\), (?:available RAM|usable)", text)
    if not m:
        return {"parsed": False}
    total = _bytes(m.group(1), m.group(2))
    total_pp = float(m.group(3)) if m.group(3) else None
    cats: List[Dict[str, Any]] = []
    for part in m.group(5).split(", "):
        c = re.fullmatch(r"(.+?) " + _AMOUNT + r"(?: = ([\d.]+) B/param)?", part)
        if not c:
            return {"parsed": False, "unparsed": part}
        cats.append({"category": c.group(1), "bytes": _bytes(c.group(2), c.group(3)),
                     "unit": c.group(3),
                     "per_param": float(c.group(4)) if c.group(4) else None})
    slack = sum(0.005 * _UNITS[c["unit"]] for c in cats) + 0.005 * _UNITS[m.group(2)]
    out = {"parsed": True, "total_bytes": total, "categories": cats,
           "sum_bytes": sum(c["bytes"] for c in cats)}
    out["bytes_add_up"] = abs(out["sum_bytes"] - total) <= slack
    if total_pp is not None:
        trained = int(m.group(4).replace(",", ""))
        pp = [c["per_param"] for c in cats]
        out.update(total_per_param=total_pp, trained_params=trained,
                   sum_per_param=round(sum(p or 0 for p in pp), 3))
        out["per_param_add_up"] = None not in pp and \
            abs(out["sum_per_param"] - total_pp) <= 0.005 * (len(pp) + 1) and \
            abs(total_pp * trained - total) <= 0.005 * trained + slack
    out["adds_up"] = out["bytes_add_up"] and out.get("per_param_add_up", True)
    return out


def plan_only(model, options: Dict[str, Any]) -> Optional[str]:
    """What wrap() would decide for ``model`` with ``options``, without allocating
    anything: None when its plan fits, the MemoryError's text when it refuses (wrap()
    raises the same one first thing, before anything is copied)."""
    from trainstream.memory import install, planner
    from trainstream.options import validate
    config = validate(options)
    measured = install.measure(model, config)
    try:
        planner.plan(install.summarize(model, measured, config), measured.capacity, config)
    except MemoryError as e:
        return str(e)
    return None

"""bench_paging.py's closing summary: one table row per run, then each case's verdict
against its goal (7B full fine-tune at most 8.5 host bytes per trained
parameter and 1.73 s/step; the full-layers depth trains and the next one is refused
with numbers that add up; the 70B LoRA against its PCIe floor; the 14B LoRA
within 1.2x of its floor).
"""
from __future__ import annotations

TARGET_B_PER_PARAM = 8.5
TARGET_7B_STEP_S = 1.73  # the 7B full fine-tune's step goal, an H200's step before the pool


def _fmt(n: float) -> str:
    from trainstream.memory.capacity import format_bytes  # the planner's own units
    return format_bytes(n)


def _per_param(r) -> str:
    per = r.get("host_bytes_per_trained_param")
    return "" if per is None else f"{per:.2f}"


def print_summary(results) -> None:
    print("\n| case | grads | cap | s/step | peak VRAM GiB | RSS GiB | daemon shm GiB | "
          "host B/trained param | PCIe GB/step | PCIe GB/s | PCIe floor s | "
          "loss first -> last | paged blocks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    by = {}
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | {r.get('grads', '')} | | error: {r['error'][:160]} |")
            continue
        if "memory_error" in r:
            print(f"| {r['case']} | {r.get('grads', '')} | | MemoryError at wrap() "
                  f"({r.get('wrap_s')} s): {r['memory_error'][:300]} |")
            continue
        cap = "none" if r["uncapped"] else f"{r['cap_gib']} GiB"
        print(f"| {r['case']} | {r.get('grads', '')} | {cap} | {r['step_s']} | "
              f"{r['peak_vram_gib']} | {r['host_rss_gib']} | {r['daemon_shm_gib']} | "
              f"{_per_param(r)} | {r['pcie_bytes_per_step'] / 1e9:.2f} | {r['pcie_gb_s']} | "
              f"{r['pcie_floor_s']} | {r['losses'][0]} -> {r['losses'][-1]} | "
              f"{r['paged_blocks']} |")
        by.setdefault((r["case"], r["uncapped"]), []).append(r)
    for r in by.get(("7b-full", False), []):
        print(f"7b-full, gradients {r['grads']} ({r['grad_pool_gib']} GiB pool, "
              f"{r['pool_waits']} waits, {r['pool_wait_s']} s): {r['step_s']} s/step "
              f"(goal <= {TARGET_7B_STEP_S}), {_per_param(r)} host B/trained param "
              f"(goal <= {TARGET_B_PER_PARAM}): {r['host_per_param_parts']}")
    for r in by.get(("full-layers", False), []):
        fewer = (f" (the planner refused {r['refused_above']} blocks first)"
                 if r.get("refused_above") else "")
        print(f"full-layers, {r['layers']} blocks{fewer}, {r['trained_params'] / 1e9:.2f}B "
              f"trained params, gradients {r['grads']}: losses {r['losses']} (decreased: "
              f"{r['loss_decreased']}), {r['step_s']} s/step, {_per_param(r)} host B/param")
    for r in results:
        if r["case"] == "full-layers-refuse" and "memory_error_parts" in r:
            p = r["memory_error_parts"]
            deeper = (f"also accepted {r['accepted_layers']} blocks (not trained here)"
                      if r["accepted_layers"] else "accepted no deeper shape")
            print(f"full-layers-refuse: the planner {deeper}, refused {r['refused_layers']}; "
                  f"wrap() raised MemoryError: its categories sum to "
                  f"{_fmt(p.get('sum_bytes', 0))} and {p.get('sum_per_param')} B/param against "
                  f"its total {_fmt(p.get('total_bytes', 0))} = {p.get('total_per_param')} "
                  f"B/param: adds up: {p.get('adds_up')}")
            for c in p.get("categories", []):
                print(f"    {c['category']}: {_fmt(c['bytes'])} = {c['per_param']} B/param")
    for case in ("70b-lora-nf4", "32b-lora-nf4"):
        for r in by.get((case, False), []):
            fb = r.get("frozen_base", {})
            print(f"{case}: {r['step_s']} s/step against the PCIe floor {r['pcie_floor_s']} s "
                  f"({r['pcie_bytes_per_step'] / 1e9:.1f} GB/step at 55 GB/s; the paged "
                  f"weights alone, twice: {r['weights_floor_s']} s): "
                  f"{r['step_s'] / max(r['pcie_floor_s'], 1e-9):.2f}x; frozen base "
                  f"{fb.get('placed_bytes', 0) / 1e9:.1f} GB in the daemon's region "
                  f"(registered: {fb.get('registered')}), process copies of frozen weights "
                  f"{fb.get('process_weight_buffers_bytes', 0) / 1e9:.2f} GB")
    for case in ("14b-lora-bf16", "14b-lora-nf4"):
        capped, free = by.get((case, False)), by.get((case, True))
        if not (capped and free):
            continue
        # Every measured step of every run of a variant, pooled: its median and its best.
        times = {k: sorted(t for r in rs for t in r["step_times"])
                 for k, rs in (("capped", capped), ("free", free))}
        pcie = max(r["pcie_floor_s"] for r in capped)
        for name, pick in (("median", lambda t: t[len(t) // 2]), ("best", lambda t: t[0])):
            ours, compute = pick(times["capped"]), pick(times["free"])
            floor = max(pcie, compute)
            print(f"{case} ({name} of {len(times['capped'])} capped and {len(times['free'])} "
                  f"uncapped steps): {ours:.4f} s/step against floor {floor:.4f} s "
                  f"(PCIe {pcie} s, compute {compute:.4f} s): {ours / floor:.2f}x (goal 1.2x)")

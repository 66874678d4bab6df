"""wrap()'s memory steps: measure, plan, stream, adapt (install.py), and their parts:
capacity.py (measure), planner.py (the pure plan), controller.py (adapt)."""
from .install import adapt, decide, measure, plan, report_sections, stream, uninstall

__all__ = ["measure", "decide", "plan", "stream", "adapt", "uninstall", "report_sections"]

"""benchmarks/compare.py's parts: what is trained (scenarios), how each
library trains it (engines), what is measured and how (measure), and the tables, charts
and README section made from the results (report). docs/benchmarks-compare.md says
what each is and the fairness rules."""

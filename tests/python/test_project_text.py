"""The project speaks of itself only, and its front page stays a front page.

- No text or file name numbers the stretches of work behind a figure or a change: a run
  is named by its host and date (benchmarks/results/README.md), a change by what it does.
  The daemon's own sessions ("session 7" in its log lines, "no session 999" in an error)
  are the product speaking, and are listed below one by one.
- No text cites a tracker's number ("issue 16", "issues #3", "issue-17"): a comment or
  docstring says what the thing is or does and cites the doc in docs/ that describes it.
- Every reference to the design document points into the repository (docs/design.md),
  and no reference points outside it.
- README.md is at most 250 lines; every kept result lives in benchmarks/results/ and is
  listed in its index.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"

# The daemon's sessions, not the project's: (path, text on the line). A new hit of the
# patterns must be reworded, or, if it is the product's own session, listed here. A
# tracker's number is never the product's, so no line of that kind belongs here.
PRODUCT_SESSIONS = [
    ("daemon/logging/log_safe.h", "info ... session 7"),
    ("daemon/planes/optimizer_plane.h", '"session 7"'),
    ("daemon/recovery/adoption.h", "as session 0's"),
    ("tests/cpp/daemon/control_service_test.cc", "no session 999"),
    ("tests/cpp/daemon/optimizer_plane_test.cc", "(session 2)"),
    ("tests/cpp/daemon/optimizer_plane_test.cc", '"session 1"'),
    ("tests/cpp/daemon/optimizer_service_test.cc", '"session 7"'),
    ("tests/python/test_hostile_misc.py", "session 99 ended"),
    ("tests/python/test_project_text.py", ""),  # this file names the patterns
]
# What numbers the work: the project's stretches of work, and a tracker's entries.
HOW_IT_WAS_MADE = (r"session [0-9]|sessions [0-9]|s[0-9]{1,2}-"
                   r"|issue [0-9]|issues #?[0-9]|issue #[0-9]|issue-[0-9]")
# Client-chosen bytes the fuzzer found, not words.
NOT_TEXT = ("tests/fuzz/corpus/",)


def _git(*args):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to list the project's files")
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def _allowed(path: str, line: str) -> bool:
    if path.startswith(NOT_TEXT):
        return True
    return any(path == p and text in line for p, text in PRODUCT_SESSIONS)


def test_no_text_numbers_how_the_project_was_made():
    proc = _git("grep", "-I", "-n", "-i", "-E", HOW_IT_WAS_MADE, "--", ".")
    assert proc.returncode in (0, 1), proc.stderr
    hits = []
    for row in proc.stdout.splitlines():
        path, _, rest = row.partition(":")
        _, _, line = rest.partition(":")
        if not _allowed(path, line):
            hits.append(row[:200])
    assert not hits, ("name a run by its host and date, a change by what it does, and cite "
                      "docs/ rather than a tracker's number:\n" + "\n".join(hits))


def test_no_file_name_numbers_how_the_project_was_made():
    names = _git("ls-files").stdout.split()
    bad = [n for n in names if re.search(r"(^|[-_/])s[0-9]{1,2}[a-z]?([-_.]|$)", os.path.basename(n))
           and not n.startswith(NOT_TEXT)]
    assert not bad, bad


def test_the_design_doc_is_in_the_repository():
    assert (REPO / "docs" / "design.md").is_file()
    proc = _git("grep", "-n", "DESIGN.md", "--", ".", ":!tests/python/test_project_text.py")
    outside = [row for row in proc.stdout.splitlines() if "docs/design.md" not in row.split(":", 2)[2]]
    assert not outside, "cite docs/design.md, the project's design document:\n" + "\n".join(outside)


def test_nothing_points_outside_the_repository():
    """A reader who follows a reference finds it in the checkout: no path into the
    machine the project was written on, and no document that is not in the repository."""
    proc = _git("grep", "-I", "-n", "-E", r"/work/|\.\./shared/|STYLE\.md", "--", ".",
                ":!tests/python/test_project_text.py", ":!benchmarks/results/")
    assert proc.returncode in (0, 1), proc.stderr
    assert not proc.stdout, "cite a file in the repository:\n" + proc.stdout[:2000]


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md is {len(lines)} lines: move detail into docs/"
    text = "\n".join(lines)
    assert "make test" in text and "make demo" in text
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", text):
        assert (REPO / link).exists(), f"README.md links to {link}, which does not exist"


def test_every_result_file_is_in_the_results_folder_and_its_index():
    index = (RESULTS / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", index, re.M))
    present = {p.name for p in RESULTS.iterdir() if p.is_file() and p.name not in ("README.md", "index.json")}
    assert present == listed, (f"not in benchmarks/results/README.md: {sorted(present - listed)}; "
                               f"listed but missing: {sorted(listed - present)}")
    for name in present:
        assert re.match(r"(cpu|h100|h200|h200x2)-\d{4}-\d\d-\d\d-", name), f"{name}: name it <host>-<date>-<what>"
    strays = [n for n in _git("ls-files", "benchmarks").stdout.split()
              if re.search(r"(^|/)results-[^/]*\.(log|json|jsonl)$", n)]
    assert not strays, f"results live in benchmarks/results/: {strays}"

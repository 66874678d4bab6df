"""What a base load shows while the daemon reads (``load_base``, ``load_model``).

``progress`` accepts:

- ``"auto"``: a bar on stderr when stderr is a terminal, nothing otherwise;
- ``True``: the bar even when stderr is not a terminal (a log file gets its lines);
- ``False`` or ``None``: nothing;
- a callable ``progress(bytes_read, bytes_total, tensors_done, tensors_total)``,
  called as the daemon reports (about every 100 ms), on the loading thread.

The bar is tqdm's when tqdm is importable (transformers depends on it), else one
plain line rewritten in place. A base found cached reports nothing, so it draws
nothing.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

__all__ = ["check_progress", "resolve_progress", "LoadProgressBar"]

ProgressFn = Callable[[int, int, int, int], None]


class LoadProgressBar:
    """A progress callable that draws on ``stream`` (stderr); ``close()`` ends the line."""

    def __init__(self, desc: str, stream: Any = None):
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self._bar = None
        self._plain = False
        self._last = 0
        self._drawn = 0.0
        self._started = time.monotonic()

    def _open(self, total: int) -> None:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._plain = True
            return
        self._bar = tqdm(total=total, desc=self.desc, unit="B", unit_scale=True,
                         unit_divisor=1000, file=self.stream, dynamic_ncols=True, leave=True)

    def __call__(self, bytes_read: int, bytes_total: int, tensors_done: int,
                 tensors_total: int) -> None:
        if bytes_total <= 0:
            return
        if self._bar is None and not self._plain:
            self._open(bytes_total)
        if self._bar is not None:
            self._bar.set_postfix_str(f"{tensors_done}/{tensors_total} tensors", refresh=False)
            self._bar.update(bytes_read - self._last)
            self._last = bytes_read
            return
        now = time.monotonic()
        if now - self._drawn < 0.2 and tensors_done != tensors_total:
            return
        self._drawn = now
        rate = bytes_read / max(now - self._started, 1e-9) / 1e9
        self.stream.write(f"\r{self.desc}: {bytes_read / 1e9:.2f}/{bytes_total / 1e9:.2f} GB "
                          f"({100.0 * bytes_read / bytes_total:.0f}%), {rate:.2f} GB/s, "
                          f"{tensors_done}/{tensors_total} tensors   ")
        self.stream.flush()
        self._last = bytes_read

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._plain and self._last:
            self.stream.write("\n")
            self.stream.flush()


def check_progress(progress: Any) -> None:
    """ValueError unless ``progress`` is one of the values the module doc lists."""
    if progress is None or isinstance(progress, bool):
        return
    if progress == "auto" if isinstance(progress, str) else callable(progress):
        return
    raise ValueError(f"progress={progress!r}: use 'auto', True, False, None or a callable "
                     "(bytes_read, bytes_total, tensors_done, tensors_total)")


def resolve_progress(progress: Any, desc: str) -> tuple[Optional[ProgressFn], Callable[[], None]]:
    """``progress`` (see the module doc) as (callback or None, close); ValueError for
    anything else."""
    check_progress(progress)
    if progress is None or progress is False:
        return None, lambda: None
    auto = isinstance(progress, str)  # "auto": check_progress let no other string through
    if progress is True or auto:
        if auto and not _is_terminal(sys.stderr):
            return None, lambda: None
        bar = LoadProgressBar(desc)
        return bar, bar.close
    return progress, lambda: None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False

"""Which host memory this process's TrainStream code holds, by what it is for.

Every place that maps or pins host memory for the package (the optimizer's staging
and state regions, activation pages, paged weights' host buffers) calls
``track(owner, nbytes, tag)``; a shared frozen base's mapping is not recorded
(docs/inspection.md says why). The registry holds ``owner`` weakly: the
entry goes when the owner is collected, so the registry can neither keep memory
alive nor report memory that is gone. ``pinned_stats()["by_tag"]`` reads it.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Dict

# token -> (tag, bytes); guarded by _lock (finalizers run on whichever thread drops
# the last reference).
_live: Dict[int, tuple] = {}
_lock = threading.Lock()
_tokens = itertools.count()


def track(owner: Any, nbytes: int, tag: str) -> bool:
    """Counts ``nbytes`` under ``tag`` for as long as ``owner`` lives. Returns False
    (nothing counted) when ``owner`` cannot be referenced weakly."""
    token = next(_tokens)
    try:
        weakref.finalize(owner, _forget, token)
    except TypeError:
        return False
    with _lock:
        _live[token] = (tag, int(nbytes))
    return True


def _forget(token: int) -> None:
    with _lock:
        _live.pop(token, None)


def live_bytes_by_tag() -> Dict[str, int]:
    """Bytes still held, per tag (tags with nothing live are absent)."""
    out: Dict[str, int] = {}
    with _lock:
        for tag, nbytes in _live.values():
            out[tag] = out.get(tag, 0) + nbytes
    return out

"""Memory probes of the operating system: this process, its worker processes, the machine.

- `memory_sample`, `max_rss`, `growth_mb`: how far `tune_loader`'s candidates grow the
  memory of this process plus the private memory of its DataLoader workers;
- `default_budget`: half the memory available now, `max_batch_size`'s budget on CPU.

Each probe uses psutil when it is installed (more exact numbers, and it works where
/proc does not exist), else /proc, ``getrusage`` or ``sysconf``; a number that cannot be
read is ``None`` (the budget raises instead: the caller can pass one).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from contextlib import suppress

from graphopt.errors import InvalidOptionError

try:  # optional: more exact memory numbers, and it works where /proc does not exist
    import psutil  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - depends on the environment
    psutil = None

try:  # not on Windows
    import resource
except ImportError:  # pragma: no cover - depends on the platform
    resource = None  # type: ignore[assignment]

MB = 1024 * 1024


def memory_sample() -> int | None:
    """Resident bytes of this process plus private bytes of its live multiprocessing children."""
    own = _own_rss()
    if own is None:
        return None
    for child in multiprocessing.active_children():
        private = _private_bytes(child.pid) if child.pid is not None else None
        own += private or 0
    return own


def _own_rss() -> int | None:
    if psutil is not None:
        with suppress(psutil.Error, OSError):  # psutil can fail in sandboxes: fall back to /proc
            return int(psutil.Process().memory_info().rss)
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _private_bytes(pid: int) -> int | None:
    """Memory only ``pid`` holds (USS): forked workers share the rest with this process."""
    if psutil is not None:
        try:
            return int(psutil.Process(pid).memory_full_info().uss)
        except (psutil.Error, OSError):  # gone already, or not allowed
            return None
    try:
        with open(f"/proc/{pid}/smaps_rollup") as smaps:
            total = 0
            for line in smaps:
                if line.startswith(("Private_Clean:", "Private_Dirty:", "Private_Hugetlb:")):
                    total += int(line.split()[1]) * 1024
            return total
    except (OSError, ValueError, IndexError):
        return None


def max_rss() -> int | None:
    """Peak resident bytes of this process so far (monotonic)."""
    if resource is None:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def max_or_none(a: int | None, b: int | None) -> int | None:
    present = [v for v in (a, b) if v is not None]
    return max(present) if present else None


def growth_mb(before: int | None, peak: int | None, max_before: int | None, max_after: int | None) -> float | None:
    """The larger of the sampled growth and the rise of the process's lifetime peak (both under-estimate)."""
    growths = []
    if before is not None and peak is not None:
        growths.append(peak - before)
    if max_before is not None and max_after is not None:
        growths.append(max_after - max_before)
    return max(0, *growths) / MB if growths else None


def default_budget() -> int:
    """Half the memory available now."""
    available: int | None = None
    if psutil is not None:
        try:
            available = int(psutil.virtual_memory().available)
        except (psutil.Error, OSError):  # pragma: no cover
            available = None
    if available is None:
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        available = int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            available = None
    if available is None:
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - no sysconf
            raise InvalidOptionError(
                "cannot read how much memory is available on this system: pass memory_budget_bytes"
            ) from None
    return max(1, available // 2)

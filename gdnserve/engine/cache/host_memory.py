"""What the host can spare: the RAM a new process may take, read by the host checkpoint tier's sizing
(cache/checkpoint_tiers.py) and by the CPU memory budget (memory/memory_budget.py)."""
from __future__ import annotations

import os


def meminfo_available() -> int:
    """Bytes of RAM available to a new process (``MemAvailable``; free pages where /proc/meminfo is absent)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

"""What this process has mapped: resident bytes of a file's mappings (Linux /proc)."""

from __future__ import annotations


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` this process has mapped and resident (``Rss`` in /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = line.rstrip("\n").endswith(path)
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total

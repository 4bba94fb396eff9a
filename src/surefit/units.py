"""Units. Every ``_gb`` setting counts GiB (2**30 bytes), the way GPU memory is quoted: "a 4 GB card" has 4 GiB, and
sizes are printed in the same binary units."""

from __future__ import annotations

GiB = 2**30
MiB = 2**20
KiB = 2**10


def human_bytes(n: float, unit: str | None = None) -> str:
    """``1.25 GB``, ``21.7 MB``, ``8.0 KB``, ``12 B``, in binary units (1 GB = 2**30 bytes, as ``--gpu_memory_gb``).

    ``unit="GB"`` always says GB (``0.00012 GB``), for a figure set against a budget given in GB."""
    if unit == "GB":
        v = n / GiB
        return f"{v:.2f} GB" if abs(v) >= 0.1 or v == 0 else f"{v:.2g} GB"
    for unit, size in (("GB", GiB), ("MB", MiB), ("KB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.{2 if size == GiB else 1}f} {unit}"
    return f"{int(n)} B"

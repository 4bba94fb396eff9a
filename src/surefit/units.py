"""Units. Every ``_gb`` setting counts GiB (2**30 bytes), the way GPU memory is quoted: "a 4 GB card" has 4 GiB."""

from __future__ import annotations

GiB = 2**30

"""Minor page faults and system CPU time of a whole ``surefit train`` (the job of a ``cpu_sft.py --keep`` work
folder, no start-up cache), before the training loop and in it; run it once as is and once with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc 2.35+: malloc asks for transparent huge pages) to see whether
faulting memory in costs a run much.

    python benchmarks/cpu_sft.py --rows 64 --workload squad --only surefit --keep --workdir /tmp/squad
    python benchmarks/page_faults.py /tmp/squad /tmp/faults-run
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/page_faults.py /tmp/squad /tmp/faults-run

Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    from benchlib import kept_surefit_settings

    import surefit
    import surefit.tasks.runner as common

    marks: dict[str, Any] = {}
    original = common.fit

    def fit(*a: Any, **k: Any) -> Any:
        r = resource.getrusage(resource.RUSAGE_SELF)
        marks["loop_start"] = {"minor_faults": r.ru_minflt, "sys_s": r.ru_stime}
        try:
            return original(*a, **k)
        finally:
            r = resource.getrusage(resource.RUSAGE_SELF)
            marks["loop_end"] = {"minor_faults": r.ru_minflt, "sys_s": r.ru_stime}

    common.fit = fit
    t0 = time.perf_counter()
    surefit.train(**kept_surefit_settings(Path(sys.argv[1]), Path(sys.argv[2])))
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"glibc_tunables": os.environ.get("GLIBC_TUNABLES"), "minor_faults": r.ru_minflt,
                      "sys_s": r.ru_stime, "user_s": r.ru_utime, "wall_s": round(time.perf_counter() - t0, 1),
                      **marks}))


if __name__ == "__main__":
    main()

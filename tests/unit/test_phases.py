"""`utils.phases`: a restart's start, phase by phase, on the wall clock its incidents use."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from stalwart.utils.phases import Phases

CHILD = """
import json, time
from stalwart.utils.phases import Phases, process_age_s
time.sleep(0.3)
phases = Phases()
phases.mark("work")
print(json.dumps({"age": process_age_s(), "phases": phases.seconds}))
"""


def test_a_process_age_fits_inside_what_its_parent_saw():
    """The process phase sums with the rest to no more than the wall time the parent measured around the
    child (psutil's create_time, with its whole-second boot time, was off by up to a second)."""
    for _ in range(2):
        t0 = time.time()
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
        wall = time.time() - t0
        child = json.loads(out)
        assert 0.3 <= child["phases"]["process"] <= child["age"] <= wall + 0.011, (child, wall)
        assert sum(child["phases"].values()) <= wall + 0.011, (child, wall)


def test_marks_are_consecutive_intervals():
    phases = Phases()
    time.sleep(0.05)
    phases.mark("a")
    phases.mark("b")
    assert list(phases.seconds) == ["process", "a", "b"]
    assert 0.05 <= phases.seconds["a"] < 1.0 and 0 <= phases.seconds["b"] < phases.seconds["a"]

"""`make test` queues the test modules longest first (tests/module_order.py)."""

from __future__ import annotations

from tests.module_order import MODULE_SECONDS, longest_first


def test_modules_go_longest_first_whole_and_in_their_own_order():
    long = max(MODULE_SECONDS, key=MODULE_SECONDS.get)
    ids = ["tests/unit/test_a.py::x", "tests/unit/test_a.py::y", "tests/unit/test_b.py::z", f"{long}::p", f"{long}::q"]
    ordered = [ids[i] for i in longest_first(ids)]
    assert ordered == [f"{long}::p", f"{long}::q", "tests/unit/test_a.py::x", "tests/unit/test_a.py::y", ids[2]]

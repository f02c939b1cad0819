"""The order in which `make test`'s two xdist workers take the test modules (``--dist loadfile``: one
module per worker at a time, the next one from the front of the queue): the longest first
(longest-processing-time first). xdist's own order (most tests first) put the e2e modules last, and the
run ended with one worker on a 5-minute module while the other idled. The figures only order the queue:
a stale one costs balance, never a result.
"""

from __future__ import annotations

# Seconds a module took in a full run on 2 cores (its tests' `--durations`, setup included; 504a22c).
# Modules not named here count ``UNLISTED_S_PER_TEST`` per test: all of them are far shorter.
MODULE_SECONDS = {
    "tests/e2e/test_train_layouts.py": 300,
    "tests/e2e/test_peer_replicas.py": 287,
    "tests/e2e/test_ckpt_s3.py": 179,
    "tests/e2e/test_spares.py": 177,
    "tests/e2e/test_integrations.py": 154,
    "tests/e2e/test_slurm.py": 139,
    "tests/e2e/test_ckpt_resume.py": 137,
    "tests/e2e/test_demo.py": 128,
    "tests/e2e/test_ckpt_masterless.py": 121,
    "tests/e2e/test_autoscale.py": 119,
    "tests/e2e/test_train.py": 117,
    "tests/e2e/test_techniques.py": 117,
    "tests/e2e/test_ckpt_multinode.py": 111,
    "tests/e2e/test_elastic.py": 105,
    "tests/e2e/test_gpu_bench_cpu.py": 103,
    "tests/e2e/test_elastic_layouts.py": 97,
    "tests/e2e/test_preempt.py": 91,
    "tests/e2e/test_recovery_bench.py": 77,
    "tests/protocol/test_explorer.py": 67,
    "tests/e2e/test_netns.py": 55,
    "tests/e2e/test_run_multinode.py": 53,
    "tests/e2e/test_nccl_env.py": 48,
    "tests/unit/test_compile.py": 45,
    "tests/e2e/test_parallel.py": 42,
}
UNLISTED_S_PER_TEST = 1.0


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(nodeids: list[str]) -> list[int]:
    """The permutation of ``nodeids`` (indices) that puts whole modules in order of their expected time,
    longest first; a module's tests keep their order, and modules of equal estimate their first-seen one."""
    first: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, nodeid in enumerate(nodeids):
        module = module_of(nodeid)
        first.setdefault(module, i)
        count[module] = count.get(module, 0) + 1

    def expected_s(module: str) -> float:
        return MODULE_SECONDS.get(module, count[module] * UNLISTED_S_PER_TEST)

    return sorted(range(len(nodeids)), key=lambda i: (-expected_s(m := module_of(nodeids[i])), first[m], i))

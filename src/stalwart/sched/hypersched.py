"""``hypersched``: the greedy baseline the learned policy (``mlfs``) is compared with, and the teacher it
starts from. HyperSched (SoCC'19) gives GPUs to the trials whose progress promises most by a deadline;
the Pollux workloads have no deadlines, so what is left is its progress-aware greedy:

1. one GPU each, shortest believed remaining time first (remaining progress / goodput at 1 GPU, a
   stopped job charged its restart): shortest-remaining-time first when there are more jobs than GPUs;
2. the rest of the GPUs by doubling, each time for the job whose doubling saves the most of its
   remaining time per GPU added, while the saving exceeds two restarts and the believed speedup 10 %;
3. a running job keeps its count when the plan moves it by one doubling only (hysteresis: a restart is
   not worth a factor of two that the next interval may undo) and capacity allows.
Goodput is the same performance model the learned policy sees (``mlfs_env.features``)."""

from __future__ import annotations

from stalwart.sched.mlfs_env import RUNGS, goodputs, rung_of
from stalwart.sched.pollux_sim import SimJob

MIN_SPEEDUP = 1.1


class HyperSched:
    """The greedy chooser: ``(now, active jobs, gpus) -> GPU count per job`` (``mlfs_env.Chooser``)."""

    def __init__(self, restart_cost_s: float = 30.0) -> None:
        self.restart_cost_s = restart_cost_s

    def __call__(self, now: float, jobs: list[SimJob], gpus: int) -> list[int]:
        from stalwart.sched.mlfs_env import remaining

        good = [goodputs(j) for j in jobs]
        left = [remaining(j) for j in jobs]
        charge = [0.0 if j.alloc else self.restart_cost_s for j in jobs]
        order = sorted(range(len(jobs)), key=lambda i: (left[i] / max(good[i][1], 1e-9) + charge[i], i))
        rung = [0] * len(jobs)
        free = gpus
        for i in order:
            if free >= 1 and good[i][1] > 0:
                rung[i], free = 1, free - 1
        while True:
            best, best_gain = -1, 0.0
            for i in order:
                r = rung[i]
                if not r or r + 1 >= len(RUNGS) or RUNGS[r] > free or good[i][r + 1] < MIN_SPEEDUP * good[i][r]:
                    continue
                saved = left[i] / good[i][r] - left[i] / good[i][r + 1]
                if saved > 2 * self.restart_cost_s and saved / RUNGS[r] > best_gain:
                    best, best_gain = i, saved / RUNGS[r]
            if best < 0:
                break
            free -= RUNGS[rung[best]]
            rung[best] += 1
        counts = [RUNGS[r] for r in rung]
        for i, job in enumerate(jobs):  # hysteresis, within what is left
            have = len(job.alloc)
            if have and counts[i] and abs(rung_of(have) - rung[i]) == 1 and have - counts[i] <= free:
                free -= have - counts[i]
                counts[i] = have
        return counts

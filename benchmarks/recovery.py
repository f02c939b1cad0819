"""How fast does a job get back to training after a fault? The same job and the same SIGKILL under
stalwart run and under plain torchrun, in one run.

    python benchmarks/recovery.py [--json] [--repeats 3] [--steps 160] [--kill-step 137]

Nine kill runs and one hang run: ~2.5 min per repeat at load 3 on 2 cores, 14-17 min in all at load 7.

The job is ``benchmarks/recovery_job.py``: a 4-layer GPT (d_model 256), 2 ranks, DDP over gloo, one
torch thread per rank, deterministic synthetic data. Chaos (``STALWART_CHAOS=kill:rank=1:step=K``)
SIGKILLs rank 1 right after step K completed and was checkpointed; the job logs the kill time itself
just before firing, so every launcher is timed the same way. Configurations:

``stalwart``       ``stalwart run --max-restarts 3 --hang-timeout auto``, flash checkpoints (memory
                   snapshot every step, keeper persists every 50 steps), workers forked warm;
``stalwart_cold``  (optional) the same with ``--warm-start off``: every worker a fresh interpreter, to
                   show what the warm start itself gives;
``torchrun_dcp``   ``torchrun --max-restarts 3``, synchronous DCP save every ``--dcp-every`` (20) steps
                   and resume from the newest complete one (what a torchrun user writes);
``torchrun_flash`` ``torchrun --max-restarts 3`` with the same per-step memory snapshots as stalwart
                   (stalwart's Checkpointer without stalwart's agent): a DLRover-style flash checkpoint
                   baseline (DLRover itself is not installed), for the issue's regain target.

Definitions (times are wall clock, from the job's own per-step log on rank 0). MTTR, regain, lost
steps and goodput are ``stalwart.demo.recovery_metrics``' (the same as ``stalwart demo``'s):

* **MTTR** = fault time (kill) → first step completed after the restart.
* **regain** = fault time → first completion of a step past the killed step (step K+1).
* **lost_steps** = killed step K − step the restarted job resumed from.
* **goodput** = productive time of the final trajectory (the last completion of each step 1..N; a
  step's ``dt`` = forward+backward+all-reduce+optimizer, the checkpoint call timed apart) ÷ wall time
  of the whole job (launcher start → launcher exit, so cold start and teardown count). The job is
  short (one fault in ~25 s of work, harsher than one per minute) so the benchmark fits in minutes.
* **goodput_1fpm** = steady efficiency × (1 − fault_cost / 60 s): one fault per minute of a long job,
  where steady efficiency = Σ step time ÷ Σ step-to-step wall time over fault-free steps (checkpoint
  stalls included, startup amortised) and fault_cost = wall time from the first completion of the step
  resumed from to the regain, minus the step time of the final trajectory's steps in that interval
  (the work redone, the stall, the restart).
* **hang_detect_s** = hang start (the rank stops reporting: chaos ``hang`` spins after the step's
  report) → the agent's ``detected`` time in the incident journal; a separate stalwart run.
* **tokens_per_s** = tokens per step ÷ median step-to-step wall time over fault-free steps 6..K of the
  same runs (the DCP run's median excludes its save steps, i.e. it is plain torchrun training); the
  stalwart/torchrun_dcp ratio is the no-fault overhead of stalwart run + flash snapshots, the
  stalwart/torchrun_flash ratio that of the launcher alone (the same script, flash snapshots included,
  under plain torchrun: the target's "same script under plain torchrun"; the dcp ratio when flash is
  not run). Separate runs on a shared box make it noisy; ``ckpt_s_per_step`` (blocking checkpoint
  seconds per step) and ``steady_efficiency`` are the direct measures of the checkpoint's cost.

``breakdown_s`` splits the MTTR into consecutive intervals: ``detect`` (fault → the agent's
``detected``), ``stop`` (→ ``stopped``), ``respawn`` (→ the new worker process starts: the agent's
save-on-failure hook, rendezvous, spawn), ``imports`` (→ torch/stalwart imported in the slowest rank,
torch._dynamo included), ``pg_init`` (→ gloo process group up), ``build`` (model, DDP, optimizer),
``restore`` (checkpointer set-up and restore: host → device on a GPU), ``first_step``; with ``--device
cuda``, ``cuda_init`` (the CUDA context) comes between imports and ``pg_init`` (which then includes
NCCL's communicator); the first three come from the incident
journal, so torchrun gets one ``detect_stop_respawn`` interval. Medians over ``--repeats``, and every
run's values under ``runs``.

Targets (issue #5): MTTR ≤ 0.33 × torchrun+DCP; regain ≤ 0.5 × DLRover-style per-step flash; hang
detected within max(3 × step time, 10 s); goodput ≥ 0.90 with one fault per minute; no-fault tokens/s
≥ 0.98 × plain torchrun.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stalwart.demo.recovery_metrics import StepRecord, final_trajectory, goodput, recovery
from stalwart.runtime import ENV_CHAOS, ENV_CHAOS_DIR, ENV_CHAOS_FILE

HERE = Path(__file__).resolve().parent
JOB = HERE / "recovery_job.py"
LAUNCHERS = ("stalwart", "torchrun_dcp", "torchrun_flash", "stalwart_cold")
DEFAULT_CONFIGS = LAUNCHERS[:3]
PHASES = (
    "detect",
    "stop",
    "respawn",
    "detect_stop_respawn",
    "imports",
    "cuda_init",
    "pg_init",
    "build",
    "restore",
    "first_step",
    "agent_restarted_after_stop",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeats", type=int, default=3, help="kill runs per configuration (default 3)")
    p.add_argument("--hang-repeats", type=int, default=1, help="hang runs under stalwart (default 1)")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--kill-step", type=int, default=137)
    p.add_argument("--hang-step", type=int, default=30)
    p.add_argument("--dcp-every", type=int, default=20)
    p.add_argument("--persist-every", type=int, default=50)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hang-timeout", default="auto", help="stalwart run --hang-timeout for the hang run")
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma-separated subset of {','.join(LAUNCHERS)} (default {','.join(DEFAULT_CONFIGS)}; "
        "stalwart_cold = stalwart with --warm-start off)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launched job")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the job on GPUs (NCCL with a GPU per rank); the breakdown then shows cuda_init (context) "
        "apart from pg_init (NCCL communicator) and restore (host → device); e.g. --device cuda --nproc 1",
    )
    p.add_argument("--dir", type=Path, default=None, help="keep every run's logs here (default: a temp dir)")
    return p.parse_args(argv)


# -- running one job -------------------------------------------------------------------------------
def launch(config: str, args: argparse.Namespace, work: Path, chaos: str, steps: int) -> dict[str, Any]:
    """Run the job once under ``config``; returns the launcher's exit code, wall time and paths."""
    work.mkdir(parents=True)
    log_dir, ckpt_dir = work / "log", work / "ckpt"
    env = {
        **os.environ,
        ENV_CHAOS: chaos,
        ENV_CHAOS_DIR: str(work / "chaos"),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop(ENV_CHAOS_FILE, None)
    # Plain torchrun shares its rendezvous store with the workers across restarts without a per-round
    # prefix, so a restarted gloo worker may read its predecessor's address: the first restart then
    # fails ("connectFullMesh ... Connection refused", one more restart) or hangs in init. The baseline
    # gets the documented switch that avoids it (stalwart run sets it itself).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    job = [
        str(JOB),
        "--ckpt",
        "dcp" if config == "torchrun_dcp" else "flash",
        "--ckpt-dir",
        str(ckpt_dir),
        "--log-dir",
        str(log_dir),
        "--steps",
        str(steps),
        "--dcp-every",
        str(args.dcp_every),
        "--persist-every",
        str(args.persist_every),
        "--batch",
        str(args.batch),
        "--seq-len",
        str(args.seq_len),
        "--device",
        args.device,
    ]
    common = ["--standalone", "--nproc-per-node", str(args.nproc), "--max-restarts", "3"]
    if config.startswith("stalwart"):
        common += ["--warm-start", "off" if config == "stalwart_cold" else "on"]
        cmd = [
            sys.executable,
            "-m",
            "stalwart",
            "run",
            *common,
            "--hang-timeout",
            args.hang_timeout,
            "--chaos",
            chaos,
            "--run-dir",
            str(work / "run"),
            "--summary-json",
            str(work / "summary.json"),
            *job,
        ]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *common, *job]
    t0 = time.time()
    with open(work / "launcher.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:  # SIGTERM first: the launcher then stops its workers
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = -1
    t1 = time.time()
    return {"config": config, "rc": rc, "t_start": t0, "t_end": t1, "work": work, "steps": steps}


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by SIGKILL
            pass
    return out


def journal_incidents(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "journal.sqlite"
    if not path.exists():
        return []
    from stalwart.launch.journal import Journal

    j = Journal(path)
    try:
        return j.incidents()
    finally:
        j.close()


def analyse(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The recovery figures of one kill run (see the module docstring)."""
    log_dir = run["work"] / "log"
    logs = {r: read_log(log_dir / f"rank{r}.jsonl") for r in range(args.nproc)}
    steps = [e for e in logs[0] if e["ev"] == "step"]
    faults = [e for r in logs for e in logs[r] if e["ev"] == "fault"]
    starts = [e for r in logs for e in logs[r] if e["ev"] == "start"]
    records = [StepRecord(e["step"], e["t"], e["dt"]) for e in steps]  # dt excludes the checkpoint call
    final = final_trajectory(records)
    out: dict[str, Any] = {
        "rc": run["rc"],
        "wall_s": run["t_end"] - run["t_start"],
        "finished": run["rc"] == 0 and sorted(final) == list(range(1, run["steps"] + 1)),
        "attempts": len({e["attempt"] for e in starts}),
    }
    if steps:
        out["startup_s"] = steps[0]["t"] - run["t_start"]  # launcher start → first step done
        out["teardown_s"] = run["t_end"] - steps[-1]["t"]  # last step done → launcher exit
    out["goodput"] = goodput(records, out["wall_s"])
    tokens_per_step = args.nproc * args.batch * args.seq_len
    first = [e for e in steps if e["attempt"] == 0]
    gaps = [
        (b["t"] - a["t"], b["dt"])
        for a, b in itertools.pairwise(first)
        if b["step"] > 5 and b["save_s"] < 0.5 * b["dt"]
    ]
    all_gaps = [(b["t"] - a["t"], b["dt"]) for a, b in itertools.pairwise(first) if b["step"] > 5]
    out["step_s"] = statistics.median(dt for _, dt in gaps) if gaps else None
    out["tokens_per_s"] = tokens_per_step / statistics.median(g for g, _ in gaps) if gaps else None
    efficiency = sum(dt for _, dt in all_gaps) / sum(g for g, _ in all_gaps) if all_gaps else None
    out["steady_efficiency"] = efficiency
    steady = [e for e in first if e["step"] > 5]
    # blocking checkpoint time per step (flash: the save() call; DCP: its saves spread over K steps)
    out["ckpt_s_per_step"] = sum(e["save_s"] for e in steady) / len(steady) if steady else None
    if not faults:
        out["error"] = "no fault fired"
        return out
    fault = faults[0]
    k, t_fault, attempt = fault["step"], fault["t"], fault["attempt"]
    after = [e for e in steps if e["attempt"] > attempt]
    # the attempt that trained again (an attempt that failed in init writes no start record)
    restart_starts = {e["rank"]: e for e in starts if after and e["attempt"] == after[0]["attempt"]}
    if not after or 0 not in restart_starts:
        out["error"] = "no step after the restart"
        return out
    resumed = restart_starts[0]["resume_step"]
    figures = recovery(
        [r for r, e in zip(records, steps, strict=True) if e["attempt"] <= attempt],
        [r for r, e in zip(records, steps, strict=True) if e["attempt"] > attempt],
        t_fault,
        last_step=k,
        resumed_step=resumed,
    )
    out["killed_step"], out["resume_step"] = k, resumed
    out["lost_steps"], out["mttr_s"], out["regain_s"] = figures.lost_steps, figures.mttr_s, figures.regain_s
    # fault cost for goodput_1fpm: wall from the first completion of the resumed step to the regain,
    # minus the final trajectory's step time in that interval
    base = next((e["t"] for e in first if e["step"] == resumed), t_fault if resumed == 0 else None)
    if figures.regain_s is not None and base is not None and efficiency:
        redo = sum(final[s].productive_s for s in range(resumed + 1, k + 2) if s in final)
        out["fault_cost_s"] = t_fault + figures.regain_s - base - redo
        out["goodput_1fpm"] = efficiency * max(0.0, 1 - out["fault_cost_s"] / 60.0)
    # what the restart was spent on: journal (stalwart) + the restarted workers' own log
    r0 = restart_starts
    t_proc = min(e["t_proc"] for e in r0.values())
    marks = {"fault": t_fault}
    incidents = journal_incidents(run["work"] / "run")
    if incidents:
        inc = incidents[0]
        marks.update({k2: inc[k2] for k2 in ("detected", "stopped", "restarted") if inc.get(k2)})
        out["journal"] = {k2: inc.get(k2) for k2 in ("kind", "fault", "detected", "stopped", "restarted", "first_step")}
    marks.update(
        {
            "proc_start": t_proc,
            "imported": max(e["t_import"] for e in r0.values()),
            "cuda_up": max(e.get("t_cuda", e["t_import"]) for e in r0.values()),
            "pg_up": max(e["t_pg"] for e in r0.values()),
            "built": max(e["t_built"] for e in r0.values()),
            "restored": max(e["t_restored"] for e in r0.values()),
            "first_step": after[0]["t"],
        }
    )
    out["restore_source"] = r0[0]["source"]
    out["restore_s"] = max(e["restore_s"] for e in r0.values())
    out["breakdown_s"] = breakdown(marks)
    return out


def breakdown(m: dict[str, float]) -> dict[str, float]:
    """Consecutive intervals between the recovery's milestones (seconds)."""
    order = [
        ("detect", "detected"),
        ("stop", "stopped"),
        ("respawn", "proc_start"),
        ("imports", "imported"),
        ("cuda_init", "cuda_up"),
        ("pg_init", "pg_up"),
        ("build", "built"),
        ("restore", "restored"),
        ("first_step", "first_step"),
    ]
    out, prev = {}, m["fault"]
    if "detected" not in m:  # torchrun: detection, stop and respawn are one interval
        out["detect_stop_respawn"] = m["proc_start"] - prev
        prev = m["proc_start"]
        order = order[3:]
    for name, key in order:
        if key in m:
            out[name] = m[key] - prev
            prev = m[key]
    if "restarted" in m:  # the agent's "restarted" stamp: after rendezvous and spawning the processes
        out["agent_restarted_after_stop"] = m["restarted"] - m.get("stopped", m["restarted"])
    return out


def hang_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    chaos = f"hang:rank={min(1, args.nproc - 1)}:step={args.hang_step}"
    run = launch("stalwart", args, work, chaos, args.hang_step + 10)
    summary_path = work / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    incs = [i for i in summary.get("incidents", []) if i["kind"] == "hang"]
    logs = [e for r in range(args.nproc) for e in read_log(work / "log" / f"rank{r}.jsonl")]
    fault = next((e for e in logs if e["ev"] == "fault"), None)
    steps = [e for e in read_log(work / "log" / "rank0.jsonl") if e["ev"] == "step" and e["attempt"] == 0]
    step_s = statistics.median(b["t"] - a["t"] for a, b in itertools.pairwise(steps)) if len(steps) > 1 else None
    out: dict[str, Any] = {"rc": run["rc"], "wall_s": run["t_end"] - run["t_start"], "step_s": step_s}
    if not incs or fault is None:
        out["error"] = "no hang incident journaled"
        return out
    inc = incs[0]
    out["hang_detect_s"] = inc["detected"] - fault["t"]
    out["hang_detect_journal_s"] = inc["detected"] - inc["fault"] if inc.get("fault") else None
    out["hang_mttr_s"] = inc["first_step"] - fault["t"] if inc.get("first_step") else None
    out["target_s"] = max(3 * step_s, 10.0) if step_s else 10.0
    m = re.search(
        r"silent for \[([\d.]+)[^]]*\] s \(allowance \[([\d.]+)", (work / "launcher.log").read_text(errors="replace")
    )
    if m:  # the agent's own view: silence since the last report, and the allowance it applied
        out["silent_s"], out["allowance_s"] = float(m.group(1)), float(m.group(2))
    return out


# -- summarising -----------------------------------------------------------------------------------
def med(values: list[Any]) -> float | None:
    vs = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vs) if vs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


KEYS = (
    "mttr_s",
    "regain_s",
    "lost_steps",
    "goodput",
    "goodput_1fpm",
    "fault_cost_s",
    "tokens_per_s",
    "step_s",
    "ckpt_s_per_step",
    "steady_efficiency",
    "wall_s",
    "startup_s",
    "teardown_s",
    "restore_s",
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in LAUNCHERS:
            raise SystemExit(f"unknown config {c!r}; choose from {', '.join(LAUNCHERS)}")
    if not 0 < args.kill_step < args.steps:
        raise SystemExit(f"--kill-step must be in 1..{args.steps - 1}")
    root = args.dir or Path(tempfile.mkdtemp(prefix="stalwart-recovery-"))
    root.mkdir(parents=True, exist_ok=True)
    t_bench = time.time()
    chaos = f"kill:rank={min(1, args.nproc - 1)}:step={args.kill_step}"  # rank 1, or the only one
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    try:
        for i in range(args.repeats):  # interleaved, so load from other processes hits all alike
            for c in configs:
                res = analyse(launch(c, args, root / f"{c}-{i}", chaos, args.steps), args)
                runs[c].append(res)
                if not args.json:
                    print(
                        f"[{c} #{i}] "
                        + json.dumps(
                            {k: _round(res.get(k)) for k in ("rc", "mttr_s", "regain_s", "lost_steps", "goodput")}
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
        hangs = [hang_run(args, root / f"hang-{i}") for i in range(args.hang_repeats)] if "stalwart" in configs else []
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    result: dict[str, Any] = {}
    for c in configs:
        result[c] = {k: med([r.get(k) for r in runs[c]]) for k in KEYS}
        result[c]["finished"] = all(r["finished"] for r in runs[c])
        phases = sorted(
            {p for r in runs[c] for p in r.get("breakdown_s", {})},
            key=lambda p: PHASES.index(p) if p in PHASES else len(PHASES),
        )
        result[c]["breakdown_s"] = {p: med([r.get("breakdown_s", {}).get(p) for r in runs[c]]) for p in phases}
    if hangs:
        result.setdefault("stalwart", {})["hang_detect_s"] = med([h.get("hang_detect_s") for h in hangs])
        result["stalwart"]["hang_target_s"] = med([h.get("target_s") for h in hangs])
        result["stalwart"]["hang_allowance_s"] = med([h.get("allowance_s") for h in hangs])
    s, d, f = result.get("stalwart", {}), result.get("torchrun_dcp", {}), result.get("torchrun_flash", {})
    result["ratios"] = {
        "mttr_s": ratio(s.get("mttr_s"), d.get("mttr_s")),
        "regain_s": ratio(s.get("regain_s"), d.get("regain_s")),
        "lost_steps": ratio(s.get("lost_steps"), d.get("lost_steps")),
        "goodput": ratio(s.get("goodput"), d.get("goodput")),
        "goodput_1fpm": ratio(s.get("goodput_1fpm"), d.get("goodput_1fpm")),
        "tokens_per_s": ratio(s.get("tokens_per_s"), d.get("tokens_per_s")),
        "tokens_per_s_vs_torchrun_flash": ratio(s.get("tokens_per_s"), f.get("tokens_per_s")),
        "mttr_vs_torchrun_flash": ratio(s.get("mttr_s"), f.get("mttr_s")),
        "regain_vs_torchrun_flash": ratio(s.get("regain_s"), f.get("regain_s")),
        "mttr_vs_stalwart_cold": ratio(s.get("mttr_s"), result.get("stalwart_cold", {}).get("mttr_s")),
    }
    r = result["ratios"]
    result["targets"] = {
        "mttr_le_0.33_torchrun_dcp": _le(r["mttr_s"], 0.33),
        "regain_le_0.5_flash_baseline": _le(r["regain_vs_torchrun_flash"], 0.5),
        "hang_detect_le_max_3step_10s": (
            None if s.get("hang_detect_s") is None else s["hang_detect_s"] <= s["hang_target_s"]
        ),
        "goodput_1fpm_ge_0.90": _ge(s.get("goodput_1fpm"), 0.90),
        "tokens_per_s_ge_0.98_torchrun": _ge(r["tokens_per_s_vs_torchrun_flash"] or r["tokens_per_s"], 0.98),
    }
    result["runs"] = {c: [_clean(x) for x in runs[c]] for c in configs}
    if hangs:
        result["runs"]["stalwart_hang"] = [_clean(h) for h in hangs]
    result["setup"] = {
        "nproc": args.nproc,
        "steps": args.steps,
        "kill": chaos,
        "dcp_every": args.dcp_every,
        "persist_every": args.persist_every,
        "tokens_per_step": args.nproc * args.batch * args.seq_len,
        "repeats": args.repeats,
        "bench_s": time.time() - t_bench,
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(_clean(result)))
    else:
        print_table(result, configs)
    return 0 if all(result[c]["finished"] for c in configs) else 1


def _le(v: float | None, bound: float) -> bool | None:
    return None if v is None else v <= bound


def _ge(v: float | None, bound: float) -> bool | None:
    return None if v is None else v >= bound


def _round(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if k != "work"}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return _round(x)


def print_table(r: dict[str, Any], configs: list[str]) -> None:
    cols = ("mttr_s", "regain_s", "lost_steps", "goodput", "goodput_1fpm", "tokens_per_s")
    print(f"{'config':16}" + "".join(f"{c:>14}" for c in cols))
    for c in configs:
        print(f"{c:16}" + "".join(f"{_fmt(r[c].get(k)):>14}" for k in cols))
    if r.get("stalwart", {}).get("hang_detect_s") is not None:
        print(
            f"stalwart hang detected after {r['stalwart']['hang_detect_s']:.2f} s "
            f"(target ≤ {r['stalwart']['hang_target_s']:.1f} s)"
        )
    for c in configs:
        print(f"{c} recovery breakdown (s): " + json.dumps({k: _round(v) for k, v in r[c]["breakdown_s"].items()}))
    print("ratios (stalwart / baseline):", json.dumps({k: _round(v) for k, v in r["ratios"].items()}))
    print("targets:", json.dumps(r["targets"]))
    print(f"{r['setup']['bench_s']:.0f} s, load average {r['setup']['load_avg_1m']:.1f} on {r['setup']['cpus']} CPUs")


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())

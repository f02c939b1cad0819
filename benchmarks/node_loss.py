"""How fast does a 3-node job train again after a whole node dies? stalwart run with a spare waiting,
against torchrun relaunching the lost node, in one run (issue 16, items 1 and 2).

    python benchmarks/node_loss.py [--json] [--repeats 1] [--parallel ddp,fsdp]
                                   [--configs stalwart,stalwart-noreplica,torchrun]

The job is ``benchmarks/recovery_job.py`` (a 4-layer GPT, one rank per node, DDP or FSDP2 over gloo)
on 3 nodes — agents on this host, as `stalwart run`'s tests run them. Once rank 0 has logged step
``--kill-step``, every process of a node that does not host rank 0 is SIGKILLed at once (agent,
workers, keeper) and its shared memory removed: a dead host.

``stalwart``  a master serving the rendezvous store (`stalwart master --rdzv-port`), 4 agents
              (`stalwart run --nnodes 3:3`: the 4th waits as a spare), flash checkpoints (memory every
              step, persisted every ``--persist-every`` steps), each node's snapshot copied into one
              peer's memory (`--replicas 1`, the default). The survivors regroup with the spare and
              restore the lost node's ranks from a peer's memory.
``stalwart-sync``  the same with `--replica-sync`: a step's checkpoint call returns once every rank's
              snapshot of it is in a peer's memory (no completed step can be lost; the copy is paid
              in every step: compare ``wall_step_s``).
``stalwart-overlap``  the same with `--replica-overlap`: a step's checkpoint call waits for the previous
              step's copies, so they overlap a step (at most the step whose copy was on the way is lost).
``stalwart-noreplica``  the same with `--replicas 0`: the lost node's state comes from storage.
``torchrun``  3 `torchrun --nnodes 3` agents (c10d rendezvous hosted by the first), synchronous DCP
              every ``--dcp-every`` steps; the lost node is relaunched at once (an operator with zero
              delay: torchrun's best case) and the survivors' agents restart their workers.

Both use the rendezvous settings given by ``--rdzv-conf`` (default: TorchElastic's, keep-alive 5 s × 3).
Measured from rank 0's per-step log: **back_s** = kill → first step completed after it;
**lost_steps** = newest step before the kill − step the new round resumed from; **lost_safe_steps** =
the newest step the job was told is safe before the kill (``safe_step``: every rank's copy of it was out;
only under ``--replica-sync``, the step itself, and ``--replica-overlap``, the step before) − the same;
**regain_s** = kill → first completion of a step past the newest step before the kill; **step_s** =
median compute time of a step before the kill (forward, backward, optimizer), **wall_step_s** = median
time between two steps' log lines (compute plus the checkpoint call; less ``--pace-s``, the sleep that
keeps a GPU's millisecond steps from outrunning the kill: none on the CPU); **wall_over_compute** = the
two's ratio, and **wall_over_noreplica** = wall_step_s ÷ stalwart-noreplica's (what the copies cost a
step, the copying included, when both ran).
Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
from recovery import read_log  # benchmarks/ is the script's directory: on sys.path

from stalwart.checkpoint.node_job import NodeJob
from stalwart.launch.client import MasterClient

JOB = Path(__file__).resolve().parent / "recovery_job.py"
CONFIGS = ("stalwart", "stalwart-sync", "stalwart-overlap", "stalwart-noreplica", "torchrun")
WAITS = {"stalwart-sync": ["--replica-sync"], "stalwart-overlap": ["--replica-overlap"]}  # how steps wait for copies
TOKEN = "node-loss-benchmark"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--parallel", default="ddp,fsdp", help="ddp, fsdp or both (comma-separated)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-step", type=int, default=40)
    p.add_argument("--persist-every", type=int, default=10, help="stalwart: keeper persists every N steps")
    p.add_argument("--dcp-every", type=int, default=10, help="torchrun: synchronous DCP save every N steps")
    p.add_argument("--rdzv-conf", default="", help="rendezvous settings for both, e.g. keep_alive_interval=1")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    p.add_argument("--work", type=Path, help="keep every run's logs and journals here (default: a temp dir)")
    p.add_argument(
        "--pace-s",
        type=float,
        help="seconds of sleep after every step, so that millisecond steps do not outrun the kill "
        "(default: 0.05 with a GPU, 0 on the CPU, whose steps take ~0.3 s; a pause absorbs the "
        "checkpoint's background work)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.pace_s is None:
        import torch

        args.pace_s = 0.05 if torch.cuda.is_available() else 0.0
    return args


def job_args(work: Path, args: argparse.Namespace, parallel: str, ckpt: str) -> list[str]:
    return [
        str(JOB),
        "--ckpt",
        ckpt,
        "--ckpt-dir",
        str(work / "ckpt"),
        "--log-dir",
        str(work / "log"),
        "--steps",
        str(args.steps),
        "--persist-every",
        str(args.persist_every),
        "--dcp-every",
        str(args.dcp_every),
        *(["--fsdp"] if parallel == "fsdp" else []),
    ]


def env(args: argparse.Namespace) -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if args.pace_s > 0:  # every step at least this long: the kill lands mid-run
        out["STALWART_CHAOS"] = f"slow:seconds={args.pace_s:g}"
    return out


def rank0_steps(work: Path) -> list[dict[str, Any]]:
    return read_log(work / "log" / "rank0.jsonl")


def worker_pids_by_rank(work: Path) -> dict[int, int]:
    """rank → pid of its newest process, from the job's start events."""
    out = {}
    for path in sorted((work / "log").glob("rank*.jsonl")):
        for row in (json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")):
            if row.get("ev") == "start":
                out[row["rank"]] = row["pid"]
    return out


def wait_for_step(work: Path, step: int, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(r.get("ev") == "step" and r["step"] >= step for r in rank0_steps(work)):
        dead = [p.args for p in procs if p.poll() not in (None, 0)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"no step {step} within {timeout:.0f} s (failed: {dead}); see {work}")
        time.sleep(0.05)


def kill_tree(pid: int, marker: str | None = None) -> None:
    """Every process of a node at once: the agent, its children, and (``marker``) anything naming it."""
    victims = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    if marker:
        victims += [p for p in psutil.process_iter(["cmdline"]) if any(marker in c for c in p.info["cmdline"] or [])]
    for v in victims:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass


def agent_of(worker_pid: int, agents: dict[str, subprocess.Popen]) -> str | None:
    try:
        parents = {p.pid for p in psutil.Process(worker_pid).parents()}
    except psutil.NoSuchProcess:
        return None
    return next((name for name, proc in agents.items() if proc.pid in parents), None)


def run_stalwart(
    work: Path, args: argparse.Namespace, parallel: str, replicas: int = 1, wait: list[str] | None = None
) -> dict[str, Any]:
    job = f"nodeloss-{uuid.uuid4().hex[:8]}"
    ready = work / "master.json"
    cmd = [sys.executable, "-m", "stalwart", "master", "--db", str(work / "journal.sqlite"), "--port", "0"]
    cmd += ["--rdzv-port", "0", "--job-token", TOKEN, "--node-timeout", "10", "--ready-file", str(ready)]
    master = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=open(work / "master.log", "w"),
    )
    agents: dict[str, subprocess.Popen] = {}
    try:
        while not ready.exists():
            time.sleep(0.05)
        address = json.loads(ready.read_text())["address"]
        client = MasterClient(address, TOKEN)
        for n in range(4):
            cmd = [sys.executable, "-m", "stalwart", "run", "--nnodes", "3:3", "--nproc-per-node", "1"]
            cmd += ["--rdzv-backend", "c10d", "--rdzv-id", job, "--master", address, "--job-token", TOKEN]
            cmd += ["--node-id", f"node{n}", "--max-restarts", "3", "--run-dir", str(work / f"run{n}")]
            cmd += ["--replicas", str(replicas), *(wait or [])]
            cmd += ["--rdzv-conf", args.rdzv_conf] if args.rdzv_conf else []
            agents[f"node{n}"] = subprocess.Popen(
                cmd + job_args(work, args, parallel, "flash"),
                stdout=subprocess.DEVNULL,
                stderr=open(work / f"node{n}.log", "w"),
                env=env(args),
                start_new_session=True,
            )
        wait_for_step(work, args.kill_step, list(agents.values()), args.timeout)
        spares = client.status()["spares"]
        pids = worker_pids_by_rank(work)
        victim = next(a for r, pid in sorted(pids.items()) if r != 0 and (a := agent_of(pid, agents)) is not None)
        t_kill = time.time()
        kill_tree(agents[victim].pid, f"{job}-{victim}")
        shutil.rmtree(NodeJob.of_agent(job, victim).paths.root, ignore_errors=True)
        rcs = {n: p.wait(timeout=args.timeout) for n, p in agents.items() if n != victim}
    finally:
        for p in agents.values():
            if p.poll() is None:
                kill_tree(p.pid)
        master.terminate()
        master.wait(10)
    return {"t_kill": t_kill, "rcs": rcs, "victim": victim, "spare": spares}


def run_torchrun(work: Path, args: argparse.Namespace, parallel: str) -> dict[str, Any]:
    job = f"nodeloss-{uuid.uuid4().hex[:8]}"
    port = _free_port()

    def agent(n: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "3", "--nproc-per-node", "1"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job]
        cmd += ["--max-restarts", "3", *(["--rdzv-conf", args.rdzv_conf] if args.rdzv_conf else [])]
        return subprocess.Popen(
            cmd + job_args(work, args, parallel, "dcp"),
            stdout=subprocess.DEVNULL,
            stderr=open(work / f"node{n}.log", "w"),
            env=env(args),
            start_new_session=True,
        )

    agents: dict[str, subprocess.Popen] = {}
    try:
        agents["node0"] = agent(0)  # hosts the rendezvous store: never the victim
        time.sleep(1.0)
        agents.update({f"node{n}": agent(n) for n in (1, 2)})
        wait_for_step(work, args.kill_step, list(agents.values()), args.timeout)
        pids = worker_pids_by_rank(work)
        victim = next(
            a for r, pid in sorted(pids.items()) if r != 0 and (a := agent_of(pid, agents)) not in (None, "node0")
        )
        t_kill = time.time()
        kill_tree(agents[victim].pid)
        agents["node3"] = agent(3)  # the relaunch
        rcs = {n: p.wait(timeout=args.timeout) for n, p in agents.items() if n != victim}
    finally:
        for p in agents.values():
            if p.poll() is None:
                kill_tree(p.pid)
    return {"t_kill": t_kill, "rcs": rcs, "victim": victim}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def analyse(work: Path, run: dict[str, Any]) -> dict[str, Any]:
    rows = rank0_steps(work)
    t_kill = run["t_kill"]
    before = [r["step"] for r in rows if r.get("ev") == "step" and r["t"] < t_kill]
    after = [r for r in rows if r.get("ev") == "step" and r["t"] >= t_kill]
    starts = [r for r in rows if r.get("ev") == "start" and r["t_proc"] >= t_kill - 1.0]
    newest = max(before, default=0)
    # what the job was last told before the kill: the step no node loss can take (Checkpointer.safe_step,
    # sync and overlap; None: none, e.g. after a confirmation failed)
    last = max((r for r in rows if r.get("ev") == "step" and r["t"] < t_kill), key=lambda r: r["t"], default={})
    safe = last.get("safe")
    resumed = starts[-1]["resume_step"] if starts else None
    regain = next((r["t"] for r in after if r["step"] > newest), None)
    # median step time before the kill: what replication costs a step (against stalwart-noreplica)
    steady = [r for r in rows if r.get("ev") == "step" and r["t"] < t_kill and r["step"] > 5]
    dts = [r["dt"] for r in steady]
    # less the injected pacing (``--pace-s`` after every step), which is the benchmark's, not the job's
    walls = [
        b["t"] - a["t"] - b.get("injected_s", 0.0) for a, b in itertools.pairwise(steady) if b["step"] == a["step"] + 1
    ]
    return {
        "ok": all(rc == 0 for rc in run["rcs"].values()) and bool(after) and after[-1]["step"] > newest,
        "exit_codes": run["rcs"],
        "victim": run["victim"],
        "killed_after_step": newest,
        "resumed_from": resumed,
        "source": starts[-1].get("source") if starts else None,
        # resumed past the newest logged step (its copies landed, the kill came before the log line): 0
        "lost_steps": None if resumed is None else max(0, newest - resumed),
        "safe_step": safe,
        "lost_safe_steps": None if resumed is None or safe is None else max(0, safe - resumed),
        "back_s": round(after[0]["t"] - t_kill, 3) if after else None,
        "regain_s": round(regain - t_kill, 3) if regain else None,
        "final_step": max((r["step"] for r in after), default=None),
        "step_s": round(statistics.median(dts), 4) if dts else None,
        "wall_step_s": round(statistics.median(walls), 4) if walls else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    parallels = [p for p in args.parallel.split(",") if p]
    if set(configs) - set(CONFIGS) or set(parallels) - {"ddp", "fsdp"} or not configs or not parallels:
        raise SystemExit(f"--configs takes {','.join(CONFIGS)} and --parallel ddp,fsdp")
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp_dir:
        tmp = args.work or tmp_dir
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for rep in range(args.repeats):
            for parallel in parallels:
                for config in configs:
                    work = Path(tmp) / f"{config}-{parallel}-{rep}"
                    work.mkdir()
                    if config == "torchrun":
                        run = run_torchrun(work, args, parallel)
                    else:
                        replicas = 0 if config == "stalwart-noreplica" else 1
                        run = run_stalwart(work, args, parallel, replicas, WAITS.get(config))
                    row = analyse(work, run)
                    runs.setdefault(f"{config}/{parallel}", []).append(row)
                    if not args.json:
                        print(f"{config}/{parallel} #{rep}: {row}", file=sys.stderr, flush=True)
    summary = {}
    for key, rows in runs.items():
        good = [r for r in rows if r["ok"]]
        summary[key] = {
            "runs_ok": f"{len(good)}/{len(rows)}",
            "back_s": _median([r["back_s"] for r in good]),
            "regain_s": _median([r["regain_s"] for r in good]),
            "lost_steps": _median([r["lost_steps"] for r in good]),
            "lost_steps_each": [r["lost_steps"] for r in good],
            "lost_safe_steps": _median([r["lost_safe_steps"] for r in good]),
            "lost_safe_steps_each": [r["lost_safe_steps"] for r in good],
            "step_s": _median([r["step_s"] for r in good]),
            "wall_step_s": _median([r["wall_step_s"] for r in good]),
            "wall_over_compute": _median(
                [r["wall_step_s"] / r["step_s"] for r in good if r["wall_step_s"] and r["step_s"]]
            ),
            "sources": sorted({str(r["source"]) for r in good}),
        }
    for parallel in parallels:
        theirs = summary.get(f"torchrun/{parallel}")
        bare = summary.get(f"stalwart-noreplica/{parallel}")
        for config in ("stalwart", "stalwart-sync", "stalwart-overlap"):
            ours = summary.get(f"{config}/{parallel}")
            if ours and bare and ours["wall_step_s"] and bare["wall_step_s"]:  # what the copies cost a step
                ours["wall_over_noreplica"] = round(ours["wall_step_s"] / bare["wall_step_s"], 3)
            if ours and theirs and ours["back_s"] and theirs["back_s"]:
                ours["speedup_vs_torchrun"] = round(theirs["back_s"] / ours["back_s"], 2)
                ours["regain_speedup_vs_torchrun"] = round(theirs["regain_s"] / ours["regain_s"], 2)
    result = {"rdzv_conf": args.rdzv_conf or "torch defaults", "pace_s": args.pace_s, "summary": summary, "runs": runs}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, s in summary.items():
            print(f"{key:18s} {s}")
    return 0


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


if __name__ == "__main__":
    sys.exit(main())

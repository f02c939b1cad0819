"""Claim: with PP×TP, Falcon's pipeline scatter-gather (``parallel.pp_scatter_gather = true``, the
default) sends 1/tp of the bytes per stage-boundary send that the plain send does, with the same losses.

Two torchrun jobs of pp × tp gloo ranks (CPU) train the debug model on the same batches with
tests/e2e/parallel_harness.py, scatter-gather on and off, ``--repeats`` times. Bytes are the tensors each
rank's pipeline stages posted to ``isend`` (counted where the stage builds its send ops: activations
forward, activation gradients backward), divided by the sends made (micro-batches × steps). Step times
are medians (after one warm-up step) and are reported, not claimed: on one CPU host a send is a
loopback copy, so the bytes are the figure that carries to a real network.

    python benchmarks/pp_scatter_gather.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "e2e" / "parallel_harness.py"


def run_once(a: argparse.Namespace, scatter_gather: bool, out: Path) -> dict:
    from stalwart.data import ensure_default_corpus

    data = ensure_default_corpus(Path(a.data))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.pp * a.tp)]
    cmd += [str(HARNESS), f"--data={data}", f"--out={out}", f"--layout=pp={a.pp},tp={a.tp}", "--schedule=1f1b"]
    cmd += [f"--steps={a.steps}", f"--seq-len={a.seq_len}", f"--global-batch={a.global_batch}"]
    cmd += [f"--micro-batch={a.micro_batch}"] + ([] if scatter_gather else ["--no-pp-scatter-gather"])
    result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(out.read_text())


def summarise(runs: list[dict], sends: int) -> dict:
    sent = runs[0]["pp_sent_bytes"]  # per rank (forward, backward): the same in every repeat
    return {
        "fwd_bytes_per_send_per_rank": [f / sends for f, _ in sent],
        "bwd_bytes_per_send_per_rank": [b / sends for _, b in sent],
        "step_s": statistics.median(statistics.median(r["step_times"][1:]) for r in runs),
        "losses": runs[0]["losses"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data", default=str(ROOT / "data" / "prepared" / "stdlib-byte"))
    a = p.parse_args()
    sends = a.steps * (a.global_batch // a.micro_batch)
    res: dict = {"claim": "PP×TP scatter-gather: bytes per stage-boundary send, 1/tp of the plain send"}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sg in (("scatter_gather", True), ("plain", False)):
            runs = [run_once(a, sg, Path(tmp) / f"{name}-{i}.json") for i in range(a.repeats)]
            res[name] = summarise(runs, sends)
    on, off = res["scatter_gather"], res["plain"]
    sent_on = sum(on["fwd_bytes_per_send_per_rank"]) + sum(on["bwd_bytes_per_send_per_rank"])
    sent_off = sum(off["fwd_bytes_per_send_per_rank"]) + sum(off["bwd_bytes_per_send_per_rank"])
    res["setup"] = {k: getattr(a, k) for k in ("pp", "tp", "steps", "seq_len", "global_batch", "micro_batch")}
    res["bytes_ratio_plain_over_scatter_gather"] = sent_off / sent_on
    res["max_loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(on["losses"], off["losses"]))
    res["step_speedup"] = off["step_s"] / on["step_s"]
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"bytes per send, plain / scatter-gather: {res['bytes_ratio_plain_over_scatter_gather']:.2f} (tp={a.tp})")
        print(f"max relative loss difference: {res['max_loss_rel_diff']:.2e}")
        print(f"step: scatter-gather {on['step_s'] * 1e3:.0f} ms, plain {off['step_s'] * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

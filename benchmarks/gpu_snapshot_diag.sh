#!/usr/bin/env bash
# Where do a memory snapshot's host blocking (6.36 ms per save on an H200, 280m shape) and the 26 % step
# slowdown come from? One device call, ≤ 240 s, each part under its own `timeout`, everything appended
# to $OUT/diag.log (plus diag.json, trace.json.gz, pyspy.txt: 4 files back).
#
#   A  D2H bandwidth of the 280m state's tensors (params + AdamW moments, ~3.4 GB, the snapshot's own
#      tensor list): into torch pinned memory, into a /dev/shm slot page-locked by stalwart's SlotFile
#      (what the writer uses), into pageable memory; alone and beside a bf16 matmul loop.
#   B  An in-process Trainer (the shape/batch of benchmarks/gpu_step.py, checkpoint memory_every=1,
#      persist off) driven step by step with the snapshot path instrumented by wrappers (no source
#      edits): save call = capture() + writer.wait() (the previous snapshot) + the rest of start();
#      the optimizer hook's host wait and, with CUDA timing events, the training stream's GPU-side wait
#      for the copy; the snapshot thread's copy issue time, copy duration on the GPU, event sync and
#      header writes; the final wait for the last snapshot (until f66fcfd gpu_step.py's hook_wait_s
#      included it, divided over all steps). Phases: off, every1, every4, every1 without the
#      GPU-side wait, every1 without the copies, every1 with no snapshot thread at all (capture() +
#      start() only), off again; then a torch.profiler trace of 3 snapshotted steps,
#      summarised (GPU idle gaps, DtoH memcpy kind/bandwidth, CUDA runtime calls per thread); py-spy
#      (if the carried wheel installs) samples a snapshotted phase.
#   C  benchmarks/gpu_step.py --sections stalwart,checkpoint (fewer steps): the original figures.
#
# Run from the repo root (carry [".whl"] for py-spy; works without), timeout_s ≥ 260 (expect ~150-190 s):
#   bash benchmarks/gpu_snapshot_diag.sh
# CPU dry run of the plumbing (tiny shape, gloo, no CUDA parts):
#   OUT=/tmp/diag DIAG_CPU=1 PATH=.venv/bin:$PATH bash benchmarks/gpu_snapshot_diag.sh
# Knobs: DIAG_STEPS (steps per phase, default 12), DIAG_SKIP_C=1, DIAG_SKIP_A=1, DIAG_BUDGET (s, 235).
set -u
OUT=${OUT:-runs/gpu-snapshot-diag}
mkdir -p "$OUT"
LOG=$OUT/diag.log
WORK=$(mktemp -d /tmp/snapdiag.XXXXXX)
BUDGET=${DIAG_BUDGET:-235}
say() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET - SECONDS )); }
export PYTHONUNBUFFERED=1
PY=python3
command -v $PY >/dev/null || PY=python
if [ "${DIAG_CPU:-0}" = 1 ]; then
    DEV=cpu; STEPS=${DIAG_STEPS:-4}
else
    DEV=cuda; STEPS=${DIAG_STEPS:-12}
fi

# 0. py-spy from the carried wheels (optional), environment
if [ "$DEV" = cuda ] && compgen -G ".whl/py_spy*.whl" >/dev/null; then
    timeout 40 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/py_spy*.whl >>"$LOG" 2>&1 || say "py-spy wheel install failed (rc $?): going on without it"
fi
export PYTHONPATH=/tmp/site:src:.${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
{
    echo "== environment"
    [ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,clocks.sm,power.draw --format=csv
    df -h /dev/shm /tmp
    nproc; ulimit -l
    $PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    command -v py-spy || echo "py-spy: not available"
} >>"$LOG" 2>&1
say "environment logged (device $DEV, $STEPS steps per phase, work $WORK)"

# The Python parts, written out once (this script is the only file the diagnosis adds)
cat >"$WORK/common.py" <<'PY'
import json, os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import gpu_step  # SHAPES, GPU_DEFAULTS, SMOKE_DEFAULTS (the benchmark's own)
import gpu_step_parts as parts

def shape_args(dev):
    """(shape dict, seq_len, micro_batch, global_batch) of benchmarks/gpu_step.py on `dev`."""
    name, seq, mb, gb, _, _ = gpu_step.GPU_DEFAULTS if dev == "cuda" else gpu_step.SMOKE_DEFAULTS
    shape = dict(gpu_step.SHAPES[name])
    if os.environ.get("DIAG_SHAPE_JSON"):
        shape = json.loads(os.environ["DIAG_SHAPE_JSON"])
    return shape, int(os.environ.get("DIAG_SEQ", seq)), int(os.environ.get("DIAG_MB", mb)), int(os.environ.get("DIAG_GB", gb))

def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

def med(xs):
    return statistics.median(xs) if xs else None

def r3(x):
    return None if x is None else round(x, 3)
PY

# --------------------------------------------------------------------------------------------------
# A. D2H bandwidth of the snapshot's tensors into the three kinds of host memory
cat >"$WORK/bandwidth.py" <<'PY'
import os, sys, time, mmap, statistics, json
from pathlib import Path
import torch
from common import shape_args, parts, r3
from stalwart._compat import copy_tensors
from stalwart.checkpoint.slot_file import SlotFile
from stalwart.models import build_model, model_args

dev = sys.argv[1]
cuda = dev == "cuda"
shape, seq, mb, gb = shape_args(dev)
with torch.device("meta"):
    m = build_model(parts.BASE_MODEL, model_args(parts.BASE_MODEL, vocab_size=257, max_seq_len=seq, **shape))
shapes = [tuple(p.shape) for p in m.parameters()] * 3  # params, exp_avg, exp_avg_sq (fp32)
srcs = [torch.randn(s, device=dev) for s in shapes]
nbytes = sum(t.numel() * 4 for t in srcs)
print(f"A: {len(srcs)} tensors, {nbytes / 1e9:.3f} GB (params + 2 AdamW moments, fp32)")

def views(buf):
    out, off = [], 0
    for t in srcs:
        n = t.numel() * 4
        out.append(buf[off:off + n].view(torch.float32).view(t.shape))
        off += -(-n // 64) * 64
    return out
total = sum(-(-t.numel() * 4 // 64) * 64 for t in srcs)

def timed_copy(dsts, non_blocking, label, busy=None):
    """Copies on a side stream as the snapshot thread issues them: host issue time, GPU time, GB/s."""
    if not cuda:
        t0 = time.perf_counter(); copy_tensors(dsts, srcs); dt = time.perf_counter() - t0
        print(f"A: {label:<34} cpu copy {dt*1e3:8.1f} ms  {nbytes/dt/1e9:6.1f} GB/s"); return
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    mm_ms = None
    if busy is not None:  # a bf16 matmul loop on the default stream, as the next step's compute
        a, n = busy
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            a @ a
        e1.record()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        s.record(side)
        copy_tensors(dsts, srcs, non_blocking=non_blocking)
        e.record(side)
    issue = time.perf_counter() - t0
    torch.cuda.synchronize()
    gpu = s.elapsed_time(e) / 1e3
    extra = ""
    if busy is not None:
        mm_ms = e0.elapsed_time(e1)
        extra = f"  matmul loop {mm_ms:7.1f} ms (alone {busy_alone:7.1f} ms)"
    print(f"A: {label:<34} issue {issue*1e3:8.2f} ms  gpu {gpu*1e3:8.1f} ms  {nbytes/gpu/1e9:6.1f} GB/s{extra}")
    return {"issue_ms": issue * 1e3, "gpu_ms": gpu * 1e3, "gbps": nbytes / gpu / 1e9, "matmul_ms": mm_ms}

res = {}
# 1. torch pinned (cudaHostAlloc)
if cuda:
    t0 = time.perf_counter(); pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    print(f"A: cudaHostAlloc {total/1e9:.2f} GB: {time.perf_counter()-t0:.2f} s")
    dp = views(pinned)
    timed_copy(dp, True, "pinned (cudaHostAlloc), warm-up")
    res["pinned"] = timed_copy(dp, True, "pinned (cudaHostAlloc)")
    flat = torch.empty(nbytes // 4, device=dev)
    t0 = time.perf_counter(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); pinned[: nbytes].view(torch.float32).copy_(flat, non_blocking=True); e.record(); torch.cuda.synchronize()
    print(f"A: {'pinned, ONE flat copy':<34} gpu {s.elapsed_time(e):8.1f} ms  {nbytes/(s.elapsed_time(e)/1e3)/1e9:6.1f} GB/s")
    del flat
# 2. a /dev/shm slot as stalwart's writer holds it: fallocate + MAP_POPULATE + cudaHostRegister
shm = Path(os.environ.get("DIAG_SHM", "/dev/shm")) / f"snapdiag-{os.getpid()}.bin"
slot = SlotFile(shm)
ds = None
try:
    t0 = time.perf_counter(); slot.ensure(total); t1 = time.perf_counter()
    if cuda:
        slot.pin_for_cuda()
    t2 = time.perf_counter()
    print(f"A: shm slot {total/1e9:.2f} GB: fallocate+map {t1-t0:.2f} s, cudaHostRegister {t2-t1:.2f} s, pinned={slot.pinned}")
    ds = views(torch.frombuffer(slot.map, dtype=torch.uint8, count=total))
    timed_copy(ds, slot.pinned, "shm slot (registered), warm-up")
    res["shm"] = timed_copy(ds, slot.pinned, "shm slot (registered), as the writer")
    if cuda:
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        n = 60
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a @ a; torch.cuda.synchronize(); e0.record()
        for _ in range(n):
            a @ a
        e1.record(); torch.cuda.synchronize(); busy_alone = e0.elapsed_time(e1)
        res["shm_busy"] = timed_copy(ds, slot.pinned, "shm slot, beside a matmul loop", busy=(a, n))
        del a
        slot.unpin()
        # 3. what the writer does if cudaHostRegister fails: synchronous pageable copies
        t0 = time.perf_counter()
        res["shm_pageable"] = timed_copy(ds, False, "shm slot NOT registered (sync)")
finally:
    slot.unpin()
    if slot.map is not None:
        ds = None
        try:
            slot.map.close()
        except BufferError:
            pass
    os.close(slot.fd); shm.unlink(missing_ok=True)
print("A_JSON " + json.dumps({k: {kk: r3(vv) for kk, vv in (v or {}).items()} for k, v in res.items()}))
PY

if [ "${DIAG_SKIP_A:-0}" != 1 ]; then
    say "A: D2H bandwidth of the snapshot's tensors (timeout 50 s)"
    timeout -k 5 50 env PYTHONPATH="$WORK:$PYTHONPATH" $PY "$WORK/bandwidth.py" $DEV >>"$LOG" 2>&1 || say "A: exit $?"
fi

# --------------------------------------------------------------------------------------------------
# B. the instrumented in-process Trainer
cat >"$WORK/driver.py" <<'PY'
import gzip, json, os, statistics, sys, tempfile, threading, time
from collections import defaultdict
from pathlib import Path
import torch
from common import shape_args, parts, pct, med, r3

dev = sys.argv[1]
steps_per_phase = int(sys.argv[2])
out_dir = Path(sys.argv[3])
mark = Path(sys.argv[4])
cuda = dev == "cuda"
shape, seq, mb, gb = shape_args(dev)

from stalwart.config import load_config
from stalwart.data import ensure_default_corpus
from stalwart.dist import init_distributed, shutdown
from stalwart._compat import copy_tensors
from stalwart.checkpoint import checkpointer as ck_mod, snapshot as snap_mod, state as state_mod, slot_file as slot_mod
from stalwart.train.hooks import CheckpointHook
from stalwart.train.trainer import Trainer

work = Path(tempfile.mkdtemp(prefix="snapdiag-run-", dir=os.environ.get("DIAG_TMP")))  # under $WORK: removed
data = ensure_default_corpus(Path(os.environ.get("DIAG_DATA", work / "data")))
ov = {
    "model.name": parts.BASE_MODEL, **{f"model.{k}": v for k, v in shape.items()},
    "data.dir": str(data), "data.seq_len": seq, "train.steps": 10**6, "train.global_batch": gb,
    "train.micro_batch": mb, "train.warmup_steps": 0, "train.deterministic": False,
    "train.log_every": 10**6, "train.out_dir": str(work / "run"), "train.tensorboard": "off",
    "checkpoint.enabled": True, "checkpoint.dir": str(work / "run" / "checkpoints"),
    "checkpoint.shm_dir": os.environ.get("DIAG_SHM", "/dev/shm"), "checkpoint.memory_every": 1,
    "checkpoint.persist_every_steps": 0,
}
if not cuda:
    ov |= {"parallel.backend": "gloo", "train.threads": 1}
cfg = load_config("configs/debug.toml", ov)

# ---- probes: wrappers around the snapshot path (class attributes replaced in this process only) ----
class P:
    phase = None
    rec = defaultdict(lambda: defaultdict(list))   # phase -> name -> values
    gpu_pending = defaultdict(list)                # phase -> (name, ev_a, ev_b)
    skip_gpu_wait = False
    skip_copies = False
    info = {}

def add(name, v, phase=None):
    ph = phase or P.phase
    if ph:
        P.rec[ph][name].append(v)

def tev():
    return torch.cuda.Event(enable_timing=True)

orig_save = ck_mod.Checkpointer.save
def save(self, step, state, **kw):
    t0 = time.perf_counter()
    started = orig_save(self, step, state, **kw)
    add("save_call_ms", (time.perf_counter() - t0) * 1e3)
    return started
ck_mod.Checkpointer.save = save

orig_capture = state_mod.TrainingState.capture
def capture(self):
    t0 = time.perf_counter(); c = orig_capture(self)
    add("capture_ms", (time.perf_counter() - t0) * 1e3)
    P.info["tensors"] = len(c.sources); P.info["cuda_tensors"] = sum(t.is_cuda for t in c.sources.values())
    P.info["bytes"] = sum(t.numel() * t.element_size() for t in c.sources.values())
    return c
state_mod.TrainingState.capture = capture

W = snap_mod.SnapshotWriter
orig_start, orig_wait = W.start, W.wait
def start(self, step, captured, persist):
    t0 = time.perf_counter(); P.in_start_wait = 0.0
    if cuda and P.phase:  # the training stream's position at the save (start() records `ready` here too)
        captured._diag_ready = tev(); captured._diag_ready.record()
    r = orig_start(self, step, captured, persist)
    add("start_ms", (time.perf_counter() - t0) * 1e3)
    add("start_wait_prev_ms", P.in_start_wait * 1e3)   # of start_ms: the previous snapshot's future
    return r
W.start = start
def wait(self, *stat):
    t0 = time.perf_counter(); orig_wait(self, *stat); dt = time.perf_counter() - t0
    P.in_start_wait = getattr(P, "in_start_wait", 0.0) + dt
W.wait = wait

def wait_copied(self):  # = SnapshotWriter.wait_copied, timed; the GPU-side wait bracketed by events
    t0 = time.perf_counter()
    if not self._copied.is_set():
        self._copied.wait()
        self.stats["wait_s"] += time.perf_counter() - t0
    add("hook_host_wait_ms", (time.perf_counter() - t0) * 1e3)
    if self._cuda_event is not None and not P.skip_gpu_wait:
        if P.phase:
            a = tev(); a.record()
        torch.cuda.current_stream().wait_event(self._cuda_event)
        if P.phase:
            b = tev(); b.record(); P.gpu_pending[P.phase].append(("gpu_stall_ms", a, b))
    self._raise_if_failed()
W.wait_copied = wait_copied

class TimedEvent(torch.cuda.Event if cuda else object):
    def synchronize(self):
        t0 = time.perf_counter(); super().synchronize()
        add("bg_copy_sync_ms", (time.perf_counter() - t0) * 1e3, self.phase)

def issue(self, pairs, pinned, ready):  # = SnapshotWriter._issue_cuda_copies with timing events
    t0 = time.perf_counter()
    phase = P.phase
    stream = self._stream
    with torch.no_grad(), torch.cuda.device(stream.device), torch.cuda.stream(stream):
        stream.wait_event(ready)
        s = tev(); s.record(stream)
        if not P.skip_copies:
            copy_tensors([d for d, _ in pairs], [src for _, src in pairs], non_blocking=pinned)
        done = TimedEvent(enable_timing=True); done.phase = phase
        done.record(stream)
    self._cuda_event = done
    add("bg_issue_ms", (time.perf_counter() - t0) * 1e3, phase)
    P.info["pinned"] = pinned; P.info["cuda_pairs"] = len(pairs)
    if phase:
        P.gpu_pending[phase].append(("gpu_copy_ms", s, done))
        ready_ev = getattr(P.tl, "ready", None)  # recorded by start() on the training stream
        if ready_ev is not None:
            P.gpu_pending[phase].append(("gpu_copy_start_lag_ms", ready_ev, s))
W._issue_cuda_copies = issue

orig_run = W._run
def run(self, step, *a):
    phase = P.phase; t0 = time.perf_counter()
    P.tl.phase = phase
    P.tl.ready = getattr(a[3], "_diag_ready", None)  # a = (slot, entries, size, captured, ...)
    try:
        return orig_run(self, step, *a)
    finally:
        add("bg_run_ms", (time.perf_counter() - t0) * 1e3, phase)
W._run = run
P.tl = threading.local()
orig_aw = snap_mod.atomic_write
def atomic_write(path, blob):
    t0 = time.perf_counter(); orig_aw(path, blob)
    add("bg_header_write_ms", (time.perf_counter() - t0) * 1e3, getattr(P.tl, "phase", None))
snap_mod.atomic_write = atomic_write
orig_dumps = snap_mod.json.dumps
class _J:  # snapshot.py's `json`, with dumps timed (the header of every save)
    def __getattr__(self, k):
        return getattr(json, k)
    @staticmethod
    def dumps(o, *a, **k):
        t0 = time.perf_counter(); s = json.dumps(o, *a, **k)
        if isinstance(o, dict) and "entries" in o:
            add("bg_header_json_ms", (time.perf_counter() - t0) * 1e3, getattr(P.tl, "phase", None))
            P.info["header_bytes"] = len(s)
        return s
snap_mod.json = _J()
orig_pin = slot_mod.SlotFile.pin_for_cuda
def pin(self):
    was = self.pinned; t0 = time.perf_counter(); orig_pin(self)
    if not was and self.map is not None:
        P.info.setdefault("pin_s", []).append(round(time.perf_counter() - t0, 3))
        P.info["pinned_ok"] = self.pinned
slot_mod.SlotFile.pin_for_cuda = pin

# ---- a GIL-latency probe: a thread sleeping 2 ms, how late it wakes (the GIL held by others) ----
class GilProbe:
    def __init__(self):
        self.lat, self.stop = [], threading.Event()
        self.t = threading.Thread(target=self.loop, daemon=True); self.t.start()
    def loop(self):
        while not self.stop.is_set():
            t0 = time.perf_counter(); time.sleep(0.002)
            self.lat.append((time.perf_counter() - t0 - 0.002) * 1e3)
    def close(self):
        self.stop.set(); self.t.join()
        return {"gil_late_p50_ms": r3(pct(self.lat, 0.5)), "gil_late_p99_ms": r3(pct(self.lat, 0.99)),
                "gil_late_max_ms": r3(max(self.lat) if self.lat else None)}

# ---- the trainer ----
env = init_distributed(cfg.parallel.backend)
t0 = time.perf_counter()
tr = Trainer(cfg, env)
tr.metrics.open(tr.step, False)
print(f"B: trainer built in {time.perf_counter() - t0:.1f} s: {tr.n_params / 1e6:.1f} M params, device {env.device}, "
      f"seq {seq}, micro {mb}, global {gb}")
ck = tr.ckpt
ckpt_hooks = [h for h in tr.hooks if isinstance(h, CheckpointHook)]
all_hooks = list(tr.hooks)
sync = torch.cuda.synchronize if cuda else (lambda: None)
results = {}

def run_nothing(self, step, slot, *a):  # the snapshot thread skipped: capture() + start() only
    self._copied.set(); self._cuda_event = None; self.slots[slot].unlock()

def phase(name, n, every=1, on=True, skip_gpu_wait=False, skip_copies=False, spy=False, no_thread=False):
    tr.hooks = all_hooks if on else [h for h in all_hooks if h not in ckpt_hooks]
    ck.memory_every = every
    ck.wait(); sync()
    P.skip_gpu_wait, P.skip_copies = skip_gpu_wait, skip_copies
    if spy and os.environ.get("DIAG_SPY") == "1":
        try:  # Yama ptrace_scope 1: let py-spy (a sibling, not an ancestor) attach
            import ctypes
            ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY
        except Exception:
            pass
        (mark / "spy.start").write_text(str(os.getpid()))
        deadline = time.time() + 15
        while not (mark / "spy.attached").exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
    W._run = run_nothing if no_thread else run
    w0 = dict(ck.writer.stats)
    P.phase = name
    gil = GilProbe()
    host, evs = [], []
    ts = time.perf_counter()
    for _ in range(n):
        if cuda:
            e = tev(); e.record(); evs.append(e)
        t = time.perf_counter()
        tr.train_step()
        host.append(time.perf_counter() - t)
    if cuda:
        e = tev(); e.record(); evs.append(e)
    w1 = dict(ck.writer.stats)
    t = time.perf_counter(); ck.wait()  # the last snapshot's whole copy: what a run's end waits for
    tail = time.perf_counter() - t
    sync()
    wall = time.perf_counter() - ts
    P.phase = None
    W._run = run
    g = gil.close()
    if spy:
        (mark / "spy.done").write_text("1")
    r = {"steps": n, "wall_per_step_ms": wall / n * 1e3, "host_step_ms_med": med(host) * 1e3,
         "host_step_ms_list": [round(x * 1e3, 1) for x in host]}
    if cuda:
        gs = [evs[i].elapsed_time(evs[i + 1]) for i in range(n)]
        r["gpu_step_ms_med"] = med(gs); r["gpu_step_ms_list"] = [round(x, 1) for x in gs]
        for key, a, b in P.gpu_pending.pop(name, []):
            P.rec[name][key].append(a.elapsed_time(b))
    for k, v in P.rec.get(name, {}).items():
        r[k + "_med"] = med(v); r[k + "_max"] = max(v); r[k + "_n"] = len(v)
    # until f66fcfd gpu_step.py's hook_wait_s was start()'s wait for the previous snapshot + the hook's
    # waits + the run's final wait for the last snapshot, over all steps; now wait_s is the hook's alone
    r["writer_wait_in_loop_ms"] = (w1["wait_s"] - w0["wait_s"]) * 1e3
    r["tail_wait_ms"] = tail * 1e3
    r["gpu_step_style_hook_wait_ms_per_step"] = (w1["wait_s"] - w0["wait_s"] + tail) * 1e3 / n
    r["snapshots"] = ck.writer.stats["snapshots"] - w0["snapshots"]
    r |= g
    results[name] = {k: (r3(v) if isinstance(v, float) else v) for k, v in r.items()}
    keys = ("wall_per_step_ms", "gpu_step_ms_med", "save_call_ms_med", "capture_ms_med", "start_wait_prev_ms_med",
            "hook_host_wait_ms_med", "gpu_stall_ms_med", "gpu_copy_ms_med", "gpu_copy_start_lag_ms_med",
            "bg_issue_ms_med", "bg_run_ms_med", "bg_header_json_ms_med", "tail_wait_ms", "gil_late_p99_ms")
    print(f"B: {name:<18} " + "  ".join(f"{k.replace('_med', '')}={r3(r[k])}" for k in keys if r.get(k) is not None),
          flush=True)

n = steps_per_phase
phase("warm", max(3, n // 2))            # the first saves: slots reserved, mapped, page-locked
phase("off", n, on=False)
phase("every1", n)
phase("every4", n, every=4)
phase("every1_nogpuwait", n, skip_gpu_wait=True)   # diagnostic only: the copy may read updated params
phase("every1_nocopy", n, skip_copies=True)        # everything but the D2H copies
phase("every1_nothread", n, no_thread=True)        # capture() + start() only: no copies, no header, no thread work
phase("off2", n, on=False)
if os.environ.get("DIAG_SPY") == "1":
    phase("every1_spy", max(n, 16), spy=True)

# ---- a profile of 3 snapshotted steps (CUDA): GPU idle gaps, memcpy kinds, runtime calls per thread ----
prof_summary = {}
if cuda and os.environ.get("DIAG_PROFILE", "1") == "1":
    from torch.profiler import ProfilerActivity, profile
    ck.memory_every = 1; tr.hooks = all_hooks; P.skip_gpu_wait = P.skip_copies = False
    for _ in range(2):
        tr.train_step()
    ck.wait(); sync()
    trace = work / "trace.json"
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                tr.train_step()
            ck.wait(); sync()
        prof.export_chrome_trace(str(trace))
        tj = json.loads(trace.read_text())
        evs = [e for e in tj.get("traceEvents", []) if e.get("ph") == "X"]
        gpu = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        kern = [e for e in gpu if e["cat"] == "kernel"]
        by_stream = defaultdict(list)
        for e in kern:
            by_stream[e.get("args", {}).get("stream", e.get("tid"))].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        main_stream = max(by_stream, key=lambda s: len(by_stream[s])) if by_stream else None
        ks = sorted(by_stream.get(main_stream, []))
        gaps, busy, end = [], 0.0, None
        for a, b, nm in ks:
            if end is not None and a > end:
                gaps.append((a - end, nm))
            end = b if end is None else max(end, b)
        window = (ks[-1][1] - ks[0][0]) if ks else 0
        union = 0.0; cur = None
        for a, b, _ in ks:
            if cur is None or a > cur[1]:
                if cur: union += cur[1] - cur[0]
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        if cur: union += cur[1] - cur[0]
        memcpy = [e for e in gpu if e["cat"] == "gpu_memcpy"]
        kinds = defaultdict(lambda: [0, 0.0, 0])
        for e in memcpy:
            k = kinds[e["name"]]; k[0] += 1; k[1] += e["dur"]; k[2] += int(e.get("args", {}).get("bytes", 0))
        names = {e.get("tid"): e.get("args", {}).get("name") for e in tj.get("traceEvents", [])
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        rt = defaultdict(lambda: [0, 0.0])
        for e in evs:
            if e.get("cat") in ("cuda_runtime", "cuda_driver"):
                tid = e.get("tid")
                k = rt[(f"{tid} {names.get(tid) or ''}".strip(), e["name"])]; k[0] += 1; k[1] += e["dur"]
        top_rt = sorted(rt.items(), key=lambda kv: -kv[1][1])[:14]
        gaps.sort(reverse=True)
        prof_summary = {
            "main_stream": main_stream, "streams_with_kernels": {str(s): len(v) for s, v in by_stream.items()},
            "window_ms": window / 1e3, "main_stream_busy_ms": union / 1e3,
            "main_stream_idle_ms": (window - union) / 1e3, "idle_gaps_over_0.2ms": sum(1 for g, _ in gaps if g > 200),
            "top_gaps_ms": [(round(g / 1e3, 2), nm[:60]) for g, nm in gaps[:8]],
            "memcpy": {k: {"n": v[0], "ms": round(v[1] / 1e3, 2), "GB": round(v[2] / 1e9, 3),
                           "GB/s": round(v[2] / v[1] / 1e3, 1) if v[1] else None} for k, v in kinds.items()},
            "runtime_by_thread": [(str(t), nm, c, round(d / 1e3, 2)) for (t, nm), (c, d) in top_rt],
        }
        print("B: profile of 3 snapshotted steps: " + json.dumps({k: v for k, v in prof_summary.items()
                                                                 if k != "runtime_by_thread"}))
        print("B: CUDA runtime/driver calls, top by total time (thread, call, count, ms):")
        for row in prof_summary["runtime_by_thread"]:
            print(f"B:   {row}")
        gz = out_dir / "trace.json.gz"
        with open(trace, "rb") as f, gzip.open(gz, "wb", compresslevel=5) as g:
            g.write(f.read())
        if gz.stat().st_size > 25 * 2**20:
            gz.unlink(); print("B: trace.json.gz over 25 MiB: not kept")
    except Exception as err:
        print(f"B: profile failed: {type(err).__name__}: {err}")

summary = {"device": torch.cuda.get_device_name() if cuda else "cpu", "n_params": tr.n_params, "shape": shape,
           "seq": seq, "micro_batch": mb, "global_batch": gb, "info": P.info, "phases": results, "profile": prof_summary}
off = results["off"]["wall_per_step_ms"]
VARIANTS = ("every1", "every4", "every1_nogpuwait", "every1_nocopy", "every1_nothread", "off2")
for k in VARIANTS:
    results[k]["vs_off"] = round(results[k]["wall_per_step_ms"] / off, 3)
print("B: info " + json.dumps(P.info))
print("B: step (wall/step) vs off: " + ", ".join(f"{k} {results[k]['vs_off']}" for k in VARIANTS))
e = results["every1"]
print(f"B: every1 accounting: save call {e.get('save_call_ms_med')} ms median (capture {e.get('capture_ms_med')}, "
      f"start {e.get('start_ms_med')}, of it waiting for the previous snapshot {e.get('start_wait_prev_ms_med')}); "
      f"hook host wait {e.get('hook_host_wait_ms_med')} ms median; writer wait_s in the loop {e['writer_wait_in_loop_ms']} ms "
      f"total, tail wait for the last snapshot {e['tail_wait_ms']} ms -> gpu_step-style hook_wait per step "
      f"{e['gpu_step_style_hook_wait_ms_per_step']} ms over {e['steps']} steps")
(out_dir / "diag.json").write_text(json.dumps(summary, indent=1, default=str))
ck.close(success=True)
tr.loader.close()
tr.metrics.close()
shutdown()
os._exit(0)
PY

say "B: instrumented trainer, phases of $STEPS steps (timeout 130 s)"
MARK=$WORK/mark; mkdir -p "$MARK"
SPY=0; [ "$DEV" = cuda ] && command -v py-spy >/dev/null && SPY=1
[ "${DIAG_SPY:-}" = 1 ] && command -v py-spy >/dev/null && SPY=1  # forced (a CPU dry run of the py-spy plumbing)
DIAG_SPY=$SPY DIAG_DATA="$WORK/data" DIAG_TMP="$WORK" timeout -k 5 130 env PYTHONPATH="$WORK:$PYTHONPATH" $PY "$WORK/driver.py" $DEV "$STEPS" "$OUT" "$MARK" \
    >>"$LOG" 2>&1 &
bpid=$!
if [ $SPY = 1 ]; then
    for _ in $(seq 1 1200); do  # ≤ 120 s for the driver to reach its py-spy phase
        [ -f "$MARK/spy.start" ] && break
        kill -0 $bpid 2>/dev/null || break
        sleep 0.1
    done
    if [ -f "$MARK/spy.start" ]; then
        timeout 20 py-spy record --pid "$(cat "$MARK/spy.start")" --duration 4 --rate 200 --threads --nonblocking \
            --format raw -o "$WORK/pyspy.raw" >"$WORK/pyspy.log" 2>&1 &
        spid=$!
        sleep 0.5; touch "$MARK/spy.attached"
        wait $spid; echo "py-spy exit $?" >>"$WORK/pyspy.log"
    fi
fi
wait $bpid; rc=$?
say "B: exit $rc"
if [ -s "$WORK/pyspy.raw" ]; then
    cp "$WORK/pyspy.raw" "$OUT/pyspy.txt"
    { echo "== py-spy (every1 phase): samples per thread, then the top stacks (innermost 4 frames)"
      $PY - "$WORK/pyspy.raw" <<'PY'
import sys
from collections import Counter, defaultdict
per_thread, stacks = Counter(), defaultdict(Counter)
for line in open(sys.argv[1]):
    line = line.rstrip()
    if not line:
        continue
    stack, _, n = line.rpartition(" ")
    frames = stack.split(";")
    thread = frames[0]
    per_thread[thread] += int(n)
    stacks[thread][" <- ".join(reversed(frames[-4:]))] += int(n)
for t, n in per_thread.most_common(6):
    print(f"  {t}: {n} samples")
    for s, c in stacks[t].most_common(8):
        print(f"     {c:5d}  {s[:230]}")
PY
    } >>"$LOG" 2>&1
else
    [ -f "$WORK/pyspy.log" ] && { echo "== py-spy log"; cat "$WORK/pyspy.log"; } >>"$LOG"
fi

# --------------------------------------------------------------------------------------------------
# C. the benchmark's own figures (fewer steps), for comparison with the driver
if [ "${DIAG_SKIP_C:-0}" != 1 ]; then
    cap=$(( $(left) - 5 )); [ $cap -gt 110 ] && cap=110
    if [ $cap -ge 40 ]; then
        say "C: gpu_step.py --sections stalwart,checkpoint (timeout $cap s)"
        if [ "$DEV" = cuda ]; then
            args="--warmup 3 --steps 8"
        else
            args="--smoke --peak-tflops 0.05"
        fi
        timeout -k 5 $cap $PY benchmarks/gpu_step.py $args --sections stalwart,checkpoint \
            --section-timeout $(( cap / 2 )) --work "$WORK" --out-json "$WORK/c.json" >>"$LOG" 2>&1 || say "C: exit $?"
        [ -f "$WORK/c.json" ] && $PY -c 'import json,sys; r=json.load(open(sys.argv[1])); print("C_JSON", json.dumps({k: r.get(k) for k in ("stalwart", "checkpoint", "sections")}))' "$WORK/c.json" >>"$LOG" 2>&1
    else
        say "C: skipped ($cap s left)"
    fi
fi
rm -rf "$WORK"
say "done in ${SECONDS}s; files: $(ls "$OUT" | tr '\n' ' ')"

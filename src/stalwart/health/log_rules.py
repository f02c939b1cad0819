"""Classify a failed worker from its log: hardware | system | user | storage, and whether to retry.

A rule table, first match wins, ordered from the most specific evidence (hardware) to the least.
User errors are not retried: restarting a SyntaxError burns the budget and hides the traceback.
Errors that are only surely the user's before any step completed (shapes, types, OOM) are fatal then,
and retried once training has made progress (they may come from a bad node or a bad batch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HARDWARE, SYSTEM, USER, STORAGE = "hardware", "system", "user", "storage"


NEVER, ALWAYS, BEFORE_PROGRESS = "never", "always", "before_progress"  # when a match is fatal


@dataclass(frozen=True)
class Rule:
    kind: str
    cls: str
    pattern: re.Pattern
    fatal: str


def _r(kind: str, cls: str, pattern: str, fatal: str = NEVER) -> Rule:
    return Rule(kind, cls, re.compile(pattern, re.IGNORECASE | re.MULTILINE), fatal)


RULES: tuple[Rule, ...] = (
    # The training guard's verdicts (stalwart.train.guard): a wrong burn-in is the hardware's fault
    # (retry elsewhere); a rollback budget spent or no checkpoint to roll back to needs a person.
    _r("sdc", HARDWARE, r"\bSilentDataCorruption\b"),
    _r("gpu_xid", HARDWARE, r"\bNVRM: Xid\b|\bXid \(PCI:"),
    _r("ecc", HARDWARE, r"uncorrectable ECC|ECC error|double bit ECC"),
    _r("gpu_lost", HARDWARE, r"GPU has fallen off the bus|unable to determine the device handle"),
    _r("nvlink", HARDWARE, r"NVLink (?:error|fatal)"),
    _r(
        "cuda_error",
        HARDWARE,
        r"CUDA error: (?:an illegal memory access|unspecified launch failure|"
        r"device-side assert)",
    ),
    # The checkpoint store failed the job (stalwart.checkpoint.storage_health): restarting cannot fix storage.
    _r("storage", STORAGE, r"\bStorageUnavailableError\b", fatal=ALWAYS),
    _r("rollback_limit", USER, r"\b(?:RollbackLimitExceeded|RollbackUnavailable)\b", fatal=ALWAYS),
    _r("checkpoint_dir_in_use", USER, r"holds committed step\(s\) .* of an earlier run", fatal=ALWAYS),
    _r(
        "oom",
        USER,
        r"CUDA out of memory|OutOfMemoryError|DefaultCPUAllocator: can't allocate memory",
        fatal=BEFORE_PROGRESS,
    ),
    _r("nccl", SYSTEM, r"NCCL (?:WARN|error)|ncclSystemError|ncclInternalError|ProcessGroupNCCL.*[Tt]imeout"),
    _r(
        "collective_timeout",
        SYSTEM,
        r"Watchdog caught collective operation timeout|"
        r"gloo.*(?:Timed out|timeout)|Socket Timeout",
    ),
    _r(
        "connection",
        SYSTEM,
        r"Connection (?:refused|reset by peer|closed by peer)|connectFullMesh|Broken pipe|"
        r"DistNetworkError|RendezvousConnectionError",
    ),
    _r("nan", USER, r"\bloss (?:is )?(?:nan|inf)\b|non-finite loss|NaN or Inf found"),
    _r("syntax_error", USER, r"^(?:SyntaxError|IndentationError|TabError):", fatal=ALWAYS),
    _r("import_error", USER, r"^(?:ImportError|ModuleNotFoundError):", fatal=ALWAYS),
    _r("name_error", USER, r"^(?:NameError|UnboundLocalError):", fatal=ALWAYS),
    _r(
        "shape_error",
        USER,
        r"size mismatch|shape .* is invalid|mat1 and mat2 shapes cannot be multiplied|"
        r"^RuntimeError: The size of tensor",
        fatal=BEFORE_PROGRESS,
    ),
    _r(
        "type_error",
        USER,
        r"^(?:TypeError|AttributeError|KeyError|IndexError|ValueError|"
        r"FileNotFoundError|AssertionError):",
        fatal=BEFORE_PROGRESS,
    ),
)


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    cls: str
    fatal: str
    evidence: str  # the matching line

    def retry(self, progressed: bool) -> bool:
        """Whether a restart can help, given whether the job ever completed a step."""
        return self.fatal == NEVER or (self.fatal == BEFORE_PROGRESS and progressed)


def diagnose(log_text: str) -> Diagnosis | None:
    """The first rule (in table order) whose pattern occurs in the log, with its line."""
    for rule in RULES:
        match = rule.pattern.search(log_text)
        if match:
            start = log_text.rfind("\n", 0, match.start()) + 1
            end = log_text.find("\n", match.end())
            return Diagnosis(rule.kind, rule.cls, rule.fatal, log_text[start : end if end >= 0 else None].strip())
    return None


def last_traceback(log_text: str, max_lines: int = 60) -> str | None:
    """The last Python traceback in a log, up to and including its exception line."""
    start = log_text.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    lines = log_text[start:].splitlines()
    out = [lines[0]]
    for line in lines[1:]:
        out.append(line)
        if line and not line.startswith((" ", "\t")):  # the exception line ends the block
            break
    return "\n".join(out[-max_lines:])

"""Reading spec/handoff.pml and running spin on it, for the tests in tests/spec."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec"
MODEL = SPEC / "handoff.pml"

# one entry per mutant: file in spec/mutants/, and the properties spin may name
MUTANTS = {
    "a": ("a_handoff_after_reject.pml", {"I4_no_resources_after_reject", "I4_no_handoff_after_reject"}),
    "b": ("b_attend_reserved_length.pml", {"I3_reads_written_slots_only"}),
    "c": ("c_free_during_pull.pml", {"I6_transfer_writes_own_page", "I6_no_reuse_under_transfer"}),
    "d": ("d_lease_expiry_without_fence.pml", {"I2_reader_owns_page", "I6_no_reuse_under_transfer"}),
    # with the network adversary (spec/adversary.pml)
    "e": ("e_rows_not_sealed.pml", {"I10_network_reads_see_no_plaintext"}),
    "f": ("f_key_not_bound_to_request.pml", {"I5_decode_after_verified_transfer", "I2_reader_reads_own_data"}),
    "g": ("g_verify_then_reread.pml", {"I10_attention_reads_no_foreign_bytes", "I2_reader_reads_own_data"}),
    "h": ("h_control_plane_not_authenticated.pml", {"I2_reader_owns_page", "I6_no_reuse_under_transfer"}),
}
ADVERSARY_MUTANTS = frozenset("efgh")   # these include the adversary (#define ADVERSARY)


# ----------------------------------------------------------------- source

def strip_comments(text: str) -> str:
    """Remove /* */ and // comments, keeping line breaks so line numbers hold."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def preprocess(text: str, defined: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """The (line number, line) pairs that survive #ifdef/#ifndef/#else/#endif with
    the given macros defined; directive lines are dropped. Enough for this model."""
    out: list[tuple[int, str]] = []
    stack: list[tuple[bool, bool]] = []  # (parent active, this branch active)
    active = True
    for number, line in enumerate(strip_comments(text).splitlines(), start=1):
        directive = line.strip()
        m = re.match(r"#\s*(ifdef|ifndef)\s+(\w+)", directive)
        if m:
            cond = (m.group(2) in defined) == (m.group(1) == "ifdef")
            stack.append((active, cond))
            active = active and cond
            continue
        if re.match(r"#\s*else\b", directive):
            parent, cond = stack[-1]
            stack[-1] = (parent, not cond)
            active = parent and not cond
            continue
        if re.match(r"#\s*endif\b", directive):
            active = stack.pop()[0]
            continue
        if active and not directive.startswith("#"):
            out.append((number, line))
    assert not stack, "unbalanced #if in the model"
    return out


def mtype_names(text: str, kind: str) -> list[str]:
    m = re.search(r"mtype\s*:\s*%s\s*=\s*\{([^}]*)\}" % kind, strip_comments(text))
    assert m, f"no mtype:{kind} in the model"
    return [name.strip() for name in m.group(1).split(",") if name.strip()]


ADVANCE = re.compile(
    r"\badvance\(\s*((?:[^,()\[\]]|\[[^\]]*\])+?)\s*,\s*(\w+)\s*,\s*(\w+)\s*,\s*(\w+)\s*\)")


@dataclass(frozen=True)
class Advance:
    line: int
    var: str     # e.g. "ps[r]"
    frm: str
    event: str
    to: str

    @property
    def node(self) -> str:
        return {"ps": "prefill", "ds": "decode"}.get(self.var.split("[")[0], self.var)


def advances(text: str, defined: frozenset[str] = frozenset()) -> list[Advance]:
    return [Advance(number, *m.groups())
            for number, line in preprocess(text, defined)
            for m in ADVANCE.finditer(line)]


def reached_markers(text: str, defined: frozenset[str] = frozenset()) -> dict[str, int]:
    return {m.group(1): number
            for number, line in preprocess(text, defined)
            for m in re.finditer(r"\bREACHED\((\w+)\)", line)}


# ------------------------------------------------------------------ spin

@dataclass
class PanResult:
    output: str
    returncode: int

    def number(self, pattern: str) -> float:
        m = re.search(pattern, self.output)
        assert m, f"{pattern!r} not in pan output:\n{self.output[-3000:]}"
        return float(m.group(1))

    @property
    def errors(self) -> int:
        return int(self.number(r"errors:\s*(\d+)"))

    @property
    def states(self) -> int:
        return int(self.number(r"([\d.e+]+) states, stored"))

    @property
    def transitions(self) -> int:
        return int(self.number(r"([\d.e+]+) transitions"))

    @property
    def depth(self) -> int:
        return int(self.number(r"depth reached (\d+)"))

    @property
    def seconds(self) -> float:
        return self.number(r"pan: elapsed time ([\d.e+]+) seconds")

    def summary(self) -> str:
        return (f"{self.states} states stored, {self.transitions} transitions, "
                f"depth {self.depth}, {self.seconds:g} s, errors {self.errors}")


def copy_spec(dest: Path) -> Path:
    """Copy spec/ into dest (spin and gcc write their files next to the model)."""
    target = dest / "spec"
    shutil.copytree(SPEC, target, ignore=shutil.ignore_patterns("*.trail", "pan*", "_spin_nvr.tmp"))
    return target


_live: set[subprocess.Popen] = set()    # every spin, gcc and pan running now (kill_all)
_live_lock = threading.Lock()


def run(cmd: list[str], cwd: Path, timeout: float, nice: int = 0) -> subprocess.CompletedProcess[str]:
    """cmd's output; `nice` > 0 runs it at that lower CPU priority."""
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=(lambda: os.nice(nice)) if nice else None)
    with _live_lock:
        _live.add(p)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        p.kill()
        p.communicate()
        raise
    finally:
        with _live_lock:
            _live.discard(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def kill_all() -> None:
    """Stop every tool still running (the session ends, maybe interrupted)."""
    with _live_lock:
        for p in _live:
            try:
                p.kill()
            except OSError:
                pass   # it ended meanwhile


def build_pan(model: Path, spin_defines: Sequence[str] = (), cc_flags: Sequence[str] = ("-DSAFETY",),
              opt: str = "-O2", nice: int = 0) -> Path:
    """spin -a, then gcc, in the model's own directory. Returns the pan binary."""
    cwd = model.parent
    gen = run(["spin", *spin_defines, "-a", model.name], cwd, 300, nice)
    assert gen.returncode == 0 and (cwd / "pan.c").exists(), \
        f"spin -a failed:\n{gen.stdout}\n{gen.stderr}"
    cc = run(["gcc", opt, "-w", *cc_flags, "-o", "pan", "pan.c"], cwd, 300, nice)
    assert cc.returncode == 0, f"gcc failed:\n{cc.stderr[-3000:]}"
    return cwd / "pan"


def run_pan(pan: Path, args: Sequence[str], timeout: float = 600, nice: int = 0) -> PanResult:
    proc = run([str(pan), *args], pan.parent, timeout, nice)
    return PanResult(proc.stdout + proc.stderr, proc.returncode)


@dataclass(frozen=True)
class PanJob:
    """One model check: which model (relative to spec/), how to build pan, how to run it."""
    model: str
    spin_defines: tuple[str, ...] = ()
    cc_flags: tuple[str, ...] = ("-DSAFETY",)
    opt: str = "-O2"
    args: tuple[str, ...] = ()


@dataclass
class PanRun:
    model: Path          # the model file in this job's own copy of spec/ (its trail lands next to it)
    result: PanResult


def check(job: PanJob, workdir: Path, nice: int = 0, timeout: float = 600) -> PanRun:
    """Build and run one job in its own copy of spec/: spin -a writes pan.c next to the model,
    so two jobs sharing a directory would overwrite each other's pan."""
    spec = copy_spec(workdir)
    pan = build_pan(spec / job.model, job.spin_defines, job.cc_flags, job.opt, nice)
    return PanRun(spec / job.model, run_pan(pan, job.args, timeout, nice))


class Campaign:
    """Every job at once on a pool of min(cores, 4) threads (each search is single-threaded;
    memory: up to ~3 GB per exhaustive search), each in its own directory under `root` (None:
    a temporary directory, removed by stop()). `nice` > 0: at that lower CPU priority, with a
    longer time limit (see tests/spec/conftest.py)."""

    def __init__(self, jobs: dict[str, PanJob], root: Path | None = None, nice: int = 0):
        self.own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kvfence-spin-")) if root is None else root
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, 4)))
        timeout = 600 if not nice else 3600   # starved by the tests that run meanwhile
        self.futures: dict[str, Future[PanRun]] = {}
        for name, job in jobs.items():
            workdir = self.root / name.replace(" ", "_")
            workdir.mkdir(parents=True)
            self.futures[name] = self.pool.submit(check, job, workdir, nice, timeout)

    def __getitem__(self, name: str) -> Future[PanRun]:
        return self.futures[name]

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        kill_all()
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)


_background: list[Campaign] = []


def start_in_background() -> None:
    """Start JOBS at the lowest CPU priority (tests/spec/conftest.py, as the session begins)."""
    if not _background:
        _background.append(Campaign(JOBS, nice=19))


def background() -> Campaign | None:
    return _background[0] if _background else None


def stop_background() -> None:
    while _background:
        _background.pop().stop()


# The campaign tests/spec/test_handoff_model.py reads: three exhaustive searches, one per mutant.
# -m: search depth bound (the model needs < 100); -w: hash table of 2^24 slots
PAN_ARGS = ("-m10000", "-w24")
# The exhaustive searches store ~6-10 million states: NOCOMP skips pan's byte-mask
# compression of each state (~20% faster, ~30% more memory: under 3 GB each). Bound
# checks stay on: an index out of range in the model is an error, not a silent overwrite.
EXHAUSTIVE = ("-DNOCOMP",)

JOBS: dict[str, PanJob] = {
    "adversary": PanJob("adversary.pml", ("-DCOVERAGE",), ("-DSAFETY", *EXHAUSTIVE), args=PAN_ARGS),
    # no progress label, so any cycle counts; COVERAGE probes compiled in (pan refuses NOCOMP with -l)
    "liveness": PanJob("handoff.pml", ("-DCOVERAGE",), ("-DNP",), args=("-l", *PAN_ARGS)),
    "clean": PanJob("handoff.pml", (), ("-DSAFETY", *EXHAUSTIVE), args=PAN_ARGS),
    # a mutant's search stops at its first error: compile time matters more than search speed
    **{f"mutant {key}": PanJob(f"mutants/{name}", (), ("-DSAFETY",), "-O1", PAN_ARGS)
       for key, (name, _) in sorted(MUTANTS.items())},
}

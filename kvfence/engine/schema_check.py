"""A client's JSON schema compiled once in a separate process, under a deadline, before any
engine sees it.

Compiling a schema costs llguidance anywhere from microseconds to hours, and nothing short of
compiling tells which: `{"type": "integer", "multipleOf": 999983}` (30 bytes) took 5.6 s to
build its matcher, one of 9999991 took 140 s, and 20 `pattern`s under one `allOf` took 22 s to
validate. None of llguidance's limits bound that work, and a thread that runs it cannot be
stopped. The engine builds the matcher on its own thread, between forward passes: one such
schema stopped every tenant's generation for as long as it took.

So the server sends each schema to `SchemaChecker`'s worker process first. The worker
validates it, builds the matcher and computes its first token mask, exactly what the engine
will do; past `deadline_s` the worker is killed (and started again for the next schema) and
the request gets a 400. A schema that passes is built again in the server's thread
(grammar.build_matcher, at most about the deadline) and handed to the engine with the request:
the engine thread compiles nothing (a PD decode node builds it in its own thread: pd/node.py).

The worker is a plain child process (this file, run by python) speaking JSON
lines on its stdin and stdout; multiprocessing's spawn would import the server's main module
again. One worker, one schema at a time: schemas wait for each other, never for more than the
deadline each, and the worker takes at most one core from the forward pass.
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfence.model.tokenizer import KvTokenizer

log = logging.getLogger("kvfence.schema_check")

DEADLINE_S = 1.0      # the largest schemas of the test suite's tools compile in ~30 ms
START_TIMEOUT_S = 120.0
WORKER_MEMORY_BYTES = 4 << 30   # address space; the worker itself uses ~0.3 GiB of it


class SchemaTooCostly(ValueError):
    """The schema's compilation ran past the deadline (the client's 400)."""


def _worker() -> None:
    """The worker process: one llguidance tokenizer, then a grammar in, a verdict out, until EOF.
    It imports llguidance alone (kvfence would bring torch: a second more at each restart)."""
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    _die_with_parent()
    _cap_memory()
    # answers go out on a copy of stdout; stdout itself goes to stderr, so that nothing else
    # printed (a library's warning) can be read as an answer to the wrong schema
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    setup = json.loads(sys.stdin.readline())
    ll = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"])
    _say(answers, "ready")
    for line in sys.stdin:
        grammar = json.loads(line)
        err = llguidance.LLMatcher.validate_grammar(grammar, ll) or None   # check_schema's verdict
        if err is None:   # what the engine does next: build the matcher, then its first mask
            matcher = llguidance.LLMatcher(ll, grammar, log_level=0,   # grammar.py's limits
                                           limits=llguidance.LLParserLimits(verbose_errors=False))
            if not matcher.is_error():
                fill_next_token_bitmask(matcher, allocate_token_bitmask(1, ll.vocab_size), 0)
            if matcher.is_error():
                err = matcher.get_error()
        _say(answers, err)


def _die_with_parent() -> None:
    """Linux: killed when the server is (a server killed mid-compile would leave it compiling
    for hours). Elsewhere it ends at its next read, when the pipe is closed."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 9)   # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _cap_memory() -> None:
    """A schema may ask for memory as well as time: past this the worker dies (the caller's
    verdict then says so). Where the limit cannot be set, time alone bounds it."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass


def _say(answers, value: str | None) -> None:
    answers.write(json.dumps(value) + "\n")
    answers.flush()


class SchemaChecker:
    """`check(schema_json)`: llguidance's message for a schema it cannot compile, None when it
    compiles, SchemaTooCostly past the deadline. Thread-safe; the worker starts on first use."""

    def __init__(self, tok: KvTokenizer, n_vocab: int | None = None, deadline_s: float = DEADLINE_S):
        from kvfence.engine.grammar import ll_tokenizer_args

        self.deadline_s = deadline_s
        text, n, eos = ll_tokenizer_args(tok, n_vocab)   # as the server's and the engine's own
        self._setup = json.dumps({"tokenizer": text, "n_vocab": n, "eos": eos}) + "\n"
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._closed = False
        self.killed = 0     # schemas that ran past the deadline (for the tests and the log)

    def check(self, schema_json: str, deadline_s: float | None = None) -> str | None:
        """`deadline_s`: this call's own, when shorter than the checker's."""
        from kvfence.engine.grammar import GrammarError, grammar_for

        deadline = self.deadline_s if deadline_s is None else min(self.deadline_s, deadline_s)
        if deadline <= 0:
            raise SchemaTooCostly("no time was left to compile it")

        try:
            grammar = grammar_for(schema_json)
        except GrammarError as e:
            return str(e)
        with self._lock:
            proc = self._ready()
            began = time.monotonic()
            try:
                self._send(proc, json.dumps(grammar) + "\n")
                line = self._read_line(proc, began + deadline)
                if line is not None:
                    verdict = json.loads(line)
                    if verdict is None or isinstance(verdict, str):
                        return verdict
            except (OSError, ValueError):   # the worker died on it, or said something else
                pass
            died = proc.poll() is not None   # by itself (e.g. past its memory), not by our kill
            self._stop()
            self.killed += 1
            log.warning("a schema's compilation %s; refused", "ended its worker process" if died else
                        f"ran past {deadline:.1f} s (stopped after {time.monotonic() - began:.1f} s)")
            if died:
                raise SchemaTooCostly("compiling it ended the compiler's process (e.g. more memory than "
                                      f"{WORKER_MEMORY_BYTES >> 30} GiB); simplify the schema")
            raise SchemaTooCostly(f"compiling it takes longer than {deadline:.3g} s (e.g. a large "
                                  "multipleOf, or many patterns under one allOf); simplify the schema")

    def _ready(self) -> subprocess.Popen[bytes]:
        if self._closed:
            raise RuntimeError("the schema checker is closed (the server is stopping)")
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        # run as a file, -P: its folder (kvfence/engine: config.py, ...) must not shadow any module
        # its own session: a Ctrl+C to the server's process group would kill it mid-check while
        # the server shuts down gracefully (the server's death still ends it: _die_with_parent)
        proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=None, close_fds=True, start_new_session=True)
        self._proc = proc
        try:
            self._send(proc, self._setup)
            started = self._read_line(proc, time.monotonic() + START_TIMEOUT_S) == b'"ready"'
        except OSError:
            started = False
        if not started:
            self._stop()
            raise RuntimeError("the schema-check worker did not start")
        return proc

    @staticmethod
    def _send(proc: subprocess.Popen[bytes], text: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(text.encode())
        proc.stdin.flush()

    def _read_line(self, proc: subprocess.Popen[bytes], until: float) -> bytes | None:
        """One line from the worker, or None at `until` or if it ended first."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = until - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc, self._buffer = None, b""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()


if __name__ == "__main__":
    _worker()

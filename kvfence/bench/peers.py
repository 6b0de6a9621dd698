"""Other inference engines run on the `kvfence bench` workload, for comparison.

llama.cpp (through llama-cpp-python's low-level API) is imported only inside the functions, so
kvfence works without it: `pip install llama-cpp-python` (it builds llama.cpp from source; set
CMAKE_ARGS="-DGGML_NATIVE=ON" to use this CPU's instruction set). vLLM runs in its own virtual
environment (see vllm_peer.py). Both are optional: `kvfence bench` says which it skipped and why.
"""
from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import tempfile
import time
from pathlib import Path


def bf16_gguf(src: str, cache_dir: str | None = None) -> str:
    """A BF16 copy of a quantized GGUF, made once and cached by source path.

    kvfence dequantizes GGUF weights to bf16, so llama.cpp on BF16 weights is the like-for-like
    comparison. llama.cpp's own quantizer does the conversion (dequantize, then round to bf16);
    `allow_requantize` is what lets it start from an already quantized file."""
    import llama_cpp

    src_p = Path(src).resolve()
    cache = Path(cache_dir or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvfence" / "peers"
    out = cache / f"{src_p.stem}.{hashlib.sha1(str(src_p).encode()).hexdigest()[:8]}.BF16.gguf"
    if out.exists() and out.stat().st_mtime >= src_p.stat().st_mtime:
        return str(out)
    cache.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
    params.allow_requantize = True
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src_p).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not convert {src_p} to BF16")
    tmp.replace(out)  # only a complete file ever has the cached name
    return str(out)


_log_sink = None


def _quiet_llama_log(L) -> None:
    """llama.cpp logs every tensor and buffer to stderr; the bench's rows are what matter."""
    global _log_sink
    if _log_sink is None:
        _log_sink = L.llama_log_callback(lambda level, text, data: None)  # kept: C holds the pointer
        L.llama_log_set(_log_sink, None)


def run_llama_cpp(gguf_path: str, prompts: list[list[int]], output_tokens: int, threads: int,
                  flash_attn: bool = True, extra_bufts: bool = True) -> dict:
    """All prompts submitted at once to one llama.cpp context, greedy, exactly `output_tokens` each.

    Prompts are prefilled packed into n_batch-sized llama_decode calls (several sequences per
    call, the way llama-server batches), then every sequence decodes together, one token per
    step. Greedy is an argmax over the logits, so the result does not depend on a sampler.
    Returns seconds from submission to the last token, the output token count, per-request
    first-token and token times (seconds since submission) and the generated ids."""
    import llama_cpp as L
    import numpy as np

    n_seq, plen = len(prompts), max(len(p) for p in prompts)
    _quiet_llama_log(L)
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    # extra_bufts False: no repacked or AMX weight buffers. Needed for Q4_0/Q4_1/Q8_0 files on a
    # CPU that reports AMX it cannot run (a general protection fault in ggml_backend_amx_mul_mat)
    mparams.use_extra_bufts = extra_bufts
    model = L.llama_model_load_from_file(gguf_path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    cp = L.llama_context_default_params()
    cp.n_seq_max = n_seq
    # per-sequence KV streams (kv_unified off, the default): n_ctx is split evenly among the
    # sequences, and each attends only over its own stream, not over all 32 prompts' cells
    cp.n_ctx = n_seq * (plen + output_tokens)
    cp.n_batch, cp.n_ubatch = 2048, 512
    cp.n_threads = cp.n_threads_batch = threads
    # flash attention: measured faster here on CPU too (prefill ~25% with 2 threads), so on
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create the context")
    n_batch = L.llama_n_batch(ctx)
    batch = L.llama_batch_init(max(n_batch, n_seq), 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of (token, pos, seq, wants_logits); the argmax of each logits row."""
        for i, (tok, pos, seq, out) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, out
        batch.n_tokens = len(entries)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")
        n_out = sum(e[3] for e in entries)
        # logits rows are stored in batch order for the entries that asked for them
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_out * n_vocab,))
        return logits.reshape(n_out, n_vocab).argmax(axis=1)

    try:
        # warm-up outside the timing (thread pool, buffers), as kvfence's run does; then forget it
        decode([(200, i, 0, i == 19) for i in range(20)])
        L.llama_memory_clear(L.llama_get_memory(ctx), True)

        start = time.perf_counter()
        outputs: list[list[int]] = [[] for _ in prompts]
        times: list[list[float]] = [[] for _ in prompts]
        # prefill: pack whole prompts, plus the next prompt's head, into each n_batch call
        # (a prompt split across calls gets its logits from the call holding its last token)
        flat = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for lo in range(0, len(flat), n_batch):
            chunk = flat[lo:lo + n_batch]
            firsts = decode(chunk)
            now = time.perf_counter() - start
            for s, tok in zip([e[2] for e in chunk if e[3]], firsts):
                outputs[s].append(int(tok))
                times[s].append(now)
        # decode: every sequence together, one token each per step
        for _ in range(output_tokens - 1):
            nexts = decode([(out[-1], len(p) + len(out) - 1, s, True)
                            for s, (p, out) in enumerate(zip(prompts, outputs))])
            now = time.perf_counter() - start
            for s, tok in enumerate(nexts):
                outputs[s].append(int(tok))
                times[s].append(now)
        seconds = time.perf_counter() - start
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return {"seconds": seconds, "output_tokens": sum(map(len, outputs)),
            "prompt_tokens": sum(map(len, prompts)), "first_token_times": [t[0] for t in times],
            "token_times": times, "outputs": outputs,
            "settings": f"n_ctx={cp.n_ctx} n_batch={cp.n_batch} n_ubatch={cp.n_ubatch} n_seq_max={n_seq} "
                        f"threads={threads} flash_attn={'on' if flash_attn else 'off'} kv=f16 kv_unified=off"}


def llama_cpp_result(name: str, r: dict):
    """A `run_llama_cpp` answer as a row of `kvfence bench` (kvfence.bench.offline.Result)."""
    from kvfence.bench.offline import Result
    from kvfence.bench.stats import percentiles

    itl = [b - a for t in r["token_times"] for a, b in zip(t, t[1:])]
    return Result(name, r["seconds"], r["output_tokens"], r["output_tokens"] + r["prompt_tokens"],
                  percentiles(r["first_token_times"]), percentiles(itl), note=r["settings"])


class VllmPeer:
    """vLLM in its own interpreter (kvfence/bench/vllm_peer.py), started once and kept stopped
    (SIGSTOP) between its rounds: its OpenMP threads are bound to the cores and spin, and must
    not slow kvfence's rounds in between.

    LD_PRELOAD gets tcmalloc and the venv's Intel OpenMP where both exist, as vLLM's CPU guide
    asks (measured here: 9.7 s with them, 11.2 s without)."""

    def __init__(self, python: str, model_dir: str, prompts: list[list[int]], output_tokens: int, threads: int,
                 timeout: float = 1800.0):
        env = dict(os.environ)
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                               str(Path(python).absolute().parent.parent / "lib" / "libiomp5.so")) if Path(p).exists()]
        if len(preload) == 2 and "LD_PRELOAD" not in env:
            env["LD_PRELOAD"] = ":".join(preload)
        env.pop("OMP_NUM_THREADS", None)  # vLLM sets its own from the bind list
        self.timeout = timeout
        self.log = tempfile.TemporaryFile(mode="w+b")  # its chatter; a pipe could fill and block it
        self.proc = subprocess.Popen([python, str(Path(__file__).with_name("vllm_peer.py"))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     start_new_session=True)  # its own group: stopped and resumed as one
        self._pending = b""
        self._send(json.dumps({"model": model_dir, "prompts": prompts, "output_tokens": output_tokens,
                               "threads": threads}))
        hello = self._answer()
        self.settings = hello["settings"]
        self._signal("SIGSTOP")

    def round(self) -> dict:
        """One timed run of the workload: {"seconds", "output_tokens", "prompt_tokens"}."""
        self._signal("SIGCONT")
        try:
            self._send("run")
            return self._answer()
        finally:
            self._signal("SIGSTOP")

    def close(self) -> None:
        if self.proc.poll() is None:
            self._signal("SIGCONT")
            try:
                self._send("quit")
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._signal("SIGKILL")
                self.proc.wait()
        self.log.close()

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def _answer(self) -> dict:
        deadline, fd = time.monotonic() + self.timeout, self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            while b"\n" in self._pending:  # whole lines first; vLLM may print its own on stdout
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(b"{"):
                    return json.loads(line)
            ready, _, _ = select.select([fd], [], [], 5.0)
            if not ready:
                if self.proc.poll() is not None:
                    break
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            self._pending += chunk
        self.log.seek(0)
        tail = self.log.read()[-1500:].decode(errors="replace")
        raise RuntimeError(f"vLLM peer gave no answer (exit {self.proc.poll()}): {tail}")

    def _signal(self, name: str) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, getattr(signal, name))
            except ProcessLookupError:
                pass
            if name == "SIGSTOP":  # delivery is asynchronous: return once the whole group has stopped
                self._wait_stopped()

    def _wait_stopped(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(state not in "Tt" for state in self._group_states()):
            time.sleep(0.001)

    def _group_states(self) -> list[str]:
        """The scheduler state letter of every process in the peer's group (Linux /proc)."""
        states = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:  # gone meanwhile
                    continue
                if int(fields[2]) == self.proc.pid:  # fields: state, ppid, pgrp, ...
                    states.append(fields[0])
        return states

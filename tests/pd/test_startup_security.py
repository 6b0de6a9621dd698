"""PD processes refuse insecure configurations at start-up, before loading anything, and say
how to fix them (I11): no cluster secret, or internal HTTP in the clear off loopback."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from pd_cluster import ROOT

from kvfence.pd.seal import SECRET_ENV, SECRET_FILE_ENV

SECRET = "s" * 64


def serve(*args: str, secret: str | None = SECRET) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    if secret is not None:
        env[SECRET_ENV] = secret
    return subprocess.run([sys.executable, "-m", "kvfence.cli", "serve", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfence.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_pd_roles_refuse_to_start_without_the_cluster_secret(role):
    extra = ["--prefill-url", "http://127.0.0.1:1", "--decode-url", "http://127.0.0.1:2"] if role == "router" else []
    r = serve("--role", role, *extra, secret=None)
    assert r.returncode == 2 and "needs the cluster secret" in r.stderr and "--cluster-secret-file" in r.stderr


def test_a_short_secret_is_refused():
    r = serve("--role", "prefill", secret="too short")
    assert r.returncode == 2 and "at least 32" in r.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_refuses_to_listen_off_loopback_without_tls(role):
    r = serve("--role", role, "--host", "0.0.0.0")
    assert r.returncode == 2 and "in the clear on 0.0.0.0" in r.stderr and "--tls-cert" in r.stderr, r.stderr


def test_the_router_refuses_plain_http_to_a_node_off_loopback():
    r = serve("--role", "router", "--prefill-url", "http://192.0.2.1:8001", "--decode-url", "http://127.0.0.1:2")
    assert r.returncode == 2 and "over plain HTTP off loopback" in r.stderr and "https://" in r.stderr, r.stderr


def test_cert_without_key_is_refused():
    r = serve("--role", "prefill", "--tls-cert", "/nonexistent.crt")
    assert r.returncode == 2 and "--tls-cert and --tls-key go together" in r.stderr


@pytest.mark.parametrize("flag", [("--tls-ca", "/x.crt"), ("--cluster-secret-file", "/x"),
                                  ("--allow-plaintext-network",), ("--prefill-url", "http://127.0.0.1:1"),
                                  # found in review: the PD tuning flags were still silently ignored
                                  ("--lease", "10"), ("--transfer-buffer-pages", "8"), ("--clock-skew", "2"),
                                  ("--node-wait", "5"), ("--prefill-routing", "round-robin"),
                                  ("--decode-reserve-tokens", "64")])
def test_a_single_node_refuses_flags_of_the_pd_plane_instead_of_ignoring_them(flag):
    r = serve("--role", "single", *flag)
    assert r.returncode == 2 and flag[0] in r.stderr and "--role single does not read" in r.stderr, r.stderr


@pytest.mark.parametrize("role,flag", [("router", ("--kv-cache-memory", "4GiB")), ("router", ("--threads", "4")),
                                       ("router", ("--dtype", "float32")), ("router", ("--lease", "10")),
                                       ("router", ("--transfer-host", "10.0.0.2")),
                                       ("prefill", ("--node-stall", "3")), ("decode", ("--served-model-name", "m")),
                                       ("decode", ("--max-body-bytes", "100")),
                                       ("prefill", ("--prefill-url", "http://127.0.0.1:1"))])
def test_a_pd_role_refuses_flags_it_would_ignore(role, flag, capsys):
    """Found in the fleet probe: --kv-cache-memory on the router (where an operator sizing a
    cluster may put it) started a router and changed nothing; the nodes kept their default
    pool. Refused before anything starts, naming the flag and whose it is."""
    from kvfence import cli as kvcli

    extra = ["--prefill-url", "http://127.0.0.1:1", "--decode-url", "http://127.0.0.1:2"] if role == "router" else []
    assert kvcli.main(["serve", "--role", role, *extra, *flag]) == 2
    err = capsys.readouterr().err
    assert f"--role {role} does not read {flag[0]}" in err, err


@pytest.mark.parametrize("role,flag", [("router", ("--max-model-len", "1024")), ("router", ("--clamp-context",)),
                                       ("router", ("--model", "/nonexistent")), ("prefill", ("--lease", "10")),
                                       ("decode", ("--kv-cache-memory", "8MiB"))])
def test_what_a_role_reads_is_not_refused_as_ignored(role, flag):
    from kvfence import cli as kvcli

    a = kvcli.build_parser().parse_args(["serve", "--role", role, *flag])
    assert kvcli.ignored_flags(a) == []


def test_a_single_node_serves_https_with_tls_cert_and_key(tmp_path):
    import ssl

    import httpx
    from certs import make_pki
    from pd_cluster import free_port

    pki = make_pki(tmp_path, ["127.0.0.1"])
    bad = serve("--role", "single", "--tls-cert", pki["server_cert"], "--tls-key", pki["client_key"])
    assert bad.returncode == 2 and "cannot use --tls-cert" in bad.stderr, bad.stderr   # refused before the model
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvfence.cli", "serve", "--port", str(port), "--threads", "1",
                             "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                             "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--clamp-context"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ctx = ssl.create_default_context(cafile=pki["ca"])
        for _ in range(240):
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/health", verify=ctx, timeout=5)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.5)
        r = httpx.post(f"https://127.0.0.1:{port}/v1/completions", verify=ctx, timeout=60,
                       json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        with pytest.raises(httpx.TransportError):      # no plain HTTP on that port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        # the commands that reach a server by --url verify it against a private CA with --tls-ca
        url = f"https://127.0.0.1:{port}"
        ok = cli("isolation", "--url", url, "--tls-ca", pki["ca"])
        assert ok.returncode == 0 and '"invariants"' in ok.stdout, ok.stderr
        for ca in ([], ["--tls-ca", pki["other_ca"]]):      # the system's CAs, or another CA: refused
            no = cli("isolation", "--url", url, *ca)
            assert no.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in no.stderr and "--tls-ca" in no.stderr
        load = cli("bench", "--url", url, "--tls-ca", pki["ca"], "--num-requests", "2", "--output-tokens", "2")
        assert load.returncode == 0 and "2 ok, errors none" in load.stdout, load.stdout + load.stderr
    finally:
        proc.terminate()
        proc.wait(30)


def test_every_flag_of_the_pd_plane_is_one_a_single_node_refuses():
    # a PD flag added later must not be silently ignored by --role single either
    import argparse

    from kvfence.cli import PD_ONLY_FLAGS, _pd_args

    p = argparse.ArgumentParser()
    _pd_args(p)
    assert {a.dest for a in p._actions if a.dest != "help"} <= set(PD_ONLY_FLAGS)

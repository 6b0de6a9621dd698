"""A node URL whose host is a name means every address behind it (kvfence/pd/addresses.py):
the expansion, the fleet following the name as it changes, and TLS to an address verified
against the name (SNI), with a real TLS server."""
from __future__ import annotations

import http.server
import ssl
import threading

import httpx
import pytest
from certs import make_pki

from kvfence.pd.addresses import NodeAddress, expand
from kvfence.pd.fleet import Fleet
from kvfence.pd.messages import NodeInfo


def table(entries: dict[str, list[str]]):
    def resolve(host: str, port: int) -> list[str]:
        if host not in entries:
            raise OSError(f"{host}: name does not resolve")
        return list(entries[host])
    return resolve


def test_a_name_expands_to_every_address_and_an_ip_url_stays_as_given():
    dns = table({"prefill.svc": ["10.0.0.7", "10.0.0.5", "10.0.0.7", "fd00::3"]})
    got = expand("https://prefill.svc:8001", dns)
    assert [a.url for a in got] == ["https://10.0.0.5:8001", "https://10.0.0.7:8001", "https://[fd00::3]:8001"]
    assert {a.host for a in got} == {"prefill.svc"} and {a.configured for a in got} == {"https://prefill.svc:8001"}
    assert expand("http://10.1.2.3:9000", dns) == [NodeAddress("http://10.1.2.3:9000", "http://10.1.2.3:9000")]
    assert expand("http://gone.svc:80", dns) is None
    assert expand("http://prefill.svc", dns)[0].url == "http://10.0.0.5:80"


def test_request_options_name_the_host():
    a = expand("https://prefill.svc:8001", table({"prefill.svc": ["10.0.0.5"]}))[0]
    opts = a.http_options(headers={"content-type": "application/json"}, content=b"{}")
    assert opts["extensions"] == {"sni_hostname": "prefill.svc"}
    assert opts["headers"] == {"content-type": "application/json", "host": "prefill.svc:8001"}
    assert opts["content"] == b"{}"
    plain = expand("http://prefill.svc:8001", table({"prefill.svc": ["10.0.0.5"]}))[0]
    assert "extensions" not in plain.http_options()        # no TLS, no server name
    assert NodeAddress("http://10.0.0.5:1", "http://10.0.0.5:1").http_options(timeout=3) == {"timeout": 3}


def _info() -> NodeInfo:
    return NodeInfo.from_json(dict(
        model_name="m", model_path="/m", default_served_name="m", fingerprint="fp", dtype="float32", device="cpu",
        page_size=16, pool_pages=90, pool_tokens=1440, pool_bytes=1, model_max_context=8192,
        configured_max_model_len=1024, usable_context=1024, context_clamped=False, context_note="", scrub="zero",
        read_checks=True, max_num_seqs=8, max_num_batched_tokens=512, vocab_size=49152, prefix_cache=True,
        pd=dict(role="prefill", boot_id="b", transfer_session="127.0.0.1:1", buffer_base=0, kv_layout="L",
                slot_bytes=1, buffer_rows=90, lease_s=4.0, max_pull_s=3.0, clock_skew_s=0.5)))


def test_the_fleet_follows_a_name_as_pods_come_and_go():
    url = "https://prefill.svc:8001"
    dns = {"prefill.svc": ["10.0.0.5"]}
    f = Fleet({"prefill": expand(url, table(dns)), "decode": ["http://10.9.9.9:1"]}, 1024, _info())
    f.observe(f.nodes[0], _info())
    assert [n.state for n in f.nodes] == ["ready", "checking"]
    dns["prefill.svc"] = ["10.0.0.5", "10.0.0.6"]             # a pod appeared
    added, removed = f.sync("prefill", url, expand(url, table(dns)))
    assert [n.url for n in added] == ["https://10.0.0.6:8001"] and not removed
    assert added[0].state == "checking" and added[0] not in f.serving("prefill")   # checked before it serves
    assert f.sync("prefill", url, expand(url, table(dns))) == ([], [])              # nothing changed
    dns["prefill.svc"] = ["10.0.0.6"]                         # the first one went away
    added, removed = f.sync("prefill", url, expand(url, table(dns)))
    assert not added and [n.url for n in removed] == ["https://10.0.0.5:8001"]
    assert [n.url for n in f.nodes if n.role == "prefill"] == ["https://10.0.0.6:8001"]
    assert f.to_json()[-1]["configured_url"] == url and f.to_json()[-1]["host"] == "prefill.svc"


@pytest.fixture
def tls_server(tmp_path):
    """A real HTTPS server on 127.0.0.1 whose certificate names only node.kvfence.test."""
    pki = make_pki(tmp_path, [], ("node.kvfence.test",))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki["server_cert"], pki["server_key"])

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = self.headers.get("host", "").encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Hello)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], pki
    srv.shutdown()
    srv.server_close()


def test_tls_to_an_address_is_verified_against_the_name(tls_server):
    port, pki = tls_server
    a = expand(f"https://node.kvfence.test:{port}", table({"node.kvfence.test": ["127.0.0.1"]}))[0]
    assert a.url == f"https://127.0.0.1:{port}"
    verify = ssl.create_default_context(cafile=pki["ca"])
    with httpx.Client(verify=verify, timeout=5) as c:
        r = c.get(a.url + "/", **a.http_options())
        assert r.status_code == 200 and r.text == f"node.kvfence.test:{port}"
        with pytest.raises(httpx.ConnectError, match="(?i)certificate"):   # by address alone: the name is not checked
            c.get(a.url + "/")

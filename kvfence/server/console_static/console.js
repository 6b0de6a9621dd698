// kvfence operator console: reads /v1/kvfence/console every REFRESH_MS and rebuilds the page.
// Everything shown goes through textContent (never innerHTML): tenant names and incident
// details cannot become markup. Colours per tenant are a hash of the name, so they stay put.
"use strict";

const REFRESH_MS = 2000;
const MAX_CELLS = 2048;
let previous = null;   // the last answer's request counters and time, for rates
let renders = 0;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.dataset[k.slice(5).replace(/-([a-z])/g, (_, c) => c.toUpperCase())] = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function hue(name) {   // FNV-1a, then murmur3's finaliser: similar names land far apart
  let h = 0x811c9dc5;
  for (let i = 0; i < name.length; i++) {
    h ^= name.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  h ^= h >>> 16; h = Math.imul(h, 0x85ebca6b) >>> 0;
  h ^= h >>> 13; h = Math.imul(h, 0xc2b2ae35) >>> 0;
  h ^= h >>> 16;
  return (h >>> 0) % 360;
}

const FIXED = {free: "#e3e6ea", quarantined: "#7a1020", fenced: "#e08a00", unknown: "#9aa0a6"};

function colour(kind, name) {
  if (kind === "owned") return `hsl(${hue(name)}, 62%, 44%)`;
  if (kind === "shared") return `hsl(${hue(name)}, 62%, 76%)`;   // a tenant's own cache: its hue, lighter
  return FIXED[kind] || FIXED.unknown;
}

function badge(status) {
  return el("span", {class: "badge " + String(status).replace(/[^a-z_]/gi, "")}, status);
}

function table(headers, rows, attrs) {
  const t = el("table", attrs || {});
  // a number column's header sits over its numbers (right), not over the cell's left edge
  const numeric = (i) => rows.length > 0 && rows[0].children[i] && rows[0].children[i].classList.contains("num");
  t.append(el("thead", {}, el("tr", {}, ...headers.map((h, i) => el("th", numeric(i) ? {class: "num"} : {}, h)))));
  const body = el("tbody");
  for (const r of rows) body.append(r);
  t.append(body);
  return t;
}

function renderNodes(nodes) {
  const rows = nodes.map((n) => {
    const checks = el("ul", {class: "checks"}, ...(n.checks || []).map((c) =>
      el("li", {"data-check": c.name, "data-status": c.status}, badge(c.status), " ",
         el("b", {}, c.name), c.invariant ? ` (${c.invariant})` : "", c.detail ? ": " + c.detail : "")));
    return el("tr", {"data-node": n.name, "data-role": n.role, "data-state": n.state},
      el("td", {class: "name"}, n.name), el("td", {}, n.role), el("td", {}, badge(n.state), n.reason ? " " + n.reason : ""),
      el("td", {class: "num"}, n.running ?? "-"), el("td", {class: "num"}, n.waiting ?? "-"), el("td", {}, checks));
  });
  return table(["node", "role", "state", "running", "waiting", "checks"], rows, {class: "nodes"});
}

function poolParts(p) {
  const parts = [];
  const owned = Object.entries(p.owned).sort();
  for (const [t, n] of owned) parts.push({key: "owned:" + t, kind: "owned", label: "owned by " + t, name: t, count: n});
  const attributed = owned.reduce((a, [, n]) => a + n, 0);
  if (p.owned_total > attributed)
    parts.push({key: "owned:?", kind: "unknown", label: "owned (tenant not reported)", name: "?",
                count: p.owned_total - attributed});
  for (const [s, n] of Object.entries(p.shared).sort()) {
    const label = s.startsWith("public:") ? "shared, public scope " + s.slice(7) : "shared, " + s + "'s prefix cache";
    parts.push({key: "shared:" + s, kind: "shared", label: label, name: s, count: n});
  }
  parts.push({key: "quarantined", kind: "quarantined", label: "quarantined", name: "", count: p.quarantined});
  parts.push({key: "fenced", kind: "fenced", label: "fenced (I6: a remote party may still touch it)", name: "",
              count: p.fenced});
  parts.push({key: "free", kind: "free", label: "free", name: "", count: p.free});
  return parts;
}

function renderPool(p) {
  const parts = poolParts(p);
  const per = Math.max(1, Math.ceil(p.pages_total / MAX_CELLS));
  const size = p.pages_total <= 256 ? "large" : p.pages_total <= 1024 ? "medium" : "small";
  const grid = el("div", {class: "grid " + size, role: "img", "aria-label": `KV pool of ${p.node}`});
  for (const part of parts) {
    const cells = per === 1 ? part.count : Math.ceil(part.count / per);
    for (let i = 0; i < cells; i++) {
      const c = el("span", {class: "cell " + part.kind, title: `${part.label} (${part.count} pages)`});
      c.style.backgroundColor = colour(part.kind, part.name);
      grid.append(c);
    }
  }
  const legend = el("ul", {class: "legend"}, ...parts.map((part) => {
    const sw = el("span", {class: "swatch " + part.kind});
    sw.style.backgroundColor = colour(part.kind, part.name);
    return el("li", {"data-key": part.key, "data-count": String(part.count)}, sw, part.label + ": ",
              el("b", {class: "count"}, part.count));
  }));
  const used = p.pages_total - p.free;
  // a node the router cannot reach now: what it said last, not what it holds now
  const stale = p.node_state && p.node_state !== "ready";
  const box = el("div", {class: "pool", "data-node": p.node, "data-stale": stale ? "1" : "0"},
    el("h3", {}, p.node, el("span", {class: "sub"}, ` ${p.role} - ${p.pages_total} pages, ${used} in use` +
                                     (per > 1 ? `; one cell = ${per} pages` : "")),
       stale ? el("span", {class: "stale"}, ` ${p.node_state}: as it last reported`) : null),
    grid, legend);
  if (p.buffer) {
    const b = p.buffer;
    box.append(el("p", {class: "buffer", "data-rows": String(b.rows)}, "transfer buffer: ",
      el("b", {}, b.rows), " rows, ", el("b", {}, b.held), " held, ", el("b", {}, b.fenced), " fenced, ",
      el("b", {}, b.free), " free"));
  }
  return box;
}

function rate(now, key, group) {
  if (!previous || !previous.requests[group]) return "-";
  const dt = now.generated_at - previous.generated_at;
  const d = (now.requests[group][key] || 0) - (previous.requests[group][key] || 0);
  return dt > 0 ? (Math.max(0, d) / dt).toFixed(2) : "-";
}

function counterTable(data, group, title) {
  const entries = Object.entries(data.requests[group] || {}).sort((a, b) => b[1] - a[1]);
  const rows = entries.map(([k, v]) => el("tr", {"data-key": k, "data-total": String(v)},
    el("td", {}, k), el("td", {class: "num"}, v), el("td", {class: "num"}, rate(data, k, group))));
  return el("div", {class: "counters", "data-group": group}, el("h3", {}, title),
            rows.length ? table(["", "total", "per s"], rows) : el("p", {class: "note"}, "none yet"));
}

function seconds(v) {
  return v === null || v === undefined ? "-" : (v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`);
}

function latencyTable(data) {
  // since start, from the histograms' buckets (interpolated as Prometheus's histogram_quantile)
  const entries = Object.entries(data.requests.latency || {}).sort((a, b) => a[0].localeCompare(b[0]));
  const rows = entries.map(([tenant, r]) => el("tr", {"data-tenant": tenant, "data-ttft-p95": String(r.ttft_p95),
                                                       "data-queue-p95": String(r.queue_p95)},
    el("td", {}, tenant), el("td", {class: "num"}, r.ttft_count ?? 0),
    el("td", {class: "num"}, seconds(r.ttft_p50)), el("td", {class: "num"}, seconds(r.ttft_p95)),
    el("td", {class: "num"}, seconds(r.queue_p50)), el("td", {class: "num"}, seconds(r.queue_p95))));
  return el("div", {class: "counters", "data-group": "latency"},
            el("h3", {}, "first token and wait to run by tenant (since start)"),
            rows.length ? table(["", "answers", "TTFT p50", "TTFT p95", "wait p50", "wait p95"], rows)
                        : el("p", {class: "note"}, "none yet"));
}

function renderRequests(data) {
  return el("div", {},
            el("div", {class: "row"}, counterTable(data, "by_outcome", "requests by outcome"),
               counterTable(data, "rejections", "admission rejections by reason"),
               counterTable(data, "by_tenant", "requests by tenant"),
               // a router's: failures its clients never saw (another node took the request)
               data.role === "router" ? counterTable(data, "pd_retries", "retried on another node, by stage")
                                      : null),
            el("div", {class: "row"}, latencyTable(data)));
}

function renderIncidents(inc) {
  if (!inc.records.length)
    return el("p", {class: "note", id: "no-incidents"}, "No incident recorded by this process since it started.");
  const rows = inc.records.map((r) => el("tr", {"data-kind": r.kind, "data-request": r.request_id || ""},
    el("td", {class: "time"}, r.time), el("td", {}, el("b", {}, r.kind)), el("td", {}, r.invariant),
    el("td", {class: "mono"}, r.request_id || "-"), el("td", {}, r.tenant || "-"),
    el("td", {}, (r.involved_tenants || []).join(", ") || "-"),
    el("td", {class: "mono"}, [...(r.pages || []).map((p) => "page " + p), ...(r.rows || []).map((x) => "row " + x)]
      .join(", ") || "-"),
    el("td", {}, r.client ? `${r.client.status} ${r.client.code || ""}, ${r.client.tokens_streamed} tokens streamed`
                          : "-"),
    el("td", {class: "detail"}, r.detail || "")));
  return table(["time", "kind", "invariant", "request", "tenant", "involved", "pages/rows", "client got", "detail"],
               rows, {class: "incidents"});
}

function renderValue(v) {
  if (v === null || v === undefined) return el("span", {class: "null"}, "none");
  if (Array.isArray(v)) {
    if (!v.length) return el("span", {class: "null"}, "none");
    if (v.every((x) => typeof x !== "object" || x === null)) return el("span", {}, v.join(", "));
    return el("ol", {}, ...v.map((x) => el("li", {}, renderValue(x))));
  }
  if (typeof v === "object") {
    const dl = el("dl");
    for (const [k, x] of Object.entries(v)) dl.append(el("dt", {}, k.replace(/_/g, " ")), el("dd", {}, renderValue(x)));
    return dl;
  }
  if (typeof v === "boolean") return el("span", {class: v ? "yes" : "no"}, v ? "yes" : "no");
  return el("span", {}, String(v));
}

function renderStatement(st) {
  // the answers a customer asks first, then the whole statement (kept open across refreshes)
  const iso = st.kv_memory_isolation || {};
  const facts = [
    ["read checks before every forward pass", iso.read_checks_before_every_forward_pass],
    ["scrub policy", (iso.scrub_policy || {}).policy],
    ["tenancy", (iso.tenancy || {}).mode],
    ["advertised context", (st.capacity || {}).advertised_context_tokens],
    ["prompt text logged", (st.data_handling || {}).prompt_text_logged],
    ["fault injection active", (st.fault_injection || {}).active],
  ];
  const head = el("ul", {class: "facts"}, ...facts.map(([k, v]) => el("li", {}, k + ": ", renderValue(v))));
  const was = document.querySelector("#isolation details");
  const details = el("details", {}, el("summary", {}, "the full statement (as served at /v1/kvfence/isolation)"),
                     renderValue(st));
  details.open = !!(was && was.open);
  return el("div", {}, head, details);
}

function renderTenants(t) {
  const where = t.file ? `from ${t.file} (edit it, then SIGHUP or POST /v1/kvfence/tenants/reload)` : "not from a file";
  const out = el("p", {class: "note", id: "tenants-line"}, `Tenants: ${t.configured}, ${where}. `);
  const r = t.last_reload;
  const when = (x) => new Date(x.at * 1000).toLocaleTimeString();
  const names = (label, list) => list && list.length ? `${label} ${list.join(", ")}; ` : "";
  const good = (x, label) => `${label} ${when(x)} (${x.trigger}): ${names("added", x.added)}` +
    `${names("removed", x.removed)}${names("changed", x.changed)}${x.keys_revoked} key(s) revoked, ` +
    `${x.requests_revoked ?? "?"} request(s) in flight ended, ${x.prefix_pages_retired ?? "?"} cached page(s) retired.`;
  if (!r) {
    out.append("Not reloaded since start.");
  } else if (r.result === "ok") {
    out.append(el("span", {"data-result": "ok"}, good(r, "Last reload")));
  } else {
    out.append(el("span", {"data-result": r.result},
                  `Last reload ${when(r)} (${r.trigger}) FAILED, the previous file stays in force: ${r.error} `));
    // what the last reload that worked changed stays in view (a failed one hid it)
    const g = t.last_good_reload;
    out.append(el("span", {"data-result": "ok"}, g ? good(g, "The last that worked:") : "None has worked since start."));
  }
  return out;
}

function replace(id, node) {
  const box = document.getElementById(id);
  box.replaceChildren(node);
}

function render(data) {
  replace("nodes", renderNodes(data.nodes));
  const pools = el("div", {}, ...data.pools.map(renderPool));
  if (!data.pools.length) pools.append(el("p", {class: "note"}, "No node has reported its pool yet."));
  replace("pools", pools);
  replace("requests", renderRequests(data));
  replace("tenants", renderTenants(data.tenants));
  const inc = data.incidents;
  document.getElementById("incidents-note").textContent = inc.note +
    (inc.log ? ` This process's log: ${inc.log.path} (${inc.log.records_this_boot} records this boot; last hash ${inc.log.last_hash}).` : "");
  replace("incidents", renderIncidents(inc));
  replace("isolation", data.isolation ? renderStatement(data.isolation)
                                      : el("p", {class: "note"}, "not available: " + (data.isolation_unavailable || "")));
  renders += 1;
  document.body.dataset.renders = String(renders);
  const when = new Date(data.generated_at * 1000).toLocaleTimeString();
  document.getElementById("status").textContent =
    `${data.role}${data.served_model ? " - " + data.served_model : ""} - updated ${when}, every ${REFRESH_MS / 1000} s`;
  previous = {generated_at: data.generated_at, requests: data.requests};
}

async function refresh() {
  try {
    const r = await fetch("/v1/kvfence/console", {credentials: "same-origin", cache: "no-store"});
    if (r.status === 401) { window.location.reload(); return; }   // signed out or expired: the sign-in form
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
    document.body.classList.remove("stale");
  } catch (e) {
    document.body.classList.add("stale");
    document.getElementById("status").textContent = "refresh failed (" + e.message + "); retrying";
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();

// The flowkv controller's dashboard: polls the controller's JSON API and draws with plain DOM and SVG.
"use strict";

const COLORS = ["#2f6fdb", "#e07b00", "#1f8a4c", "#9b3fd1", "#c0392b", "#00838f"];
const POLL_MS = 2000;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value; else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function bytes(n) {
  if (n == null) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function fillBar(tier) {
  const used = tier.used_bytes, cap = tier.capacity_bytes;
  const share = used != null && cap ? Math.min(1, used / cap) : 0;
  const bar = el("div", {class: "bar", title: `${bytes(used)} of ${bytes(cap)}`},
                 el("span", {style: `width:${(share * 100).toFixed(1)}%`}), el("em", {}, (share * 100).toFixed(0) + "%"));
  return el("div", {class: "tier", "data-tier": tier.name},
            el("div", {class: "muted"}, `${tier.name} (${tier.kind}) · ${tier.chunks} chunks`), bar);
}

// The controller wants a reader token with every call: asked for once, kept for this tab only (sessionStorage
// dies with the tab; localStorage would leave it on disk for every later visitor of the page).
const TOKEN_KEY = "flowkv-controller-token";

function askForToken(why) {
  document.getElementById("token-why").textContent = why;
  document.getElementById("token-form").hidden = false;
  document.getElementById("token-input").focus();
}

document.getElementById("token-form").addEventListener("submit", event => {
  event.preventDefault();
  const input = document.getElementById("token-input");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  document.getElementById("token-form").hidden = true;
  refresh();
});

async function getJSON(path, options) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = Object.assign({}, (options && options.headers) || {});
  if (token) headers["Authorization"] = `Bearer ${token}`;
  const response = await fetch(path, Object.assign({}, options, {headers}));
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    askForToken(token ? "The controller refused that token: give a reader token." :
                        "The controller needs a reader token.");
  }
  if (!response.ok) throw new Error(`${path}: ${response.status} ${await response.text()}`);
  return response.json();
}

let knownModels = [];

function drawInstances(instances) {
  const body = document.querySelector("#instances tbody");
  body.replaceChildren(...instances.map(i => el("tr", {"data-instance": i.instance_id},
    el("td", {class: "mono"}, i.instance_id, i.url ? el("div", {class: "muted"}, i.url) : ""),
    el("td", {}, el("span", {class: `state ${i.state}`}, i.state)),
    el("td", {}, i.model),
    el("td", {}, i.pipeline),
    el("td", {class: "num"}, i.chunks),
    el("td", {}, ...i.tiers.map(fillBar)),
    el("td", {class: "num"}, `${i.last_seen_s.toFixed(1)} s ago`))));
  const up = instances.filter(i => i.state === "up").length;
  document.getElementById("summary").textContent =
    `${instances.length} instances · ${up} up · ${instances.length - up} down`;
  const models = [...new Set(instances.map(i => i.model))].sort();
  if (models.join() !== knownModels.join()) {
    knownModels = models;
    document.getElementById("lookup-model").replaceChildren(...models.map(m => el("option", {value: m}, m)));
  }
}

// Per tenant, summed over the fleet (GET /tenants).
function drawTenants(tenants) {
  const rows = Object.entries(tenants).map(([name, t]) => el("tr", {"data-tenant": name},
    el("td", {class: "mono"}, name), el("td", {class: "num"}, bytes(t.bytes)), el("td", {class: "num"}, t.entries),
    el("td", {class: "num"}, t.hits + t.misses ? (100 * t.hits / (t.hits + t.misses)).toFixed(0) + "%" : "–"),
    el("td", {class: "num"}, t.hits), el("td", {class: "num"}, t.misses), el("td", {class: "num"}, t.evictions)));
  if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 7, class: "muted"}, "no tenant has stored anything yet")));
  document.querySelector("#tenants tbody").replaceChildren(...rows);
}

function drawLatency(instances) {
  const rows = [];
  for (const i of instances) {
    const latency = (i.stats && i.stats.latency_ms) || {};
    for (const op of ["lookup", "store", "retrieve"]) {
      const p = latency[op];
      if (!p) continue;
      rows.push(el("tr", {}, el("td", {class: "mono"}, i.instance_id), el("td", {}, op),
        el("td", {class: "num"}, p.p50.toFixed(2)), el("td", {class: "num"}, p.p95.toFixed(2)),
        el("td", {class: "num"}, p.p99.toFixed(2)), el("td", {class: "num"}, p.n)));
    }
  }
  if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 6, class: "muted"}, "no stores or retrieves yet")));
  document.querySelector("#latency tbody").replaceChildren(...rows);
}

// Hit rate per heartbeat interval: lookup hit tokens / lookup requested tokens.
function drawHitRate(history) {
  const svg = document.getElementById("hitrate");
  const W = 600, H = 200, pad = 28;
  const series = [];
  let t0 = Infinity, t1 = -Infinity;
  Object.entries(history).forEach(([id, points], n) => {
    const line = [];
    for (let k = 1; k < points.length; k++) {
      const a = points[k - 1].counters, b = points[k].counters;
      const asked = (b.lookup_requested_tokens || 0) - (a.lookup_requested_tokens || 0);
      if (asked <= 0) continue;
      const hit = (b.lookup_hit_tokens || 0) - (a.lookup_hit_tokens || 0);
      line.push([points[k].t, Math.max(0, Math.min(1, hit / asked))]);
    }
    for (const [t] of line) { t0 = Math.min(t0, t); t1 = Math.max(t1, t); }
    series.push({id, line, color: COLORS[n % COLORS.length]});
  });
  const parts = [];
  for (const y of [0, 0.5, 1]) {
    const py = H - pad - y * (H - 2 * pad);
    parts.push(`<line x1="${pad}" x2="${W - 8}" y1="${py}" y2="${py}" stroke="#dde1ea"/>`,
               `<text x="2" y="${py + 4}">${(y * 100).toFixed(0)}%</text>`);
  }
  const span = Math.max(1, t1 - t0);
  for (const s of series) {
    if (!s.line.length) continue;
    const xy = s.line.map(([t, v]) =>
      `${(pad + (t - t0) / span * (W - pad - 8)).toFixed(1)},${(H - pad - v * (H - 2 * pad)).toFixed(1)}`);
    parts.push(`<polyline fill="none" stroke="${s.color}" stroke-width="2" points="${xy.join(" ")}"/>`);
    for (const point of xy) {
      const [x, y] = point.split(",");
      parts.push(`<circle cx="${x}" cy="${y}" r="2.5" fill="${s.color}"/>`);
    }
  }
  if (!series.some(s => s.line.length)) parts.push(`<text x="${W / 2 - 60}" y="${H / 2}">no lookups yet</text>`);
  svg.innerHTML = parts.join("");
  document.getElementById("hitrate-legend").replaceChildren(
    ...series.map(s => el("span", {}, el("i", {style: `background:${s.color}`}), s.id)));
}

function drawEvents(events) {
  document.querySelector("#events tbody").replaceChildren(...events.map(e => el("tr", {},
    el("td", {class: "muted"}, new Date(e.time * 1000).toLocaleTimeString()),
    el("td", {class: "mono"}, e.instance_id + (e.rank ? `:${e.rank}` : "")),
    el("td", {}, e.op), el("td", {}, e.tier), el("td", {class: "mono"}, e.chunk))));
}

async function refresh() {
  try {
    const [instances, history, events, tenants] = await Promise.all(
      [getJSON("/instances"), getJSON("/api/history"), getJSON("/api/events?limit=40"), getJSON("/tenants")]);
    drawInstances(instances);
    drawTenants(tenants);
    drawLatency(instances);
    drawHitRate(history);
    drawEvents(events);
  } catch (error) {
    document.getElementById("summary").textContent = "controller unreachable: " + error.message;
  }
}

document.getElementById("lookup-form").addEventListener("submit", async event => {
  event.preventDefault();
  const status = document.getElementById("lookup-status");
  status.textContent = "looking up…";
  try {
    const reply = await getJSON("/lookup", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({text: document.getElementById("lookup-text").value,
                            model: document.getElementById("lookup-model").value || null})});
    status.textContent = `${reply.num_tokens} tokens · ${reply.holders.length} holders`;
    const rows = reply.holders.map(h => el("tr", {"data-instance": h.instance_id},
      el("td", {class: "mono"}, h.instance_id), el("td", {}, el("span", {class: `state ${h.state}`}, h.state)),
      el("td", {class: "num"}, h.matched_tokens),
      el("td", {}, Object.entries(h.chunks_by_tier).map(([t, n]) => `${t}: ${n}`).join(", "))));
    if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 4, class: "muted"}, "no instance holds a prefix")));
    document.querySelector("#lookup-result tbody").replaceChildren(...rows);
  } catch (error) {
    status.textContent = error.message;
  }
});

refresh();
setInterval(refresh, POLL_MS);

// The tensorwire dashboard: renders each snapshot the server streams (/events, about once a second).
// Every string from a server is set as text (textContent), never as markup. No dependencies.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, String(value));
    else node[key] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let size = n, unit = 0;
  while (size >= 1024 && unit < units.length - 1) { size /= 1024; unit += 1; }
  return unit === 0 ? `${size.toFixed(0)} B` : `${size.toFixed(1)} ${units[unit]}`;
}

function rate(n) { return n === null || n === undefined ? "–" : `${bytes(n)}/s`; }
function num(n, digits = 1) { return n === null || n === undefined ? "–" : Number(n).toFixed(digits); }
function ms(n) { return n === null || n === undefined ? "–" : `${n < 10 ? n.toFixed(2) : n.toFixed(0)} ms`; }
function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

function replace(container, children) {
  container.replaceChildren(...children);
}

function renderSlots(doc) {
  const slots = doc.slots.map((slot) => {
    const replicas = slot.replicas.map((r) => {
      const cls = r.up ? (r.role === "backup" ? "dot backup" : "dot up") : "dot";
      const state = r.up ? `${r.role || "store"}${r.epoch !== null ? " @" + r.epoch : ""}` : "DOWN";
      return el("div", {class: "replica", "data-url": r.url, "data-role": r.role || "", "data-up": r.up},
        el("span", {class: cls}), el("span", {}, r.url), el("span", {class: r.up ? "" : "down"}, state),
        r.up ? (r.lag ? el("span", {class: "why muted"}, r.lag) : null) : el("span", {class: "why"}, r.error || ""));
    });
    const title = `slot ${slot.slot}` + (slot.epoch !== null ? ` · epoch ${slot.epoch}` : "");
    return el("div", {class: slot.up ? "slot" : "slot failed", "data-slot": slot.slot,
                      "data-primary": slot.primary || "", "data-epoch": slot.epoch === null ? "" : slot.epoch},
      el("h4", {}, title, " ", el("span", {class: slot.up ? "up" : "down"}, slot.up ? "serving" : "no primary")),
      ...replicas);
  });
  replace(document.getElementById("slots"), slots);
}

function renderStores(doc) {
  const rows = doc.servers.map((s) => {
    const meter = (used, capacity) => {
      const bar = el("span", {class: "meter"}, el("span"));
      bar.firstChild.style.width = `${capacity ? Math.min(100, (100 * (used || 0)) / capacity).toFixed(1) : 0}%`;
      return bar;
    };
    return el("tr", {"data-url": s.url},
      el("td", {}, s.url),
      el("td", {class: s.up ? "up" : "down"}, s.up ? (s.metrics_error ? "up (no metrics)" : "up") : "down"),
      el("td", {}, s.role ? `${s.role} @${s.epoch}` : ""),
      el("td", {}, meter(s.stored, s.capacity), `${bytes(s.stored)} / ${bytes(s.capacity)}`),
      el("td", {}, s.ps_capacity ? meter(s.ps_held, s.ps_capacity) : null,
         s.ps_capacity ? `${bytes(s.ps_held)} / ${bytes(s.ps_capacity)}` : ""),
      el("td", {}, s.tensors ?? ""), el("td", {}, s.connections ?? ""), el("td", {}, s.in_flight ?? ""),
      el("td", {class: s.up ? "wrap muted" : "wrap down"}, s.up ? (s.lag || "") : (s.error || "")));
  });
  replace(document.querySelector("#stores tbody"), rows);
}

function line(points, key, max, width, height, cls) {
  const poly = document.createElementNS(SVG, "polyline");
  const n = points.length;
  const coords = points.map((p, i) => {
    const x = n > 1 ? (i * width) / (n - 1) : width;
    const y = height - ((p[key] || 0) / max) * (height - 4) - 2;
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  });
  poly.setAttribute("points", coords.join(" "));
  poly.setAttribute("fill", "none");
  poly.setAttribute("stroke", cls === "in" ? "#58a6ff" : cls === "out" ? "#bc8cff" : "#3fb950");
  poly.setAttribute("stroke-width", "1.5");
  return poly;
}

function chart(points, keys) {
  const width = 300, height = 70;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const max = Math.max(1, ...points.flatMap((p) => keys.map((k) => p[k] || 0)));
  for (const [key, cls] of keys.map((k, i) => [k, ["in", "out", "req"][i]])) {
    svg.append(line(points, key, max, width, height, keys.length === 1 ? "req" : cls));
  }
  return svg;
}

function renderTraffic(doc) {
  const charts = doc.servers.map((s) => {
    const r = s.rates;
    const transports = Object.entries(r.by_transport || {})
      .map(([t, v]) => `${t} ↓${rate(v.in_bps)} ↑${rate(v.out_bps)}`).join(" · ");
    return el("div", {class: "chart", "data-url": s.url},
      el("div", {class: "title"}, el("strong", {}, s.url),
         el("span", {}, el("span", {class: "legend-in"}, `in ${rate(r.in_bps)}`), " ",
            el("span", {class: "legend-out"}, `out ${rate(r.out_bps)}`))),
      chart(s.history, ["in_bps", "out_bps"]),
      el("div", {class: "title"}, el("span", {}, `${num(r.req_s)} req/s`),
         el("span", {class: "muted"}, `p50 ${ms(r.p50_ms)} · p90 ${ms(r.p90_ms)} · p99 ${ms(r.p99_ms)}`)),
      chart(s.history, ["req_s"]),
      el("div", {class: "muted"}, s.up ? (transports || "no traffic") : `down: ${s.error || ""}`));
  });
  replace(document.getElementById("traffic"), charts);
}

function staleness(bars) {
  const max = Math.max(1, ...bars.map((b) => b[1]));
  const box = el("span", {class: "bars", title: bars.map((b) => `≤${b[0]}: ${b[1]}`).join(", ")});
  for (const [, count] of bars) {
    const bar = el("span", {class: "bar"});
    bar.style.height = `${Math.max(1, (22 * count) / max)}px`;
    box.append(bar);
  }
  return box;
}

function renderJobs(doc) {
  const rows = doc.jobs.map((j) => el("tr", {"data-job": j.job},
    el("td", {}, j.job), el("td", {}, j.server), el("td", {}, j.mode || ""), el("td", {}, j.step ?? ""),
    el("td", {}, `${j.live ?? "?"}/${j.world ?? "?"}`), el("td", {}, num(j.pushes_s)),
    el("td", {}, j.optimizer || ""), el("td", {}, staleness(j.staleness || []))));
  replace(document.querySelector("#jobs tbody"), rows);
  document.getElementById("nojobs").hidden = rows.length > 0;
  const gens = doc.generations.map((g) => el("tr", {},
    el("td", {}, g.prefix), el("td", {}, g.server), el("td", {}, g.newest), el("td", {}, g.readers)));
  replace(document.querySelector("#generations tbody"), gens);
  document.getElementById("nogens").hidden = gens.length > 0;
}

function renderTimeline(doc) {
  const items = doc.timeline.slice().reverse().map((e) => el("li", {"data-kind": e.kind},
    el("span", {class: "muted"}, clock(e.t)), " ", el("span", {class: `kind ${e.kind}`}, e.kind), " ",
    el("span", {}, e.server), " ", el("span", {}, e.text)));
  replace(document.getElementById("timeline"), items);
  document.getElementById("noevents").hidden = items.length > 0;
}

function render(doc) {
  const summary = document.getElementById("summary");
  summary.textContent = `${doc.up} of ${doc.total} servers up`;
  summary.className = doc.up === doc.total ? "pill up" : "pill down";
  document.getElementById("updated").textContent = `updated ${clock(doc.t)}`;
  renderSlots(doc);
  renderStores(doc);
  renderTraffic(doc);
  renderJobs(doc);
  renderTimeline(doc);
  document.body.dataset.snapshots = String(Number(document.body.dataset.snapshots || 0) + 1);
}

function connect() {
  const stream = document.getElementById("stream");
  const events = new EventSource("/events");
  events.addEventListener("open", () => { stream.textContent = "live"; stream.className = "pill up"; });
  events.addEventListener("snapshot", (message) => render(JSON.parse(message.data)));
  events.addEventListener("error", () => {
    // EventSource reconnects by itself; say so meanwhile (the dashboard process may be restarting).
    stream.textContent = "stream: reconnecting"; stream.className = "pill down";
  });
}

document.addEventListener("DOMContentLoaded", connect);

// rollout-gateway dashboard: polls /v1/lag?history=true and draws plain SVG charts.
// No library, no network beyond the gateway itself (works offline).
"use strict";

const POLL_MS = 2000;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
  "#17becf"];
const SVGNS = "http://www.w3.org/2000/svg";

function el(name, attrs, text) {
  const e = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function box(svg) {
  const vb = svg.viewBox.baseVal;
  return { w: vb.width, h: vb.height, l: 36, r: 8, t: 8, b: 20 };
}

function clear(svg) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  svg.dataset.marks = "0";
}

function empty(svg, msg) {
  const b = box(svg);
  svg.appendChild(el("text", { x: b.w / 2, y: b.h / 2, "text-anchor": "middle", class: "empty" },
    msg));
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function axes(svg, b, ymax, fmt) {
  for (let i = 0; i <= 4; i++) {
    const y = b.t + (b.h - b.t - b.b) * (1 - i / 4);
    svg.appendChild(el("line", { x1: b.l, x2: b.w - b.r, y1: y, y2: y, class: "grid" }));
    svg.appendChild(el("text", { x: b.l - 4, y: y + 3, "text-anchor": "end", class: "tick" },
      fmt ? fmt(ymax * i / 4) : String(Math.round(ymax * i / 4 * 100) / 100)));
  }
  svg.appendChild(el("line", { x1: b.l, x2: b.l, y1: b.t, y2: b.h - b.b, class: "axis" }));
  svg.appendChild(el("line", { x1: b.l, x2: b.w - b.r, y1: b.h - b.b, y2: b.h - b.b,
    class: "axis" }));
}

// bars: [{label, value}]
function barChart(svg, bars, color, unit) {
  unit = unit || "tokens";
  clear(svg);
  const b = box(svg);
  if (!bars.length || bars.every(x => x.value === 0)) { empty(svg, "no " + unit); return; }
  const ymax = niceMax(Math.max(...bars.map(x => x.value)));
  axes(svg, b, ymax, v => v >= 1000 ? (v / 1000).toFixed(1) + "k"
    : String(Math.round(v * 100) / 100));
  const slot = (b.w - b.l - b.r) / bars.length;
  const hh = b.h - b.t - b.b;
  bars.forEach((x, i) => {
    const h = hh * x.value / ymax;
    const r = el("rect", { x: b.l + i * slot + slot * 0.15, y: b.t + hh - h, width: slot * 0.7,
      height: Math.max(h, 0), fill: color, "data-value": x.value });
    r.appendChild(el("title", {}, `lag ${x.label}: ${x.value} ${unit}`));
    svg.appendChild(r);
    svg.appendChild(el("text", { x: b.l + i * slot + slot / 2, y: b.h - 6, "text-anchor": "middle",
      class: "tick" }, x.label));
  });
  svg.dataset.marks = String(bars.filter(x => x.value > 0).length);
}

// series: [{name, color, points: [[t, v]]}]
function lineChart(svg, series, opts) {
  clear(svg);
  const b = box(svg);
  const pts = series.flatMap(s => s.points);
  if (pts.length < 1) { empty(svg, "no data yet"); return; }
  const t0 = Math.min(...pts.map(p => p[0])), t1 = Math.max(...pts.map(p => p[0]));
  const ymax = niceMax(Math.max(opts.minMax || 1, ...pts.map(p => p[1])));
  axes(svg, b, ymax, opts.fmt);
  const x = t => b.l + (b.w - b.l - b.r) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1);
  const y = v => b.t + (b.h - b.t - b.b) * (1 - v / ymax);
  let marks = 0;
  for (const s of series) {
    if (!s.points.length) continue;
    let d = "";
    s.points.forEach((p, i) => {
      // step lines for versions/lags (they jump), straight for rates
      if (i === 0) d += `M${x(p[0])},${y(p[1])}`;
      else d += opts.step ? `H${x(p[0])}V${y(p[1])}` : `L${x(p[0])},${y(p[1])}`;
    });
    if (s.points.length === 1) d += `H${x(s.points[0][0]) + 2}`;
    svg.appendChild(el("path", { d, fill: "none", stroke: s.color, "stroke-width": 2,
      "data-series": s.name }));
    marks += s.points.length;
  }
  svg.appendChild(el("text", { x: b.w - b.r, y: b.h - 6, "text-anchor": "end", class: "tick" },
    `last ${Math.round(t1 - t0)} s`));
  svg.dataset.marks = String(marks);
}

const STATE_COLORS = { healthy: "#2ca02c", paused: "#ff7f0e", unhealthy: "#d62728",
  failed_load: "#8b0000", deregistered: "#9aa5b1" };

// one row per engine, one band per history interval, coloured by state
function stateChart(svg, hist, ids) {
  clear(svg);
  const b = box(svg);
  if (hist.length < 2 || !ids.length) { empty(svg, "no data yet"); return; }
  const t0 = hist[0].t, t1 = hist[hist.length - 1].t;
  const left = 60, rowH = (b.h - b.t - b.b) / ids.length;
  const x = t => left + (b.w - left - b.r) * (t - t0) / Math.max(t1 - t0, 1e-9);
  let marks = 0;
  ids.forEach((id, r) => {
    svg.appendChild(el("text", { x: left - 4, y: b.t + r * rowH + rowH / 2 + 3,
      "text-anchor": "end", class: "tick" }, id));
    for (let i = 1; i < hist.length; i++) {
      const e = hist[i - 1].engines[id];
      if (!e) continue;
      svg.appendChild(el("rect", { x: x(hist[i - 1].t), y: b.t + r * rowH + 2,
        width: Math.max(x(hist[i].t) - x(hist[i - 1].t) + 0.5, 0.5), height: rowH - 4,
        fill: STATE_COLORS[e.state] || "#9aa5b1", "data-state": e.state }));
      marks++;
    }
  });
  svg.dataset.marks = String(marks);
}

function pauseChart(svg, windows) {
  clear(svg);
  const b = box(svg);
  const done = windows.filter(w => w.seconds !== null).slice(0, 8);
  if (!done.length) { empty(svg, "no swap yet"); return; }
  const xmax = niceMax(Math.max(...done.map(w => w.seconds)));
  const rowH = (b.h - b.t - b.b) / done.length;
  const left = 110;
  done.forEach((w, i) => {
    const wpx = (b.w - left - b.r - 48) * w.seconds / xmax;  // 48: room for the value
    const r = el("rect", { x: left, y: b.t + i * rowH + 2, width: Math.max(wpx, 1),
      height: rowH - 4, fill: w.engine === "*" ? "#6b7683" : "#ff7f0e",
      "data-value": w.seconds });
    r.appendChild(el("title", {}, `v${w.version} ${w.mode} ${w.engine}: ${w.seconds.toFixed(3)} s`));
    svg.appendChild(r);
    svg.appendChild(el("text", { x: left - 4, y: b.t + i * rowH + rowH / 2 + 3,
      "text-anchor": "end", class: "tick" }, `v${w.version} ${w.engine === "*" ? "pool" : w.engine}`));
    svg.appendChild(el("text", { x: left + Math.max(wpx, 1) + 3, y: b.t + i * rowH + rowH / 2 + 3,
      class: "tick" }, w.seconds.toFixed(3)));
  });
  svg.dataset.marks = String(done.length);
}

function dist(d) {
  return d.buckets.map(x => ({ label: String(x.lag), value: x.tokens }));
}

function facts(dl, pairs) {
  dl.innerHTML = "";
  for (const [k, v] of pairs) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = String(v);
    dl.append(dt, dd);
  }
}

function rows(tbody, data) {
  tbody.innerHTML = "";
  for (const r of data) {
    const tr = document.createElement("tr");
    for (const c of r) {
      const td = document.createElement("td");
      if (c && typeof c === "object") { td.textContent = c.text; td.className = c.cls; }
      else td.textContent = c === null || c === undefined ? "–" : String(c);
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
}

function engineColor(ids, id) {
  return COLORS[ids.indexOf(id) % COLORS.length];
}

function render(rep) {
  document.getElementById("learner-version").textContent = rep.learner_version;
  document.getElementById("max-engine-lag").textContent = rep.max_engine_lag;
  // the fleet's version cut: engines by version, newest first (status prints the same)
  document.getElementById("version-cut").textContent = (rep.version_cut || []).map(c =>
    `v${c.version === null ? "?" : c.version}: ${c.engines.join(", ")}`).join("  |  ") || "–";
  document.getElementById("store-backlog").textContent = rep.store_backlog;
  document.getElementById("inflight-samples").textContent = rep.in_flight.samples;
  const hist = rep.history || [];
  const ids = [...new Set([...rep.engines.map(e => e.id),
    ...hist.flatMap(h => Object.keys(h.engines))])].sort();
  // version lag over time, one step line per engine
  const lagSeries = ids.map(id => ({
    name: id, color: engineColor(ids, id),
    points: hist.filter(h => h.learner_version !== null && h.engines[id] &&
      h.engines[id].version !== null).map(h => [h.t, h.learner_version - h.engines[id].version]),
  }));
  lineChart(document.getElementById("chart-lag"), lagSeries, { step: true, minMax: 1 });
  const legend = document.getElementById("legend-lag");
  legend.innerHTML = "";
  for (const s of lagSeries) {
    const sp = document.createElement("span");
    sp.style.setProperty("--c", s.color); sp.textContent = s.name;
    legend.appendChild(sp);
  }
  // engine versions over time (and the learner's)
  const verSeries = [{ name: "learner", color: "#1d232b",
    points: hist.filter(h => h.learner_version !== null).map(h => [h.t, h.learner_version]) }]
    .concat(ids.map(id => ({ name: id, color: engineColor(ids, id),
      points: hist.filter(h => h.engines[id] && h.engines[id].version !== null)
        .map(h => [h.t, h.engines[id].version]) })));
  lineChart(document.getElementById("chart-versions"), verSeries, { step: true, minMax: 1 });
  stateChart(document.getElementById("chart-states"), hist, ids);
  barChart(document.getElementById("chart-inflight"), dist(rep.in_flight), "#1f77b4");
  barChart(document.getElementById("chart-inflight-requests"),
    rep.in_flight.requests_by_engine_lag.map(x => ({ label: String(x.lag), value: x.tokens })),
    "#aec7e8", "requests");
  barChart(document.getElementById("chart-unconsumed"), dist(rep.unconsumed), "#9467bd");
  barChart(document.getElementById("chart-delivered"), dist(rep.delivered), "#2ca02c");
  pauseChart(document.getElementById("chart-pauses"), rep.pause_windows);
  // throughput from consecutive history points
  const tp = [];
  for (let i = 1; i < hist.length; i++) {
    const dt = hist[i].t - hist[i - 1].t;
    if (dt > 0) tp.push([hist[i].t, Math.max(0, (hist[i].tokens - hist[i - 1].tokens) / dt)]);
  }
  lineChart(document.getElementById("chart-throughput"),
    [{ name: "tokens/s", color: "#17becf", points: tp }], { step: false, minMax: 1,
      fmt: v => v >= 1000 ? (v / 1000).toFixed(1) + "k" : String(Math.round(v)) });
  document.getElementById("throughput-now").textContent =
    tp.length ? Math.round(tp[tp.length - 1][1]) : "–";
  rows(document.querySelector("#engines tbody"), rep.engines.map(e => [
    e.id, { text: e.state + (e.fenced ? " (fenced)" : ""), cls: "state-" + e.state },
    e.version, e.lag, e.outstanding_requests]));
  rows(document.querySelector("#groups tbody"), rep.groups.map(g => [
    g.group, g.backlog, g.pending, g.redelivered]));
  const it = rep.intra_trajectory;
  facts(document.getElementById("intra"), [
    ["trajectories finished", it.trajectories], ["spanning versions", it.spanning_versions],
    ["max intra-trajectory lag", it.max_intra_lag], ["tokens after a switch", it.tokens_after_switch],
    ["tokens on stale KV", it.tokens_on_stale_kv]]);
  // the fleet: refit transactions with each engine's outcome, version-policy counters
  rows(document.querySelector("#refits tbody"), rep.fleet.refits.map(r => [
    r.swap_id, `v${r.version} ${r.mode}`, { text: r.status, cls: "refit-" + r.status },
    Object.entries(r.results).map(([id, res]) => `${id}: ${res}`).join(", ") || "–",
    `${r.stale_dropped} / ${r.kv_refused}`]));
  const fl = rep.fleet;
  facts(document.getElementById("fleet"), [
    ["requests filtered by policy", fl.policy_filtered],
    ["unroutable by policy (503)", fl.policy_unroutable],
    ["trajectories spanning versions", it.spanning_versions],
    ["re-prefilled: policy refused kept KV", fl.kv_policy_reprefills],
    ["stale dropped by refits (published / requeued)",
      `${fl.stale_published} / ${fl.stale_requeued}`]]);
  const s = rep.staleness;
  facts(document.getElementById("handling"), [
    ["tokens re-prefilled", s.tokens_reprefilled],
    ["dropped / masked / recycled at finish",
      `${s.at_finish_dropped} / ${s.at_finish_masked} / ${s.at_finish_recycled}`],
    ["dropped / masked / recycled at delivery",
      `${s.at_delivery_dropped} / ${s.at_delivery_masked} / ${s.at_delivery_recycled}`],
    ["dead-lettered", s.dead_lettered]]);
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const r = await fetch("v1/lag?history=true", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const rep = await r.json();
    render(rep);
    status.textContent = (rep.replica ? `replica ${rep.replica} · ` : "") +
      `updated ${new Date(rep.at * 1000).toLocaleTimeString()}`;
    status.className = "status";
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (e) {
    status.textContent = `cannot read /v1/lag: ${e.message}`;
    status.className = "status error";
  }
  setTimeout(poll, POLL_MS);
}

poll();

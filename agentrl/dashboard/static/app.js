// agentrl dashboard: curves polled from /api/metrics?since=STEP, a trajectory viewer over /api/trajectories.
// No external library: small canvas charts drawn here (the page must work offline).
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const COLOURS = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6"];
const HOT = 0.1; // mismatch highlight, as agentrl.dashboard.viewer.MISMATCH_HIGHLIGHT
const state = { rows: [], last: -1, curves: [], status: {}, timer: null, trajectories: [] };

async function api(path) {
  const r = await fetch(path, { headers: TOKEN ? { Authorization: "Bearer " + TOKEN } : {} });
  if (!r.ok) throw new Error(path + ": HTTP " + r.status + " " + (await r.text()));
  return r.json();
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}

function fmt(v) {
  if (v == null || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
  return (Math.round(v * 1000) / 1000).toString();
}

// -- charts ---------------------------------------------------------------------------------------------

function drawChart(canvas, series, xlabel) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 360, h = canvas.clientHeight || 190;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const pts = series.flatMap(s => s.points);
  canvas.dataset.points = String(pts.length);
  g.font = "11px system-ui"; g.fillStyle = "#888";
  if (!pts.length) { g.fillText("no data yet", w / 2 - 30, h / 2); return; }
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const L = 48, R = 8, T = 18, B = 22;
  const X = x => L + (x - x0) / (x1 - x0) * (w - L - R);
  const Y = y => h - B - (y - y0) / (y1 - y0) * (h - T - B);
  g.strokeStyle = "#eee"; g.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const yv = y0 + (y1 - y0) * i / 4, xv = x0 + (x1 - x0) * i / 4;
    g.beginPath(); g.moveTo(L, Y(yv)); g.lineTo(w - R, Y(yv)); g.stroke();
    g.fillText(y1 - y0 < 1e-3 * Math.abs(y1) ? yv.toPrecision(6) : fmt(yv), 2, Y(yv) + 4);
    g.fillText(fmt(xv), X(xv) - 8, h - 6);
  }
  g.fillText(xlabel, w - R - 30, h - 6 - 10);
  let legendX = L + 4;
  series.forEach((s, k) => {
    g.strokeStyle = g.fillStyle = s.colour || COLOURS[k % COLOURS.length];
    g.lineWidth = 1.5;
    g.beginPath();
    s.points.forEach(([x, y], i) => (i ? g.lineTo(X(x), Y(y)) : g.moveTo(X(x), Y(y))));
    g.stroke();
    if (s.points.length < 40) s.points.forEach(([x, y]) => g.fillRect(X(x) - 1.5, Y(y) - 1.5, 3, 3));
    g.fillText(s.label, legendX, 11);
    legendX += g.measureText(s.label).width + 14;
  });
}

function drawBars(canvas, counts) {
  const keys = Object.keys(counts).sort((a, b) => a - b);
  const series = [{ label: "trajectories by staleness (versions)", points: keys.map(k => [Number(k), counts[k]]) }];
  drawChart(canvas, series, "staleness");
  const g = canvas.getContext("2d");
  // bars over the line: one per staleness value
  const pts = series[0].points;
  if (!pts.length) return;
  const w = canvas.clientWidth || 360, h = canvas.clientHeight || 190, L = 48, R = 8, T = 18, B = 22;
  const top = Math.max(...pts.map(p => p[1]));
  const bw = (w - L - R) / pts.length;
  g.fillStyle = "rgba(51,102,204,0.35)";
  pts.forEach(([, c], i) => {
    const bh = c / top * (h - T - B);
    g.fillRect(L + i * bw + 2, h - B - bh, bw - 4, bh);
  });
}

function points(key) {
  const out = [];
  for (const r of state.rows) {
    const v = r[key];
    if (r.phase === "warmup" || typeof v !== "number" || !Number.isFinite(v)) continue;
    out.push([r.step || 0, v]);
  }
  return out;
}

function buildCharts() {
  const grid = document.getElementById("charts");
  for (const c of state.curves) {
    grid.append(el("div", { class: "card" }, el("h3", { text: c.title }), el("canvas", { id: "chart-" + c.name })));
  }
  grid.append(el("div", { class: "card" }, el("h3", { text: "staleness histogram (queue, at sample time)" }),
    el("canvas", { id: "chart-staleness-hist" })));
}

function redraw() {
  for (const c of state.curves) {
    const series = c.keys.map(k => ({ label: k, points: points(k) })).filter(s => s.points.length);
    drawChart(document.getElementById("chart-" + c.name), series, "step");
  }
  const withHist = state.rows.filter(r => r.staleness_hist && typeof r.staleness_hist === "object");
  drawBars(document.getElementById("chart-staleness-hist"), withHist.length ? withHist.at(-1).staleness_hist : {});
}

// -- status and polling --------------------------------------------------------------------------------

function showStatus(s) {
  state.status = s;
  document.getElementById("run-name").textContent = s.name;
  const badge = document.getElementById("run-state");
  badge.textContent = s.state; badge.className = "badge " + s.state;
  const last = s.last || {};
  document.getElementById("run-line").textContent =
    `step ${last.step ?? 0}/${s.target_steps ?? "?"} · ${s.mode ?? ""} · reward ${fmt(last.reward_mean)}` +
    ` · v${last.policy_version ?? 0} · ${Math.round(last.wall_s || 0)}s` + (s.pid ? ` · pid ${s.pid}` : "");
}

async function poll() {
  try {
    const [m, s] = await Promise.all([api("api/metrics?since=" + state.last), api("api/status")]);
    if (m.rows.length) {
      state.rows.push(...m.rows);
      state.last = m.last_step;
      redraw();
    }
    showStatus(s);
    if (s.state !== "running") return; // a finished run does not change: stop polling
  } catch (err) {
    console.warn("dashboard poll failed, retrying:", err.message);
  }
  state.timer = setTimeout(poll, 2000);
}

// -- trajectory viewer ---------------------------------------------------------------------------------

function query() {
  const p = new URLSearchParams();
  const v = id => document.getElementById(id).value.trim();
  const step = v("f-step");
  if (step !== "") p.set("step", step);
  for (const [id, name] of [["f-id", "id"], ["f-group", "group"], ["f-min-reward", "min_reward"],
    ["f-max-reward", "max_reward"], ["f-min-staleness", "min_staleness"], ["f-min-mismatch", "min_mismatch"]]) {
    if (v(id) !== "") p.set(name, v(id));
  }
  return p;
}

async function loadTrajectories(params) {
  const data = await api("api/trajectories?" + params.toString());
  const sel = document.getElementById("f-step");
  const chosen = data.step == null ? "" : String(data.step);
  sel.replaceChildren(el("option", { value: "-1", text: `queued (${data.queued})` }),
    ...data.steps.map(s => el("option", { value: String(s), text: "step " + s })));
  sel.value = chosen === "" ? (data.steps.length ? String(data.steps.at(-1)) : "-1") : chosen;
  document.getElementById("traj-count").textContent =
    `${data.total} trajectories` + (data.missing ? ` (${data.missing} compacted out of the log)` : "");
  state.trajectories = data.trajectories;
  const list = document.getElementById("traj-list");
  list.replaceChildren(...data.trajectories.map((t, i) => {
    const item = el("div", { class: "traj", "data-i": String(i) },
      el("div", { text: t.id + (t.step != null ? "  (step " + t.step + ")" : "") }),
      el("div", { class: "meta", text: `reward ${fmt(t.reward)} · adv ${fmt(t.advantage)} · stale ${t.staleness ?? "–"}` +
        ` · mismatch ${fmt(t.mismatch)} · group ${t.group_id}` }));
    item.addEventListener("click", () => openTrajectory(i));
    return item;
  }));
}

// a trajectory's picture, where its tokens start (an <img> sends no header: the token goes in the query)
function picture(p) {
  const src = p.url + (TOKEN ? "?token=" + encodeURIComponent(TOKEN) : "");
  return el("img", { class: "pic", src, alt: `picture ${p.sha256.slice(0, 12)}`,
    title: `picture ${p.sha256.slice(0, 12)} · ${p.length} tokens from position ${p.start} · grid ${p.grid_thw.join("x")}` });
}

function openTrajectory(i) {
  const t = state.trajectories[i];
  document.querySelectorAll(".traj").forEach(e => e.classList.toggle("sel", e.dataset.i === String(i)));
  const detail = document.getElementById("traj-detail");
  const head = el("div", {},
    el("h3", { text: t.id }),
    el("div", { class: "meta", text: `group ${t.group_id} · env ${t.env} · status ${t.status} · reward ${fmt(t.reward)}` +
      ` · advantage ${fmt(t.advantage)} · staleness ${t.staleness ?? "–"} · versions ${JSON.stringify(t.versions)}` +
      (t.sampled_by_learner ? "" : " · no learner log-probs (not in the learner's sample)") }),
    el("pre", {}, ...(t.prompt_parts || [{ text: t.prompt }]).map(p => p.image ? picture(p.image) : p.text)));
  let k2 = 0; // assistant turns seen: index into turn_rewards
  const turns = t.turns.map(turn => {
    const box = el("div", { class: "turn " + turn.role + (turn.highlight ? " hot" : "") },
      el("div", { class: "head", text: `${turn.role} · ${turn.tokens.length} tokens` +
        (turn.mismatch != null ? ` · mismatch ${fmt(turn.mismatch)}` : "") +
        (t.turn_rewards && turn.role === "assistant" && k2 < t.turn_rewards.length ? ` · turn reward ${fmt(t.turn_rewards[k2++])}` : "") }));
    for (const tok of turn.tokens) {
      if (tok.image) box.append(picture(tok.image));
      const gap = tok.lp != null && tok.llp != null ? Math.abs(tok.lp - tok.llp) : null;
      const span = el("span", { class: "tok m" + tok.mask + (tok.mask && gap != null && gap > HOT ? " hot" : ""),
        title: `token ${tok.id} · version ${tok.v} · rollout lp ${fmt(tok.lp)} · learner lp ${fmt(tok.llp)}` +
          ` · advantage ${fmt(tok.adv)}` }, tok.text);
      box.append(span);
      if (document.getElementById("f-versions").checked) box.append(el("sub", { class: "ver", text: "v" + tok.v }));
    }
    return box;
  });
  const messages = t.messages.length
    ? el("details", {}, el("summary", { text: "messages (env observations)" }),
      ...t.messages.map(m => el("pre", { text: m.role + ": " + m.content })))
    : null;
  detail.replaceChildren(...[head, ...turns, messages].filter(Boolean));
}

// -- tabs and start ------------------------------------------------------------------------------------

function showTab(name) {
  for (const s of document.querySelectorAll(".tab")) s.hidden = s.id !== "tab-" + name;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("on", a.dataset.tab === name);
  if (name === "curves") redraw();
}

async function route() {
  // #trajectories?step=N&id=..&open=0 opens the viewer (links from issues, and the browser test)
  const [tab, qs] = (location.hash.slice(1) || "curves").split("?");
  showTab(tab);
  if (tab === "trajectories") {
    const params = new URLSearchParams(qs || "");
    const open = params.get("open");
    params.delete("open");
    await loadTrajectories(params);
    if (open != null && state.trajectories.length) openTrajectory(Number(open));
  }
}

async function main() {
  state.curves = await api("api/curves");
  buildCharts();
  const cfg = await api("api/config");
  document.getElementById("config-text").textContent = cfg.text || "(no config.toml)";
  document.getElementById("f-versions").addEventListener("change", () => {
    const sel = document.querySelector(".traj.sel");
    if (sel) openTrajectory(Number(sel.dataset.i));
  });
  document.getElementById("traj-form").addEventListener("submit", ev => {
    ev.preventDefault();
    loadTrajectories(query()).catch(err => console.warn(err.message));
  });
  window.addEventListener("hashchange", () => route().catch(err => console.warn(err.message)));
  await poll();
  await route();
}

main().catch(err => {
  document.body.prepend(el("p", { class: "badge stopped", text: "dashboard error: " + err.message }));
  throw err;
});

"use strict";
// harness rollout viewer: vanilla JS, hash-routed single page over the JSON API served next to it.
// All data reaches the DOM through textContent / attributes, never through innerHTML.

const app = document.getElementById("app");
const POLL_MS = 5000;
const PAGE_SIZE = 100;
const SERIES_LABELS = {
  reward_mean: "reward", val_pass_at_n: "pass@k (validation)", kl: "KL", entropy: "entropy",
  response_length: "response length", drift_rate: "drift rate", merge_ratio: "merge ratio",
  computed_ratio: "sample tokens per token computed", update_s: "update seconds",
  mismatch_kl: "engine/trainer KL", rejected_share: "tokens rejected (off-policy)",
};
const EP_COLS = [ // key: the th's data-sort, sorted by the API
  { label: "episode" }, { key: "step", label: "step" }, { key: "task_id", label: "task" }, { label: "rep" },
  { key: "reward", label: "reward" }, { key: "status", label: "status" }, { key: "n_calls", label: "calls" },
  { key: "duration_ms", label: "duration ms" }, { key: "started_at", label: "started" }, { label: "roles" },
];
const DEFAULT_SQL = "SELECT run_id, count(*) AS calls FROM calls GROUP BY 1";

let pageToken = 0; // bumped on every route change; async work for an older page is dropped
let pollTimer = null;
let inflight = 0;
let sqlText = DEFAULT_SQL;

// ---------- DOM helpers ----------

function el(tag, attrs = {}, ...kids) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  appendKids(node, kids);
  return node;
}

function appendKids(node, kids) {
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false) continue;
    node.append(kid instanceof Node ? kid : String(kid)); // strings become text nodes
  }
}

const SVGNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function errorBox() { return el("div", { class: "error", role: "alert" }); }
function showError(box, err) { box.textContent = err ? err.message || String(err) : ""; }
function loadingNote(text) { return el("p", { class: "loading", text }); }

function emptyRow(span, text) {
  return el("tr", { class: "empty" }, el("td", { colspan: span, class: "muted", text }));
}

// ---------- formatting ----------

function fmtNum(v, digits = 4) {
  if (v === null || v === undefined || v === "") return "";
  if (typeof v !== "number") return String(v);
  if (!Number.isFinite(v) || Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a >= 1000 && a < 1e9) return String(Math.round(v));
  if (a < 1e-4 || a >= 1e9) return v.toExponential(2);
  return String(Number(v.toPrecision(digits)));
}

function fmtTime(iso) {
  if (!iso) return "";
  return String(iso).replace("T", " ").replace(/(\d\d:\d\d:\d\d)\.\d+/, "$1");
}

function pretty(value) { return typeof value === "string" ? value : JSON.stringify(value, null, 2); }
function clock() { return new Date().toTimeString().slice(0, 8); }
function numCell(v) { return el("td", { class: "num", text: fmtNum(v) }); }

// ---------- API ----------

function setLoading(delta) {
  inflight += delta;
  document.getElementById("loading").hidden = inflight <= 0;
}

async function api(path, options) {
  setLoading(1);
  try {
    const res = await fetch(path, options);
    const body = await res.json().catch(() => null);
    if (!res.ok) {
      const msg = body && body.error && body.error.message;
      throw new Error(msg || `HTTP ${res.status} ${res.statusText}`.trim());
    }
    if (body === null) throw new Error(`the server answered ${path} with something that is not JSON`);
    return body;
  } finally {
    setLoading(-1);
  }
}

// ---------- routing ----------

function stopPolling() {
  if (pollTimer !== null) clearInterval(pollTimer);
  pollTimer = null;
}

function decode(s) {
  try { return decodeURIComponent(s); } catch (_) { return s; }
}

function route() {
  stopPolling();
  pageToken += 1;
  const hash = location.hash || "#/";
  document.getElementById("nav-runs").classList.toggle("active", hash === "#/" || hash.startsWith("#/run"));
  document.getElementById("nav-sql").classList.toggle("active", hash === "#/sql");
  app.replaceChildren();
  let m;
  if ((m = hash.match(/^#\/run\/(.+)$/))) return renderRun(decode(m[1]));
  if ((m = hash.match(/^#\/episode\/(.+)$/))) return renderEpisode(decode(m[1]));
  if (hash === "#/sql") return renderSql();
  return renderRuns();
}

// ---------- runs list ----------

async function renderRuns() {
  const token = pageToken;
  const err = errorBox();
  const loading = loadingNote("loading runs…");
  const head = el("tr", {}, ["run", "started", "episodes", "calls", "steps", "mean reward"].map((h) => el("th", { text: h })));
  const table = el("table", { id: "runs", class: "grid" }, el("thead", {}, head), el("tbody"));
  app.append(el("h2", { text: "Runs" }), err, loading, table);
  try {
    const data = await api("/api/runs");
    if (token !== pageToken) return;
    const runs = data.runs || [];
    table.tBodies[0].replaceChildren(...(runs.length ? runs.map(runRow) : [emptyRow(6, "no runs recorded")]));
  } catch (e) {
    if (token === pageToken) showError(err, e);
  } finally {
    loading.remove();
  }
}

function runRow(r) {
  return el("tr", { "data-run-id": r.run_id },
    el("td", {}, el("a", { href: "#/run/" + encodeURIComponent(r.run_id), class: "mono", text: r.run_id })),
    el("td", { title: r.started_at, text: fmtTime(r.started_at) }),
    numCell(r.episodes), numCell(r.calls), numCell(r.steps), numCell(r.mean_reward));
}

// ---------- run page ----------

function renderRun(runId) {
  const st = { runId, token: pageToken, sort: "started_at", order: "desc", offset: 0, total: 0, seq: 0 };
  st.live = el("span", { id: "live-indicator", class: "live", text: "live · connecting…" });
  st.curvesErr = errorBox();
  st.episodesErr = errorBox();
  st.curves = el("div", { id: "curves", class: "curves" }, loadingNote("loading curves…"));
  st.count = el("span", { id: "episode-count", text: "…" });
  st.table = buildEpisodesTable(st);
  st.pager = buildPager(st);
  app.append(
    el("div", { class: "page-head" }, el("h2", {}, "Run ", el("code", { text: runId })), st.live),
    el("h3", { text: "Training curves" }), st.curvesErr, st.curves,
    el("h3", {}, "Episodes ", el("span", { class: "muted" }, "(", st.count, " matching)")),
    buildFilters(st), st.episodesErr, st.pager.node,
    el("div", { class: "table-wrap" }, st.table));
  updateSortArrows(st);
  refreshRun(st);
  pollTimer = setInterval(() => refreshRun(st), POLL_MS);
}

async function refreshRun(st) {
  if (st.token !== pageToken || st.refreshing) return;
  st.refreshing = true;
  const ok = await Promise.all([loadCurves(st), loadEpisodes(st)]);
  st.refreshing = false;
  if (st.token !== pageToken) return;
  st.live.textContent = ok.every(Boolean) ? `live · updated ${clock()}` : `live · error at ${clock()}`;
  st.live.classList.toggle("live-error", !ok.every(Boolean));
}

async function loadCurves(st) {
  try {
    const data = await api(`/api/runs/${encodeURIComponent(st.runId)}/curves`);
    if (st.token !== pageToken) return false;
    const key = JSON.stringify(data);
    if (key !== st.lastCurves) drawCurves(st.curves, data); // unchanged: leave the DOM (and any hover) alone
    st.lastCurves = key;
    showError(st.curvesErr, null);
    return true;
  } catch (e) {
    if (st.token === pageToken) showError(st.curvesErr, e);
    return false;
  }
}

function drawCurves(box, data) {
  box.querySelector(".loading")?.remove();
  const series = data.series || {};
  const names = Object.keys(SERIES_LABELS).concat(Object.keys(series).filter((k) => !(k in SERIES_LABELS)));
  for (const name of names) {
    let fig = box.querySelector(`figure[data-series="${CSS.escape(name)}"]`);
    if (!fig) {
      fig = el("figure", { class: "chart", "data-series": name });
      box.append(fig);
    }
    fig.replaceChildren(el("figcaption", { text: SERIES_LABELS[name] || name }), lineChart(data.steps || [], series[name] || []));
  }
}

function lineChart(steps, values) {
  const pts = [];
  values.forEach((v, i) => {
    if (typeof v === "number" && Number.isFinite(v) && steps[i] !== null && steps[i] !== undefined) pts.push([Number(steps[i]), v]);
  });
  if (!pts.length) return el("div", { class: "nodata", text: "no data" });
  const W = 300, H = 150, L = 50, R = 10, T = 10, B = 22;
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = (x) => (x1 === x0 ? (L + W - R) / 2 : L + ((x - x0) / (x1 - x0)) * (W - L - R));
  const sy = (y) => (y1 === y0 ? (T + H - B) / 2 : T + ((y1 - y) / (y1 - y0)) * (H - T - B));
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "chart-svg", role: "img" });
  chart.append(
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }),
    svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
    svg("text", { x: L - 4, y: T + 4, "text-anchor": "end", class: "axis-label y-max" }, fmtNum(y1)),
    svg("text", { x: L - 4, y: H - B, "text-anchor": "end", class: "axis-label y-min" }, fmtNum(y0)),
    svg("text", { x: L, y: H - 6, "text-anchor": "start", class: "axis-label x-min" }, fmtNum(x0)),
    svg("text", { x: W - R, y: H - 6, "text-anchor": "end", class: "axis-label x-max" }, fmtNum(x1)),
    svg("polyline", { points: pts.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "), class: "line" }));
  for (const [x, y] of pts) {
    const dot = svg("circle", { cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 2.5, class: "dot" });
    dot.append(svg("title", {}, `step ${x}: ${fmtNum(y, 6)}`));
    chart.append(dot);
  }
  return chart;
}

function buildFilters(st) {
  const opt = (value, text) => el("option", { value, text });
  st.f = {
    step: el("select", { id: "filter-step" }, opt("", "all")),
    task: el("input", { id: "filter-task", type: "text", placeholder: "substring", size: 16 }),
    status: el("select", { id: "filter-status" }, opt("", "all")),
    role: el("select", { id: "filter-role" }, opt("", "all")),
    min: el("input", { id: "filter-min-reward", type: "number", step: "any", placeholder: "min" }),
    max: el("input", { id: "filter-max-reward", type: "number", step: "any", placeholder: "max" }),
  };
  const requery = () => { clearTimeout(st.debounce); st.offset = 0; loadEpisodes(st); };
  const debounced = () => { clearTimeout(st.debounce); st.debounce = setTimeout(requery, 250); };
  for (const s of [st.f.step, st.f.status, st.f.role]) s.addEventListener("change", requery);
  for (const i of [st.f.task, st.f.min, st.f.max]) i.addEventListener("input", debounced);
  const field = (label, control) => el("label", { class: "filter" }, el("span", { text: label }), control);
  return el("div", { class: "filters" },
    field("step", st.f.step), field("task", st.f.task), field("status", st.f.status),
    field("role", st.f.role), field("reward ≥", st.f.min), field("reward ≤", st.f.max));
}

function syncOptions(select, values) {
  const vals = (values || []).filter((v) => v !== null && v !== undefined).map(String);
  const current = select.value;
  if (current && !vals.includes(current)) vals.push(current);
  const have = [...select.options].slice(1).map((o) => o.value);
  if (have.join("\u0000") === vals.join("\u0000")) return; // unchanged: keep the element (and its focus) as is
  select.replaceChildren(el("option", { value: "", text: "all" }), ...vals.map((v) => el("option", { value: v, text: v })));
  select.value = current;
}

function episodeQuery(st) {
  const f = st.f;
  const params = [["step", f.step.value], ["task", f.task.value.trim()], ["status", f.status.value],
    ["role", f.role.value], ["min_reward", f.min.value], ["max_reward", f.max.value]];
  if (st.sort) params.push(["sort", st.sort], ["order", st.order]);
  params.push(["limit", PAGE_SIZE], ["offset", st.offset]);
  return new URLSearchParams(params.filter(([, v]) => v !== "").map(([k, v]) => [k, String(v)])).toString();
}

async function loadEpisodes(st) {
  const seq = ++st.seq;
  const query = episodeQuery(st);
  st.table.classList.add("busy");
  try {
    const data = await api(`/api/runs/${encodeURIComponent(st.runId)}/episodes?${query}`);
    if (st.token !== pageToken || seq !== st.seq) return true; // a newer query superseded this one
    const key = query + "\u0000" + st.sort + st.order + JSON.stringify(data);
    if (key !== st.lastEpisodes) renderEpisodes(st, data);
    st.lastEpisodes = key;
    showError(st.episodesErr, null);
    return true;
  } catch (e) {
    if (st.token === pageToken && seq === st.seq) showError(st.episodesErr, e);
    return false;
  } finally {
    if (seq === st.seq) st.table.classList.remove("busy");
  }
}

function renderEpisodes(st, data) {
  const facets = data.facets || {};
  syncOptions(st.f.step, facets.steps);
  syncOptions(st.f.status, facets.statuses);
  syncOptions(st.f.role, facets.roles);
  st.total = Number(data.total) || 0;
  st.count.textContent = String(data.total ?? 0);
  const eps = data.episodes || [];
  const rows = eps.length ? eps.map(episodeRow) : [emptyRow(EP_COLS.length, "no episodes match")];
  st.table.tBodies[0].replaceChildren(...rows);
  updatePager(st);
  updateSortArrows(st);
}

function episodeRow(ep) {
  const bad = ep.status !== "finished";
  return el("tr", { "data-episode-id": ep.episode_id },
    el("td", {}, el("a", { href: "#/episode/" + encodeURIComponent(ep.episode_id), class: "mono", text: ep.episode_id })),
    numCell(ep.step),
    el("td", { text: ep.task_id ?? "" }),
    numCell(ep.repeat_index),
    numCell(ep.reward),
    el("td", { class: bad ? "status status-bad" : "status", title: bad ? ep.error || ep.status : null, text: ep.status ?? "" }),
    numCell(ep.n_calls),
    numCell(ep.duration_ms),
    el("td", { title: ep.started_at, text: fmtTime(ep.started_at) }),
    el("td", { text: (ep.roles || []).join(", ") }));
}

function buildEpisodesTable(st) {
  const ths = EP_COLS.map((c) => (c.key
    ? el("th", { "data-sort": c.key, class: "sortable", title: `sort by ${c.label}`, onclick: () => toggleSort(st, c.key) },
      c.label, el("span", { class: "arrow" }))
    : el("th", { text: c.label })));
  return el("table", { id: "episodes", class: "grid" }, el("thead", {}, el("tr", {}, ths)), el("tbody"));
}

function toggleSort(st, key) {
  st.order = st.sort === key && st.order === "asc" ? "desc" : "asc";
  st.sort = key;
  st.offset = 0;
  updateSortArrows(st);
  loadEpisodes(st);
}

function updateSortArrows(st) {
  for (const th of st.table.querySelectorAll("th[data-sort]")) {
    const on = th.dataset.sort === st.sort;
    th.querySelector(".arrow").textContent = on ? (st.order === "asc" ? " ▲" : " ▼") : "";
    th.setAttribute("aria-sort", on ? (st.order === "asc" ? "ascending" : "descending") : "none");
  }
}

function buildPager(st) {
  const go = (offset) => { st.offset = Math.max(0, offset); loadEpisodes(st); };
  const prev = el("button", { id: "page-prev", type: "button", text: "◀ prev", disabled: true, onclick: () => go(st.offset - PAGE_SIZE) });
  const next = el("button", { id: "page-next", type: "button", text: "next ▶", disabled: true, onclick: () => go(st.offset + PAGE_SIZE) });
  const info = el("span", { class: "pager-info muted" });
  return { node: el("div", { class: "pager" }, prev, info, next), prev, next, info };
}

function updatePager(st) {
  const { prev, next, info } = st.pager;
  prev.disabled = st.offset <= 0;
  next.disabled = st.offset + PAGE_SIZE >= st.total;
  const last = Math.min(st.offset + PAGE_SIZE, st.total);
  info.textContent = st.total ? `${st.offset + 1}–${last} of ${st.total}` : "0 of 0";
}

// ---------- episode page ----------

async function renderEpisode(id) {
  const token = pageToken;
  const err = errorBox();
  const loading = loadingNote("loading episode…");
  app.append(el("h2", {}, "Episode ", el("code", { text: id })), err, loading);
  try {
    const data = await api("/api/episodes/" + encodeURIComponent(id));
    if (token !== pageToken) return;
    app.append(
      episodeSummary(data.episode || {}),
      samplesSection(data.samples || []),
      breaksSection(data.breaks || []),
      callsSection(data.calls || []));
  } catch (e) {
    if (token === pageToken) showError(err, e);
  } finally {
    loading.remove();
  }
}

function episodeSummary(ep) {
  const bad = ep.status && ep.status !== "finished";
  const rows = [
    ["run", ep.run_id ? el("a", { href: "#/run/" + encodeURIComponent(ep.run_id), class: "mono", text: ep.run_id }) : ""],
    ["step", fmtNum(ep.step)],
    ["task", ep.task_id ?? ""],
    ["status", el("span", { class: bad ? "status-bad" : "", text: ep.status ?? "" })],
    ["reward", fmtNum(ep.reward)],
    ["duration", ep.duration_ms === null || ep.duration_ms === undefined ? "" : `${fmtNum(ep.duration_ms)} ms`],
  ];
  if (ep.error) rows.push(["error", el("span", { class: "call-error", text: ep.error })]);
  rows.push(["answer", ep.answer === null || ep.answer === undefined
    ? el("span", { class: "muted", text: "none" })
    : el("pre", { class: "json", text: pretty(ep.answer) })]);
  rows.push(["judge details", ep.judge_details === null || ep.judge_details === undefined
    ? el("span", { class: "muted", text: "none" })
    : el("details", {}, el("summary", { text: "show" }), el("pre", { class: "json", text: pretty(ep.judge_details) }))]);
  return el("div", { id: "summary", class: "summary" },
    el("dl", {}, rows.map(([k, v]) => [el("dt", { text: k }), el("dd", {}, v)])));
}

function heatColor(logprob) {
  const t = Math.min(1, Math.max(0, -logprob / 5)); // 0 at logprob 0 (green) .. 1 at <= -5 (red)
  return `hsl(${Math.round(120 * (1 - t))}, 80%, 78%)`;
}

function samplesSection(samples) {
  const box = el("div", { id: "samples" });
  const toggle = el("input", { type: "checkbox", id: "toggle-heat", checked: true });
  toggle.addEventListener("change", () => box.classList.toggle("noheat", !toggle.checked));
  if (!samples.length) box.append(el("p", { class: "muted", text: "no samples recorded for this episode" }));
  for (const s of samples) box.append(sampleView(s));
  return el("section", {},
    el("h3", { text: `Samples (${samples.length})` }),
    el("div", { class: "token-controls" }, el("label", {}, toggle, " logprob heat map"), legend()),
    box);
}

function legend() {
  const item = (cls, color, label) => el("span", { class: "legend-item" },
    el("span", { class: `swatch ${cls}`, style: color ? `background: ${color}` : null }), label);
  return el("div", { class: "legend" },
    item("swatch-mask0", null, "mask 0: prompt, tool results, user turns (not trained)"),
    item("", heatColor(0), "mask 1, logprob ≈ 0"),
    item("", heatColor(-2.5), "−2.5"),
    item("", heatColor(-5), "≤ −5"),
    item("swatch-flat", null, "mask 1 with the heat map off"));
}

function sampleView(s) {
  const head = el("div", { class: "sample-head" },
    el("strong", { text: s.role_key ?? "sample" }),
    ` · #${s.sample_index} · ${fmtNum(s.n_tokens)} tokens · ${fmtNum(s.n_trainable)} trainable · reward ${fmtNum(s.reward)}`,
    s.truncation && s.truncation.length ? el("span", { class: "sample-cut", text: ` · cut: ${s.truncation.join(", ")}` }) : null);
  const toks = el("div", { class: "tokens" });
  const frag = document.createDocumentFragment();
  for (const t of s.tokens || []) frag.append(tokenSpan(t));
  toks.append(frag);
  return el("div", { class: "sample", "data-sample-index": s.sample_index }, head, toks);
}

function tokenSpan(t) {
  const mask = t.mask ? 1 : 0;
  const lp = typeof t.logprob === "number" ? t.logprob : null;
  const span = document.createElement("span");
  span.className = t.text === null || t.text === undefined ? "tok tok-id" : "tok";
  span.dataset.id = String(t.id);
  span.dataset.mask = String(mask);
  span.dataset.logprob = lp === null ? "" : String(lp);
  span.textContent = t.text === null || t.text === undefined ? `⟨${t.id}⟩` : t.text.replace(/\n/g, "↵\n");
  const p = lp === null ? "n/a" : Math.exp(lp).toFixed(4);
  span.title = `id ${t.id} · mask ${mask} · logprob ${lp === null ? "n/a" : lp} · p=${p}`;
  if (mask === 1 && lp !== null) span.style.setProperty("--heat", heatColor(lp));
  return span;
}

function breaksSection(breaks) {
  const box = el("div", { id: "breaks" });
  if (!breaks.length) box.append(el("p", { class: "muted", text: "no merge breaks" }));
  for (const b of breaks) {
    box.append(el("div", { class: "merge-break" },
      el("strong", { text: b.reason ?? "unknown reason" }),
      " · call ", el("code", { text: b.call_id ?? "?" }),
      ` · choice ${b.choice_index ?? "?"} · position ${b.position ?? "?"}`));
  }
  return el("section", {}, el("h3", { text: `Merge breaks (${breaks.length})` }), box);
}

function callsSection(calls) {
  const box = el("div", { id: "calls" });
  if (!calls.length) box.append(el("p", { class: "muted", text: "no calls recorded for this episode" }));
  for (const c of calls) box.append(callView(c));
  return el("section", {}, el("h3", { text: `LLM calls (${calls.length})` }), box);
}

function continuityText(co) {
  if (!co || typeof co !== "object" || !co.mode) return null;
  return co.reason ? `continuity ${co.mode} (${co.reason})` : `continuity ${co.mode}`;
}

function callView(c) {
  const parts = [
    `#${c.call_index}`,
    c.status,
    `HTTP ${c.http_status ?? "–"}`,
    c.latency_ms === null || c.latency_ms === undefined ? null : `${fmtNum(c.latency_ms)} ms`,
    c.requested_model,
    c.role ? `role ${c.role}` : null,
    c.stream ? "stream" : "no stream",
    continuityText(c.continuity),
  ].filter((p) => p !== null && p !== undefined && p !== "");
  const head = el("div", { class: "call-head" }, el("strong", { text: parts.join(" · ") }),
    " ", el("code", { class: "muted", title: "call id", text: c.call_id ?? "" }));
  return el("div", { class: c.error ? "call call-failed" : "call", "data-call-index": c.call_index },
    head,
    c.error ? el("div", { class: "call-error", text: c.error }) : null,
    flagsView(c.flags),
    jsonDetails("request", c.request),
    jsonDetails("response", c.response),
    c.continuity ? jsonDetails("continuity", c.continuity) : null,
    (c.choices || []).map(choiceView));
}

// What cut the call short or what the degenerate-output guard found (docs/schema.md: the flags view).
function flagsView(flags) {
  if (!Array.isArray(flags) || !flags.length) return null;
  const text = flags.map((f) => {
    const where = f.choice === null || f.choice === undefined ? "episode" : `choice ${f.choice}`;
    const measured = f.value === null || f.value === undefined ? ""
      : ` ${fmtNum(f.value)}${f.threshold === null || f.threshold === undefined ? "" : ` (limit ${fmtNum(f.threshold)})`}`;
    return `${f.kind} ${f.reason}${measured} · ${where}`;
  });
  return el("div", { class: "call-flags", text: `flags: ${text.join("; ")}` });
}

function jsonDetails(label, value) {
  return el("details", { class: "json-details" },
    el("summary", { text: label }),
    el("pre", { class: "json", text: value === null || value === undefined ? "null" : pretty(value) }));
}

function choiceView(ch) {
  const tools = Array.isArray(ch.tool_calls) && ch.tool_calls.length ? ch.tool_calls : null;
  return el("div", { class: "choice" },
    el("div", { class: "choice-head", text: `choice ${ch.index ?? 0} · finish reason: ${ch.finish_reason ?? "–"}` }),
    ch.text ? el("pre", { class: "choice-text", text: ch.text }) : el("div", { class: "muted", text: "(no text)" }),
    tools ? [el("div", { class: "label", text: "tool calls" }), el("pre", { class: "json", text: pretty(tools) })] : null);
}

// ---------- SQL page ----------

function renderSql() {
  const ui = {
    input: el("textarea", { id: "sql-input", rows: 6, spellcheck: "false" }),
    run: el("button", { id: "sql-run", type: "button", text: "Run" }),
    status: el("span", { class: "loading" }),
    err: el("div", { id: "sql-error", class: "error", role: "alert" }),
    note: el("div", { id: "sql-note", class: "muted" }),
    table: el("table", { id: "sql-result", class: "grid" }),
  };
  ui.input.value = sqlText;
  ui.run.addEventListener("click", () => runSql(ui));
  ui.input.addEventListener("input", () => { sqlText = ui.input.value; });
  ui.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); runSql(ui); }
  });
  app.append(
    el("h2", { text: "SQL" }),
    el("p", { class: "muted", text: "Read-only DuckDB queries over the recorded tables. Ctrl/Cmd+Enter runs." }),
    ui.input,
    el("div", { class: "sql-actions" }, ui.run, " ", ui.status),
    ui.err, ui.note,
    el("div", { class: "table-wrap" }, ui.table));
}

async function runSql(ui) {
  if (ui.busy) return;
  const token = pageToken;
  ui.busy = true;
  ui.run.disabled = true;
  ui.status.textContent = "running…";
  try {
    const data = await api("/api/sql", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ sql: ui.input.value }),
    });
    if (token !== pageToken) return;
    ui.err.textContent = "";
    fillSqlTable(ui.table, data);
    const n = (data.rows || []).length;
    ui.note.replaceChildren(`${n} row${n === 1 ? "" : "s"}`);
    if (data.truncated) ui.note.append(el("span", { class: "truncated", text: " · truncated: the server returned only the first rows" }));
  } catch (e) {
    if (token !== pageToken) return;
    ui.err.textContent = e.message || String(e);
    ui.table.replaceChildren();
    ui.note.textContent = "";
  } finally {
    ui.busy = false;
    ui.run.disabled = false;
    ui.status.textContent = "";
  }
}

function fillSqlTable(table, data) {
  const types = data.types || [];
  const head = el("tr", {}, (data.columns || []).map((c, i) => el("th", { title: types[i] ?? null, text: c })));
  const rows = (data.rows || []).map((r) => el("tr", {}, r.map(sqlCell)));
  table.replaceChildren(el("thead", {}, head), el("tbody", {}, rows));
}

function sqlCell(v) {
  if (v === null || v === undefined) return el("td", {}, el("span", { class: "null", text: "null" }));
  if (typeof v === "object") {
    const s = JSON.stringify(v);
    return el("td", { class: "mono", title: s, text: s.length > 300 ? s.slice(0, 300) + "…" : s });
  }
  return el("td", { class: typeof v === "number" ? "num" : null, text: String(v) });
}

// ---------- start ----------

window.addEventListener("hashchange", route);
route();

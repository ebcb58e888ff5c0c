// The run viewer: plain JS, no build step, no CDN. It talks to the gateway's /v1 API.
//
// Decide, then do: `apply(view, event)` folds one event into the view (a plain object)
// and touches nothing; `render(view)` draws it. The view and the seq of the last event
// folded into it are saved together in sessionStorage after every event, so a reload
// draws the same page and resumes with `?after=<that seq>`: no event is applied twice
// and none is skipped. Everything shown comes from a model or a machine: it is set as
// text, never as HTML.
//
// Every refusal of the gateway (401, 403, 413, 422, 429, 503…) is shown in the notice
// under the header, always visible, with its status; a 401 also marks the token box as
// needed. The runs started here are kept in localStorage (the gateway lists none) and
// listed under "Recent runs", each a link that reopens its event stream.
"use strict";

const TERMINAL = new Set(["DONE", "ERROR", "CANCELLED"]);
const $ = (id) => document.getElementById(id);
let follower = null; // the AbortController of the stream being read

// --- the view: pure ------------------------------------------------------------------

function emptyView(runId) {
  return { runId, lastSeq: 0, answer: "", status: "running", tools: {}, order: [], end: null };
}

function tool(view, id, data) {
  if (!view.tools[id]) {
    view.tools[id] = { id, tool: data.tool, machine: data.machine, input: data.input, state: "running" };
    view.order.push(id);
  }
  return view.tools[id];
}

function apply(view, event) {
  if (event.seq <= view.lastSeq) return view; // already folded in
  const d = event.data || {};
  switch (event.type) {
    case "TOKEN":
      if (view.answer && view.textTurn !== event.turn) view.answer += "\n\n"; // a new turn's text
      view.textTurn = event.turn;
      view.answer += d.text;
      break;
    case "TOOL_START":
      tool(view, d.tool_call_id, d).started_ms = event.ts_ms;
      break;
    case "TOOL_END": {
      const t = tool(view, d.tool_call_id, d);
      t.state = d.status || (d.is_error ? "error" : "ok");
      t.output = d.output;
      t.duration_ms = d.duration_ms;
      t.waited_ms = d.waited_ms || 0;
      t.elapsed_ms = t.started_ms != null ? event.ts_ms - t.started_ms : null;
      t.approval = t.approval && t.approval.verdict ? t.approval : null;
      break;
    }
    case "APPROVAL_REQUEST": {
      const t = tool(view, d.tool_call_id, d);
      t.state = "waiting";
      t.approval = { reason: d.reason, timeout_s: d.timeout_s, input: d.input, verdict: null, shown: d };
      break;
    }
    case "APPROVAL_RESOLVED": {
      const t = tool(view, d.tool_call_id, d);
      t.approval = { ...(t.approval || {}), verdict: d.verdict, by: d.by };
      if (t.state === "waiting") t.state = d.verdict === "approved" ? "running" : d.verdict;
      break;
    }
    case "STEERED":
      view.answer += (view.answer ? "\n" : "") + "» " + d.text + "\n";
      break;
    default:
      if (TERMINAL.has(event.type)) {
        view.status = event.type;
        view.end = { ...d };
        for (const id of view.order) {
          if (view.tools[id].state === "running" || view.tools[id].state === "waiting") {
            view.tools[id].state = "cancelled";
          }
        }
      }
  }
  view.lastSeq = event.seq;
  return view;
}

// --- drawing -------------------------------------------------------------------------

function text(tag, value, cls) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  el.textContent = value == null ? "" : String(value);
  return el;
}

function short(value, n) {
  const s = typeof value === "string" ? value : JSON.stringify(value);
  return s && s.length > n ? s.slice(0, n) + "…" : s || "";
}

function render(view) {
  $("run-view").hidden = false;
  $("run-id").textContent = view.runId;
  $("status").textContent = view.status;
  $("status").dataset.status = view.status;
  $("answer").textContent = view.answer;
  document.body.dataset.seq = String(view.lastSeq);
  const body = $("tools").tBodies[0];
  for (const id of view.order) renderTool(body, view, view.tools[id]);
  $("stop").disabled = view.status !== "running";
  $("usage").textContent = view.end ? usageLine(view) : "";
}

function renderTool(body, view, t) {
  let row = body.querySelector(`tr[data-call="${CSS.escape(t.id)}"]`);
  if (!row) {
    row = document.createElement("tr");
    row.className = "tool-row";
    row.dataset.call = t.id;
    row.dataset.machine = t.machine || "";
    for (const cls of ["tool", "machine", "input", "state", "output"]) row.appendChild(text("td", "", cls));
    row.cells[0].textContent = t.tool;
    row.cells[1].textContent = t.machine || "—";
    row.cells[2].textContent = short(t.input, 300);
    body.appendChild(row);
  }
  const key = `${t.state}|${t.approval ? t.approval.verdict : ""}|${t.output == null ? "" : "o"}`;
  if (row.dataset.key === key) return;
  row.dataset.key = key;
  row.dataset.state = t.state;
  const cell = row.cells[3];
  cell.replaceChildren();
  if (t.state === "running") {
    cell.appendChild(text("span", "", "spinner"));
    cell.appendChild(text("span", "running"));
  } else if (t.state === "waiting") {
    cell.appendChild(text("span", "needs approval: " + (t.approval.reason || "")));
    cell.appendChild(approvalButtons(view, t));
  } else {
    const ran = t.duration_ms != null ? ` (${took(t.duration_ms, t.waited_ms, t.elapsed_ms)})` : "";
    cell.appendChild(text("span", t.state + ran));
  }
  if (t.approval && t.approval.verdict) cell.appendChild(text("div", `${t.approval.verdict} by ${t.approval.by}`, "muted"));
  row.cells[4].textContent = t.output == null ? "" : t.output;
}

function approvalButtons(view, t) {
  const box = text("div", "", "approval");
  const yes = text("button", "Approve", "approve");
  const no = text("button", "Deny", "deny");
  const edit = text("button", "Edit input…", "edit");
  // what this page showed goes with the answer: refused if the call's record asks otherwise
  const shown = t.approval.shown;
  yes.onclick = () => answerCall(view.runId, t.id, { approve: true, shown });
  no.onclick = () => answerCall(view.runId, t.id, { approve: false, reason: "denied in the run viewer", shown });
  edit.onclick = () => {
    const area = text("textarea", JSON.stringify(t.approval.input, null, 2));
    area.rows = 4;
    const go = text("button", "Approve with this input", "approve-edited");
    go.onclick = () => {
      let input;
      try { input = JSON.parse(area.value); } catch (e) { return notice("input is not JSON: " + e.message); }
      answerCall(view.runId, t.id, { approve: true, input, shown });
    };
    edit.replaceWith(area, go);
  };
  box.append(yes, no, edit);
  return box;
}

// The figures as every screen says them: these two mirror cmdop_worker/core/figures.py.
function figures(u) {
  const n = (v) => Math.trunc(Number(v || 0));
  const cost = u.cost_usd === undefined ? 0 : u.cost_usd;
  return [
    `${n(u.input_tokens)} in`,
    `${n(u.cache_read_input_tokens)} cache read`,
    `${n(u.cache_creation_input_tokens)} cache write`,
    `${n(u.output_tokens)} out`,
    cost === null ? "cost unknown" : `$${Number(cost).toFixed(4)}`,
  ].join(" · ");
}

function took(durationMs, waitedMs, elapsedMs) {
  const ran = durationMs > 0 || elapsedMs == null ? durationMs : Math.max(elapsedMs, 0);
  let said = `${(ran / 1000).toFixed(2)}s`;
  if (waitedMs > 0) said += `, waited ${(waitedMs / 1000).toFixed(1)}s for approval`;
  return said;
}

function usageLine(view) {
  const e = view.end, u = e.usage || {};
  const parts = [view.status];
  if (e.turns != null) parts.push(`${e.turns} turn${e.turns === 1 ? "" : "s"}`);
  parts.push(figures(u));
  if (e.stop_reason) parts.push(e.stop_reason);
  if (e.message) parts.push(`${e.kind}: ${e.message}`);
  if (e.reason) parts.push(`${e.channel} cancel: ${e.reason}`);
  return parts.join(" · ");
}

// The notice under the header: `source` says who set it, so that one clears it when
// what failed works again (the machine list's 503 goes once Redis answers).
let noticeSource = "";
function notice(message, source = "", kind = "error") {
  const el = $("notice");
  el.textContent = message || "";
  el.hidden = !message;
  el.dataset.kind = kind;
  noticeSource = message ? source : "";
}

function clearNotice(source) { if (noticeSource === source) notice(""); }

// What a refusal says to a person: its status, the gateway's code and message, and
// what to do about a missing token.
function refusal(status, data) {
  const code = (data && data.error) || "error";
  const said = (data && data.message) || "";
  let text = `${status} ${code}${said ? ": " + said : ""}`;
  if (status === 401) text += " · enter the gateway's token at the top right";
  const e = new Error(text);
  e.status = status;
  return e;
}

// Whether the gateway wants a token, as its last answer said: the box says so (an
// answer to a request sent with no token at all says that none is needed).
function tokenNeeded(needed) {
  const box = $("token");
  box.classList.toggle("needed", needed);
  if (needed) box.placeholder = "required: this gateway needs a token";
  else if (!sessionStorage.getItem("cmdop.token")) box.placeholder = "none needed";
}

// --- the API -------------------------------------------------------------------------

// X-Cmdop-Client: a gateway without tokens takes writes only with it, because a page on
// another origin cannot send it (the browser would ask the gateway first, which says no).
function headers(json) {
  const h = { "X-Cmdop-Client": "viewer" };
  const token = sessionStorage.getItem("cmdop.token");
  if (token) h["Authorization"] = "Bearer " + token;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function api(method, path, body) {
  let res;
  try {
    res = await fetch(path, { method, headers: headers(body !== undefined), body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) { throw new Error("the gateway cannot be reached: " + e.message); }
  const data = res.status === 204 ? null : await res.json().catch(() => null);
  if (res.status === 401) tokenNeeded(true);
  if (!res.ok) throw refusal(res.status, data);
  return data;
}

async function answerCall(runId, callId, answer) {
  try {
    await api("POST", `/v1/runs/${runId}/approvals/${encodeURIComponent(callId)}`, answer);
    clearNotice("approval");
  } catch (e) { notice(e.message, "approval"); }
}

function save(view) {
  sessionStorage.setItem("cmdop.view." + view.runId, JSON.stringify(view));
}

function load(runId) {
  try { return JSON.parse(sessionStorage.getItem("cmdop.view." + runId)); } catch (e) { return null; }
}

// --- recent runs: localStorage, newest first -----------------------------------------

const RECENT = "cmdop.recent", RECENT_MAX = 30;

function recentRuns() {
  try { return JSON.parse(localStorage.getItem(RECENT)) || []; } catch (e) { return []; }
}

function remember(runId, fields) {
  const runs = recentRuns();
  let entry = runs.find((r) => r.runId === runId);
  if (!entry) {
    entry = { runId, prompt: "", thread: "", status: "", at: Date.now() };
    runs.unshift(entry);
  }
  Object.assign(entry, fields);
  localStorage.setItem(RECENT, JSON.stringify(runs.slice(0, RECENT_MAX)));
  renderRecent();
}

function renderRecent() {
  const runs = recentRuns();
  const current = new URL(location.href).searchParams.get("run");
  $("recent-runs").replaceChildren(...(runs.length ? runs.map((r) => {
    const li = text("li", "");
    li.dataset.run = r.runId;
    const link = text("a", r.runId);
    const url = new URL(location.href);
    url.search = "";
    url.searchParams.set("run", r.runId);
    link.href = url.pathname + url.search;
    if (r.runId === current) link.setAttribute("aria-current", "page");
    li.append(link, text("span", ` · ${r.status || "…"} · ${short(r.prompt || "", 80)}`, "muted"));
    if (r.thread) {
      const thread = text("a", `thread ${r.thread}`, "thread");
      thread.href = "#";
      thread.title = "continue this thread";
      thread.onclick = (ev) => { ev.preventDefault(); $("thread").value = r.thread; $("prompt").focus(); };
      li.append(thread);
    }
    return li;
  }) : [text("li", "none yet in this browser", "muted")]));
}

// Read the run's events from `view.lastSeq` on until its terminal one, reconnecting
// (from the last seq folded in) whenever the stream drops.
async function follow(view) {
  if (follower) follower.abort();
  const ctl = follower = new AbortController();
  render(view);
  let misses = 0;
  while (!ctl.signal.aborted && !TERMINAL.has(view.status)) {
    let res;
    try {
      res = await fetch(`/v1/runs/${view.runId}/events?after=${view.lastSeq}`, { headers: headers(false), signal: ctl.signal });
    } catch (e) {
      if (ctl.signal.aborted) return;
      notice("connection lost; reconnecting…"); await sleep(1000); continue;
    }
    if (res.status === 204) break;
    if (res.status === 404 && misses++ < 60) { notice("waiting for a coordinator to take the run…", "stream", "info"); await sleep(1000); continue; }
    if (!res.ok) {
      if (res.status === 401) tokenNeeded(true);
      const said = refusal(res.status, await res.json().catch(() => null)).message;
      if (res.status === 503) { notice(said + " · retrying", "stream"); await sleep(2000); continue; }
      notice(said, "stream");
      return;
    }
    clearNotice("stream");
    await readStream(res, view, ctl);
  }
  if (TERMINAL.has(view.status)) remember(view.runId, { status: view.status });
}

async function readStream(res, view, ctl) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue; // a ping
        apply(view, JSON.parse(data));
        save(view);
        render(view);
      }
    }
  } catch (e) {
    if (!ctl.signal.aborted) notice("stream dropped; resuming…", "stream", "info");
  }
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function submit(ev) {
  ev.preventDefault();
  const request = { prompt: $("prompt").value };
  if ($("machine").value) request.machine = $("machine").value;
  const thread = $("thread").value.trim();
  if (thread) request.on_busy = "enqueue"; // a message while the thread runs waits its turn
  try {
    const path = thread ? `/v1/threads/${encodeURIComponent(thread)}/runs` : "/v1/runs";
    const created = await api("POST", path, request);
    clearNotice("submit");
    remember(created.run_id, { prompt: request.prompt, thread, status: "", at: Date.now() });
    const view = emptyView(created.run_id);
    const url = new URL(location.href);
    url.searchParams.set("run", created.run_id);
    history.replaceState(null, "", url);
    $("tools").tBodies[0].replaceChildren();
    save(view);
    follow(view);
  } catch (e) { notice(e.message, "submit"); }
}

async function stop() {
  const runId = new URL(location.href).searchParams.get("run");
  if (!runId) return;
  $("stop").disabled = true;
  try { await api("POST", `/v1/runs/${runId}/cancel`, { channel: "ui", reason: "Stop button" }); } catch (e) { notice(e.message, "stop"); }
}

// The machines a label selector matches (`/v1/machines?selector=`); the box left empty,
// every machine. A selector the gateway refuses (422) is said beside the box.
async function machines() {
  const selector = $("selector").value.trim();
  const path = selector ? `/v1/machines?selector=${encodeURIComponent(selector)}` : "/v1/machines";
  let list;
  try {
    list = await api("GET", path);
    $("selector-error").textContent = "";
    clearNotice("machines");
    tokenNeeded(false);
  } catch (e) {
    if (selector && e.status === 422) { $("selector-error").textContent = e.message; return; }
    notice(e.message, "machines");
    const why = e.status === 401 ? "a token is required to see the machines" : "unknown: " + e.message;
    $("machines").replaceChildren(text("li", why, "muted"));
    return;
  }
  try {
    const ul = $("machines"), select = $("machine"), chosen = select.value;
    const none = selector ? "no machines online match the selector" : "no machines online";
    ul.replaceChildren(...(list.length ? list.map((m) => {
      const li = text("li", "");
      li.dataset.machine = m.machine;
      const labels = Object.entries(m.labels || {}).sort().map(([k, v]) => `${k}=${v}`).join(",");
      li.append(text("span", "", "dot"), text("span", `${m.machine} · ${m.host} · ${m.tools.length} tools`));
      if (labels) li.append(text("span", ` · ${labels}`, "labels"));
      return li;
    }) : [text("li", none, "muted")]));
    select.replaceChildren(select.options[0], ...list.map((m) => {
      const o = text("option", m.machine); o.value = m.machine; return o;
    }));
    select.value = list.some((m) => m.machine === chosen) ? chosen : "";
  } catch (e) { notice(e.message, "machines"); }
}

function start() {
  $("token").value = sessionStorage.getItem("cmdop.token") || "";
  $("token").onchange = () => {
    sessionStorage.setItem("cmdop.token", $("token").value.trim());
    notice(""); // what the old token was refused is no longer the news
    machines();
  };
  $("ask-form").onsubmit = submit;
  $("stop").onclick = stop;
  $("selector").onchange = machines;
  $("selector").onkeydown = (e) => { if (e.key === "Enter") { e.preventDefault(); machines(); } };
  machines();
  setInterval(machines, 3000);
  renderRecent();
  const runId = new URL(location.href).searchParams.get("run");
  if (runId && /^[A-Za-z0-9_-]{1,64}$/.test(runId)) {
    const saved = load(runId);
    if (!recentRuns().some((r) => r.runId === runId)) remember(runId, {});
    follow(saved && saved.runId === runId ? saved : emptyView(runId));
  }
}

start();

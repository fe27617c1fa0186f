// stopline console: a chat that streams through /v1/chat/completions, and a live view of
// the engine read from /v1/console/snapshot. Plain JS, no dependencies, nothing fetched from
// outside this server.
"use strict";

const POLL_MS = 250; // the live view updates 4 times a second
const KEY_STORE = "stopline.apiKey";
const $ = (id) => document.getElementById(id);

// What tests (and curious users, in the devtools console) can read.
const live = (window.stopline = {
  polls: 0, // snapshots drawn
  snapshot: null, // the latest one
  mine: new Set(), // request ids this tab sent
  needKey: false,
});

const chat = { turns: [], current: null }; // turns: {role, content, el, failed}

// ---- auth ----------------------------------------------------------------------------------
function apiKey() { return localStorage.getItem(KEY_STORE) || ""; }

function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function askKey(message) {
  live.needKey = true;
  $("key-error").textContent = message || "";
  $("key-dialog").hidden = false;
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  localStorage.setItem(KEY_STORE, $("key-input").value.trim());
  $("key-input").value = "";
  $("key-dialog").hidden = true;
  live.needKey = false;
});

$("forget-key").addEventListener("click", () => {
  localStorage.removeItem(KEY_STORE);
  askKey();
});

// ---- chat ----------------------------------------------------------------------------------
function addMessage(role, text) {
  $("empty")?.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  el.appendChild(body);
  if (role === "assistant") {
    const meta = document.createElement("div");
    meta.className = "meta";
    el.appendChild(meta);
  }
  $("messages").appendChild(el);
  scrollDown(true);
  return el;
}

function scrollDown(force) {
  const box = $("messages");
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regen").disabled = busy || !chat.turns.some((t) => t.role === "user");
  $("clear").disabled = busy;
}

function numberOr(id, fallback) {
  const v = $(id).value.trim();
  return v === "" ? fallback : Number(v);
}

function requestBody(messages) {
  const body = {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: numberOr("temperature", 0.7), max_tokens: numberOr("max-tokens", 512),
  };
  const seed = numberOr("seed", null);
  if (seed !== null) body.seed = seed;
  const extra = $("extra").value.trim();
  if (extra) Object.assign(body, JSON.parse(extra)); // a bad JSON throws: shown as the error
  return body;
}

function send(text) {
  chat.turns.push({ role: "user", content: text, el: addMessage("user", text) });
  generate();
}

async function generate() {
  const messages = chat.turns.filter((t) => !t.failed).map((t) => ({ role: t.role, content: t.content }));
  const turn = { role: "assistant", content: "", el: addMessage("assistant", "") };
  chat.turns.push(turn);
  const run = (chat.current = {
    turn, ctrl: new AbortController(), id: null, chunks: 0, reason: null, usage: null,
    stopped: false, t0: performance.now(), firstAt: null, error: null,
  });
  turn.el.classList.add("streaming");
  setBusy(true);
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(requestBody(messages)), signal: run.ctrl.signal,
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => null);
      if (resp.status === 401) askKey(err?.error?.message);
      throw new Error(`HTTP ${resp.status}: ${err?.error?.message || resp.statusText}`);
    }
    run.id = resp.headers.get("X-Request-Id");
    if (run.id) live.mine.add(run.id);
    await readStream(resp.body.getReader(), run);
  } catch (e) {
    if (!run.stopped) run.error = e.message || String(e);
  }
  if (run.stopped && run.reason === null) await confirmStop(run);
  finish(run);
}

async function readStream(reader, run) {
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read(); // throws AbortError after Stop
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) onData(line.slice(6), run);
      }
    }
  }
}

function onData(data, run) {
  if (data === "[DONE]") return;
  const msg = JSON.parse(data);
  if (msg.error) { run.error = msg.error.message; return; }
  if (!run.id && msg.id) { run.id = msg.id; live.mine.add(msg.id); }
  if (msg.usage) run.usage = msg.usage;
  for (const c of msg.choices || []) {
    const delta = c.delta || {};
    if (typeof delta.content === "string" && !delta.role) {
      run.chunks += 1; // one chunk per engine output: one token, bar a held-back byte
      if (run.firstAt === null) run.firstAt = performance.now();
      run.turn.content += delta.content;
      draw(run);
    }
    if (c.finish_reason) { run.reason = c.finish_reason; run.detail = c.stop_detail; }
  }
}

// Text is drawn once per frame: a fast model sends far more chunks than a screen shows.
function draw(run) {
  if (run.drawing) return;
  run.drawing = true;
  requestAnimationFrame(() => {
    run.drawing = false;
    run.turn.el.querySelector(".body").textContent = run.turn.content;
    scrollDown(false);
  });
}

// Stop closes the stream: the server sees the disconnect and the engine aborts the request.
// A moment later the page asks the server how it ended. The cancel endpoint is idempotent: for
// a request already over it changes nothing and says why it ended; for one still open (a
// proxy that kept the upstream connection after the browser closed its side) it cancels it.
// The wait lets the disconnect land first, so the abort is counted under its real source.
const CONFIRM_AFTER_MS = 300;

async function confirmStop(run) {
  run.reason = "abort";
  if (!run.id) return;
  await new Promise((r) => setTimeout(r, CONFIRM_AFTER_MS));
  try {
    const resp = await fetch(`/v1/requests/${encodeURIComponent(run.id)}/cancel`,
      { method: "POST", headers: headers() });
    const body = await resp.json();
    if (resp.ok && body.finish_reasons) {
      run.reason = body.finish_reasons[0] || "abort";
      run.confirmed = true;
    }
  } catch (e) {
    // the stream is closed either way; the reason stays the one this page knows
  }
}

function finish(run) {
  const { turn } = run;
  turn.el.classList.remove("streaming");
  turn.el.querySelector(".body").textContent = turn.content;
  const meta = turn.el.querySelector(".meta");
  const secs = (performance.now() - run.t0) / 1000;
  if (run.error && !run.reason) {
    turn.failed = true;
    meta.innerHTML = "";
    meta.append(span("reason abort", "error"), ` ${run.error}`);
    meta.dataset.finish = "error";
  } else {
    const reason = run.reason || "unknown";
    meta.dataset.finish = reason;
    meta.innerHTML = "";
    meta.append("finish ", span(`reason ${reason}`, reason));
    let usage;
    if (run.usage) {
      const u = run.usage;
      usage = `${u.prompt_tokens} prompt + ${u.completion_tokens} completion = ${u.total_tokens} tokens`;
      meta.dataset.completionTokens = u.completion_tokens;
    } else {
      usage = `${run.chunks} tokens received`;
      meta.dataset.completionTokens = run.chunks;
    }
    const ttft = run.firstAt === null ? "" : ` · first token ${((run.firstAt - run.t0) / 1000).toFixed(2)} s`;
    meta.append(` · ${usage} · ${secs.toFixed(2)} s${ttft}`);
    if (run.stopped) meta.append(run.confirmed ? " · stopped (server confirms)" : " · stopped");
    if (run.detail) meta.append(` · ${run.detail}`);
  }
  if (run.id) meta.title = run.id;
  meta.dataset.requestId = run.id || "";
  chat.current = null;
  setBusy(false);
}

function span(cls, text) {
  const s = document.createElement("span");
  s.className = cls;
  s.textContent = text;
  return s;
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.current) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => {
  const run = chat.current;
  if (!run || run.stopped) return;
  run.stopped = true;
  run.ctrl.abort();
});

$("regen").addEventListener("click", () => {
  if (chat.current) return;
  // Drop everything after the last user message and answer it again.
  while (chat.turns.length && chat.turns[chat.turns.length - 1].role !== "user") {
    chat.turns.pop().el.remove();
  }
  if (chat.turns.length) generate();
});

$("clear").addEventListener("click", () => {
  if (chat.current) return;
  for (const t of chat.turns) t.el.remove();
  chat.turns = [];
  setBusy(false);
});

// ---- live view -----------------------------------------------------------------------------
function colorOf(id) {
  let h = 0;
  for (let i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
  return `hsl(${h % 360}, 62%, 48%)`;
}

const FREE = "#e3e7ec", CACHED = "#9aa5b1", HELD = "#4a5560";
const short = (id) => (id.length > 18 ? `${id.slice(0, 9)}…${id.slice(-6)}` : id);

async function poll() {
  for (;;) {
    const t0 = performance.now();
    if (!live.needKey) {
      try {
        const resp = await fetch("/v1/console/snapshot", { headers: headers(), cache: "no-store" });
        if (resp.status === 401) {
          const err = await resp.json().catch(() => null);
          askKey(apiKey() ? err?.error?.message : "");
        } else if (resp.ok) {
          render(await resp.json());
        }
      } catch (e) {
        $("engine-state").textContent = "unreachable";
        $("engine-state").className = "pill bad";
      }
    }
    await new Promise((r) => setTimeout(r, Math.max(0, POLL_MS - (performance.now() - t0))));
  }
}

function render(s) {
  live.snapshot = s;
  live.polls += 1;
  $("model").textContent = s.model;
  $("engine-state").textContent = s.engine;
  $("engine-state").className = `pill ${s.engine === "ready" ? "ready" : s.engine === "dead" ? "bad" : ""}`;
  $("forget-key").hidden = !apiKey();
  drawPool(s);
  drawRequests(s);
  drawSpeed(s);
  drawStops(s);
  const age = s.age_s === null ? "" : ` · snapshot taken ${(s.age_s * 1000).toFixed(0)} ms before`;
  $("updated").textContent = `update ${live.polls} · step ${s.steps}${age}`;
}

function drawPool(s) {
  const p = s.pool, canvas = $("pool"), ctx = canvas.getContext("2d");
  const owner = new Array(p.total).fill(null); // block -> the live sequences holding it
  for (const q of s.live) for (const b of q.block_ids) (owner[b] ||= []).push(q);
  const cached = new Set(p.cached_ids);
  let mine = 0, owned = 0;
  for (const list of owner) if (list) { owned += 1; if (list.some((q) => live.mine.has(q.id))) mine += 1; }
  const width = canvas.clientWidth || 440;
  const cell = Math.max(2, Math.min(14, Math.floor(Math.sqrt((width * 160) / Math.max(1, p.total)))));
  const cols = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(p.total / cols);
  canvas.width = cols * cell;
  canvas.height = Math.max(cell, rows * cell);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const gap = cell >= 5 ? 1 : 0;
  if (p.complete_map) {
    for (let b = 0; b < p.total; b++) {
      const list = owner[b];
      ctx.fillStyle = list ? colorOf(list[0].id) : cached.has(b) ? CACHED : FREE;
      ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - gap, cell - gap);
      if (list && list.length > 1 && cell >= 6) { // shared by several tables (prefix, n > 1)
        ctx.fillStyle = "#fff";
        ctx.fillRect((b % cols) * cell + cell / 2 - 1, Math.floor(b / cols) * cell + cell / 2 - 1, 2, 2);
      }
    }
  } else {
    // Too many blocks to list each step: the same counts as runs (used, cached, free).
    const runs = [[HELD, p.used], [CACHED, p.cached], [FREE, p.free]];
    let b = 0;
    for (const [color, n] of runs) {
      ctx.fillStyle = color;
      for (let i = 0; i < n; i++, b++) ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - gap, cell - gap);
    }
  }
  // Used but in no live table: blocks behind the fence, waiting for the step in flight.
  const held = p.complete_map ? p.used - owned : 0;
  canvas.dataset.used = p.used;
  canvas.dataset.cached = p.cached;
  canvas.dataset.free = p.free;
  canvas.dataset.mine = mine;
  canvas._owner = owner;
  canvas._cols = cols;
  canvas._cell = cell;
  canvas._cached = cached;
  $("pool-title").textContent = `${p.total} blocks of ${p.block_size} tokens`;
  const legend = $("pool-legend");
  legend.innerHTML = "";
  const item = (color, text, id) => {
    const e = document.createElement("span");
    if (id) e.id = id;
    e.innerHTML = `<i class="sw" style="background:${color}"></i>`;
    e.append(text);
    legend.appendChild(e);
  };
  item("linear-gradient(90deg,#d33,#3a3,#36c)", `owned ${p.used - held}`, "pool-owned");
  if (held) item(HELD, `fenced ${held}`, "pool-held");
  item(CACHED, `cached ${p.cached}`, "pool-cached");
  item(FREE, `free ${p.free}`, "pool-free");
  if (mine) item(colorOf([...live.mine].pop()), `this tab ${mine}`, "pool-mine");
  if (!p.complete_map) item(HELD, "(too many to map per block: counts only)");
  drawGroups(p);
}

// Every KV layer group's pool (Gemma 3: global layers, then local ones of a window): the map
// above is group 0's; each group here as used / cached / free of its total.
function drawGroups(p) {
  const box = $("pool-groups");
  box.innerHTML = "";
  const groups = p.groups || [];
  if (groups.length < 2) return;
  $("pool-title").textContent += ` · ${groups.length} layer groups (the map: group 0)`;
  for (const g of groups) {
    const e = document.createElement("span");
    e.id = `pool-group-${g.group}`;
    const bar = document.createElement("i");
    bar.className = "sw";
    const pct = (n) => (100 * n) / Math.max(1, g.total);
    const u = pct(g.used), c = u + pct(g.cached);
    bar.style.width = "60px";
    bar.style.background = `linear-gradient(90deg,${HELD} ${u}%,${CACHED} ${u}% ${c}%,${FREE} ${c}%)`;
    e.append(bar, `group ${g.group} (${g.window ? `window ${g.window}` : "global"}): ` +
      `used ${g.used} · cached ${g.cached} · free ${g.free} of ${g.total}`);
    box.appendChild(e);
  }
}

$("pool").addEventListener("mousemove", (ev) => {
  const c = ev.currentTarget;
  if (!c._cell) return;
  const r = c.getBoundingClientRect();
  const x = Math.floor(((ev.clientX - r.left) * c.width) / r.width / c._cell);
  const y = Math.floor(((ev.clientY - r.top) * c.height) / r.height / c._cell);
  const b = y * c._cols + x;
  const list = c._owner?.[b];
  c.title = list ? `block ${b}: ${list.map((q) => `${q.id}#${q.index} (${q.state})`).join(", ")}`
    : c._cached?.has(b) ? `block ${b}: cached prefix (free, reusable)` : `block ${b}: free`;
});

function drawRequests(s) {
  const c = s.counts;
  $("req-counts").textContent = `${c.running} running · ${c.waiting} waiting · ${c.preempted} preempted · ${s.open_streams} open streams`;
  const body = $("requests").querySelector("tbody");
  body.innerHTML = "";
  for (const q of s.live) {
    const tr = document.createElement("tr");
    tr.dataset.id = q.id;
    tr.dataset.state = q.state;
    if (live.mine.has(q.id)) tr.className = "mine";
    const who = live.mine.has(q.id) ? " (this tab)" : "";
    const idx = q.index ? `#${q.index}` : "";
    const cells = [`<i class="sw" style="background:${colorOf(q.id)}"></i>`, "", q.adapter || "base", q.state, q.tokens, q.blocks];
    cells.forEach((v, i) => {
      const td = document.createElement("td");
      if (i === 0) td.innerHTML = v; else td.textContent = String(v);
      if (i === 1) { td.textContent = short(q.id) + idx + who; td.title = q.id; }
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
  if (!s.live.length) body.innerHTML = '<tr><td></td><td class="dim" colspan="5">idle</td></tr>';
}

const ms = (v) => (v === null || v === undefined ? "–" : `${(v * 1000).toFixed(v < 0.01 ? 2 : 1)} ms`);

function drawSpeed(s) {
  const rows = [
    ["tokens/s", s.tokens_per_s.toFixed(0)],
    [`TTFT (${s.ttft_s.n})`, `p50 ${ms(s.ttft_s.p50)} · p90 ${ms(s.ttft_s.p90)} · p99 ${ms(s.ttft_s.p99)}`],
    [`ITL (${s.itl_s.n})`, `p50 ${ms(s.itl_s.p50)} · p90 ${ms(s.itl_s.p90)} · p99 ${ms(s.itl_s.p99)}`],
  ];
  const body = $("speed").querySelector("tbody");
  body.innerHTML = "";
  for (const [k, v] of rows) {
    const tr = body.insertRow();
    tr.insertCell().textContent = k;
    tr.insertCell().textContent = v;
  }
  body.rows[0].id = "tokens-per-s";
}

function drawStops(s) {
  const fin = $("finished");
  fin.innerHTML = "<b>finished</b>";
  for (const [reason, n] of Object.entries(s.finished).sort()) {
    const e = document.createElement("span");
    e.textContent = `${reason} ${n}`;
    e.dataset.reason = reason;
    e.dataset.n = n;
    fin.appendChild(e);
  }
  // Aborts: one row per source, one column per state the sequence was in.
  const table = $("aborts");
  const states = [...new Set(s.aborts.map((a) => a.state))].sort();
  const sources = [...new Set(s.aborts.map((a) => a.source))].sort();
  const n = {};
  for (const a of s.aborts) n[`${a.source}/${a.state}`] = a.n;
  table.tHead.innerHTML = "";
  table.tBodies[0].innerHTML = "";
  if (!s.aborts.length) {
    table.tBodies[0].innerHTML = '<tr><td class="dim">no aborts yet</td></tr>';
  } else {
    const h = table.tHead.insertRow();
    h.insertCell().textContent = "aborts: source \\ state";
    for (const st of states) h.insertCell().textContent = st;
    for (const src of sources) {
      const tr = table.tBodies[0].insertRow();
      tr.dataset.source = src;
      tr.insertCell().textContent = src;
      for (const st of states) tr.insertCell().textContent = n[`${src}/${st}`] || 0;
    }
  }
  table.dataset.total = s.aborts.reduce((a, b) => a + b.n, 0);
  const pre = $("preemptions");
  const modes = Object.entries(s.preemptions);
  pre.textContent = `preemptions: ${modes.length ? modes.map(([m, k]) => `${m} ${k}`).join(" · ") : "none"}` +
    ` · recomputed tokens ${s.recomputed_tokens} · computed after an abort (never sent) ${s.tokens_after_abort}`;
  const last = $("last-aborts");
  last.innerHTML = "";
  if (s.last_aborts.length) {
    const a = s.last_aborts[0];
    last.textContent = `last abort (${a.source}, ${short(a.id)}): accepted ${a.accept_ms.toFixed(1)} ms · ` +
      `quiet ${a.quiet_ms.toFixed(1)} ms · blocks back ${a.reclaim_ms.toFixed(1)} ms after the ${a.source}`;
  }
}

setBusy(false);
poll();

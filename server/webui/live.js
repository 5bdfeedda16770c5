// The live iteration view: reads /live/events (server.live_feed) and draws one row per request and one
// column per iteration, so a request is seen joining the running batch at the next step and leaving it
// the step it finishes. Drawing happens at most once a frame, whatever the event rate.
import { AuthError, apiFetch, apiKey, askForKey, readEvents } from "./api.js";

const MAX_COLUMNS = 1500; // iterations kept in memory (the canvas shows as many as fit)
const TABLE_ROWS = 100; // iterations listed in the table (it scrolls)
const CELL_W = 9;
const ROW_H = 18;
const LABEL_W = 150;
const HEAD_H = 20;
const STRIP_H = 56; // tokens per step and KV usage, under the grid
const MAX_ROWS = 48; // requests drawn at once; the oldest of a crowded window are left out

const $ = (id) => document.getElementById(id);
const ui = {
  dot: $("status-dot"),
  status: $("status"),
  pause: $("pause"),
  clear: $("clear"),
  rate: $("c-rate"),
  batch: $("c-batch"),
  tokens: $("c-tokens"),
  time: $("c-time"),
  spec: $("c-spec"),
  waiting: $("c-waiting"),
  kv: $("c-kv"),
  kvMeter: $("kv-meter"),
  canvas: $("timeline"),
  wrap: $("timeline-wrap"),
  empty: $("timeline-empty"),
  tooltip: $("tooltip"),
  steps: $("steps"),
  windowNote: $("window-note"),
};

let hello = null; // the stream's first event: model, limits
let firstMessage = false; // the next steps message is the first of a (re)connection
let columns = []; // oldest first: a step, or a gap {gap: {from, to, finished, preempted, reason}}
let lastStep = 0;
let paused = false;
let dirty = false;
const rates = []; // [time, step] of recent messages, for steps/s
let layout = null; // what the last drawing put where, for the tooltip

// ---- short labels ----------------------------------------------------------------------------------

// "chatcmpl-3f2a1c…-0" -> "chat 3f2a1c"; "cmpl-…-2" -> "cmpl 9b0e44 #2"; anything else: its tail.
function shortLabel(id) {
  const m = /^(chatcmpl|cmpl)-([0-9a-f]{6})[0-9a-f]*-(\d+)$/.exec(id);
  if (!m) return id.length > 18 ? `…${id.slice(-17)}` : id;
  return `${m[1] === "chatcmpl" ? "chat" : "cmpl"} ${m[2]}${m[3] === "0" ? "" : ` #${m[3]}`}`;
}

// ---- the stream ------------------------------------------------------------------------------------

function setStatus(text, kind) {
  ui.status.textContent = text;
  ui.dot.className = `dot ${kind}`;
}

async function connect() {
  let delay = 1000;
  for (;;) {
    try {
      const response = await apiFetch("/live/events", { headers: { Accept: "text/event-stream" } });
      setStatus("live", "ok");
      delay = 1000;
      await readEvents(response, onEvent);
      setStatus("stream ended; reconnecting…", "warn");
    } catch (err) {
      if (err instanceof AuthError) {
        setStatus("API key needed", "bad");
        const reason = apiKey() ? "The server did not accept that key." : "";
        if (await askForKey(reason)) continue;
        return;
      }
      setStatus(`disconnected (${err.message}); retrying…`, "bad");
    }
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(delay * 2, 10000);
  }
}

function onEvent({ event, data }) {
  const message = JSON.parse(data);
  if (event === "hello") {
    hello = message;
    firstMessage = true;
    document.title = `Live iterations · ${hello.model} · orca-serve`;
    setStatus(`live · ${hello.model} · ${hello.scheduling}-level scheduling`, "ok");
    return;
  }
  if (event !== "steps") return;
  if (firstMessage && message.steps.length && message.steps.at(-1).step < lastStep) {
    columns = []; // the server restarted: its step numbers began again
    lastStep = 0;
  }
  firstMessage = false;
  const steps = message.steps.filter((s) => s.step > lastStep);
  if (!steps.length) return; // a reconnect's backlog we already have
  if (message.gap && message.gap.to > lastStep) {
    columns.push({ gap: { ...message.gap, from: Math.max(message.gap.from, lastStep + 1), reason: "sampled" } });
  } else if (lastStep && steps[0].step > lastStep + 1) {
    // Messages this viewer read too slowly to get were dropped by the server.
    columns.push({ gap: { from: lastStep + 1, to: steps[0].step - 1, finished: [], preempted: [], reason: "dropped" } });
  }
  columns.push(...steps);
  lastStep = steps[steps.length - 1].step;
  rates.push([message.time, lastStep]);
  while (rates.length > 2 && message.time - rates[0][0] > 3) rates.shift();
  if (columns.length > MAX_COLUMNS) columns = columns.slice(-MAX_COLUMNS);
  if (!paused) scheduleDraw();
}

function scheduleDraw() {
  if (dirty) return;
  dirty = true;
  requestAnimationFrame(() => {
    dirty = false;
    draw();
  });
}

// ---- drawing ---------------------------------------------------------------------------------------

function css(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function visibleWindow() {
  const width = ui.wrap.clientWidth - 8;
  const fit = Math.max(10, Math.floor((width - LABEL_W) / CELL_W));
  return columns.slice(-fit);
}

// Requests in the window, in order of first appearance; those running at the newest step are kept
// when the window holds more than MAX_ROWS.
function rowsOf(view) {
  const order = new Map();
  for (const col of view) {
    if (col.gap) continue;
    for (const id of col.ids) if (!order.has(id)) order.set(id, order.size);
  }
  let ids = [...order.keys()];
  if (ids.length > MAX_ROWS) {
    const last = view.filter((c) => !c.gap).at(-1);
    const running = new Set(last ? last.ids : []);
    const keep = ids.filter((id) => running.has(id)).slice(-MAX_ROWS);
    const rest = ids.filter((id) => !running.has(id)).slice(-(MAX_ROWS - keep.length));
    const kept = new Set([...keep, ...rest]);
    ids = ids.filter((id) => kept.has(id));
  }
  return ids;
}

function draw() {
  const view = visibleWindow();
  const ids = rowsOf(view);
  const rowIndex = new Map(ids.map((id, k) => [id, k]));
  const width = ui.wrap.clientWidth - 8;
  const gridH = Math.max(ids.length, 3) * ROW_H;
  const height = HEAD_H + gridH + 8 + STRIP_H;
  const ratio = window.devicePixelRatio || 1;
  const canvas = ui.canvas;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.height = `${height}px`;
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);

  const color = {
    text: css("--text"),
    muted: css("--muted"),
    border: css("--border"),
    sunken: css("--sunken"),
    decode: css("--decode"),
    prefill: css("--prefill"),
    admit: css("--admit"),
    finish: css("--finish"),
    preempt: css("--preempt"),
    warn: css("--warn"),
  };
  const x0 = LABEL_W;
  const colX = (k) => x0 + k * CELL_W;
  const rowY = (r) => HEAD_H + r * ROW_H;

  // row stripes and labels
  g.font = `12px ${css("--mono") || "monospace"}`;
  g.textBaseline = "middle";
  ids.forEach((id, r) => {
    if (r % 2 === 1) {
      g.fillStyle = color.sunken;
      g.fillRect(0, rowY(r), width, ROW_H);
    }
    g.fillStyle = color.text;
    g.fillText(shortLabel(id), 6, rowY(r) + ROW_H / 2, LABEL_W - 12);
  });

  // columns
  let maxTokens = 1;
  for (const col of view) if (!col.gap) maxTokens = Math.max(maxTokens, col.tokens.reduce((a, b) => a + b, 0));
  const stripY = HEAD_H + gridH + 8;
  g.textBaseline = "alphabetic";
  view.forEach((col, k) => {
    const x = colX(k);
    if (col.gap) {
      g.fillStyle = color.warn;
      g.globalAlpha = 0.25;
      g.fillRect(x + 1, HEAD_H, CELL_W - 2, gridH + 8 + STRIP_H);
      g.globalAlpha = 1;
      return;
    }
    if (col.step % 10 === 0) {
      g.fillStyle = color.muted;
      g.font = "10px system-ui, sans-serif";
      g.fillText(String(col.step), x, HEAD_H - 6);
      g.fillStyle = color.border;
      g.fillRect(x, HEAD_H - 3, 1, gridH + 3);
    }
    col.ids.forEach((id, i) => {
      const r = rowIndex.get(id);
      if (r === undefined) return;
      const y = rowY(r) + 3;
      g.fillStyle = col.decode[i] ? color.decode : color.prefill;
      g.fillRect(x + 1, y, CELL_W - 2, ROW_H - 6);
      if (col.starts[i] === 0) {
        g.fillStyle = color.admit;
        g.fillRect(x, y - 2, 3, ROW_H - 2);
      }
    });
    for (const id of col.finished) {
      const r = rowIndex.get(id);
      if (r === undefined) continue;
      g.fillStyle = color.finish;
      g.fillRect(x + CELL_W - 3, rowY(r) + 1, 3, ROW_H - 2);
    }
    for (const id of col.preempted) {
      const r = rowIndex.get(id);
      if (r === undefined) continue;
      g.strokeStyle = color.preempt;
      g.lineWidth = 2;
      g.beginPath();
      g.moveTo(x + 1, rowY(r) + 3);
      g.lineTo(x + CELL_W - 1, rowY(r) + ROW_H - 3);
      g.moveTo(x + CELL_W - 1, rowY(r) + 3);
      g.lineTo(x + 1, rowY(r) + ROW_H - 3);
      g.stroke();
    }
    // the strip: prompt and decode tokens of the step, and the KV cache in use
    let decodeTokens = 0;
    let promptTokens = 0;
    col.tokens.forEach((n, i) => (col.decode[i] ? (decodeTokens += n) : (promptTokens += n)));
    const scale = (STRIP_H - 4) / maxTokens;
    g.fillStyle = color.decode;
    g.fillRect(x + 1, stripY + STRIP_H - decodeTokens * scale, CELL_W - 2, decodeTokens * scale);
    g.fillStyle = color.prefill;
    g.fillRect(x + 1, stripY + STRIP_H - (decodeTokens + promptTokens) * scale, CELL_W - 2, promptTokens * scale);
    if (col.kv_total) {
      g.fillStyle = color.admit;
      g.fillRect(x, stripY + STRIP_H - (col.kv_used / col.kv_total) * STRIP_H, CELL_W, 2);
    }
  });
  g.fillStyle = color.muted;
  g.font = "11px system-ui, sans-serif";
  g.fillText("tokens / step", 6, stripY + 14);
  g.fillStyle = color.admit;
  g.fillText("— KV in use", 6, stripY + 30);
  g.fillStyle = color.border;
  g.fillRect(x0, stripY + STRIP_H, width - x0, 1);

  layout = { view, ids, stripY, gridH };
  ui.empty.hidden = columns.length > 0;
  const steps = view.filter((c) => !c.gap);
  ui.windowNote.textContent = steps.length ? `steps ${steps[0].step}–${steps.at(-1).step}` : "";
  updateCards();
  updateTable();
}

// ---- numbers and the table -------------------------------------------------------------------------

function updateCards() {
  const steps = columns.filter((c) => !c.gap).slice(-20);
  const last = steps.at(-1);
  if (!last) return;
  if (rates.length > 1) {
    const [t0, s0] = rates[0];
    const [t1, s1] = rates.at(-1);
    ui.rate.textContent = t1 > t0 ? ((s1 - s0) / (t1 - t0)).toFixed(1) : "–";
  }
  ui.batch.textContent = hello ? `${last.ids.length} / ${hello.max_num_seqs}` : String(last.ids.length);
  ui.tokens.textContent = String(last.tokens.reduce((a, b) => a + b, 0));
  const avg = steps.reduce((a, s) => a + s.duration_ms, 0) / steps.length;
  ui.time.textContent = `${avg.toFixed(avg < 10 ? 2 : 1)} ms`;
  ui.waiting.textContent = String(last.waiting);
  // Speculative decoding: a step that verified proposals carries spec / accepted per request.
  let proposed = 0;
  let accepted = 0;
  for (const s of steps) {
    if (!s.spec) continue;
    proposed += s.spec.reduce((a, b) => a + b, 0);
    accepted += s.accepted.reduce((a, b) => a + b, 0);
  }
  ui.spec.textContent = proposed ? `${Math.round((100 * accepted) / proposed)}% of ${proposed}` : "–";
  ui.kv.textContent = `${last.kv_used} / ${last.kv_total}`;
  ui.kvMeter.style.width = `${last.kv_total ? (100 * last.kv_used) / last.kv_total : 0}%`;
}

function chip(kind, text, title) {
  const span = document.createElement("span");
  span.className = `chip ${kind}`;
  span.textContent = text;
  if (title) span.title = title;
  return span;
}

function td(className, ...children) {
  const cell = document.createElement("td");
  if (className) cell.className = className;
  cell.append(...children);
  return cell;
}

// What a decoding request's proposals came to in a step ("" where it proposed none): short for a chip.
function specNote(col, i, short) {
  const k = col.spec ? col.spec[i] : 0;
  if (!k) return "";
  return short ? ` ✓${col.accepted[i]}/${k}` : `, ${col.accepted[i]} of ${k} proposed tokens accepted`;
}

function updateTable() {
  const rows = columns.slice(-TABLE_ROWS).reverse().map((col) => {
    const tr = document.createElement("tr");
    if (col.gap) {
      tr.className = "gap-row";
      const n = col.gap.to - col.gap.from + 1;
      const why = col.gap.reason === "sampled" ? "not sent: the loop ran faster than the view is drawn" : "dropped: this view read too slowly";
      const cell = td("", `${n} step${n === 1 ? "" : "s"} ${why}`);
      cell.colSpan = 8;
      tr.append(td("num", `${col.gap.from}–${col.gap.to}`), cell);
      return tr;
    }
    tr.dataset.step = col.step;
    tr.dataset.ids = col.ids.join(" ");
    tr.dataset.finished = col.finished.join(" ");
    const batch = col.ids.map((id, i) =>
      col.decode[i]
        ? chip("decode", shortLabel(id) + specNote(col, i, true), `${id}: decode at position ${col.starts[i]}${specNote(col, i, false)}`)
        : chip("prefill", `${shortLabel(id)} +${col.tokens[i]}`, `${id}: prompt tokens ${col.starts[i]}–${col.starts[i] + col.tokens[i] - 1}`),
    );
    const admitted = col.ids.filter((_, i) => col.starts[i] === 0).map((id) => chip("admit", shortLabel(id), id));
    tr.append(
      td("num", String(col.step)),
      td("num", `${col.duration_ms.toFixed(1)} ms`),
      td("", ...(batch.length ? batch : ["–"])),
      td("", ...admitted),
      td("", ...col.finished.map((id) => chip("finish", shortLabel(id), id))),
      td("", ...col.preempted.map((id) => chip("preempt", shortLabel(id), id))),
      td("num", `${col.kv_used}/${col.kv_total}`),
      td("num", String(col.waiting)),
    );
    if (col.failed) tr.title = "this step failed; its requests got an error";
    return tr;
  });
  ui.steps.replaceChildren(...rows);
}

// ---- the tooltip -----------------------------------------------------------------------------------

function describe(x, y) {
  if (!layout || x < LABEL_W) return null;
  const col = layout.view[Math.floor((x - LABEL_W) / CELL_W)];
  if (!col) return null;
  if (col.gap) return `steps ${col.gap.from}–${col.gap.to}: ${col.gap.reason}`;
  if (y >= layout.stripY) {
    const tokens = col.tokens.reduce((a, b) => a + b, 0);
    return `step ${col.step}: ${col.ids.length} requests, ${tokens} tokens, ${col.duration_ms.toFixed(2)} ms, KV ${col.kv_used}/${col.kv_total}`;
  }
  const id = layout.ids[Math.floor((y - HEAD_H) / ROW_H)];
  if (id === undefined) return `step ${col.step}`;
  const i = col.ids.indexOf(id);
  const notes = [];
  if (col.finished.includes(id)) notes.push("finished");
  if (col.preempted.includes(id)) notes.push("preempted");
  if (i < 0) return `step ${col.step} · ${id}: not in this batch${notes.length ? ` (${notes.join(", ")})` : ""}`;
  const what = col.decode[i]
    ? `decode, position ${col.starts[i]}${specNote(col, i, false)}`
    : `prompt chunk of ${col.tokens[i]} tokens from position ${col.starts[i]}${col.starts[i] === 0 ? " (admitted)" : ""}`;
  return `step ${col.step} · ${id}: ${what}${notes.length ? ` · ${notes.join(", ")}` : ""}`;
}

ui.canvas.addEventListener("mousemove", (e) => {
  const box = ui.canvas.getBoundingClientRect();
  const text = describe(e.clientX - box.left, e.clientY - box.top);
  ui.tooltip.hidden = !text;
  if (!text) return;
  ui.tooltip.textContent = text;
  const left = Math.min(e.clientX - box.left + 14, ui.wrap.clientWidth - ui.tooltip.offsetWidth - 4);
  ui.tooltip.style.left = `${Math.max(0, left)}px`;
  ui.tooltip.style.top = `${e.clientY - box.top + 16}px`;
});
ui.canvas.addEventListener("mouseleave", () => (ui.tooltip.hidden = true));

// ---- controls --------------------------------------------------------------------------------------

function togglePause() {
  paused = !paused;
  ui.pause.textContent = paused ? "Resume" : "Pause";
  ui.pause.setAttribute("aria-pressed", String(paused));
  if (!paused) scheduleDraw();
}

function clearView() {
  columns = [];
  scheduleDraw();
}

ui.pause.addEventListener("click", togglePause);
ui.clear.addEventListener("click", clearView);
document.addEventListener("keydown", (e) => {
  if (e.target.closest && e.target.closest("input, textarea, dialog, button")) return;
  if (e.key === " ") {
    e.preventDefault();
    togglePause();
  } else if (e.key === "c" || e.key === "C") {
    clearView();
  }
});
window.addEventListener("resize", scheduleDraw);
document.addEventListener("visibilitychange", () => {
  if (document.visibilityState === "visible" && !paused) scheduleDraw();
});

scheduleDraw();
connect();

// The chat page: conversations in localStorage, replies streamed from /v1/chat/completions.
import { APIError, AuthError, apiFetch, apiKey, askForKey, fetchModel, readEvents, setApiKey } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const CHATS_KEY = "orca.chats.v1";
const SETTINGS_KEY = "orca.settings.v1";
const DEFAULT_SETTINGS = { system: "", temperature: 0.7, maxTokens: null };

const $ = (id) => document.getElementById(id);
const ui = {
  sidebar: $("sidebar"),
  chatList: $("chat-list"),
  newChat: $("new-chat"),
  toggleSidebar: $("toggle-sidebar"),
  statusDot: $("status-dot"),
  modelName: $("model-name"),
  messages: $("messages"),
  empty: $("empty"),
  thread: $("thread"),
  composer: $("composer"),
  input: $("input"),
  send: $("send"),
  stop: $("stop"),
  settings: $("settings"),
  openSettings: $("open-settings"),
  closeSettings: $("close-settings"),
  system: $("system-prompt"),
  temperature: $("temperature"),
  temperatureRange: $("temperature-range"),
  maxTokens: $("max-tokens"),
  keyState: $("key-state"),
  changeKey: $("change-key"),
  forgetKey: $("forget-key"),
};

function readJSON(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value && typeof value === "object" ? value : fallback;
  } catch {
    return fallback;
  }
}

// Conversations live in localStorage, shared by every tab; which one a tab shows is the tab's own
// (sessionStorage), so a new tab starts a new chat and a reload keeps the one it had. Each tab writes
// only the conversations it changed, merged into what is stored, so two tabs never undo each other.
const CURRENT_KEY = "orca.currentChat";

function storedChats() {
  const chats = readJSON(CHATS_KEY, []);
  return Array.isArray(chats) ? chats.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages)) : [];
}

let chats = storedChats();
let current = sessionStorage.getItem(CURRENT_KEY);
let settings = { ...DEFAULT_SETTINGS, ...readJSON(SETTINGS_KEY, {}) };
let model = null; // the served model's card from /v1/models
let active = null; // the generation in flight: {controller, chat, reply}
const replyNodes = new WeakMap(); // message -> its <article>, for updates while streaming

function writeChats(list) {
  // Oldest conversations go first when the browser's storage is full.
  let keep = [...list].sort((a, b) => b.updated - a.updated);
  while (keep.length) {
    try {
      localStorage.setItem(CHATS_KEY, JSON.stringify(keep));
      return;
    } catch (err) {
      if (keep.length === 1) console.warn("could not save the conversation", err);
      keep = keep.slice(0, -1);
    }
  }
}

function saveChat(chat) {
  writeChats([...storedChats().filter((c) => c.id !== chat.id), chat]);
}

function setCurrent(id) {
  current = id;
  if (id) sessionStorage.setItem(CURRENT_KEY, id);
  else sessionStorage.removeItem(CURRENT_KEY);
}

// Another tab changed the conversations: take its list, keeping this tab's own objects for the chat it
// shows and the one it is generating into (they may be ahead of what is stored).
window.addEventListener("storage", (e) => {
  if (e.key !== CHATS_KEY) return;
  const mine = new Map([currentChat(), active && active.chat].filter(Boolean).map((c) => [c.id, c]));
  chats = storedChats().map((c) => mine.get(c.id) || c);
  for (const chat of mine.values()) if (!chats.includes(chat)) chats.push(chat);
  renderSidebar();
});

function saveSettings() {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

const currentChat = () => chats.find((c) => c.id === current) || null;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- rendering -------------------------------------------------------------------------------------

function renderSidebar() {
  const sorted = [...chats].sort((a, b) => b.updated - a.updated);
  ui.chatList.replaceChildren(
    ...sorted.map((chat) => {
      const li = el("li", chat.id === current ? "current" : "");
      const open = el("button", "open-chat", chat.title || "New chat");
      open.type = "button";
      open.title = chat.title || "New chat";
      open.addEventListener("click", () => selectChat(chat.id));
      const del = el("button", "icon-btn delete-chat", "✕");
      del.type = "button";
      del.setAttribute("aria-label", `Delete conversation: ${chat.title || "New chat"}`);
      del.addEventListener("click", () => deleteChat(chat.id));
      li.append(open, del);
      return li;
    }),
  );
}

function statsText(stats) {
  const parts = [];
  if (stats.tokens != null) parts.push(`${stats.tokens} token${stats.tokens === 1 ? "" : "s"}`);
  if (stats.tokensPerSecond != null) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.ttft != null) parts.push(`first token ${stats.ttft.toFixed(2)} s`);
  parts.push(`${stats.seconds.toFixed(1)} s`);
  if (stats.finish === "length") parts.push("hit max tokens");
  return parts.join(" · ");
}

function messageNode(msg) {
  const article = el("article", `msg ${msg.role}`);
  article.append(el("div", "who", msg.role === "user" ? "You" : msg.model || "Assistant"));
  if (msg.role === "assistant") {
    // The model's thinking (a server run with --reasoning-parser sends it apart from the answer),
    // folded above the answer; made once, so a reader's open/closed choice survives re-renders.
    const thinking = el("details", "reasoning");
    thinking.append(el("summary", null, "Thinking"), el("div", "reasoning-text"));
    thinking.hidden = true;
    article.append(thinking);
  }
  const body = el("div", msg.role === "user" ? "body" : "body md");
  article.append(body);
  fillMessage(article, msg);
  replyNodes.set(msg, article);
  return article;
}

function fillMessage(article, msg) {
  const body = article.querySelector(".body");
  if (msg.role === "user") {
    body.textContent = msg.content;
    return;
  }
  body.replaceChildren(renderMarkdown(msg.content));
  const streaming = active && active.reply === msg;
  const thinking = article.querySelector("details.reasoning");
  thinking.hidden = !msg.reasoning;
  if (msg.reasoning) {
    thinking.querySelector(".reasoning-text").textContent = msg.reasoning;
    const still = streaming && !msg.content;
    thinking.querySelector("summary").textContent = still ? "Thinking…" : "Thought";
    thinking.classList.toggle("pending", Boolean(still));
  }
  body.classList.toggle("pending", Boolean(streaming));
  if (msg.requestId) article.dataset.requestId = msg.requestId;
  article.querySelector(".error")?.remove();
  article.querySelector(".stats")?.remove();
  if (msg.error) article.append(el("div", "error", msg.error));
  if (msg.stats) {
    const stats = el("div", "stats", statsText(msg.stats));
    stats.dataset.tokens = msg.stats.tokens ?? "";
    if (msg.stopped) stats.prepend(el("span", "stopped", "stopped · "));
    article.append(stats);
  }
}

function renderThread() {
  const chat = currentChat();
  const messages = chat ? chat.messages : [];
  ui.empty.hidden = messages.length > 0;
  ui.thread.replaceChildren(...messages.map(messageNode));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

let renderQueued = false;

// Re-renders the streaming reply at most once a frame (a timer in a background tab, which gets no frames).
function queueReplyRender(reply) {
  if (renderQueued) return;
  renderQueued = true;
  const run = () => {
    renderQueued = false;
    const article = replyNodes.get(reply);
    if (!article || !article.isConnected) return;
    const box = ui.messages;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    fillMessage(article, reply);
    if (atBottom) box.scrollTop = box.scrollHeight;
  };
  if (document.visibilityState === "visible") requestAnimationFrame(run);
  else setTimeout(run, 200);
}

function setGenerating(on) {
  ui.send.hidden = on;
  ui.stop.hidden = !on;
  document.body.classList.toggle("generating", on);
}

// ---- conversations ---------------------------------------------------------------------------------

function newChat() {
  setCurrent(null);
  renderSidebar();
  renderThread();
  closeSidebar();
  ui.input.focus();
}

function selectChat(id) {
  setCurrent(id);
  renderSidebar();
  renderThread();
  closeSidebar();
  ui.input.focus();
}

function deleteChat(id) {
  const chat = chats.find((c) => c.id === id);
  if (!chat || !confirm(`Delete "${chat.title || "New chat"}"?`)) return;
  if (active && active.chat === chat) active.controller.abort();
  chats = chats.filter((c) => c !== chat);
  writeChats(storedChats().filter((c) => c.id !== id));
  if (current === id) setCurrent(null);
  renderSidebar();
  renderThread();
}

// ---- generation ------------------------------------------------------------------------------------

function requestBody(chat, reply) {
  const history = chat.messages
    .filter((m) => m !== reply && !(m.role === "assistant" && m.error && !m.content))
    .map((m) => ({ role: m.role, content: m.content }));
  const system = settings.system.trim();
  const body = {
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true },
    temperature: settings.temperature,
  };
  if (model) body.model = model.id;
  if (settings.maxTokens) body.max_tokens = settings.maxTokens;
  return body;
}

async function post(body, signal) {
  for (;;) {
    try {
      return await apiFetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal,
      });
    } catch (err) {
      if (!(err instanceof AuthError)) throw err;
      const reason = apiKey() ? "The server did not accept that key." : "";
      if (!(await askForKey(reason))) throw new Error("This server needs an API key (Settings → Set key).");
      updateKeyState();
    }
  }
}

async function generate(chat, reply) {
  const controller = new AbortController();
  active = { controller, chat, reply };
  setGenerating(true);
  queueReplyRender(reply);
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  let finish = null;
  try {
    const response = await post(requestBody(chat, reply), controller.signal);
    await readEvents(response, ({ data }) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new APIError(chunk.error.message, 500);
      if (chunk.id && !reply.requestId) reply.requestId = chunk.id;
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const thought = delta.reasoning_content ?? delta.reasoning;
        if (thought) {
          firstToken ??= performance.now();
          reply.reasoning = (reply.reasoning || "") + thought;
          queueReplyRender(reply);
        }
        const text = delta.content;
        if (text) {
          firstToken ??= performance.now();
          reply.content += text;
          queueReplyRender(reply);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
  } catch (err) {
    if (err.name === "AbortError") reply.stopped = true;
    else reply.error = err.message || String(err);
  } finally {
    controller.abort(); // closes the stream if it ended by an error event; a no-op otherwise
    const ended = performance.now();
    const tokens = usage ? usage.completion_tokens : null;
    reply.stats = {
      tokens,
      // Decode speed, as llama.cpp reports it: tokens after the first over the time after the first.
      tokensPerSecond: tokens > 1 && firstToken !== null && ended > firstToken ? ((tokens - 1) * 1000) / (ended - firstToken) : null,
      ttft: firstToken !== null ? (firstToken - started) / 1000 : null,
      seconds: (ended - started) / 1000,
      finish,
    };
    active = null;
    chat.updated = Date.now();
    if (chats.includes(chat)) saveChat(chat); // not if it was deleted meanwhile
    setGenerating(false);
    const article = replyNodes.get(reply);
    if (article && article.isConnected) fillMessage(article, reply);
  }
}

// crypto.randomUUID exists only in secure contexts, and this page is often served over plain http.
const newId = () => `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;

function send() {
  const text = ui.input.value;
  if (active || !text.trim()) return;
  let chat = currentChat();
  if (!chat) {
    chat = { id: newId(), title: "", created: Date.now(), updated: Date.now(), messages: [] };
    chats.push(chat);
    setCurrent(chat.id);
  }
  if (!chat.title) chat.title = text.trim().replace(/\s+/g, " ").slice(0, 60);
  chat.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", model: model ? model.id : undefined };
  chat.messages.push(reply);
  chat.updated = Date.now();
  ui.input.value = "";
  autosize();
  saveChat(chat);
  renderSidebar();
  renderThread();
  generate(chat, reply);
}

function stop() {
  if (active) active.controller.abort();
}

// ---- settings and the key --------------------------------------------------------------------------

function updateKeyState() {
  ui.keyState.textContent = apiKey() ? "A key is saved in this browser." : "No key saved.";
  ui.forgetKey.disabled = !apiKey();
}

function openSettings() {
  ui.system.value = settings.system;
  ui.temperature.value = settings.temperature;
  ui.temperatureRange.value = settings.temperature;
  ui.maxTokens.value = settings.maxTokens ?? "";
  updateKeyState();
  ui.settings.showModal();
}

function readSettings(from) {
  const temperature = parseFloat(from.value);
  if (Number.isFinite(temperature) && temperature >= 0 && temperature <= 2) {
    settings.temperature = temperature;
    (from === ui.temperature ? ui.temperatureRange : ui.temperature).value = temperature;
  }
  const maxTokens = parseInt(ui.maxTokens.value, 10);
  settings.maxTokens = Number.isFinite(maxTokens) && maxTokens > 0 ? maxTokens : null;
  settings.system = ui.system.value;
  saveSettings();
}

// ---- the model -------------------------------------------------------------------------------------

async function connect() {
  try {
    model = await fetchModel();
  } catch {
    ui.statusDot.className = "dot bad";
    ui.modelName.textContent = "API key needed (⚙ Settings)";
    return;
  }
  if (model) {
    ui.statusDot.className = "dot ok";
    ui.modelName.textContent = model.id;
    ui.modelName.parentElement.title = `max_model_len ${model.max_model_len}`;
  } else {
    ui.statusDot.className = "dot warn";
    ui.modelName.textContent = "waiting for the model…";
    setTimeout(connect, 2000);
  }
}

// ---- wiring ----------------------------------------------------------------------------------------

function autosize() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${ui.input.scrollHeight}px`;
}

function closeSidebar() {
  ui.sidebar.classList.remove("open");
  ui.toggleSidebar.setAttribute("aria-expanded", "false");
}

ui.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
ui.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
ui.input.addEventListener("input", autosize);
ui.stop.addEventListener("click", stop);
ui.newChat.addEventListener("click", newChat);
ui.toggleSidebar.addEventListener("click", () => {
  const open = ui.sidebar.classList.toggle("open");
  ui.toggleSidebar.setAttribute("aria-expanded", String(open));
});
ui.openSettings.addEventListener("click", openSettings);
ui.closeSettings.addEventListener("click", () => ui.settings.close());
ui.settings.addEventListener("close", () => ui.input.focus());
ui.temperature.addEventListener("input", () => readSettings(ui.temperature));
ui.temperatureRange.addEventListener("input", () => readSettings(ui.temperatureRange));
ui.maxTokens.addEventListener("input", () => readSettings(ui.temperature));
ui.system.addEventListener("input", () => readSettings(ui.temperature));
ui.changeKey.addEventListener("click", async () => {
  ui.settings.close();
  if (await askForKey()) connect();
  updateKeyState();
});
ui.forgetKey.addEventListener("click", () => {
  setApiKey("");
  updateKeyState();
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && active && !document.querySelector("dialog[open]")) {
    e.preventDefault();
    stop();
  } else if ((e.ctrlKey || e.metaKey) && e.shiftKey && e.key.toLowerCase() === "o") {
    e.preventDefault();
    newChat();
  }
});

renderSidebar();
renderThread();
ui.input.focus();
connect();

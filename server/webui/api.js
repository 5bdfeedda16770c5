// What both pages share: the API key, fetch() with it, a Server-Sent Events reader over fetch(), and
// the dialog that asks for a key when the server answers 401.
//
// SSE is read from fetch()'s body stream rather than with EventSource: the chat stream is a POST, and
// EventSource can send no Authorization header, so the live view's stream would need the key in its
// URL (where access logs, history and proxies keep it).

const KEY_STORAGE = "orca.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export class AuthError extends Error {}

export class APIError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && typeof body.error.message === "string") return body.error.message;
  } catch {
    // not JSON: the status says enough
  }
  return `HTTP ${response.status} ${response.statusText}`.trim();
}

// fetch() with the stored key; a 401 throws AuthError, any other error status an APIError.
export async function apiFetch(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...init, headers });
  if (response.status === 401) throw new AuthError(await errorMessage(response));
  if (!response.ok) throw new APIError(await errorMessage(response), response.status);
  return response;
}

// Calls onEvent({event, data}) for each event of a text/event-stream response, until it ends.
// Comments (": ping") are skipped; multi-line data is joined with "\n", as the SSE spec says.
export async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = "";
  let data = [];
  const dispatch = () => {
    if (data.length) onEvent({ event: event || "message", data: data.join("\n") });
    event = "";
    data = [];
  };
  const line = (text) => {
    if (text === "") return dispatch();
    if (text.startsWith(":")) return;
    const colon = text.indexOf(":");
    const field = colon < 0 ? text : text.slice(0, colon);
    let value = colon < 0 ? "" : text.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") data.push(value);
    else if (field === "event") event = value;
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    // A "\r" at the very end may be the first half of "\r\n": keep it for the next chunk.
    const re = /\r\n|\r(?!$)|\n/g;
    let start = 0;
    let m;
    while ((m = re.exec(buffer)) !== null) {
      line(buffer.slice(start, m.index));
      start = m.index + m[0].length;
    }
    buffer = buffer.slice(start);
  }
  if (buffer) line(buffer.replace(/\r$/, ""));
  dispatch();
}

// ---- the key dialog ------------------------------------------------------------------------------

let pendingAsk = null;

function keyDialog() {
  let dialog = document.getElementById("key-dialog");
  if (dialog) return dialog;
  dialog = document.createElement("dialog");
  dialog.id = "key-dialog";
  dialog.innerHTML = `
    <h2>API key</h2>
    <p class="muted">This server was started with <code>--api-key</code>. Enter a key to use it; it is
    kept in this browser's local storage and sent only to this server.</p>
    <div class="field">
      <label class="label" for="key-input">Key</label>
      <input id="key-input" type="password" autocomplete="off" spellcheck="false">
      <p class="key-error" id="key-error"></p>
    </div>
    <div class="dialog-actions">
      <button type="button" class="btn" id="key-cancel">Cancel</button>
      <button type="button" class="btn primary" id="key-save">Use this key</button>
    </div>`; // static markup of our own: no server or model text goes in here
  document.body.append(dialog);
  return dialog;
}

// Asks for a key (one dialog at a time); resolves true once one is entered, false if cancelled.
export function askForKey(reason = "") {
  if (pendingAsk) return pendingAsk;
  const dialog = keyDialog();
  const input = dialog.querySelector("#key-input");
  const error = dialog.querySelector("#key-error");
  error.textContent = reason;
  input.value = "";
  pendingAsk = new Promise((resolve) => {
    const finish = (ok) => {
      dialog.close();
      pendingAsk = null;
      resolve(ok);
    };
    const save = () => {
      const key = input.value.trim();
      if (!key) {
        error.textContent = "Enter a key.";
        return;
      }
      setApiKey(key);
      finish(true);
    };
    dialog.querySelector("#key-save").onclick = save;
    dialog.querySelector("#key-cancel").onclick = () => finish(false);
    input.onkeydown = (e) => {
      if (e.key === "Enter") {
        e.preventDefault();
        save();
      }
    };
    dialog.oncancel = (e) => {
      e.preventDefault();
      finish(false);
    };
  });
  dialog.showModal();
  input.focus();
  return pendingAsk;
}

// The served model's card, asking for a key while the server answers 401. Resolves null while the
// model loads (503) or the server cannot be reached; throws AuthError if the user cancels the dialog.
export async function fetchModel() {
  for (;;) {
    try {
      const response = await apiFetch("/v1/models");
      const body = await response.json();
      return body.data && body.data.length ? body.data[0] : null;
    } catch (err) {
      if (!(err instanceof AuthError)) return null;
      const reason = apiKey() ? "The server did not accept that key." : "";
      if (!(await askForKey(reason))) throw err;
    }
  }
}

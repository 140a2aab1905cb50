// swiftserve's page: a chat playground over /v1/chat/completions and a live dashboard over
// /v1/stats. Plain browser JavaScript, served by the server itself (no CDN, no build step).
"use strict";

const KEY_STORE = "swiftserve.apiKey";
const HISTORY = 600;  // samples kept in the page (ten minutes at one per second)
const $ = (id) => document.getElementById(id);

const state = {
  key: localStorage.getItem(KEY_STORE) || "",
  conversation: [],
  controller: null,
  samples: [],
  lastSeq: 0,
  stats: null,
  charts: null,
  pollTimer: null,
};

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(extra = {}) {
  const h = {...extra};
  if (state.key) h["Authorization"] = `Bearer ${state.key}`;
  return h;
}

async function errorFrom(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: keep the status text */ }
  return new ApiError(response.status, message);
}

async function api(path) {
  const response = await fetch(path, {headers: headers()});
  if (!response.ok) throw await errorFrom(response);
  return response.json();
}

function describeError(err) {
  if (err instanceof ApiError) {
    const hint = err.status === 401 ? " Enter the server's API key above." : "";
    return `Error ${err.status}: ${err.message}${hint}`;
  }
  if (err && err.name === "AbortError") return "Stopped.";
  return `Error: ${err && err.message ? err.message : err}`;
}

function showBanner(text) {
  const banner = $("banner");
  banner.textContent = text;
  banner.hidden = !text;
}

// ---- views -------------------------------------------------------------------------------
function showView(view) {
  for (const name of ["chat", "dashboard"]) {
    $(`view-${name}`).hidden = name !== view;
    $(`tab-${name}`).classList.toggle("active", name === view);
  }
  if (location.hash !== `#${view}`) history.replaceState(null, "", `#${view}`);
  if (view === "dashboard") startPolling(); else stopPolling();
}

// ---- playground --------------------------------------------------------------------------
async function loadModels() {
  try {
    const models = await api("/v1/models");
    const select = $("model");
    select.replaceChildren();
    for (const m of models.data) {
      const option = document.createElement("option");
      option.value = option.textContent = m.id;
      select.append(option);
    }
    showBanner("");
  } catch (err) {
    showBanner(describeError(err));
  }
}

function addBubble(role, text) {
  const bubble = document.createElement("div");
  bubble.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  bubble.append(body);
  const meta = document.createElement("div");
  meta.className = "meta";
  bubble.append(meta);
  $("messages").append(bubble);
  $("messages").scrollTop = $("messages").scrollHeight;
  return {bubble, body, meta};
}

function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push(...state.conversation);
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: {include_usage: true},
  };
  const fields = {temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", priority: "priority"};
  for (const [name, id] of Object.entries(fields)) {
    const value = numberField(id);
    if (value !== null) body[name] = value;
  }
  const timeout = numberField("timeout");
  if (timeout) body.timeout = timeout;
  if (body.priority === 0) delete body.priority;  // the default; fcfs servers need not see it
  return body;
}

// Yields each parsed `data:` payload of a server-sent event stream.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  state.conversation.push({role: "user", content: text});
  addBubble("user", text);
  const answer = addBubble("assistant", "");
  answer.bubble.classList.add("pending");
  const controller = (state.controller = new AbortController());
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let first = null;
  let tokens = 0;
  let finish = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({"Content-Type": "application/json"}),
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw await errorFrom(response);
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new ApiError(statusOf(chunk.error), chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        if (first === null) first = performance.now();
        answer.body.textContent += piece;
        $("messages").scrollTop = $("messages").scrollHeight;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    state.conversation.push({role: "assistant", content: answer.body.textContent});
    answer.meta.textContent = timing(started, first, performance.now(), tokens, finish);
    showBanner("");
  } catch (err) {
    const message = describeError(err);
    answer.bubble.classList.add("failed");
    answer.meta.textContent = message;
    if (!(err && err.name === "AbortError")) showBanner(message);
    state.conversation.pop();  // the failed turn is not part of the conversation
  } finally {
    answer.bubble.classList.remove("pending");
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// Errors that arrive inside a stream carry no HTTP status; map the common types back.
function statusOf(error) {
  return {timeout_error: 408, server_error: 503, invalid_request_error: 400}[error.type] || 500;
}

function timing(started, first, ended, tokens, finish) {
  const parts = [];
  if (first !== null) parts.push(`TTFT ${Math.round(first - started)} ms`);
  if (first !== null && tokens > 1 && ended > first) {
    parts.push(`${((tokens - 1) / ((ended - first) / 1000)).toFixed(1)} tok/s`);
  }
  parts.push(`${tokens} tokens`);
  if (finish) parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

// ---- dashboard ---------------------------------------------------------------------------
function makeCharts(targets) {
  return {
    ttft: new LineChart($("chart-ttft"), {unit: "", goal: targets.ttft ?? null}),
    tpot: new LineChart($("chart-tpot"), {unit: "", goal: targets.tpot ?? null}),
    e2e: new LineChart($("chart-e2e")),
    queue: new LineChart($("chart-queue")),
    cache: new LineChart($("chart-cache"), {max: 100}),
    batch: new LineChart($("chart-batch")),
    embed: new LineChart($("chart-embed")),
  };
}

async function poll() {
  try {
    const stats = await api(`/v1/stats?since=${state.lastSeq}`);
    if (stats.last_seq < state.lastSeq) {  // the server restarted: start over
      state.samples = [];
      state.lastSeq = 0;
      return;
    }
    state.stats = stats;
    if ($("banner").textContent.startsWith("Error 401")) showBanner("");
    if (state.charts && stats.samples.length === 0) return;  // nothing new: no redraw
    state.samples.push(...stats.samples);
    if (state.samples.length > HISTORY) state.samples.splice(0, state.samples.length - HISTORY);
    state.lastSeq = stats.last_seq;
    if (!state.charts) state.charts = makeCharts(stats.targets_ms || {});
    render(stats);
  } catch (err) {
    showBanner(describeError(err));
  }
}

function series(name, color, key, scale = 1) {
  return {name, color, values: state.samples.map((s) => (s[key] == null ? null : s[key] * scale))};
}

function render(stats) {
  const last = state.samples[state.samples.length - 1] || {};
  // The hit rate only exists in seconds with prompt lookups: show the latest one there was.
  const lastHit = state.samples.findLast((s) => s.prefix_hit_rate != null);
  const show = (id, value) => { $(id).textContent = value == null ? "-" : String(value); };
  show("stat-running", last.running);
  show("stat-waiting", last.waiting);
  show("stat-finished", last.finished);
  show("stat-rps", last.requests_per_s == null ? null : last.requests_per_s.toFixed(2));
  show("stat-tps", last.tokens_per_s == null ? null : last.tokens_per_s.toFixed(1));
  show("stat-kv", last.kv_cache_usage == null ? null : `${(last.kv_cache_usage * 100).toFixed(1)}%`);
  show("stat-prefix", lastHit ? `${(lastHit.prefix_hit_rate * 100).toFixed(1)}%` : null);
  show("stat-budget", last.step_budget);
  $("window-s").textContent = stats.window_s;
  $("updated").textContent = `Updated ${new Date().toLocaleTimeString()}.`;

  const times = state.samples.map((s) => s.time);
  const c = state.charts;
  c.ttft.draw(times, [series("P50", "#2e86de", "ttft_p50_ms"), series("P99", "#e67e22", "ttft_p99_ms")]);
  c.tpot.draw(times, [series("P50", "#2e86de", "tpot_p50_ms"), series("P99", "#e67e22", "tpot_p99_ms")]);
  c.e2e.draw(times, [series("P50", "#2e86de", "e2e_p50_ms"), series("P99", "#e67e22", "e2e_p99_ms")]);
  c.queue.draw(times, [series("running", "#27ae60", "running"), series("waiting", "#8e44ad", "waiting")]);
  c.cache.draw(times, [
    series("KV used", "#16a085", "kv_cache_usage", 100),
    series("prefix hits", "#d35400", "prefix_hit_rate", 100),
  ]);
  c.batch.draw(times, [series("rows per step", "#2c3e50", "batch_size_mean")]);
  if (stats.embedding_model) {
    $("fig-embed").hidden = false;
    c.embed.draw(times, [
      series("window ms", "#7f8c8d", "embed_window_ms"),
      series("mean batch", "#c0392b", "embed_batch_size_mean"),
    ]);
  }
}

function startPolling() {
  if (state.pollTimer !== null) return;
  poll();
  state.pollTimer = setInterval(poll, 1000);
}

function stopPolling() {
  if (state.pollTimer !== null) clearInterval(state.pollTimer);
  state.pollTimer = null;
}

// ---- wiring ------------------------------------------------------------------------------
function init() {
  $("api-key").value = state.key;
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = $("api-key").value.trim();
    if (state.key) localStorage.setItem(KEY_STORE, state.key); else localStorage.removeItem(KEY_STORE);
    showBanner("");
    loadModels();
    if (!$("view-dashboard").hidden) poll();
  });
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => showView(tab.dataset.view));
  }
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || state.controller) return;
    $("chat-input").value = "";
    send(text);
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    state.conversation = [];
    $("messages").replaceChildren();
  });
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) stopPolling(); else if (!$("view-dashboard").hidden) startPolling();
  });
  window.addEventListener("hashchange", () => showView(location.hash === "#dashboard" ? "dashboard" : "chat"));
  showView(location.hash === "#dashboard" ? "dashboard" : "chat");
  loadModels();
}

init();

// racer's chat page: streams answers from /v1/chat/completions with racer's extension
// ("racer": true), which tells for every run of characters which draft source proposed
// it, and for every verification step how many tree nodes it checked.
"use strict";

const $ = (id) => document.getElementById(id);
let messages = [];   // the conversation, as the API takes it
let model = null;
let aborter = null;

function show(text) { $("error").textContent = text; $("error").hidden = !text; }

// A server started with --api-key wants it on /v1/ routes; the page keeps it for this
// tab only (sessionStorage), never in the page or the URL.
const KEY = "racer-api-key";
function askForKey() { $("key-field").hidden = false; $("api-key").focus(); }
function authorization() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function connect() {
  $("api-key").value = sessionStorage.getItem(KEY) || "";
  $("api-key").addEventListener("change", () => sessionStorage.setItem(KEY, $("api-key").value.trim()));
  try {
    const health = await (await fetch("/health")).json();
    model = health.model;
    $("model").textContent = `${health.model} · ${health.method || ""}`;
    if (health.api_key_required) $("key-field").hidden = false;
  } catch (err) { show(`the server did not answer /health: ${err}`); }
}

function turn(kind, text) {
  const node = document.createElement("div");
  node.className = `turn ${kind}`;
  if (text) node.textContent = text;
  $("log").appendChild(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

function tint(bubble, text, spans) {
  // spans: [characters, source, step] runs covering `text` exactly.
  let at = 0;
  for (const [length, source, step] of spans) {
    const span = document.createElement("span");
    span.className = `src-${source}`;
    span.dataset.step = step;
    span.textContent = text.slice(at, at + length);
    bubble.appendChild(span);
    at += length;
  }
  if (at < text.length) bubble.appendChild(document.createTextNode(text.slice(at)));
}

function spark(sizes) {
  const svg = $("spark");
  svg.dataset.steps = sizes.length;
  if (sizes.length === 1) sizes = [sizes[0], sizes[0]];  // one step: a level line, not an invisible point
  const top = Math.max(2, ...sizes);
  const step = sizes.length > 1 ? 240 / (sizes.length - 1) : 0;
  const points = sizes.map((s, i) => `${(i * step).toFixed(1)},${(47 - (s / top) * 45).toFixed(1)}`).join(" ");
  svg.innerHTML = `<polyline points="${points}"></polyline>`;
  svg.setAttribute("aria-label", `tree size per step, largest ${top}`);
}

function figures(stats) {
  $("rate").textContent = stats.seconds > 0 ? (stats.tokens / stats.seconds).toFixed(1) : "–";
  $("mat").textContent = stats.passes ? (stats.tokens / stats.passes).toFixed(2) : "–";
  $("count").textContent = stats.tokens;
  $("drafted").textContent = stats.tokens ? `${Math.round(100 * stats.drafted / stats.tokens)} %` : "–";
  spark(stats.sizes);
}

async function* events(response) {
  // Server-sent events: "data: {...}" blocks separated by blank lines.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function ask(prompt) {
  messages.push({ role: "user", content: prompt });
  const asked = turn("user", prompt);
  const bubble = turn("assistant", "");
  const stats = { tokens: 0, passes: 1, drafted: 0, sizes: [], seconds: 0 };
  const started = performance.now();
  let answer = "";
  aborter = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: aborter.signal, headers: { "Content-Type": "application/json", ...authorization() },
      body: JSON.stringify({ model, messages, stream: true, racer: true,
                             max_tokens: Number($("max-tokens").value) || 256,
                             temperature: Number($("temperature").value) || 0 }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      if (response.status === 401) askForKey();
      throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
    }
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = (chunk.choices[0] || {}).delta || {};
      const extension = chunk.racer || {};
      if (delta.content) {
        tint(bubble, delta.content, extension.spans || []);
        answer += delta.content;
      }
      for (const [step, nodes, tokens, drafted] of extension.steps || []) {
        stats.tokens += tokens;
        stats.drafted += drafted;
        if (step > 0) { stats.passes += 1; stats.sizes.push(nodes); }
      }
      stats.seconds = (performance.now() - started) / 1000;
      figures(stats);
      bubble.scrollIntoView({ block: "end" });
    }
  } catch (err) {
    if (err.name !== "AbortError") show(String(err.message || err));
    if (!answer) {  // nothing came back (a refused request): take the turn back, keep the prompt
      messages.pop();
      asked.remove(); bubble.remove();
      $("prompt").value = prompt;
      return;
    }
  } finally {
    aborter = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
  messages.push({ role: "assistant", content: answer });
  const line = document.createElement("span");
  line.className = "stats";
  line.textContent = `${stats.tokens} tokens · ${stats.seconds.toFixed(1)} s · MAT ${(stats.tokens / stats.passes).toFixed(2)}`;
  bubble.appendChild(line);
  bubble.dataset.done = "true";
}

$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || aborter) return;
  $("prompt").value = "";
  show("");
  ask(prompt);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (aborter) aborter.abort(); });
$("reset").addEventListener("click", () => {
  if (aborter) aborter.abort();
  messages = [];
  $("log").innerHTML = "";
  figures({ tokens: 0, passes: 0, drafted: 0, sizes: [], seconds: 0 });
  show("");
});
connect();

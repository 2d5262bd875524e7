// The instance page's playground for chat and embedding models: requests go through the console's
// own /v1 endpoint with the signed-in session (CSRF token from the page), so usage, the request
// log and /metrics count them like any client's. Chat is multi-turn and streamed token by token;
// under each answer: time to first token, tokens and tokens/s. Embeddings: two texts -> their
// dimensions and cosine similarity. Rerank models keep the server-side form (htmx).
(function () {
  "use strict";
  const root = document.getElementById("playground");
  if (!root || !root.dataset.kind || root.dataset.kind === "rerank") return;
  const kind = root.dataset.kind;
  const model = root.dataset.model;
  const api = root.dataset.api || "/v1";
  const errorBox = document.getElementById("pg-error");

  function headers() {
    return { "Content-Type": "application/json", "X-CSRFToken": root.dataset.csrf };
  }

  function showError(text) {
    errorBox.textContent = text;
    errorBox.hidden = !text;
  }

  async function errorOf(response) {
    try {
      const body = await response.json();
      const err = body.error || {};
      return `${response.status}: ${err.message || JSON.stringify(body)}`;
    } catch (e) {
      return `${response.status} ${response.statusText}`;
    }
  }

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  if (kind === "embedding") {
    const form = document.getElementById("playground-form");
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      showError("");
      const a = document.getElementById("pg-text-a").value.trim();
      const b = document.getElementById("pg-text-b").value.trim();
      const out = document.getElementById("pg-similarity");
      if (!a || !b) { showError("Type two texts to compare."); return; }
      out.textContent = "…";
      const started = performance.now();
      const response = await fetch(`${api}/embeddings`, {
        method: "POST", headers: headers(), credentials: "same-origin",
        body: JSON.stringify({ model: model, input: [a, b] }),
      });
      if (!response.ok) { out.textContent = ""; showError(await errorOf(response)); return; }
      const data = (await response.json()).data;
      const [u, v] = [data[0].embedding, data[1].embedding];
      let dot = 0, nu = 0, nv = 0;
      for (let i = 0; i < u.length; i++) { dot += u[i] * v[i]; nu += u[i] * u[i]; nv += v[i] * v[i]; }
      const cosine = dot / (Math.sqrt(nu) * Math.sqrt(nv) || 1);
      out.textContent = `${u.length} dimensions · cosine similarity ${cosine.toFixed(4)} · ` +
        `${Math.round(performance.now() - started)} ms`;
      out.dataset.cosine = cosine.toFixed(6);
    });
    return;
  }

  // Chat: the conversation lives in the page; every turn sends all of it.
  const form = document.getElementById("playground-form");
  const prompt = document.getElementById("prompt");
  const transcript = document.getElementById("pg-transcript");
  const send = document.getElementById("pg-send");
  const stop = document.getElementById("pg-stop");
  let history = [];
  let controller = null;

  document.getElementById("pg-clear").addEventListener("click", () => {
    if (controller) controller.abort();
    history = [];
    transcript.replaceChildren();
    showError("");
  });
  stop.addEventListener("click", () => { if (controller) controller.abort(); });

  function number(id, fallback) {
    const value = parseFloat(document.getElementById(id).value);
    return Number.isFinite(value) ? value : fallback;
  }

  function stats(line, t0, tFirst, tLast, tokens) {
    const parts = [];
    if (tFirst !== null) parts.push(`TTFT ${Math.round(tFirst - t0)} ms`);
    parts.push(`${tokens} tokens`);
    if (tFirst !== null && tLast > tFirst && tokens > 1) {
      parts.push(`${((tokens - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tokens/s`);
    }
    line.textContent = parts.join(" · ");
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = prompt.value.trim();
    if (!text || controller) return;
    showError("");
    prompt.value = "";
    const user = el("div", "pg-turn pg-user");
    user.append(el("span", "pg-who", "You"), el("div", "pg-text", text));
    const reply = el("div", "pg-turn pg-assistant");
    const replyText = el("div", "pg-text");
    const line = el("div", "pg-stats muted small", "waiting for the first token…");
    reply.append(el("span", "pg-who", model), replyText, line);
    transcript.append(user, reply);
    reply.scrollIntoView({ block: "nearest" });

    const messages = [];
    const system = document.getElementById("pg-system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history, { role: "user", content: text });
    const body = {
      model: model, messages: messages, stream: true,
      temperature: number("pg-temperature", 0.7), max_tokens: Math.round(number("pg-max-tokens", 256)),
    };
    controller = new AbortController();
    send.disabled = true;
    stop.hidden = false;
    const t0 = performance.now();
    let tFirst = null, tLast = t0, tokens = 0, usageTokens = null, answer = "";
    try {
      const response = await fetch(`${api}/chat/completions`, {
        method: "POST", headers: headers(), credentials: "same-origin", body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) {
        line.textContent = "";
        showError(await errorOf(response));
        reply.classList.add("pg-failed");
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
          const eventText = buffer.slice(0, cut);
          buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
          for (const raw of eventText.split(/\r?\n/)) {
            if (!raw.startsWith("data:")) continue;  // comments (": loading 40%") and other fields
            const data = raw.slice(5).trim();
            if (data === "[DONE]") continue;
            let chunk;
            try { chunk = JSON.parse(data); } catch (e) { continue; }
            if (chunk.error) { showError(chunk.error.message || JSON.stringify(chunk.error)); continue; }
            if (chunk.usage && chunk.usage.completion_tokens) usageTokens = chunk.usage.completion_tokens;
            const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
            if (delta && delta.content) {
              const now = performance.now();
              if (tFirst === null) tFirst = now;
              tLast = now;
              tokens += 1;
              answer += delta.content;
              replyText.textContent = answer;
              stats(line, t0, tFirst, tLast, usageTokens || tokens);
            }
          }
        }
      }
      stats(line, t0, tFirst, tLast, usageTokens || tokens);
      history.push({ role: "user", content: text }, { role: "assistant", content: answer });
      reply.dataset.done = "true";
    } catch (e) {
      if (e.name === "AbortError") {
        line.textContent += " · stopped";
        if (answer) history.push({ role: "user", content: text }, { role: "assistant", content: answer });
      } else {
        showError(`The request failed: ${e.message}`);
      }
    } finally {
      controller = null;
      send.disabled = false;
      stop.hidden = true;
      prompt.focus();
    }
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); form.requestSubmit(); }
  });
})();

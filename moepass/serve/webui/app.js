// moepass serve's chat page: conversations kept in this browser (localStorage), answers streamed from
// the server's own /v1/chat/completions. Model output is untrusted: it is only ever put into the page
// as text nodes (markdown is parsed here into elements whose text is set with textContent), so markup,
// event handlers and javascript: links in an answer show as the text they are.
"use strict";

const STORE = "moepass.conversations";
const KEY_STORE = "moepass.apiKey";
const SETTINGS_STORE = "moepass.settings";
const $ = (id) => document.getElementById(id);

const state = {
  key: localStorage.getItem(KEY_STORE) || "",
  conversations: loadConversations(),
  current: null, // the conversation shown
  controller: null, // the answer streaming now (AbortController)
  contextSize: 0,
};

function loadConversations() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "[]");
    return Array.isArray(saved) ? saved.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages)) : [];
  } catch {
    return [];
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state.conversations));
}

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value == null) continue;
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

// ---- the server --------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

async function askForKey(message) {
  const dialog = $("key-dialog");
  $("key-message").textContent = message;
  $("key").value = "";
  dialog.showModal();
  await new Promise((resolve) => dialog.addEventListener("close", resolve, { once: true }));
  state.key = $("key").value.trim();
  localStorage.setItem(KEY_STORE, state.key);
}

// a GET of the server's API, asking for the API key while the server refuses the one held
async function getJSON(path) {
  for (;;) {
    const response = await fetch(path, { headers: headers() });
    if (response.status !== 401) return response.json();
    await askForKey(state.key ? "The server refused this API key. Give the right one:" : "This server needs an API key:");
  }
}

async function loadModel() {
  const props = await getJSON("props");
  const name = (props.model_alias || "moepass").toString();
  $("model-name").textContent = name;
  document.title = `${name} · moepass chat`;
  state.contextSize = Number(props.n_ctx) || 0;
  $("model-context").textContent = state.contextSize ? `context ${state.contextSize.toLocaleString()} tokens` : "";
  $("max-tokens").placeholder = `auto: ${autoAnswerLength()}`;
}

// the answer length when Max tokens is left empty: a 32nd of the context (64 to 1,024 tokens), so that
// a conversation runs for a score of turns before it fills the context (128 on the demo's 4,096)
function autoAnswerLength() {
  return Math.min(1024, Math.max(64, Math.floor(state.contextSize / 32))) || 512;
}

// ---- conversations -------------------------------------------------------------------------------

function newConversation() {
  const conversation = { id: `c${Date.now()}${Math.random().toString(36).slice(2, 6)}`, title: "New chat",
    system: "", messages: [], created: Date.now() };
  state.conversations.unshift(conversation);
  save();
  show(conversation);
}

function show(conversation) {
  state.current = conversation;
  $("system").value = conversation.system || "";
  renderSidebar();
  renderMessages();
  $("sidebar").classList.remove("open");
  $("input").focus();
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conversation of state.conversations) {
    const item = el("li", { class: conversation === state.current ? "current" : "" },
      el("button", { class: "title", type: "button", text: conversation.title, title: conversation.title,
        onclick: () => show(conversation) }),
      el("button", { class: "icon rename", type: "button", text: "✎", title: "Rename",
        onclick: () => rename(conversation) }),
      el("button", { class: "icon delete", type: "button", text: "✕", title: "Delete",
        onclick: () => remove(conversation) }));
    list.append(item);
  }
}

function rename(conversation) {
  const title = prompt("Name this conversation", conversation.title);
  if (title && title.trim()) {
    conversation.title = title.trim().slice(0, 120);
    save();
    renderSidebar();
  }
}

function remove(conversation) {
  if (!confirm(`Delete "${conversation.title}"?`)) return;
  if (conversation === state.current) stop();
  state.conversations = state.conversations.filter((c) => c !== conversation);
  save();
  if (state.conversations.length === 0) newConversation();
  else show(state.conversations[0]);
}

// ---- messages ------------------------------------------------------------------------------------

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const messages = state.current.messages;
  messages.forEach((message, index) => box.append(messageView(message, index, index === messages.length - 1)));
  box.scrollTop = box.scrollHeight;
}

function messageView(message, index, last) {
  const view = el("div", { class: `message ${message.role}`, "data-index": String(index) },
    el("div", { class: "who", text: message.role === "user" ? "You" : "Assistant" }));
  const body = el("div", { class: "body" });
  view.append(body);
  fillBody(body, message);
  if (message.error) view.append(el("div", { class: "error", text: message.error }));
  if (message.stats) view.append(el("div", { class: "stats", text: message.stats }));
  const busy = state.controller !== null;
  const actions = el("div", { class: "actions" });
  if (message.role === "user") {
    actions.append(el("button", { type: "button", class: "edit", text: "Edit", disabled: busy ? "" : null,
      onclick: () => edit(view, index) }));
  } else if (last && !busy) {
    actions.append(el("button", { type: "button", class: "regenerate", text: "Regenerate", onclick: regenerate }));
  }
  if (busy) for (const b of actions.querySelectorAll("button")) b.disabled = true;
  view.append(actions);
  return view;
}

function fillBody(body, message) {
  body.replaceChildren();
  if (message.role === "user") {
    body.textContent = message.content;
    return;
  }
  const { reasoning, answer } = splitReasoning(message.reasoning || "", message.content || "");
  if (reasoning) {
    body.append(el("details", { class: "reasoning" }, el("summary", { text: "Reasoning" }),
      el("div", { class: "thought", text: reasoning })));
  }
  body.append(renderMarkdown(answer));
}

// the reasoning a template writes into the content (<think>...</think>) and the answer after it
function splitReasoning(reasoning, content) {
  const open = content.indexOf("<think>");
  if (open !== -1 && content.slice(0, open).trim() === "") {
    const close = content.indexOf("</think>", open);
    if (close === -1) return { reasoning: reasoning + content.slice(open + 7), answer: "" };
    return { reasoning: reasoning + content.slice(open + 7, close), answer: content.slice(close + 8).replace(/^\s+/, "") };
  }
  return { reasoning, answer: content };
}

// ---- markdown, as elements whose text is set as text -----------------------------------------------

function renderMarkdown(text) {
  const root = el("div", { class: "markdown" });
  const opening = /^[ \t]*```([^\n`]*)\n/m; // a fence opens at a line's start
  let rest = text;
  while (rest) {
    const found = opening.exec(rest);
    if (!found) {
      blocks(root, rest);
      break;
    }
    blocks(root, rest.slice(0, found.index));
    const body = rest.slice(found.index + found[0].length);
    // it closes at the next line that is only a fence (``` and spaces), else at the end (still streaming)
    const closing = /^[ \t]*```[ \t]*$/m.exec(body);
    const code = closing ? body.slice(0, Math.max(0, closing.index - 1)) : body;
    root.append(codeBlock(code, found[1].trim()));
    rest = closing ? body.slice(closing.index + closing[0].length).replace(/^\n/, "") : "";
  }
  return root;
}

// a fenced block: its language as a label, a copy button, the code set as text
function codeBlock(code, language) {
  const text = el("code", { text: code });
  const bar = el("div", { class: "code-bar" });
  if (language) {
    text.dataset.language = language.slice(0, 40);
    bar.append(el("span", { class: "code-language", text: language.slice(0, 40) }));
  }
  const copy = el("button", { type: "button", class: "code-copy", text: "copy" });
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(code);
      copy.textContent = "copied";
    } catch {
      copy.textContent = "copy failed";
    }
    setTimeout(() => (copy.textContent = "copy"), 1500);
  });
  bar.append(copy);
  return el("div", { class: "code-block" }, bar, el("pre", {}, text));
}

const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/; // ---, ***, ___
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/; // |---|:--:|--:|, under a table's header

// paragraphs, headings, lists (ordered from their first number, one level of nesting), tables (a
// header row, a |---| row with its alignments), rules and quotes
function blocks(root, text) {
  let list = null;
  for (const paragraph of text.split(/\n{2,}/)) {
    if (!paragraph.trim()) continue;
    const lines = paragraph.split("\n").filter((line) => line.trim());
    const at = lines.findIndex((line, i) => i + 1 < lines.length && isTableHead(line, lines[i + 1]));
    if (at !== -1) { // the lines before it, the table's rows (lines with a pipe), the lines after it
      let end = at + 2;
      while (end < lines.length && lines[end].includes("|")) end++;
      if (at > 0) blocks(root, lines.slice(0, at).join("\n"));
      root.append(table(lines.slice(at, end)));
      if (end < lines.length) blocks(root, lines.slice(end).join("\n"));
      list = null;
      continue;
    }
    for (const line of lines) {
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      const item = /^(\s*)(?:[-*+]|(\d{1,9})[.)])\s+(.*)$/.exec(line);
      if (item && !RULE.test(line)) {
        const kind = item[2] ? "OL" : "UL";
        const nested = item[1].length >= 2 && list !== null;  // under the list's last item
        const parent = nested ? list.lastElementChild : root;
        let target = nested ? parent.lastElementChild : list;
        if (!target || target.tagName !== kind) {
          target = el(kind.toLowerCase());
          if (item[2] && Number(item[2]) !== 1) target.setAttribute("start", String(Number(item[2])));
          parent.append(target);
          if (!nested) list = target;
        }
        target.append(inline(el("li"), item[3]));
        continue;
      }
      if (list && /^\s{2,}\S/.test(line)) {  // an item's next line
        list.lastElementChild.append("\n");
        inline(list.lastElementChild, line.trim());
        continue;
      }
      list = null;
      if (heading) root.append(inline(el(`h${Math.min(heading[1].length + 2, 6)}`), heading[2]));
      else if (RULE.test(line)) root.append(el("hr"));
      else if (/^\s*>/.test(line)) lineOf(root, "blockquote", line.replace(/^\s*>\s?/, ""));
      else lineOf(root, "p", line);
    }
    const last = root.lastElementChild;
    if (last) delete last.dataset.open;
    // a list goes on across a blank line (a loose list: "1. ...", a paragraph, "2. ..." numbers on)
    if (!(list && root.lastElementChild === list)) list = null;
  }
}

// a line of a paragraph or a quote: the next line of the one this paragraph of text has open, else the
// first of a new one
function lineOf(root, tag, text) {
  const last = root.lastElementChild;
  if (last && last.tagName === tag.toUpperCase() && last.dataset.open === "1") {
    last.append("\n");
    inline(last, text);
  } else {
    const block = inline(el(tag), text);
    block.dataset.open = "1";
    root.append(block);
  }
}

// a table's header row and its |---| row, with as many cells
function isTableHead(line, next) {
  return line.includes("|") && TABLE_RULE.test(next) && splitRow(line).length === splitRow(next).length;
}

// a row's cells: the pipes between them, not the outer ones, and not an escaped \|
function splitRow(line) {
  let body = line.trim();
  if (body.startsWith("|")) body = body.slice(1);
  if (body.endsWith("|") && !body.endsWith("\\|")) body = body.slice(0, -1);
  return body.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function table(lines) {
  const aligns = splitRow(lines[1]).map((cell) =>
    cell.startsWith(":") && cell.endsWith(":") ? "center" : cell.endsWith(":") ? "right" : cell.startsWith(":") ? "left" : "");
  const header = splitRow(lines[0]);
  const row = (cells, tag) => el("tr", {}, ...header.map((_, i) => {
    const cell = inline(el(tag), cells[i] || "");
    if (aligns[i]) cell.style.textAlign = aligns[i];
    return cell;
  }));
  const body = el("tbody", {}, ...lines.slice(2).filter((line) => line.trim()).map((line) => row(splitRow(line), "td")));
  return el("div", { class: "table-wrap" }, el("table", {}, el("thead", {}, row(header, "th")), body));
}

// `code`, **bold**, *italic*, [text](http(s) or mailto URL); anything else stays text
function inline(parent, text) {
  // each part stops at the next character that could start another, so that a line of 40,000 "[" is
  // read in one pass, not once from each; a link's URL may hold balanced parentheses (Foo_(bar))
  const pattern = /`([^`]+)`|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\[([^[\]]+)\]\(((?:[^()\s]|\([^()\s]*\))+)\)/g;
  let at = 0;
  for (const m of text.matchAll(pattern)) {
    parent.append(text.slice(at, m.index));
    if (m[1] !== undefined) parent.append(el("code", { text: m[1] }));
    else if (m[2] !== undefined) parent.append(el("strong", { text: m[2] }));
    else if (m[3] !== undefined) parent.append(el("em", { text: m[3] }));
    else if (safeLink(m[5])) parent.append(el("a", { href: m[5], text: m[4], rel: "noopener noreferrer nofollow", target: "_blank" }));
    else parent.append(m[0]);
    at = m.index + m[0].length;
  }
  parent.append(text.slice(at));
  return parent;
}

function safeLink(url) {
  try {
    return ["http:", "https:", "mailto:"].includes(new URL(url).protocol);
  } catch {
    return false;
  }
}

// ---- generation ---------------------------------------------------------------------------------

function settings() {
  const number = (id) => Number($(id).value);
  const length = $("max-tokens").value.trim() ? Math.round(number("max-tokens")) : null;
  const body = { temperature: number("temperature"), top_p: number("top-p"), max_tokens: length };
  localStorage.setItem(SETTINGS_STORE, JSON.stringify({ ...body, stops: $("stops").value }));
  body.max_tokens = length || autoAnswerLength();
  const stops = $("stops").value.split("\n").filter((s) => s.length > 0);
  if (stops.length) body.stop = stops.slice(0, 4);
  return body;
}

function restoreSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
    if (typeof saved.temperature === "number") $("temperature").value = saved.temperature;
    if (typeof saved.top_p === "number") $("top-p").value = saved.top_p;
    if (typeof saved.max_tokens === "number" && saved.max_tokens > 0) $("max-tokens").value = saved.max_tokens;
    if (typeof saved.stops === "string") $("stops").value = saved.stops;
  } catch {
    /* settings as the page has them */
  }
}

function send(text) {
  const conversation = state.current;
  if (state.controller || !text.trim()) return;
  conversation.messages.push({ role: "user", content: text });
  if (conversation.title === "New chat") conversation.title = text.trim().replace(/\s+/g, " ").slice(0, 48);
  save();
  renderSidebar();
  answer(conversation);
}

async function answer(conversation) {
  const history = conversation.messages.map(({ role, content }) => ({ role, content }));
  const system = (conversation.system || "").trim();
  const message = { role: "assistant", content: "", reasoning: "" };
  conversation.messages.push(message);
  const controller = new AbortController();
  state.controller = controller;
  busy(true);
  renderMessages();
  const view = $("messages").lastElementChild;
  const body = view.querySelector(".body");
  const request = { messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true, stream_options: { include_usage: true }, ...settings() };
  let usage = null;
  let timings = null;
  try {
    let response;
    for (;;) {
      response = await fetch("v1/chat/completions", { method: "POST", headers: headers(),
        body: JSON.stringify(request), signal: controller.signal });
      if (response.status !== 401) break;
      await askForKey("The server refused this API key. Give the right one:");
    }
    if (!response.ok) {
      message.error = await refusal(response, history.length === 1);
    } else {
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffered = "";
      let last = 0;
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffered += decoder.decode(value, { stream: true });
        const events = buffered.split("\n\n");
        buffered = events.pop();
        for (const event of events) {
          const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (!data || data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) message.error = chunk.error.message;
          const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
          if (typeof delta.content === "string") message.content += delta.content;
          if (typeof delta.reasoning_content === "string") message.reasoning += delta.reasoning_content;
          if (chunk.usage) usage = chunk.usage;
          if (chunk.timings) timings = chunk.timings;
        }
        if (performance.now() - last > 50) {
          fillBody(body, message);
          $("messages").scrollTop = $("messages").scrollHeight;
          last = performance.now();
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") message.stopped = true;
    else message.error = `The request failed: ${e.message}`;
  }
  message.stats = statsLine(usage, timings, message.stopped);
  state.controller = null;
  busy(false);
  save();
  if (state.current === conversation) renderMessages();
}

async function refusal(response, first) {
  let text = `The server answered ${response.status}.`;
  try {
    const error = (await response.json()).error || {};
    if (error.code === "context_length_exceeded") return tooLong(error, first);
    if (error.message) text = `The server refused the request: ${error.message}`;
  } catch {
    /* not JSON: the status says it */
  }
  return text;
}

// the server's counts (llama-server's n_prompt_tokens and n_ctx), and what would help
function tooLong(error, first) {
  const limit = (Number(error.n_ctx) || state.contextSize).toLocaleString();
  const count = Number(error.n_prompt_tokens);
  const what = first ? "This message" : "The conversation";
  const size = count ? ` is ${count.toLocaleString()} tokens; the model's context holds ${limit}.`
    : ` is longer than the model's context of ${limit} tokens can hold.`;
  const help = first
    ? "Send a shorter message, or convert the model with a longer context (moepass convert --context N)."
    : "Start a new chat, edit an earlier turn to continue from there, or convert the model with a longer "
      + "context (moepass convert --context N).";
  return `${what}${size} ${help}`;
}

function statsLine(usage, timings, stopped) {
  const parts = [];
  if (usage) parts.push(`${usage.prompt_tokens} prompt tokens`, `${usage.completion_tokens} generated`);
  if (timings && timings.predicted_per_second) parts.push(`${timings.predicted_per_second.toFixed(1)} tokens/s`);
  if (stopped) parts.push("stopped");
  else if (usage && state.contextSize && usage.prompt_tokens + usage.completion_tokens >= state.contextSize) {
    parts.push(`the context is full (${state.contextSize.toLocaleString()} tokens): start a new chat to go on`);
  }
  return parts.join(" · ");
}

function stop() {
  if (state.controller) state.controller.abort();
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
}

function regenerate() {
  const messages = state.current.messages;
  if (state.controller || !messages.length) return;
  if (messages[messages.length - 1].role === "assistant") messages.pop();
  save();
  answer(state.current);
}

// edit a user turn in place, then continue the conversation from it (what came after it is dropped)
function edit(view, index) {
  const message = state.current.messages[index];
  const body = view.querySelector(".body");
  const box = el("textarea", { class: "edit", rows: "3" });
  box.value = message.content;
  const done = el("button", { type: "button", class: "save", text: "Send",
    onclick: () => {
      if (!box.value.trim()) return;
      message.content = box.value;
      state.current.messages.length = index + 1;
      save();
      answer(state.current);
    } });
  const cancel = el("button", { type: "button", text: "Cancel", onclick: renderMessages });
  body.replaceChildren(box, el("div", { class: "actions" }, done, cancel));
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      done.click();
    }
  });
  box.focus();
}

// ---- wiring -------------------------------------------------------------------------------------

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value;
    if (!text.trim() || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.controller) stop();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newConversation);
  $("toggle-sidebar").addEventListener("click", (e) => {
    e.stopPropagation();
    $("sidebar").classList.toggle("open");
  });
  $("close-sidebar").addEventListener("click", () => $("sidebar").classList.remove("open"));
  document.addEventListener("click", (e) => {  // a tap outside the open list closes it
    if ($("sidebar").classList.contains("open") && !$("sidebar").contains(e.target)) {
      $("sidebar").classList.remove("open");
    }
  });
  $("toggle-settings").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
  });
  $("system").addEventListener("change", () => {
    state.current.system = $("system").value;
    save();
  });
  for (const id of ["temperature", "top-p", "max-tokens", "stops"]) $(id).addEventListener("change", settings);
}

async function start() {
  wire();
  restoreSettings();
  if (state.conversations.length) show(state.conversations[0]);
  else newConversation();
  try {
    await loadModel();
  } catch (e) {
    const notice = $("notice");
    notice.textContent = `The server did not answer: ${e.message}`;
    notice.hidden = false;
  }
}

start();

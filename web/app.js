/*
 * shoal web UI: chat (streamed over SSE from POST /v1/chat/completions, stoppable), several
 * conversations kept in localStorage, settings (system prompt, temperature, max tokens, API
 * key), the model picker (GET /v1/models, POST /v1/models/load) and the live cluster view
 * (GET /v1/cluster every second). The contract is docs/api.md.
 * Model output goes through ShoalMarkdown (markdown.js), which escapes everything; data from
 * the API is put in the page as text nodes, never as HTML. No framework, no network beyond the
 * node that served the page. It does not do attachments, tool calls or editing past messages.
 */
(function () {
  'use strict';

  const LS_CONVERSATIONS = 'shoal.conversations.v1';
  const LS_SETTINGS = 'shoal.settings.v1';
  const CLUSTER_POLL_MS = 1000;
  const CLUSTER_POLL_HIDDEN_MS = 5000;
  const MODELS_POLL_MS = 5000;
  const MODELS_POLL_LOADING_MS = 1000;
  const DEFAULT_SETTINGS = { system: '', temperature: 0.7, maxTokens: 1024, token: '', model: '' };

  const $ = (id) => document.getElementById(id);
  const el = {
    messages: $('messages'), input: $('chat-input'), composer: $('composer'), send: $('send'), stop: $('stop'),
    convList: $('conversation-list'), newConv: $('new-conversation'), storageWarning: $('storage-warning'),
    banner: $('banner'), conn: $('conn'), modelSelect: $('model-select'), modelLoad: $('model-load'),
    modelInfo: $('model-info'), clusterSummary: $('cluster-summary'), clusterError: $('cluster-error'),
    nodeList: $('node-list'), planList: $('plan-list'), linkList: $('link-list'),
    progressSection: $('progress-section'), progressList: $('progress-list'),
    settings: $('settings'), openSettings: $('open-settings'), setSystem: $('set-system'),
    setTemperature: $('set-temperature'), setMaxTokens: $('set-max-tokens'), setToken: $('set-token'),
    toggleChats: $('toggle-chats'), toggleCluster: $('toggle-cluster'),
  };

  // ---------- small helpers ----------

  /** Builds an element; strings become text nodes, so API data is never parsed as HTML. */
  function h(tag, props, ...kids) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v == null || v === false) continue;
      if (k === 'class') node.className = v;
      else if (k === 'style') Object.assign(node.style, v);
      else if (k.startsWith('on') && typeof v === 'function') node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? '' : String(v));
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid == null || kid === false) continue;
      node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return node;
  }

  function fmtBytes(n) {
    if (!Number.isFinite(n) || n < 0) return '?';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(n >= 100 ? 0 : 1)) + ' ' + units[i];
  }

  function fmtRate(n, unit) {
    if (!Number.isFinite(n) || n <= 0) return 'not measured';
    const prefixes = ['', 'k', 'M', 'G', 'T', 'P'];
    let i = 0;
    while (n >= 1000 && i < prefixes.length - 1) { n /= 1000; i++; }
    return n.toFixed(n >= 100 ? 0 : 1) + ' ' + prefixes[i] + unit;
  }

  function fmtTps(n) {
    return Number.isFinite(n) && n > 0 ? n.toFixed(n >= 100 ? 0 : 1) + ' tok/s' : '—';
  }

  function shortId(id) {
    const s = String(id || '');
    return s.length > 14 ? s.slice(0, 6) + '…' + s.slice(-6) : s;
  }

  function uid() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  // ---------- settings ----------

  function loadJson(key, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v && typeof v === 'object' ? v : fallback;
    } catch (_) {
      return fallback;
    }
  }

  function saveJson(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
      el.storageWarning.hidden = true;
      return true;
    } catch (e) {
      el.storageWarning.textContent = 'Could not save to browser storage (' + (e && e.name) + '); delete old chats to make room.';
      el.storageWarning.hidden = false;
      return false;
    }
  }

  const settings = Object.assign({}, DEFAULT_SETTINGS, loadJson(LS_SETTINGS, {}));
  const saveSettings = () => saveJson(LS_SETTINGS, settings);

  function authHeaders() {
    return settings.token ? { Authorization: 'Bearer ' + settings.token } : {};
  }

  /** fetch against the node's API, with the bearer token when one is set. */
  function api(path, options) {
    const opts = Object.assign({}, options);
    opts.headers = Object.assign({}, authHeaders(), opts.headers || {});
    return fetch(path, opts);
  }

  /** The message of an OpenAI-shaped error body, or the status line. */
  async function errorMessage(res) {
    let text = '';
    try { text = await res.text(); } catch (_) { /* body unreadable: use the status */ }
    try {
      const body = JSON.parse(text);
      if (body && body.error) return typeof body.error === 'string' ? body.error : (body.error.message || JSON.stringify(body.error));
    } catch (_) { /* not JSON */ }
    return 'HTTP ' + res.status + (res.statusText ? ' ' + res.statusText : '') + (text ? ': ' + text.slice(0, 300) : '');
  }

  // ---------- banner (auth, connection, cluster error) ----------

  const bannerState = { auth: null, offline: null, cluster: null };
  function renderBanner() {
    const msg = bannerState.auth || bannerState.offline || bannerState.cluster;
    el.banner.hidden = !msg;
    el.banner.textContent = msg || '';
    el.banner.dataset.kind = bannerState.auth ? 'auth' : bannerState.offline ? 'offline' : 'cluster';
  }

  function noteAuth(status) {
    const next = status === 401
      ? (settings.token ? 'The node refused the API key. Check it in Settings.' : 'This node needs an API key: enter it in Settings.')
      : null;
    if (next !== bannerState.auth) { bannerState.auth = next; renderBanner(); }
  }

  // ---------- conversations ----------

  const store = (() => {
    const raw = loadJson(LS_CONVERSATIONS, null);
    const list = raw && Array.isArray(raw.list) ? raw.list.filter((c) => c && c.id && Array.isArray(c.messages)) : [];
    return { active: raw && raw.active, list };
  })();

  function saveConversations() {
    return saveJson(LS_CONVERSATIONS, store);
  }

  function newConversation() {
    const c = { id: uid(), title: '', created: Date.now(), updated: Date.now(), messages: [] };
    store.list.unshift(c);
    store.active = c.id;
    return c;
  }

  function activeConversation() {
    let c = store.list.find((x) => x.id === store.active);
    if (!c) c = store.list[0] || newConversation();
    store.active = c.id;
    return c;
  }

  function titleOf(c) {
    if (c.title) return c.title;
    const first = c.messages.find((m) => m.role === 'user');
    return first ? first.content.replace(/\s+/g, ' ').trim().slice(0, 60) || 'New chat' : 'New chat';
  }

  function renderConversationList() {
    const sorted = store.list.slice().sort((a, b) => (b.updated || 0) - (a.updated || 0));
    el.convList.replaceChildren(...sorted.map((c) => {
      const title = titleOf(c);
      const isActive = c.id === store.active;
      return h('li', { class: 'conv' + (isActive ? ' active' : ''), 'data-testid': 'conversation-item', 'data-conversation-id': c.id },
        h('button', { type: 'button', class: 'conv-open', 'aria-current': isActive ? 'true' : null, title, onclick: () => selectConversation(c.id) }, title),
        h('button', { type: 'button', class: 'conv-delete', 'aria-label': 'Delete chat: ' + title, title: 'Delete', 'data-testid': 'delete-conversation', onclick: () => deleteConversation(c.id) }, '×'));
    }));
  }

  function selectConversation(id) {
    store.active = id;
    saveConversations();
    renderConversationList();
    renderMessages();
    setPanel(null);
    el.input.focus();
  }

  function deleteConversation(id) {
    if (streaming && streaming.convId === id) streaming.controller.abort();
    store.list = store.list.filter((c) => c.id !== id);
    if (store.active === id) {
      const next = store.list.slice().sort((a, b) => (b.updated || 0) - (a.updated || 0))[0];
      store.active = next ? next.id : newConversation().id;
    }
    saveConversations();
    renderConversationList();
    renderMessages();
  }

  // ---------- messages ----------

  function statsText(s) {
    if (!s) return '';
    const parts = [];
    if (Number.isFinite(s.ttft)) parts.push('TTFT ' + s.ttft.toFixed(2) + ' s');
    if (Number.isFinite(s.decodeTps)) parts.push(fmtTps(s.decodeTps));
    if (Number.isFinite(s.completionTokens)) parts.push(s.completionTokens + ' tokens');
    if (Number.isFinite(s.prefillTps)) parts.push('prefill ' + fmtTps(s.prefillTps));
    if (s.finish === 'length') parts.push('cut at max tokens');
    return parts.join(' · ');
  }

  function statsTitle(s) {
    if (!s) return '';
    const lines = [];
    if (Number.isFinite(s.serverTtft)) lines.push('time to first token (node): ' + s.serverTtft.toFixed(3) + ' s');
    if (Number.isFinite(s.clientTtft)) lines.push('time to first token (browser): ' + s.clientTtft.toFixed(3) + ' s');
    if (Number.isFinite(s.serverDecodeTps)) lines.push('decode (node): ' + fmtTps(s.serverDecodeTps));
    if (Number.isFinite(s.clientTps)) lines.push('decode (browser): ' + fmtTps(s.clientTps));
    if (Number.isFinite(s.promptTokens)) lines.push('prompt tokens: ' + s.promptTokens);
    return lines.join('\n');
  }

  function messageNode(m) {
    const isUser = m.role === 'user';
    const content = h('div', { class: 'msg-content' + (isUser ? ' plain' : ' md'), 'data-testid': 'message-content' });
    if (isUser) content.textContent = m.content;
    else content.innerHTML = ShoalMarkdown.render(m.content);
    const node = h('article', {
      class: 'msg msg-' + m.role, 'data-testid': 'message-' + m.role, 'data-message-id': m.id,
      'data-streaming': isUser ? null : String(!!m.streaming),
    },
    h('div', { class: 'msg-role' }, isUser ? 'You' : (m.model || 'assistant')),
    content,
    h('div', { class: 'msg-error', role: 'alert', 'data-testid': 'message-error', hidden: !m.error }, m.error || ''),
    isUser ? null : h('div', { class: 'msg-stats', 'data-testid': 'message-stats', 'data-final': String(!m.streaming), title: statsTitle(m.stats) },
      m.streaming ? liveStatsText(m) : [statsText(m.stats), m.stopped ? (m.stats ? ' · ' : '') + 'stopped' : '']));
    if (!isUser && m.streaming && !m.content) content.append(h('span', { class: 'typing', 'aria-label': 'waiting for the first token' }, '●●●'));
    return node;
  }

  function liveStatsText(m) {
    const s = m.stats || {};
    if (!Number.isFinite(s.clientTtft)) return 'waiting for the first token…';
    return 'TTFT ' + s.clientTtft.toFixed(2) + ' s · ' + (s.chunks || 0) + ' tokens so far';
  }

  function renderMessages() {
    const c = activeConversation();
    if (!c.messages.length) {
      el.messages.replaceChildren(h('div', { class: 'empty', 'data-testid': 'empty-chat' },
        h('p', { class: 'empty-title' }, 'Ask anything.'),
        h('p', { class: 'muted' }, 'The model runs on your own machines. Pick it above; the cluster view shows where its layers live.')));
      return;
    }
    el.messages.replaceChildren(...c.messages.map(messageNode));
    el.messages.scrollTop = el.messages.scrollHeight;
  }

  function nearBottom() {
    return el.messages.scrollHeight - el.messages.scrollTop - el.messages.clientHeight < 80;
  }

  /**
   * Updates one message in place (if it is on screen), keeping the scroll pinned to the end.
   * The article stays the same node, so the live region does not announce it anew per token.
   */
  function refreshMessage(m) {
    const old = el.messages.querySelector('[data-message-id="' + CSS.escape(m.id) + '"]');
    if (!old) return;
    const stick = nearBottom();
    const fresh = messageNode(m);
    if (m.role === 'assistant') old.setAttribute('data-streaming', String(!!m.streaming));
    old.setAttribute('aria-busy', String(!!m.streaming));
    old.replaceChildren(...fresh.childNodes);
    if (stick) el.messages.scrollTop = el.messages.scrollHeight;
  }

  // ---------- chat ----------

  let streaming = null; // { convId, msg, controller }

  function setStreamingUi(on) {
    el.send.hidden = on;
    el.stop.hidden = !on;
    el.messages.setAttribute('aria-busy', String(on));
    if (!on) el.send.disabled = false;
  }

  function chosenModel() {
    return el.modelSelect.value || settings.model || '';
  }

  function requestMessages(c) {
    const out = [];
    if (settings.system.trim()) out.push({ role: 'system', content: settings.system });
    for (const m of c.messages) {
      if (m.streaming) continue;
      if (m.role === 'assistant' && !m.content) continue;
      out.push({ role: m.role, content: m.content });
    }
    return out;
  }

  /** Yields the `data:` payload of each server-sent event in a fetch body. */
  async function* sseData(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = '';
    const take = (raw) => raw.split(/\r?\n/).filter((l) => l.startsWith('data:')).map((l) => l.slice(5).replace(/^ /, '')).join('\n');
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let m;
      while ((m = /\r?\n\r?\n/.exec(buf))) {
        const data = take(buf.slice(0, m.index));
        buf = buf.slice(m.index + m[0].length);
        if (data) yield data;
      }
    }
    buf += decoder.decode();
    const rest = take(buf);
    if (rest) yield rest;
  }

  async function send(text) {
    if (streaming) return;
    const conv = activeConversation();
    const model = chosenModel();
    const user = { id: uid(), role: 'user', content: text };
    const msg = { id: uid(), role: 'assistant', content: '', model, streaming: true, stats: {} };
    conv.messages.push(user);
    const history = requestMessages(conv);
    conv.messages.push(msg);
    conv.updated = Date.now();
    saveConversations();
    renderConversationList();
    renderMessages();

    const controller = new AbortController();
    streaming = { convId: conv.id, msg, controller };
    setStreamingUi(true);

    const t0 = performance.now();
    let tFirst = null;
    let chunks = 0;
    let usage = null;
    let server = null;
    let finish = null;
    let sawDone = false;
    let frame = 0;
    let lastSave = Date.now();
    const scheduleRender = () => {
      if (frame) return;
      frame = requestAnimationFrame(() => {
        frame = 0;
        refreshMessage(msg);
        if (Date.now() - lastSave > 1000) { lastSave = Date.now(); saveConversations(); }
      });
    };

    const body = {
      model, messages: history, stream: true, stream_options: { include_usage: true },
      temperature: Number(settings.temperature), max_tokens: Number(settings.maxTokens),
    };
    try {
      const res = await api('/v1/chat/completions', {
        method: 'POST', headers: { 'Content-Type': 'application/json', Accept: 'text/event-stream' },
        body: JSON.stringify(body), signal: controller.signal,
      });
      noteAuth(res.status);
      if (!res.ok) {
        msg.error = await errorMessage(res);
      } else {
        for await (const data of sseData(res.body)) {
          if (data === '[DONE]') { sawDone = true; break; }
          let chunk;
          try { chunk = JSON.parse(data); } catch (_) { continue; }
          if (chunk.error) { msg.error = chunk.error.message || JSON.stringify(chunk.error); continue; }
          const choice = chunk.choices && chunk.choices[0];
          const piece = choice && choice.delta && choice.delta.content;
          if (piece) {
            if (tFirst === null) { tFirst = performance.now(); msg.stats.clientTtft = (tFirst - t0) / 1000; }
            chunks++;
            msg.stats.chunks = chunks;
            msg.content += piece;
            scheduleRender();
          }
          if (choice && choice.finish_reason) finish = choice.finish_reason;
          if (chunk.usage) usage = chunk.usage;
          if (chunk.shoal) server = chunk.shoal;
        }
        if (!sawDone && !msg.error) msg.error = 'The stream ended before the node finished the reply.';
      }
    } catch (e) {
      if (e && e.name === 'AbortError') msg.stopped = true;
      else msg.error = 'Could not reach the node: ' + (e && e.message ? e.message : e);
    }
    if (frame) cancelAnimationFrame(frame);
    const tEnd = performance.now();

    const s = msg.stats;
    const completion = usage && Number.isFinite(usage.completion_tokens) ? usage.completion_tokens : chunks;
    if (tFirst !== null && completion > 1 && tEnd > tFirst) s.clientTps = (completion - 1) / ((tEnd - tFirst) / 1000);
    if (server) {
      if (Number.isFinite(server.time_to_first_token_s)) s.serverTtft = server.time_to_first_token_s;
      if (Number.isFinite(server.decode_tok_s)) s.serverDecodeTps = server.decode_tok_s;
      if (Number.isFinite(server.prefill_tok_s)) s.prefillTps = server.prefill_tok_s;
    }
    s.ttft = Number.isFinite(s.serverTtft) ? s.serverTtft : s.clientTtft;
    s.decodeTps = Number.isFinite(s.serverDecodeTps) ? s.serverDecodeTps : s.clientTps;
    if (tFirst !== null || usage) s.completionTokens = completion;
    if (usage && Number.isFinite(usage.prompt_tokens)) s.promptTokens = usage.prompt_tokens;
    s.finish = finish;
    if (tFirst === null && !usage) msg.stats = null;
    msg.streaming = false;
    conv.updated = Date.now();
    streaming = null;
    saveConversations();
    refreshMessage(msg);
    setStreamingUi(false);
  }

  function submit() {
    const text = el.input.value;
    if (!text.trim() || streaming) return;
    el.input.value = '';
    autoGrow();
    send(text);
  }

  function autoGrow() {
    el.input.style.height = 'auto';
    el.input.style.height = Math.min(el.input.scrollHeight, 240) + 'px';
  }

  // ---------- models ----------

  let models = [];
  let modelsKey = '';
  let loadPending = null; // model id whose load we asked for
  let loadSawProgress = false; // the cluster showed progress for it since
  let loadGonePolls = 0;
  let lastProgress = [];

  function modelLabel(m) {
    const s = m.shoal || {};
    const size = Number.isFinite(s.size_bytes) ? fmtBytes(s.size_bytes) : '';
    if (s.loaded) return m.id + ' — loaded' + (size ? ', ' + size : '');
    return m.id + ' — ' + (s.fits === false ? "doesn't fit" : 'fits') + (size ? ', ' + size : '');
  }

  function renderModels() {
    const key = JSON.stringify(models.map((m) => [m.id, m.shoal && m.shoal.loaded, m.shoal && m.shoal.fits]));
    if (key !== modelsKey) {
      modelsKey = key;
      const loaded = models.filter((m) => m.shoal && m.shoal.loaded);
      const local = models.filter((m) => !(m.shoal && m.shoal.loaded));
      const groups = [];
      if (loaded.length) groups.push(h('optgroup', { label: 'Loaded' }, loaded.map((m) => h('option', { value: m.id, 'data-loaded': 'true' }, modelLabel(m)))));
      if (local.length) groups.push(h('optgroup', { label: 'On this node, not loaded' }, local.map((m) => h('option', { value: m.id, 'data-loaded': 'false' }, modelLabel(m)))));
      if (!models.length) groups.push(h('option', { value: '', disabled: true }, 'no models found'));
      el.modelSelect.replaceChildren(...groups);
      const want = models.some((m) => m.id === settings.model) ? settings.model : (loaded[0] || models[0] || {}).id;
      if (want) el.modelSelect.value = want;
    }
    renderModelInfo();
  }

  function renderModelInfo() {
    const m = models.find((x) => x.id === el.modelSelect.value);
    el.modelLoad.hidden = true;
    if (!m) {
      el.modelInfo.textContent = models.length ? '' : 'No model files: start with --model, or put a GGUF in the data directory.';
      return;
    }
    const s = m.shoal || {};
    const progress = lastProgress.find((p) => p.model === m.id);
    const parts = [];
    if (s.loaded) parts.push('loaded');
    else if (progress) parts.push(progress.phase + (Number.isFinite(progress.fraction) ? ' ' + Math.round(progress.fraction * 100) + '%' : '…'));
    else if (loadPending === m.id) parts.push('loading…');
    else parts.push(s.fits === false ? 'too big for this node' : 'not loaded');
    if (s.family) parts.push(s.family);
    if (Number.isFinite(s.layers)) parts.push(s.layers + ' layers');
    el.modelInfo.textContent = parts.join(' · ');
    el.modelInfo.title = s.path || '';
    if (!s.loaded && !progress && loadPending !== m.id) {
      el.modelLoad.hidden = false;
      el.modelLoad.textContent = s.fits === false ? 'Load anyway' : 'Load';
    }
  }

  let modelsTimer = 0;
  let modelsRun = 0; // a newer call supersedes an older one still waiting on the network
  async function pollModels() {
    clearTimeout(modelsTimer);
    const run = ++modelsRun;
    try {
      const res = await api('/v1/models');
      if (run !== modelsRun) return;
      noteAuth(res.status);
      if (res.ok) {
        const body = await res.json();
        if (run !== modelsRun) return;
        models = Array.isArray(body.data) ? body.data : [];
        if (loadPending && models.some((m) => m.id === loadPending && m.shoal && m.shoal.loaded)) loadPending = null;
        const gone = loadPending && loadSawProgress && !lastProgress.some((p) => p.model === loadPending);
        loadGonePolls = gone ? loadGonePolls + 1 : 0;
        if (loadGonePolls >= 2) {
          // Progress came and went, and two polls later the model is not loaded: it failed.
          const failed = loadPending;
          loadPending = null;
          renderModels();
          if (el.modelSelect.value === failed) el.modelInfo.textContent = 'Loading ' + failed + " ended without it loaded; the node's log says why.";
          modelsTimer = setTimeout(pollModels, MODELS_POLL_MS);
          return;
        }
        renderModels();
      }
    } catch (_) { /* the cluster poll reports the connection */ }
    modelsTimer = setTimeout(pollModels, loadPending ? MODELS_POLL_LOADING_MS : MODELS_POLL_MS);
  }

  async function loadModel() {
    const id = el.modelSelect.value;
    if (!id) return;
    loadPending = id;
    loadSawProgress = false;
    renderModelInfo();
    try {
      const res = await api('/v1/models/load', {
        method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ model: id }),
      });
      noteAuth(res.status);
      if (!res.ok) {
        loadPending = null;
        renderModelInfo();
        el.modelInfo.textContent = 'Load failed: ' + await errorMessage(res);
      }
    } catch (e) {
      loadPending = null;
      el.modelInfo.textContent = 'Load failed: ' + (e && e.message ? e.message : e);
    }
  }

  // ---------- cluster ----------

  let clusterKey = '';
  const PALETTE = 8;

  function meter(fraction, label, extraClass) {
    const pct = Math.max(0, Math.min(1, fraction || 0)) * 100;
    return h('div', { class: 'meter' + (extraClass ? ' ' + extraClass : ''), role: 'meter', 'aria-label': label, 'aria-valuemin': '0', 'aria-valuemax': '100', 'aria-valuenow': pct.toFixed(0) },
      h('span', { style: { width: pct.toFixed(1) + '%' } }));
  }

  function renderCluster(c) {
    const nodes = Array.isArray(c.nodes) ? c.nodes : [];
    const plans = Array.isArray(c.plans) ? c.plans : [];
    const links = Array.isArray(c.links) ? c.links : [];
    const progress = Array.isArray(c.progress) ? c.progress : [];
    const downloads = Array.isArray(c.downloads) ? c.downloads : [];
    const colour = new Map(nodes.map((n, i) => [n.id, i % PALETTE]));
    const nameOf = (id) => { const n = nodes.find((x) => x.id === id); return n ? (n.name || shortId(id)) : shortId(id); };

    el.clusterSummary.textContent = nodes.length + (nodes.length === 1 ? ' node' : ' nodes') +
      (c.epoch != null ? ' · epoch ' + c.epoch : '') + (c.leader ? ' · leader ' + nameOf(c.leader) : '');

    el.clusterError.hidden = !c.error;
    el.clusterError.textContent = c.error ? String(c.error) : '';
    bannerState.cluster = c.error ? 'Cluster: ' + String(c.error) : null;

    el.nodeList.replaceChildren(...(nodes.length ? nodes.map((n) => {
      const total = Number(n.memory_total) || 0;
      const avail = Number(n.memory_available) || 0;
      const used = Math.max(0, total - avail);
      const held = [];
      for (const p of plans) {
        const layers = Math.max(0, ...(p.stages || []).map((s) => s.end || 0));
        for (const s of p.stages || []) {
          const group = [s.node, ...(s.group || [])];
          if (!group.includes(n.id)) continue;
          const slice = group.length > 1 ? ', tensor slice ' + (group.indexOf(n.id) + 1) + ' of ' + group.length : '';
          held.push(h('li', { 'data-testid': 'node-layers' },
            h('span', { class: 'mono' }, p.model), ': layers ' + s.start + '–' + (s.end - 1) + ' (' + (s.end - s.start) + ' of ' + layers + slice + ')',
            meter(layers ? (s.end - s.start) / layers : 0, 'share of ' + p.model + ' layers', 'thin c' + colour.get(n.id))));
        }
      }
      return h('div', { class: 'node c' + colour.get(n.id), 'data-testid': 'cluster-node', 'data-node-id': n.id },
        h('div', { class: 'node-head' },
          h('span', { class: 'swatch', 'aria-hidden': 'true' }),
          h('strong', { class: 'node-name' }, n.name || shortId(n.id)),
          n.id === c.self ? h('span', { class: 'badge' }, 'this node') : null,
          n.id === c.leader ? h('span', { class: 'badge leader' }, 'leader') : null),
        h('div', { class: 'mono muted node-id', title: n.id }, n.id),
        meter(total ? used / total : 0, 'memory used on ' + (n.name || n.id)),
        h('div', { class: 'kv' }, fmtBytes(used) + ' used of ' + fmtBytes(total) + ' · ' + fmtBytes(avail) + ' free'),
        h('div', { class: 'kv' }, [n.backend, n.device].filter(Boolean).join(' · ')),
        h('div', { class: 'kv' }, 'compute ' + fmtRate(Number(n.flops), 'FLOP/s') + ' · memory ' + fmtRate(Number(n.mem_bandwidth), 'B/s')),
        held.length ? h('ul', { class: 'held' }, held) : h('div', { class: 'kv muted' }, 'holds no layers'),
        Array.isArray(n.addresses) && n.addresses.length ? h('div', { class: 'kv muted mono addr' }, n.addresses.join(' ')) : null);
    }) : [h('p', { class: 'muted' }, 'No nodes reported.')]));

    el.planList.replaceChildren(...(plans.length ? plans.map((p) => {
      const stages = p.stages || [];
      const layers = Math.max(0, ...stages.map((s) => s.end || 0));
      return h('div', { class: 'plan', 'data-testid': 'cluster-plan', 'data-model': p.model },
        h('div', { class: 'plan-head' }, h('strong', { class: 'mono' }, p.model),
          h('span', { class: 'badge strategy', 'data-testid': 'plan-strategy' }, p.strategy || '?'),
          p.epoch != null ? h('span', { class: 'muted' }, 'epoch ' + p.epoch) : null),
        h('div', { class: 'stagebar', role: 'img', 'aria-label': stages.map((s) => nameOf(s.node) + ' layers ' + s.start + ' to ' + (s.end - 1)).join('; ') },
          stages.map((s) => h('span', { class: 'c' + (colour.has(s.node) ? colour.get(s.node) : 0), style: { flexGrow: String(Math.max(1, s.end - s.start)) }, title: nameOf(s.node) + ': ' + s.start + '–' + (s.end - 1) }, String(s.end - s.start)))),
        h('div', { class: 'kv' }, stages.map((s, i) => [i ? ' → ' : '', [s.node, ...(s.group || [])].map(nameOf).join(' + ') + ' [' + s.start + ', ' + s.end + ')'])),
        h('div', { class: 'kv', 'data-testid': 'plan-tps' }, 'predicted ' + fmtTps(p.predicted_tok_s) + ' · measured ' + fmtTps(p.measured_tok_s)),
        (p.predictions || []).length ? h('div', { class: 'kv muted', 'data-testid': 'plan-predictions' }, 'cost model: ' + p.predictions.map((x) => x.strategy + (x.group > 1 ? ' ×' + x.group : '') + ' ' + fmtTps(x.tok_s) + (x.fits ? '' : ' (does not fit)')).join(' · ')) : null,
        layers ? null : h('div', { class: 'kv muted' }, 'no stages'));
    }) : [h('p', { class: 'muted' }, 'No model placed.')]));

    el.linkList.replaceChildren(links.length
      ? h('table', { class: 'links' }, h('thead', {}, h('tr', {}, h('th', { scope: 'col' }, 'From'), h('th', { scope: 'col' }, 'To'), h('th', { scope: 'col' }, 'RTT'))),
        h('tbody', {}, links.map((l) => h('tr', { 'data-testid': 'cluster-link' }, h('td', {}, nameOf(l.from)), h('td', {}, nameOf(l.to)),
          h('td', {}, Number.isFinite(l.rtt_ms) ? l.rtt_ms.toFixed(l.rtt_ms < 10 ? 2 : 0) + ' ms' : '—')))))
      : h('p', { class: 'muted' }, nodes.length > 1 ? 'No links measured yet.' : 'No links: one node.'));

    el.progressSection.hidden = !progress.length && !downloads.length;
    const downloadRows = downloads.map((d) => h('div', { class: 'progress', 'data-testid': 'cluster-download', 'data-model': d.model },
      h('div', { class: 'kv' }, h('span', { class: 'mono' }, d.model), ' ' + (d.phase || '') + (d.source ? ' from ' + d.source : '') + ' on ' + nameOf(d.node) +
        (Number.isFinite(d.fraction) ? ' — ' + Math.round(d.fraction * 100) + '%' : '') +
        ' (' + fmtBytes(Number(d.bytes_done) || 0) + (d.bytes_total != null ? ' of ' + fmtBytes(Number(d.bytes_total)) : '') +
        (Number(d.bytes_per_s) > 0 ? ', ' + fmtRate(Number(d.bytes_per_s), 'B/s') : '') + ')' + (d.error ? ' — ' + d.error : '')),
      meter(Number.isFinite(d.fraction) ? d.fraction : 0, (d.phase || 'download') + ' ' + d.model, 'download')));
    el.progressList.replaceChildren(...downloadRows, ...progress.map((p) => h('div', { class: 'progress', 'data-testid': 'cluster-progress' },
      h('div', { class: 'kv' }, h('span', { class: 'mono' }, p.model), ' ' + (p.phase || '') + ' on ' + nameOf(p.node) +
        (Number.isFinite(p.fraction) ? ' — ' + Math.round(p.fraction * 100) + '%' : '…')),
      Number.isFinite(p.fraction)
        ? meter(p.fraction, (p.phase || 'progress') + ' ' + p.model, p.phase === 'downloading' ? 'download' : 'load')
        : h('div', { class: 'meter busy', role: 'progressbar', 'aria-label': (p.phase || 'progress') + ' ' + p.model }, h('span')))));
  }

  async function pollCluster() {
    try {
      const res = await api('/v1/cluster', { cache: 'no-store' });
      noteAuth(res.status);
      if (res.ok) {
        const body = await res.json();
        el.conn.textContent = 'connected';
        el.conn.dataset.state = 'ok';
        if (bannerState.offline) { bannerState.offline = null; }
        lastProgress = Array.isArray(body.progress) ? body.progress : [];
        if (loadPending && lastProgress.some((p) => p.model === loadPending)) loadSawProgress = true;
        const key = JSON.stringify(body);
        if (key !== clusterKey) {
          clusterKey = key;
          renderCluster(body);
          renderModelInfo();
        }
      } else if (res.status !== 401) {
        el.conn.textContent = 'error ' + res.status;
        el.conn.dataset.state = 'error';
      } else {
        el.conn.textContent = 'needs API key';
        el.conn.dataset.state = 'error';
      }
    } catch (e) {
      el.conn.textContent = 'offline';
      el.conn.dataset.state = 'error';
      bannerState.offline = 'Cannot reach the node (' + (e && e.message ? e.message : e) + '). Retrying…';
    }
    renderBanner();
    setTimeout(pollCluster, document.hidden ? CLUSTER_POLL_HIDDEN_MS : CLUSTER_POLL_MS);
  }

  // ---------- layout on narrow windows ----------

  function setPanel(which) {
    document.body.dataset.panel = which || '';
    el.toggleChats.setAttribute('aria-expanded', String(which === 'chats'));
    el.toggleCluster.setAttribute('aria-expanded', String(which === 'cluster'));
  }

  // ---------- wiring ----------

  function openSettings() {
    el.setSystem.value = settings.system;
    el.setTemperature.value = settings.temperature;
    el.setMaxTokens.value = settings.maxTokens;
    el.setToken.value = settings.token;
    if (typeof el.settings.showModal === 'function') el.settings.showModal();
    else el.settings.setAttribute('open', '');
  }

  function readSettings() {
    settings.system = el.setSystem.value;
    const t = parseFloat(el.setTemperature.value);
    settings.temperature = Number.isFinite(t) ? Math.min(2, Math.max(0, t)) : DEFAULT_SETTINGS.temperature;
    const n = parseInt(el.setMaxTokens.value, 10);
    settings.maxTokens = Number.isFinite(n) && n > 0 ? n : DEFAULT_SETTINGS.maxTokens;
    const tokenChanged = settings.token !== el.setToken.value.trim();
    settings.token = el.setToken.value.trim();
    saveSettings();
    if (tokenChanged) { bannerState.auth = null; renderBanner(); modelsKey = ''; pollModels(); }
  }

  el.composer.addEventListener('submit', (e) => { e.preventDefault(); submit(); });
  el.input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.altKey && !e.isComposing) { e.preventDefault(); submit(); }
    else if (e.key === 'Escape' && streaming) { e.preventDefault(); streaming.controller.abort(); }
  });
  el.input.addEventListener('input', autoGrow);
  el.stop.addEventListener('click', () => { if (streaming) streaming.controller.abort(); el.input.focus(); });
  el.newConv.addEventListener('click', () => {
    const c = activeConversation();
    if (c.messages.length) newConversation();
    saveConversations();
    renderConversationList();
    renderMessages();
    setPanel(null);
    el.input.focus();
  });
  el.modelSelect.addEventListener('change', () => { settings.model = el.modelSelect.value; saveSettings(); renderModelInfo(); });
  el.modelLoad.addEventListener('click', loadModel);
  el.openSettings.addEventListener('click', openSettings);
  for (const input of [el.setSystem, el.setTemperature, el.setMaxTokens, el.setToken]) input.addEventListener('change', readSettings);
  el.settings.addEventListener('close', readSettings);
  el.toggleChats.addEventListener('click', () => setPanel(document.body.dataset.panel === 'chats' ? null : 'chats'));
  el.toggleCluster.addEventListener('click', () => setPanel(document.body.dataset.panel === 'cluster' ? null : 'cluster'));
  document.addEventListener('keydown', (e) => { if (e.key === 'Escape' && document.body.dataset.panel) setPanel(null); });
  for (const b of document.querySelectorAll('[data-close-panel]')) b.addEventListener('click', () => setPanel(null));
  el.messages.addEventListener('click', async (e) => {
    const btn = e.target.closest('.code-copy');
    if (!btn) return;
    const code = btn.closest('.code-block').querySelector('code').textContent;
    try {
      await navigator.clipboard.writeText(code);
    } catch (_) {
      const ta = h('textarea', { 'aria-hidden': 'true', style: { position: 'fixed', opacity: '0' } });
      ta.value = code;
      document.body.append(ta);
      ta.select();
      document.execCommand('copy');
      ta.remove();
    }
    btn.textContent = 'Copied';
    setTimeout(() => { btn.textContent = 'Copy'; }, 1200);
  });
  window.addEventListener('storage', (e) => {
    if (e.key !== LS_CONVERSATIONS || streaming) return;
    const fresh = loadJson(LS_CONVERSATIONS, null);
    if (!fresh || !Array.isArray(fresh.list)) return;
    store.list = fresh.list;
    if (!store.list.some((c) => c.id === store.active)) store.active = fresh.active;
    renderConversationList();
    renderMessages();
  });
  document.addEventListener('visibilitychange', () => { if (!document.hidden) clusterKey = ''; });

  // A reply that was streaming when the page went away is kept as far as it got.
  for (const c of store.list) for (const m of c.messages) if (m.streaming) { m.streaming = false; m.stopped = true; }

  activeConversation();
  renderConversationList();
  renderMessages();
  setStreamingUi(false);
  pollCluster();
  pollModels();
  el.input.focus();
})();

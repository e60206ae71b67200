// quickdraft admin page logic (plain JS, no build step).
// Contract: GET /admin/api/state and PUT /admin/api/models/{name}, both with
// "Authorization: Bearer <admin token>". The settings form is filled from the server when the
// page loads and after each Apply; the live figures refresh every second without touching
// the form (so a half-edited form is never overwritten).
"use strict";

const TOKEN_KEY = "quickdraft-admin-token";
const POLL_MS = 1000;
let pollTimer = null;

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

async function api(method, path, body) {
  const init = { method, headers: { Authorization: "Bearer " + token() } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    const msg = (data.error && data.error.message) || resp.statusText;
    const err = new Error(msg);
    err.status = resp.status;
    throw err;
  }
  return data;
}

function pct(x) { return (100 * x).toFixed(1) + " %"; }

function section(name) {
  return document.querySelector(`section.model[data-model="${CSS.escape(name)}"]`);
}

function fillForm(sec, model, methods) {
  const s = model.settings;
  const select = sec.querySelector(".method");
  select.replaceChildren(...methods.map((m) => new Option(m, m)));
  select.value = s.method;
  sec.querySelector(".enabled").checked = s.enabled;
  sec.querySelector(".draft-model").value = s.draft_model || "";
  sec.querySelector(".k").value = s.num_draft_tokens;
}

function renderActive(sec, model) {
  const a = model.active;
  let text = a.method === "none" ? "speculation off" : `${a.method}, k <= ${a.num_draft_tokens}`;
  if (a.draft_model) text += `, draft ${a.draft_model}`;
  if (a.method !== "none") text += a.adaptive ? ", adaptive k" : ", fixed k";
  sec.querySelector(".active").textContent = text;
}

function renderStats(sec, st, active, pc) {
  sec.querySelector(".acceptance-rate").textContent = st.draft_tokens ? pct(st.acceptance_rate) : "-";
  sec.querySelector(".recent-acceptance").textContent =
    st.recent_acceptance_rate ? pct(st.recent_acceptance_rate) : "-";
  sec.querySelector(".al").textContent = st.drafts ? st.mean_acceptance_length.toFixed(2) : "-";
  sec.querySelector(".tok-s").textContent = st.recent_tok_s.toFixed(1);
  // pc: the prefix cache (null: off)
  sec.querySelector(".prefix-hit-rate").textContent = !pc ? "off"
    : pc.queries ? `${pct(pc.hit_rate)} (${pc.megabytes} MB)` : "-";
  sec.querySelector(".window").textContent = st.window_s;
  sec.querySelector(".requests").textContent = st.requests;
  const hist = sec.querySelector(".hist");
  // one bar per possible outcome 0..k, also those that never happened yet
  const counts = [...st.acceptance_histogram];
  const k = active.method === "none" ? 0 : active.num_draft_tokens;
  while (counts.length < k + 1) counts.push(0);
  const top = Math.max(1, ...counts);
  hist.replaceChildren(...counts.map((n, j) => {
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.height = Math.round((80 * n) / top) + "px";
    bar.title = `${n} cycles accepted ${j} draft tokens`;
    bar.dataset.accepted = j;
    bar.dataset.count = n;
    const label = document.createElement("span");
    label.textContent = j;
    bar.append(label);
    return bar;
  }));
  const last = st.last_request;
  sec.querySelector(".last-request").textContent = last
    ? `last request ${last.id}: ${last.completion_tokens} tokens, ${last.decode_tok_s} tok/s, ` +
      `${last.speculative.method}, acceptance ${pct(last.speculative.acceptance_rate)}`
    : "no request finished yet";
}

async function apply(sec, name) {
  const status = sec.querySelector(".status");
  status.className = "status";
  status.textContent = "applying...";
  const body = {
    enabled: sec.querySelector(".enabled").checked,
    method: sec.querySelector(".method").value,
    draft_model: sec.querySelector(".draft-model").value.trim() || null,
    num_draft_tokens: parseInt(sec.querySelector(".k").value, 10),
  };
  try {
    const state = await api("PUT", `/admin/api/models/${encodeURIComponent(name)}`, body);
    const model = state.models.find((m) => m.name === name);
    fillForm(sec, model, state.methods);
    renderActive(sec, model);
    status.textContent = "saved";
  } catch (err) {
    status.className = "status error";
    status.textContent = err.message;
  }
}

function build(state) {
  const root = document.getElementById("models");
  const tpl = document.getElementById("model-template");
  root.replaceChildren();
  document.getElementById("draft-models")
    .replaceChildren(...state.draft_models.map((m) => new Option(m)));
  for (const model of state.models) {
    const sec = tpl.content.firstElementChild.cloneNode(true);
    sec.dataset.model = model.name;
    sec.querySelector(".name").textContent = model.name;
    sec.querySelector(".device").textContent = `runs on ${model.device}`;
    fillForm(sec, model, state.methods);
    sec.querySelector("form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      apply(sec, model.name);
    });
    root.append(sec);
  }
  update(state);
}

function update(state) {
  const e = state.engine;
  document.getElementById("engine-state").textContent = e.alive
    ? `running ${e.running}, waiting ${e.waiting} (in flight ${state.in_flight}/${state.max_concurrency})`
    : "DEAD";
  document.getElementById("settings-file").textContent = state.settings_file || "(not persisted)";
  // a cluster (quickdraft serve --replicas): one line per engine replica, as last reported
  const reps = document.getElementById("replicas");
  reps.hidden = !state.replicas.length;
  reps.textContent = state.replicas
    .map((r) => `replica ${r.replica} (pid ${r.pid}): running ${r.running}, waiting ${r.waiting}, `
      + `${r.requests} requests, acceptance ${pct(r.acceptance_rate)}`)
    .join(" | ");
  for (const model of state.models) {
    const sec = section(model.name);
    if (!sec) continue;
    renderActive(sec, model);
    renderStats(sec, model.stats, model.active, model.prefix_cache);
  }
}

async function poll() {
  try {
    update(await api("GET", "/admin/api/state"));
  } catch (err) {
    if (err.status === 401) return logout(err.message);
  }
  pollTimer = setTimeout(poll, POLL_MS);
}

async function start() {
  try {
    build(await api("GET", "/admin/api/state"));
  } catch (err) {
    return logout(err.message);
  }
  document.getElementById("login").hidden = true;
  document.getElementById("app").hidden = false;
  pollTimer = setTimeout(poll, POLL_MS);
}

function logout(message) {
  clearTimeout(pollTimer);
  sessionStorage.removeItem(TOKEN_KEY);
  document.getElementById("app").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message || "";
}

document.getElementById("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
  start();
});
document.getElementById("logout").addEventListener("click", () => logout(""));
if (token()) start();

// mpsim serve: the page's logic. Everything is computed by the server (the same Python
// API as the command line); this script only fills the form from the URL, sends uploads
// and runs, polls progress, and shows what came back.
"use strict";

const $ = (id) => document.getElementById(id);
const UPLOADED = "__upload__";
const FIELDS = ["server", "model", "schedule", "microbatch", "microbatches", "global_microbatches", "stages", "layout",
  "strategy", "partition", "runtime", "finetune", "lora_rank", "headroom"];
const SCALE_FIELDS = ["tokens", "days", "budget", "min_servers", "max_servers"];
// This server's token, put in the page by the server: sent on every request that changes
// anything, so that no other site's page can (it cannot read this page to learn it).
const TOKEN = document.querySelector('meta[name="mpsim-token"]').content;
const state = { view: "job", job: null, timer: null, started: 0, maxUploadBytes: 0, uploading: 0,
  uploads: { server: null, servers: null, model: null } };

async function api(method, url, body) {
  let response;
  try {
    const headers = method === "GET" ? {} : { "X-Mpsim-Token": TOKEN };
    response = await fetch(url, { method, body, headers });
  } catch (err) {
    throw new Error("no answer from the mpsim server (is it still running?)");
  }
  let data;
  try { data = await response.json(); } catch (err) { data = { error: `HTTP ${response.status}` }; }
  if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
  return data;
}

function showError(message) {
  $("error").textContent = message ? `error: ${message}` : "";
  $("error").hidden = !message;
}

// Options named as the command line names them, with a word on what each is where the
// catalog has one ("dgx1-v100: 8 x V100-SXM2-32GB").
function fillSelect(select, names, labels = {}) {
  select.replaceChildren(...names.map((n) => new Option(labels[n] ? `${n}: ${labels[n]}` : n, n)));
}

function setView(view) {
  state.view = view;
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === view);
  $("server-field").hidden = view !== "job";
  $("servers-field").hidden = view !== "choose";
  $("scale-field").hidden = view !== "scale";
  $("strategy-label").hidden = view !== "job";
  $("partition-label").hidden = view !== "job";
  $("stages-label").hidden = view !== "job";
  $("layout-label").hidden = view !== "job";
  $("schedule-label").hidden = view === "scale";  // choose --tokens: 1F1B at a fixed global batch
  $("microbatches-label").hidden = view !== "job";  // per replica: one layout's count
  $("global_microbatches-label").hidden = view !== "choose";  // the global batch the layouts share
  $("headroom-label").hidden = view === "scale";
  $("runtime-label").hidden = view === "scale";  // choose --tokens runs the default profile
  $("finetune-label").hidden = view === "scale";  // choose --tokens plans pre-training runs
  showRank();
}

// The adapters' rank is asked for only with a fine-tune.
function showRank() {
  $("lora_rank-label").hidden = state.view === "scale" || $("finetune").value === "none";
}

function fromQuery(params) {
  setView(["choose", "scale"].includes(params.get("view")) ? params.get("view") : "job");
  for (const key of [...FIELDS, ...SCALE_FIELDS]) {
    if (params.has(key)) $(key).value = params.get(key);
  }
  showRank();
  const clusters = (params.get("clusters") || "").split(",");
  for (const option of $("clusters").options) option.selected = clusters.includes(option.value);
  const servers = (params.get("servers") || "").split(",");
  for (const option of $("servers").options) option.selected = servers.includes(option.value);
}

// The query of the current form: shipped names only, unless withUploads (for the API).
function toQuery(withUploads) {
  const q = new URLSearchParams({ view: state.view });
  if (state.view === "scale") {
    const clusters = [...$("clusters").selectedOptions].map((o) => o.value);
    if (clusters.length) q.set("clusters", clusters.join(","));
    for (const key of SCALE_FIELDS) {
      if ($(key).value !== "") q.set(key, $(key).value);
    }
  } else if (state.view === "choose") {
    const chosen = [...$("servers").selectedOptions].map((o) => o.value);
    q.set("servers", chosen.filter((v) => v !== UPLOADED).join(","));
    if (chosen.includes(UPLOADED) && withUploads) q.set("server_upload", state.uploads.servers.upload);
  } else if ($("server").value === UPLOADED) {
    if (withUploads) q.set("server_upload", state.uploads.server.upload);
  } else {
    q.set("server", $("server").value);
  }
  if ($("model").value === UPLOADED) {
    if (withUploads) q.set("model_upload", state.uploads.model.upload);
  } else {
    q.set("model", $("model").value);
  }
  const count = { job: "microbatches", choose: "global_microbatches" }[state.view];
  for (const key of ["schedule", "microbatch", ...(count ? [count] : [])]) {
    if ($(key).value !== "") q.set(key, $(key).value);
  }
  if (state.view !== "scale" && $("headroom").value !== "" && Number($("headroom").value) !== 1) {
    q.set("headroom", $("headroom").value);
  }
  if (state.view !== "scale" && $("runtime").value !== "megatron-lm") q.set("runtime", $("runtime").value);
  if (state.view !== "scale" && $("finetune").value !== "none") {
    q.set("finetune", $("finetune").value);
    if ($("lora_rank").value !== "") q.set("lora_rank", $("lora_rank").value);
  }
  if (state.view === "job") {
    q.set("strategy", $("strategy").value);
    q.set("partition", $("partition").value);
    if ($("stages").value !== "") q.set("stages", $("stages").value);
    if ($("layout").value.trim() !== "") q.set("layout", $("layout").value.trim());
  }
  return q;
}

// An upload as XMLHttpRequest (fetch reports no upload progress), with this server's token;
// onProgress(fraction sent) while the bytes go. Resolves to the answer's JSON; rejects with
// the server's one-line error.
function sendUpload(url, file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", url);
    xhr.setRequestHeader("X-Mpsim-Token", TOKEN);
    xhr.upload.onprogress = (event) => { if (event.lengthComputable) onProgress(event.loaded / event.total); };
    xhr.upload.onload = () => onProgress(1);
    xhr.onerror = () => reject(new Error("no answer from the mpsim server (is it still running?)"));
    xhr.onload = () => {
      let data;
      try { data = JSON.parse(xhr.responseText); } catch (err) { data = { error: `HTTP ${xhr.status}` }; }
      if (xhr.status >= 200 && xhr.status < 300) resolve(data);
      else reject(new Error(data.error || `HTTP ${xhr.status}`));
    };
    xhr.send(file);
  });
}

// Run waits for the uploads in flight (a Run meanwhile would run the model or server
// selected before) and for the run in progress.
function updateRun() {
  $("run").disabled = state.uploading > 0 || state.timer !== null;
  $("run").title = state.uploading > 0 ? "waiting for the upload to finish" : "";
}

function hideResults() {
  $("result").hidden = true;
  $("choose-result").hidden = true;
}

async function upload(kind, input, slot) {
  const file = input.files[0];
  if (!file) return;
  showError("");
  const select = $(slot);
  const kb = (file.size / 1024).toFixed(file.size < 10240 ? 1 : 0);
  const say = (text) => { $("progress").hidden = false; $("progress").textContent = text; };
  state.uploading += 1;
  updateRun();
  try {
    const url = `/api/upload?kind=${kind}&name=${encodeURIComponent(file.name)}`;
    if (file.size > 16 * state.maxUploadBytes) {
      throw new Error(`${file.name}: ${(file.size / 2 ** 20).toFixed(1)} MiB is over the upload limit of ` +
                      `${state.maxUploadBytes / 2 ** 20} MiB`);
    }
    say(`uploading ${file.name} (${kb} kB): 0%`);
    const up = await sendUpload(url, file, (sent) => {
      say(sent < 1 ? `uploading ${file.name} (${kb} kB): ${Math.floor(sent * 100)}%`
        : `uploaded ${file.name}; the server is reading it`);
    });
    state.uploads[slot] = up;
    select.querySelector(`option[value="${UPLOADED}"]`)?.remove();
    const option = new Option(`uploaded: ${up.name}`, UPLOADED);
    select.prepend(option);
    if (select.multiple) option.selected = true;  // Choose: compared beside the shipped ones picked
    else select.value = UPLOADED;
    say(`uploaded ${up.name}: ready to run`);
  } catch (err) {
    hideResults();  // a result on the screen would pass for this file's
    say(`upload of ${file.name} failed`);
    showError(err.message);
  } finally {
    input.value = "";
    state.uploading -= 1;
    updateRun();
  }
}

async function run() {
  if (state.uploading > 0) return;  // Run is disabled too; this covers a submit by Enter
  showError("");
  stopPolling();
  hideResults();
  try {
    const job = await api("POST", `/api/jobs?${toQuery(true)}`);
    state.job = job.id;
    state.started = Date.now();
    const bookmark = `${location.pathname}?${job.bookmark}&run=1`;
    history.replaceState(null, "", bookmark);
    $("bookmark-note").textContent = job.bookmarkable ? "This page's address reruns this view: bookmark it."
      : "Uploads cannot be bookmarked: the address keeps the shipped choices and settings only.";
    $("cancel").hidden = false;
    showProgress(job);
    state.timer = setInterval(poll, 250);
    updateRun();
  } catch (err) {
    showError(err.message);
  }
}

function stopPolling() {
  if (state.timer !== null) clearInterval(state.timer);
  state.timer = null;
  $("cancel").hidden = true;
  updateRun();
}

function showProgress(job) {
  const words = { waiting: "waiting for the run before it", running: "running", cancelled: "cancelled",
                  done: "done", failed: "failed" };
  $("progress").hidden = false;
  // a task: one forward or backward of one microbatch on one stage, a swap, a collective
  const seconds = state.started ? Math.round((Date.now() - state.started) / 1000) : 0;
  $("progress").textContent = `${words[job.state]}: ${job.tasks.toLocaleString("en-US")} tasks simulated` +
    (job.state === "running" || job.state === "waiting" ? `, ${seconds} s` : "");
}

async function poll() {
  const id = state.job;
  let job;
  try {
    job = await api("GET", `/api/jobs/${id}`);
  } catch (err) {
    stopPolling();
    showError(err.message);
    return;
  }
  if (id !== state.job) return;
  showProgress(job);
  if (["done", "failed", "cancelled"].includes(job.state)) {
    stopPolling();
    if (job.state === "failed") showError(job.error);
    if (job.state === "done") (job.view === "job" ? showResult : showChoose)(job);
  }
}

async function cancel() {
  if (!state.job) return;
  try {
    showProgress(await api("POST", `/api/jobs/${state.job}/cancel`));
  } catch (err) {
    showError(err.message);
  }
}

function showResult(job) {
  const base = `/api/jobs/${job.id}`;
  const r = job.result;
  $("verdict").textContent = job.verdict;
  // fits, at-risk (fits, closer to the memory than the headroom) or oom: three looks
  $("verdict").className = job.verdict_class || (job.fits ? (job.at_risk ? "at-risk" : "fits") : "oom");
  $("oom").textContent = job.oom || (job.at_risk ? `at risk: ${job.at_risk}` : "");
  $("warning").textContent = job.warning ? `warning: ${job.warning}` : "";
  // what trains, as mpsim simulate prints it: the adapters and PEFT's count line
  $("fine-tune").textContent = r.fine_tune ? `fine-tune: ${r.fine_tune}${r.trainable ? `; ${r.trainable}` : ""}` : "";
  $("fine-tune").hidden = !r.fine_tune;
  const peakGiB = Math.max(...r.gpus.map((g) => g.peak_bytes)) / 2 ** 30;
  const tokens = r.tokens_per_s ? `, ${Math.round(r.tokens_per_s).toLocaleString("en-US")} tokens/s` : "";
  $("summary").textContent = `iteration ${(r.iteration_s * 1e3).toFixed(1)} ms, ` +
    `${r.samples_per_s.toFixed(2)} ± ${r.samples_per_s_band.toFixed(2)} samples/s${tokens}, ` +
    `${r.model_tflops.toFixed(1)} model TFLOP/s, peak ${peakGiB.toFixed(2)} GiB per GPU at most` +
    (job.fits ? "" : " (as if the GPUs had the memory)");
  $("dl-result").href = `${base}/result.json`;
  $("dl-plan").href = `${base}/plan.json`;
  for (const chart of ["bars", "memory", "timeline"]) {
    $(`chart-${chart}`).src = `${base}/chart/${chart}.svg`;
    $(`dl-${chart}`).href = `${base}/chart/${chart}.png`;
  }
  showLaunch($("launch-job"), job);
  showPlan(job.plan);
  $("text").textContent = `${job.plan_text}\n\n${job.text}`;
  $("result").hidden = false;
}

// One row per layer: its stage, GPU and action (keep unless the plan names one).
function showPlan(plan) {
  const head = ["layer", "stage", "gpu", "action", "peers", "split", "optimizer", "stash"];
  const rows = [head.map((h) => `<th>${h}</th>`).join("")];
  plan.stages.forEach((stage, s) => {
    const actions = new Map(stage.actions.map((a) => [a.layer, a]));
    for (let layer = stage.layers[0]; layer < stage.layers[1]; layer++) {
      const a = actions.get(layer) || { action: "keep", peers: [], split: 1 };
      const peers = a.peers.map((p) => `gpu${p.gpu} ${Math.round(p.fraction * 100)}%`).join(", ") || "-";
      const cells = [layer, s, stage.gpu, a.action, peers, a.split, stage.optimizer, stage.stash];
      rows.push(cells.map((c, i) => `<td${i === 3 ? ` class="${a.action}"` : ""}>${c}</td>`).join(""));
    }
  });
  $("plan-table").innerHTML = rows.map((r) => `<tr>${r}</tr>`).join("");
}

// The plan (job view) or the pick (choose view) as each framework's own configuration, made
// once by the server when the run ended: a link per format, or the one line why the format
// cannot state the job. Built as text nodes: nothing the server says is read as HTML.
function showLaunch(box, job) {
  const launch = job.launch;
  box.hidden = !launch;
  if (!launch) return;
  const what = launch.of === "pick" ? "the recommended plan" : "the plan";
  const intro = document.createElement("p");
  if (launch.reason) {
    intro.textContent = `Framework configurations of ${what}: none (${launch.reason})`;
    box.replaceChildren(intro);
    return;
  }
  intro.textContent = `Download ${what} as a framework's configuration (mpsim's prediction in its comment):`;
  const list = document.createElement("ul");
  for (const f of launch.formats) {
    const item = document.createElement("li");
    if (f.reason) {
      item.className = "refused";
      const own = `${f.format}: `;  // most reasons start with the format's name: said once
      item.textContent = `${f.label}: ${f.reason.startsWith(own) ? f.reason.slice(own.length) : f.reason}`;
    } else {
      const link = document.createElement("a");
      link.href = `/api/jobs/${job.id}/launch/${encodeURIComponent(f.format)}`;
      link.download = f.file;
      link.textContent = `${f.label} (${f.file})`;
      item.append(link);
    }
    list.append(item);
  }
  box.replaceChildren(intro, list);
}

function showChoose(job) {
  $("dl-choose").href = `/api/jobs/${job.id}/result.json`;
  showLaunch($("launch-choose"), job);
  $("choose-heading").textContent = job.view === "scale" ? "How many servers: time and cost to train"
    : "Choose: the servers compared";
  $("choose-out").innerHTML = job.choose.html;  // escaped on the server (mpsim.htmlreport)
  $("choose-result").hidden = false;
}

async function init() {
  try {
    const catalog = await api("GET", "/api/catalog");
    state.maxUploadBytes = catalog.max_upload_bytes;
    fillSelect($("server"), catalog.servers, catalog.labels.servers);
    fillSelect($("servers"), catalog.servers, catalog.labels.servers);
    fillSelect($("clusters"), catalog.clusters);
    fillSelect($("model"), catalog.models);
    fillSelect($("schedule"), catalog.schedules);
    fillSelect($("strategy"), catalog.strategies, catalog.labels.strategies);
    fillSelect($("partition"), catalog.partitions);
    fillSelect($("runtime"), catalog.runtimes);
    fillSelect($("finetune"), catalog.finetunes);
    $("server").value = "dgx1-v100";
    $("model").value = "gpt-5.3b";
  } catch (err) {
    showError(err.message);
    return;
  }
  const params = new URLSearchParams(location.search);
  fromQuery(params);
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => setView(tab.dataset.view));
  $("server-file").addEventListener("change", () => upload("server", $("server-file"), "server"));
  $("servers-file").addEventListener("change", () => upload("server", $("servers-file"), "servers"));
  $("trace-file").addEventListener("change", () => upload("trace", $("trace-file"), "model"));
  $("hf-file").addEventListener("change", () => upload("hf", $("hf-file"), "model"));
  $("finetune").addEventListener("change", showRank);
  $("form").addEventListener("submit", (event) => { event.preventDefault(); run(); });
  $("cancel").addEventListener("click", cancel);
  document.body.dataset.ready = "1";
  if (params.get("run") === "1") run();
}

init();

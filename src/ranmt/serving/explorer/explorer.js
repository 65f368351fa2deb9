// ranmt attention explorer: asks POST /translate (attention: true) of every loaded model and
// draws each attention map (layers x heads) as a heat map on a canvas; no external libraries.
"use strict";

const COMPONENTS = [
  ["cross", "cross-attention (target x source)", "target_tokens", "source_tokens"],
  ["encoder_self", "encoder self-attention", "source_tokens", "source_tokens"],
  ["decoder_self", "decoder self-attention", "target_tokens", "target_tokens"],
];
const INPUT_AGNOSTIC = new Set(["ran", "synthesizer", "gaussian"]);
const CELL = 22;       // pixels per cell
const LABEL = 115;     // pixels for the token labels

const tooltip = document.getElementById("tooltip");

async function loadModels() {
  const response = await fetch("models");
  const info = await response.json();
  const box = document.getElementById("models");
  for (const model of info.models) {  // built node by node: names never become markup
    const label = document.createElement("label");
    const box_ = document.createElement("input");
    box_.type = "checkbox";
    box_.checked = true;
    box_.value = model.name;
    const arch = document.createElement("small");
    arch.textContent = ` (${model.arch})`;
    label.append(box_, ` ${model.name}`, arch);
    box.appendChild(label);
  }
}

function selectedModels() {
  return [...document.querySelectorAll("#models input:checked")].map((box) => box.value);
}

async function translate(event) {
  event.preventDefault();
  const text = document.getElementById("source").value.trim();
  const beam = parseInt(document.getElementById("beam").value, 10) || 4;
  const status = document.getElementById("status");
  const results = document.getElementById("results");
  if (!text) { status.textContent = "type a sentence first"; return; }
  status.textContent = "translating...";
  results.innerHTML = "";
  const models = selectedModels();
  const replies = await Promise.all(models.map(async (name) => {
    const response = await fetch("translate", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({text: [text], model: name, beam: beam, attention: true}),
    });
    return [name, response.ok, await response.json()];
  }));
  status.textContent = "";
  for (const [name, ok, body] of replies) {
    results.appendChild(ok ? modelColumn(name, body.translations[0])
                           : errorColumn(name, body.error || "request failed"));
  }
  document.body.dataset.state = "rendered";
}

function errorColumn(name, message) {
  const column = document.createElement("section");
  column.className = "model";
  column.innerHTML = `<h2></h2><p class="error"></p>`;
  column.querySelector("h2").textContent = name;
  column.querySelector("p").textContent = message;
  return column;
}

function modelColumn(name, entry) {
  const column = document.createElement("section");
  column.className = "model";
  column.dataset.model = name;
  const title = document.createElement("h2");
  title.textContent = name;
  const translation = document.createElement("div");
  translation.className = "translation";
  translation.textContent = entry.text;
  const score = document.createElement("div");
  score.className = "score";
  score.textContent = entry.score === null ? "" : `score ${entry.score.toFixed(3)}`;
  column.append(title, translation, score);
  if (!entry.attention) return column;
  for (const [key, caption, rowsKey, colsKey] of COMPONENTS) {
    const layers = entry.attention[key];
    if (!layers || layers.every((layer) => layer === null)) continue;
    const kind = entry.attention.kinds[key];
    const note = INPUT_AGNOSTIC.has(kind) && key !== "cross" ? " - input-agnostic: the layer's matrix" : "";
    column.appendChild(heatMap(`${caption} [${kind}]${note}`, layers,
                               entry.attention[rowsKey], entry.attention[colsKey]));
  }
  return column;
}

function heatMap(caption, layers, rowTokens, colTokens) {
  const box = document.createElement("div");
  box.className = "map";
  const title = document.createElement("h3");
  title.textContent = caption;
  const layerSelect = document.createElement("select");
  const headSelect = document.createElement("select");
  layers.forEach((layer, index) => {
    if (layer !== null) layerSelect.add(new Option(`layer ${index + 1}`, index));
  });
  const canvas = document.createElement("canvas");
  canvas.className = "heat";
  const fillHeads = () => {
    const heads = layers[layerSelect.value].length;
    headSelect.innerHTML = "";
    headSelect.add(new Option("mean of heads", -1));
    for (let h = 0; h < heads; h++) headSelect.add(new Option(`head ${h + 1}`, h));
  };
  const redraw = () => draw(canvas, matrix(layers[layerSelect.value], +headSelect.value),
                            rowTokens, colTokens);
  layerSelect.onchange = () => { fillHeads(); redraw(); };
  headSelect.onchange = redraw;
  fillHeads();
  box.append(title, layerSelect, headSelect, canvas);
  redraw();
  return box;
}

function matrix(heads, head) {
  if (head >= 0) return heads[head];
  const rows = heads[0].length, cols = heads[0][0].length;
  const mean = Array.from({length: rows}, () => new Array(cols).fill(0));
  for (const weights of heads)
    for (let i = 0; i < rows; i++)
      for (let j = 0; j < cols; j++) mean[i][j] += weights[i][j] / heads.length;
  return mean;
}

function draw(canvas, weights, rowTokens, colTokens) {
  const rows = weights.length, cols = weights[0].length;
  canvas.width = LABEL + cols * CELL;
  canvas.height = LABEL + rows * CELL;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      const w = Math.max(0, Math.min(1, weights[i][j]));
      const shade = Math.round(255 * (1 - w));
      ctx.fillStyle = `rgb(${shade}, ${shade}, 255)`;
      ctx.fillRect(LABEL + j * CELL, LABEL + i * CELL, CELL - 1, CELL - 1);
    }
  }
  ctx.fillStyle = "#333";
  ctx.font = "12px sans-serif";
  ctx.textAlign = "right";
  rowTokens.slice(0, rows).forEach((token, i) =>
    ctx.fillText(token, LABEL - 4, LABEL + i * CELL + CELL * 0.7));
  colTokens.slice(0, cols).forEach((token, j) => {
    ctx.save();
    ctx.translate(LABEL + j * CELL + CELL * 0.7, LABEL - 4);
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "left";
    ctx.fillText(token, 0, 0);
    ctx.restore();
  });
  // Painted (non-white) cells, for the headless browser test and anyone debugging a map.
  const pixels = ctx.getImageData(LABEL, LABEL, cols * CELL, rows * CELL).data;
  let painted = 0;
  for (let p = 0; p < pixels.length; p += 4) if (pixels[p] < 250) painted++;
  canvas.dataset.painted = painted;
  canvas.onmousemove = (event) => {
    const rect = canvas.getBoundingClientRect();
    const j = Math.floor((event.clientX - rect.left - LABEL) / CELL);
    const i = Math.floor((event.clientY - rect.top - LABEL) / CELL);
    if (i < 0 || j < 0 || i >= rows || j >= cols) { tooltip.hidden = true; return; }
    tooltip.textContent = `${rowTokens[i]} -> ${colTokens[j]}: ${weights[i][j].toFixed(4)}`;
    tooltip.style.left = `${event.clientX + 12}px`;
    tooltip.style.top = `${event.clientY + 12}px`;
    tooltip.hidden = false;
  };
  canvas.onmouseleave = () => { tooltip.hidden = true; };
}

document.getElementById("form").addEventListener("submit", translate);
// ?text=... fills the box and submits it once the models are known (links, headless tests).
loadModels().then(() => {
  const text = new URLSearchParams(window.location.search).get("text");
  if (text) {
    document.getElementById("source").value = text;
    document.getElementById("form").requestSubmit();
  }
});

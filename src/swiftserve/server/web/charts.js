// A small line chart on a <canvas>: no library, so the page works offline with no build step.
// series: [{name, color, values: [number|null]}] sharing one x axis (sample times, seconds).
"use strict";

class LineChart {
  constructor(canvas, options = {}) {
    this.canvas = canvas;
    this.unit = options.unit || "";
    this.goal = options.goal ?? null;  // a dashed horizontal line: the latency target
    this.maxFloor = options.maxFloor ?? 1;  // the y axis shows at least 0..maxFloor
    this.max = options.max ?? null;  // a fixed top (percentages)
  }

  draw(times, series) {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width;
    const height = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(width * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const pad = {left: 52, right: 12, top: 22, bottom: 24};
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;

    let top = this.maxFloor;
    for (const s of series) for (const v of s.values) if (v != null && v > top) top = v;
    if (this.goal != null && this.goal > top) top = this.goal;
    top = this.max ?? niceCeil(top * 1.1);
    const t0 = times.length ? times[0] : 0;
    const t1 = times.length ? times[times.length - 1] : 1;
    const span = Math.max(t1 - t0, 1);
    const x = (t) => pad.left + ((t - t0) / span) * plotW;
    const y = (v) => pad.top + plotH - (v / top) * plotH;

    ctx.font = "11px system-ui, sans-serif";
    ctx.strokeStyle = "#d8dde3";
    ctx.fillStyle = "#5b6570";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {  // horizontal grid and y labels
      const v = (top * i) / 4;
      ctx.beginPath();
      ctx.moveTo(pad.left, y(v));
      ctx.lineTo(pad.left + plotW, y(v));
      ctx.stroke();
      ctx.fillText(formatNumber(v) + this.unit, 4, y(v) + 4);
    }
    if (times.length) {
      ctx.fillText(`-${Math.round(span)} s`, pad.left, height - 6);
      ctx.fillText("now", pad.left + plotW - 22, height - 6);
    }
    if (this.goal != null) {
      ctx.save();
      ctx.setLineDash([6, 4]);
      ctx.strokeStyle = "#c0392b";
      ctx.beginPath();
      ctx.moveTo(pad.left, y(this.goal));
      ctx.lineTo(pad.left + plotW, y(this.goal));
      ctx.stroke();
      ctx.fillStyle = "#c0392b";
      ctx.fillText(`target ${formatNumber(this.goal)}${this.unit}`, pad.left + plotW - 110, y(this.goal) - 4);
      ctx.restore();
    }
    let legendX = pad.left;
    let points = 0;
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      let pen = false;
      s.values.forEach((v, i) => {
        if (v == null) { pen = false; return; }  // a gap: no data in that second
        points++;
        if (pen) ctx.lineTo(x(times[i]), y(v)); else ctx.moveTo(x(times[i]), y(v));
        pen = true;
      });
      ctx.stroke();
      ctx.fillStyle = s.color;
      ctx.fillRect(legendX, 6, 10, 10);
      ctx.fillStyle = "#2c3e50";
      ctx.fillText(s.name, legendX + 14, 15);
      legendX += ctx.measureText(s.name).width + 30;
    }
    // For tests and for the curious: how many points the chart holds right now.
    canvas.dataset.points = String(points);
    canvas.dataset.samples = String(times.length);
  }
}

function niceCeil(v) {
  if (v <= 0) return 1;
  const exp = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * exp >= v) return m * exp;
  return 10 * exp;
}

function formatNumber(v) {
  if (v >= 100) return String(Math.round(v));
  if (v >= 10) return v.toFixed(1).replace(/\.0$/, "");
  return v.toFixed(2).replace(/\.?0+$/, "") || "0";
}

window.LineChart = LineChart;

/* oomdoctor HTML report: draws what the report computed (timelines with uPlot, segment maps and flame
 * graphs on a canvas). Nothing here computes a result; it lays out numbers already in the page's JSON. */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("oomdoctor-data").textContent);

  function drawHeatmap(cv, heat) {
    var rows = heat.ranks.length, cols = heat.columns, ctx = cv.getContext("2d");
    var cw = cv.width / cols, rh = cv.height / rows;
    for (var i = 0; i < rows; i++) {
      for (var j = 0; j < cols; j++) {
        var v = heat.values[i][j];
        ctx.fillStyle = "rgb(" + (255 - v) + "," + (255 - Math.round(v * 0.6)) + ",255)";
        ctx.fillRect(j * cw, i * rh, Math.ceil(cw), Math.ceil(rh));
      }
    }
  }
  if (DATA.heat) {
    document.querySelectorAll("canvas[data-heatmap]").forEach(function (cv) { drawHeatmap(cv, DATA.heat); });
  }
  var COLORS = {requested: "#80868b", allocated: "#1e8e3e", active: "#f29900", reserved: "#8e24aa"};
  var BLOCK_COLORS = {allocated: "#34a853", pending_free: "#d93025", free: "#e8eaed"};
  var MARK_COLORS = {peak_reserved: "#8e24aa", peak_allocated: "#1e8e3e", oom: "#d93025", step: "#bdc1c6"};
  var BEFORE_COLORS = {allocated: "#81c995", reserved: "#d7aefb"};  // the before run of a diff, dashed
  var SELECTED = "#1a73e8";
  var UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

  function fmtBytes(b) {
    if (b == null) return "";
    var i = 0, v = Math.abs(b);
    while (v >= 1024 && i < UNITS.length - 1) { v /= 1024; i++; }
    return (b < 0 ? "-" : "") + (i === 0 ? v : v.toFixed(2)) + " " + UNITS[i];
  }

  function fmtX(mode, v) {
    return mode === "time" ? v.toFixed(3) + " s" : Math.round(v).toLocaleString() + "";
  }

  var charts = [];

  function xOf(m, mode) { return mode === "time" ? m.time_us / 1e6 : Math.max(m.event, 0); }

  // Vertical lines for peaks, OOMs and step starts (``marks``: {x, kind, label, run}); where the chart has a
  // flame graph, ``ticks()`` gives the x of its moments (small ticks under the plot) and of the one shown.
  function markerPlugin(marks, ticks) {
    return {
      hooks: {
        draw: [function (u) {
          var ctx = u.ctx, top = u.bbox.top, h = u.bbox.height, left = u.bbox.left, right = left + u.bbox.width;
          var px1 = devicePixelRatio, rows = [];
          ctx.save();
          marks.forEach(function (m) {
            var px = u.valToPos(m.x, "x", true);
            if (px < left || px > right) return;
            ctx.strokeStyle = MARK_COLORS[m.kind] || "#000";
            ctx.lineWidth = m.kind === "step" ? 1 : 2 * px1;
            ctx.setLineDash(m.kind === "step" ? [4, 4] : m.run === "before" ? [6 * px1, 3 * px1] : []);
            ctx.beginPath(); ctx.moveTo(px, top); ctx.lineTo(px, top + h); ctx.stroke();
            if (m.kind !== "step") {  // right of the line (left of it at the right edge), in the first free row
              ctx.fillStyle = ctx.strokeStyle;
              ctx.font = (11 * px1) + "px sans-serif";
              var w = ctx.measureText(m.label).width, lx = px + 4 * px1 + w > right ? px - 4 * px1 - w : px + 4 * px1;
              var row = 0;
              while (row < 3 && (rows[row] || []).some(function (r) { return lx < r[1] && lx + w > r[0]; })) row++;
              (rows[row] = rows[row] || []).push([lx - 3 * px1, lx + w + 3 * px1]);
              ctx.fillText(m.label, lx, top + (12 + 13 * row) * px1);
            }
          });
          if (ticks) {
            var t = ticks();
            ctx.setLineDash([]);
            ctx.fillStyle = "#5f6368";
            t.xs.forEach(function (x) {
              var px = u.valToPos(x, "x", true);
              if (px >= left && px <= right) ctx.fillRect(px - px1 / 2, top + h - 6 * px1, px1, 6 * px1);
            });
            var sx = u.valToPos(t.selected, "x", true);
            if (sx >= left && sx <= right) {
              ctx.strokeStyle = SELECTED; ctx.lineWidth = 2 * px1;
              ctx.beginPath(); ctx.moveTo(sx, top); ctx.lineTo(sx, top + h); ctx.stroke();
            }
          }
          ctx.restore();
        }]
      }
    };
  }

  // A click on the plot (not the end of a drag, which zooms) calls pick(x value).
  function onClick(u, pick) {
    var down = null;
    u.over.addEventListener("mousedown", function (e) { down = e.clientX; });
    u.over.addEventListener("click", function (e) {
      if (down === null || Math.abs(e.clientX - down) > 3) return;
      pick(u.posToVal(e.clientX - u.over.getBoundingClientRect().left, "x"));
    });
  }

  function drawTimeline(el, key, view, mode, ymax) {
    el.textContent = "";
    var tl = view.timeline;
    var xs = mode === "time" ? tl.time_us.map(function (t) { return t / 1e6; }) : tl.event;
    var names = ["reserved", "active", "allocated", "requested"];  // drawn in this order: allocated shows over active
    var series = [{label: mode === "time" ? "time" : "event", value: function (u, v) { return v == null ? "" : fmtX(mode, v); }}];
    names.forEach(function (n) {
      series.push({label: n, stroke: COLORS[n], width: n === "reserved" ? 2 : 1.5,
                   fill: n === "reserved" ? "rgba(142,36,170,0.06)" : undefined,
                   value: function (u, v) { return fmtBytes(v); }});
    });
    var marks = view.markers.map(function (m) { return {x: xOf(m, mode), kind: m.kind, label: m.label}; });
    // the x axis reaches the last marker (an OOM after the last bucket's first event), also when zoomed out
    var xlast = xs[xs.length - 1], xmax = Math.max.apply(null, [xlast].concat(marks.map(function (m) { return m.x; })));
    var opts = {
      width: Math.max(el.clientWidth, 320), height: 260,
      scales: {x: {time: false, range: function (u, lo, hi) { return [lo, hi >= xlast ? Math.max(hi, xmax) : hi]; }},
               y: {range: [0, ymax * 1.08]}},
      series: series,
      axes: [{values: function (u, vals) { return vals.map(function (v) { return fmtX(mode, v); }); }},
             {size: 92, values: function (u, vals) { return vals.map(fmtBytes); }}],
      cursor: {drag: {x: true, y: false}, sync: {key: "oomdoctor-" + mode}},
      plugins: [markerPlugin(marks, flames[key] ? function () { return flames[key].ticks(mode); } : null)]
    };
    var data = [xs].concat(names.map(function (n) { return tl[n]; }));
    var u = new uPlot(opts, data, el);
    if (flames[key]) onClick(u, function (x) { flames[key].selectNearest(x, mode); });
    charts.push(u);
    return u;
  }

  // Both runs of a diff on one axis: ``pair[mode]`` holds x and the four series, null where a run has no point.
  function drawOverlay(el, pair, mode) {
    el.textContent = "";
    var t = pair[mode], ymax = 1;
    var names = ["before_reserved", "before_allocated", "after_reserved", "after_allocated"];
    names.forEach(function (n) { t.series[n].forEach(function (v) { if (v !== null && v > ymax) ymax = v; }); });
    var series = [{label: mode === "time" ? "time" : "event", value: function (u, v) { return v == null ? "" : fmtX(mode, v); }}];
    names.forEach(function (n) {
      var before = n.indexOf("before") === 0;
      series.push({label: n.replace("_", " "), stroke: (before ? BEFORE_COLORS : COLORS)[n.split("_")[1]], width: before ? 1.5 : 2,
                   dash: before ? [6, 4] : undefined, spanGaps: true, value: function (u, v) { return fmtBytes(v); }});
    });
    var u = new uPlot({
      width: Math.max(el.clientWidth, 320), height: 300,
      scales: {x: {time: false}, y: {range: [0, ymax * 1.12]}},
      series: series,
      axes: [{values: function (u, vals) { return vals.map(function (v) { return fmtX(mode, v); }); }},
             {size: 92, values: function (u, vals) { return vals.map(fmtBytes); }}],
      cursor: {drag: {x: true, y: false}},
      plugins: [markerPlugin(t.marks, null)]
    }, [t.x].concat(names.map(function (n) { return t.series[n]; })), el);
    charts.push(u);
  }

  // ---- Flame graphs (icicles) on a canvas. A tree arrives in preorder: node i has depth d[i] and a width
  // (bytes); its children follow it. Laying them out left to right inside their parent is all done here.
  var ROW = 17;

  function Icicle(canvas, tip) {
    var self = this;
    this.canvas = canvas; this.tip = tip; this.rects = []; this.zoom = 0; this.t = null;
    canvas.addEventListener("mousemove", function (ev) {
      var i = self.hit(ev);
      if (i < 0) { tip.hidden = true; return; }
      var r = canvas.getBoundingClientRect();
      tip.textContent = self.t.text(i);
      tip.style.left = Math.min(ev.clientX - r.left + 12, Math.max(r.width - 420, 0)) + "px";
      tip.style.top = (ev.clientY - r.top + 14) + "px";
      tip.hidden = false;
    });
    canvas.addEventListener("mouseleave", function () { tip.hidden = true; });
    canvas.addEventListener("click", function (ev) {
      var i = self.hit(ev);
      if (i < 0) return;
      self.zoom = i === self.zoom ? Math.max(self.parent[i], 0) : i;
      self.draw();
    });
  }

  // t: {depth, width, color(i), label(i), text(i)}
  Icicle.prototype.set = function (t) {
    var n = t.depth.length, x = new Array(n), parent = new Array(n), next = [0], last = [-1];
    for (var i = 0; i < n; i++) {
      var d = t.depth[i];
      x[i] = d === 0 ? 0 : next[d];
      parent[i] = d === 0 ? -1 : last[d - 1];
      next[d] = x[i] + t.width[i];
      next[d + 1] = x[i];
      last[d] = i;
    }
    this.t = t; this.x = x; this.parent = parent; this.zoom = 0;
    this.draw();
  };

  Icicle.prototype.hit = function (ev) {
    var r = this.canvas.getBoundingClientRect(), px = ev.clientX - r.left, py = ev.clientY - r.top;
    for (var k = 0; k < this.rects.length; k++) {
      var q = this.rects[k];
      if (px >= q[0] && px < q[0] + q[2] && py >= q[1] && py < q[1] + ROW) return q[3];
    }
    return -1;
  };

  Icicle.prototype.draw = function () {
    var c = this.canvas, t = this.t, x = this.x, z = this.zoom;
    var W = Math.max(c.parentElement.clientWidth - 2, 320);
    var lo = x[z], span = t.width[z] || 1, scale = W / span, zd = t.depth[z];
    var shown = [], maxD = 0;
    for (var i = 0; i < t.depth.length; i++) {
      var a = x[i], b = a + t.width[i];
      if (t.width[i] <= 0 || b <= lo || a >= lo + span) continue;
      var px = (Math.max(a, lo) - lo) * scale, pw = (Math.min(b, lo + span) - Math.max(a, lo)) * scale;
      if (pw < 0.35) continue;
      shown.push([px, t.depth[i] * ROW, pw, i]);
      if (t.depth[i] > maxD) maxD = t.depth[i];
    }
    var H = (maxD + 1) * ROW, dpr = window.devicePixelRatio || 1;
    c.width = W * dpr; c.height = H * dpr; c.style.width = W + "px"; c.style.height = H + "px";
    var ctx = c.getContext("2d");
    ctx.scale(dpr, dpr);
    ctx.font = "11px ui-monospace, Menlo, Consolas, monospace";
    ctx.textBaseline = "middle";
    var cw = ctx.measureText("M").width || 7;
    shown.forEach(function (q) {
      var i = q[3];
      ctx.globalAlpha = t.depth[i] < zd ? 0.5 : 1;
      ctx.fillStyle = t.color(i);
      ctx.fillRect(q[0], q[1], Math.max(q[2] - 1, 0.35), ROW - 1);
      if (q[2] > 3 * cw) {
        var s = t.label(i), room = Math.floor((q[2] - 6) / cw);
        ctx.fillStyle = "#202124";
        ctx.fillText(s.length > room ? s.slice(0, room - 1) + "\u2026" : s, q[0] + 3, q[1] + ROW / 2);
      }
    });
    ctx.globalAlpha = 1;
    this.rects = shown;
    c.setAttribute("data-zoom", z);
  };

  function pct(part, whole) { return whole ? (100 * part / whole).toFixed(1) + "%" : "-"; }

  function categoryName(i) { return DATA.categories[i].label; }

  // A rank's flame graph at its precomputed moments, with the anatomy panel of its card.
  function FlameSection(key, card, flame) {
    var self = this;
    this.key = key; this.card = card; this.flame = flame; this.moments = flame.moments; this.index = flame.shown[0];
    this.canvas = card.querySelector("canvas[data-flame]");
    this.icicle = new Icicle(this.canvas, card.querySelector(".flame .tip"));
    card.querySelectorAll("button[data-moment]").forEach(function (b) {
      b.addEventListener("click", function () { self.select(+b.getAttribute("data-moment")); });
    });
  }

  FlameSection.prototype.ticks = function (mode) {
    return {xs: this.moments.map(function (m) { return xOf(m, mode); }), selected: xOf(this.moments[this.index], mode)};
  };

  FlameSection.prototype.selectNearest = function (x, mode) {
    var best = 0, dist = Infinity;
    this.moments.forEach(function (m, i) {
      var d = Math.abs(xOf(m, mode) - x);
      if (d < dist) { dist = d; best = i; }
    });
    this.select(best);
  };

  FlameSection.prototype.select = function (i) {
    var m = this.moments[i], frames = this.flame.frames, card = this.card, cats = DATA.categories;
    this.index = i;
    function label(j) { return j === 0 ? "all allocated: " + fmtBytes(m.v[0]) : frames[m.f[j]]; }
    this.icicle.set({
      depth: m.d, width: m.v, label: label,
      color: function (j) { return j === 0 ? "#dadce0" : cats[m.c[j]].color; },
      text: function (j) {
        var lines = [label(j), fmtBytes(m.v[j]) + ", " + pct(m.v[j], m.v[0]) + " of the allocated bytes"];
        var mix = m.mix[j];
        if (mix) mix.forEach(function (p) { lines.push("  " + categoryName(p[0]) + ": " + fmtBytes(p[1])); });
        else lines.push("  " + categoryName(m.c[j]));
        return lines.join("\n");
      }
    });
    card.querySelector("[data-flame-name]").textContent = m.name;
    card.querySelector("[data-flame-event]").textContent = m.event.toLocaleString();
    card.querySelector("[data-flame-bytes]").textContent = fmtBytes(m.bytes);
    card.querySelector("[data-flame-left]").textContent =
      m.left_out ? " " + m.left_out + " smaller frames not drawn." : "";
    var an = m.anatomy, total = an.reserved_bytes || 1;
    card.querySelectorAll("[data-an]").forEach(function (el) {
      var k = el.getAttribute("data-an");
      if (el.tagName === "SPAN" && el.parentElement.classList.contains("bar")) {
        el.style.width = (100 * an[k] / total).toFixed(3) + "%";
      } else {
        el.textContent = k === "segments" ? an[k] : fmtBytes(an[k]);
      }
    });
    card.querySelectorAll("button[data-moment]").forEach(function (b) {
      b.classList.toggle("active", +b.getAttribute("data-moment") === i);
    });
    this.canvas.setAttribute("data-moment", m.name);
    this.canvas.setAttribute("data-event", m.event);
    this.canvas.setAttribute("data-root-bytes", m.v[0]);
    charts.forEach(function (u) { u.redraw(false, false); });
  };

  function diffIcicle(canvas, pair) {
    var t = pair.flame, colors = DATA.diff_colors, icicle = new Icicle(canvas, canvas.parentElement.querySelector(".tip"));
    function label(j) { return j === 0 ? "all: " + fmtBytes(t.w[0]) + " moved" : t.frames[t.f[j]]; }
    icicle.set({
      depth: t.d, width: t.w, label: label,
      color: function (j) { return colors[t.g[j] + 4]; },
      text: function (j) {
        var delta = t.a[j] - t.b[j];
        return [label(j), "before " + fmtBytes(t.b[j]) + " \u2192 after " + fmtBytes(t.a[j]) +
                " (" + (delta > 0 ? "+" : "") + fmtBytes(delta) + ")", fmtBytes(t.w[j]) + " moved under it"].join("\n");
      }
    });
    canvas.setAttribute("data-before-bytes", t.b[0]);
    canvas.setAttribute("data-after-bytes", t.a[0]);
    return icicle;
  }

  function drawSegmentMap(canvas, tip, moment) {
    var segs = moment.segments;
    var rowH = 12, gap = 3, pad = 2;
    var width = Math.max(canvas.parentElement.clientWidth, 320);
    var maxSize = 1;
    segs.forEach(function (s) { if (s.size > maxSize) maxSize = s.size; });
    var height = Math.max(segs.length * (rowH + gap), rowH);
    var dpr = window.devicePixelRatio || 1;
    canvas.width = width * dpr; canvas.height = height * dpr;
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    var ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    var rows = [];
    segs.forEach(function (s, i) {
      var y = i * (rowH + gap), w = (width - pad * 2) * s.size / maxSize;
      var scale = w / s.size;
      ctx.fillStyle = BLOCK_COLORS.free;
      ctx.fillRect(pad, y, Math.max(w, 1), rowH);
      s.blocks.forEach(function (b) {
        if (b[2] === "free") return;
        ctx.fillStyle = BLOCK_COLORS[b[2]];
        ctx.fillRect(pad + b[0] * scale, y, Math.max(b[1] * scale, 1), rowH);
      });
      ctx.strokeStyle = s.is_expandable ? "#1a73e8" : "#5f6368";
      ctx.lineWidth = 1;
      ctx.strokeRect(pad + 0.5, y + 0.5, Math.max(w - 1, 1), rowH - 1);
      rows.push({y: y, w: w, scale: scale, seg: s});
    });
    canvas.addEventListener("mousemove", function (ev) {
      var r = canvas.getBoundingClientRect(), x = ev.clientX - r.left - pad, y = ev.clientY - r.top;
      var row = rows[Math.floor(y / (rowH + gap))];
      if (!row || x < 0 || x > row.w) { tip.hidden = true; return; }
      var off = x / row.scale, blk = null;
      row.seg.blocks.forEach(function (b) { if (off >= b[0] && off < b[0] + b[1]) blk = b; });
      var s = row.seg;
      tip.textContent = "segment 0x" + s.address.toString(16) + "  " + fmtBytes(s.size) + "  " + s.segment_type +
        (s.is_expandable ? " expandable" : "") + "  stream " + s.stream +
        (blk ? "\nblock +" + fmtBytes(blk[0]) + "  " + fmtBytes(blk[1]) + "  " + blk[2].replace("_", " ") : "");
      tip.style.left = (ev.clientX - r.left + 12) + "px";
      tip.style.top = (ev.clientY - r.top + 12) + "px";
      tip.hidden = false;
    });
    canvas.addEventListener("mouseleave", function () { tip.hidden = true; });
  }

  function timelineGroups() {
    // One y-scale for every chart of a group, so that ranks compare at a glance.
    var groups = {};
    document.querySelectorAll("[data-timeline]").forEach(function (el) {
      var g = el.getAttribute("data-group") || "all";
      var view = DATA.views[el.getAttribute("data-timeline")];
      if (!view || !view.timeline) return;
      (groups[g] = groups[g] || []).push({el: el, view: view});
    });
    return groups;
  }

  function drawAll(mode) {
    charts.forEach(function (u) { u.destroy(); });
    charts = [];
    var groups = timelineGroups();
    Object.keys(groups).forEach(function (g) {
      var ymax = 1;
      groups[g].forEach(function (it) { ymax = Math.max(ymax, Math.max.apply(null, it.view.timeline.reserved)); });
      groups[g].forEach(function (it) { drawTimeline(it.el, it.el.getAttribute("data-timeline"), it.view, mode, ymax); });
    });
    document.querySelectorAll("[data-overlay]").forEach(function (el) {
      drawOverlay(el, DATA.pairs[el.getAttribute("data-overlay")], mode);
    });
  }

  var flames = {}, icicles = [];
  document.querySelectorAll("[data-flame-card]").forEach(function (card) {
    var key = card.getAttribute("data-flame-card");
    flames[key] = new FlameSection(key, card, DATA.views[key].flame);
  });
  document.querySelectorAll("canvas[data-diff-flame]").forEach(function (c) {
    icicles.push(diffIcicle(c, DATA.pairs[c.getAttribute("data-diff-flame")]));
  });
  var mode = "event";
  drawAll(mode);
  Object.keys(flames).forEach(function (key) { flames[key].select(flames[key].index); });
  document.querySelectorAll("input[name=xmode]").forEach(function (r) {
    r.addEventListener("change", function () { mode = r.value; drawAll(mode); });
  });
  document.querySelectorAll("canvas[data-segmap]").forEach(function (c) {
    var ref = c.getAttribute("data-segmap").split(":");
    var view = DATA.views[ref[0]];
    drawSegmentMap(c, c.parentElement.querySelector(".tip"), view.moments[+ref[1]]);
  });
  var resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () {
      drawAll(mode);
      Object.keys(flames).forEach(function (key) { flames[key].icicle.draw(); });
      icicles.forEach(function (ic) { ic.draw(); });
    }, 150);
  });
  window.oomdoctorReady = performance.now();
  document.body.setAttribute("data-ready", "1");
})();

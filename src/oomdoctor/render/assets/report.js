/* oomdoctor HTML report: draws what the report computed (timelines with uPlot, segment maps on a
 * canvas). Nothing here computes a result; it lays out numbers already in the page's JSON. */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("oomdoctor-data").textContent);
  var COLORS = {requested: "#80868b", allocated: "#1e8e3e", active: "#f29900", reserved: "#8e24aa"};
  var BLOCK_COLORS = {allocated: "#34a853", pending_free: "#d93025", free: "#e8eaed"};
  var MARK_COLORS = {peak_reserved: "#8e24aa", peak_allocated: "#1e8e3e", oom: "#d93025", step: "#bdc1c6"};
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

  function markerPlugin(markers, mode) {
    return {
      hooks: {
        draw: [function (u) {
          var ctx = u.ctx, top = u.bbox.top, h = u.bbox.height;
          ctx.save();
          markers.forEach(function (m) {
            var x = mode === "time" ? m.time_us / 1e6 : Math.max(m.event, 0);
            var px = u.valToPos(x, "x", true);
            if (px < u.bbox.left || px > u.bbox.left + u.bbox.width) return;
            ctx.strokeStyle = MARK_COLORS[m.kind] || "#000";
            ctx.lineWidth = m.kind === "step" ? 1 : 2 * devicePixelRatio;
            ctx.setLineDash(m.kind === "step" ? [4, 4] : []);
            ctx.beginPath(); ctx.moveTo(px, top); ctx.lineTo(px, top + h); ctx.stroke();
            if (m.kind !== "step") {
              ctx.fillStyle = ctx.strokeStyle;
              ctx.font = (11 * devicePixelRatio) + "px sans-serif";
              ctx.fillText(m.label, px + 4, top + 12 * devicePixelRatio);
            }
          });
          ctx.restore();
        }]
      }
    };
  }

  function drawTimeline(el, view, mode, ymax) {
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
    var opts = {
      width: Math.max(el.clientWidth, 320), height: 260,
      scales: {x: {time: false}, y: {range: [0, ymax * 1.08]}},
      series: series,
      axes: [{values: function (u, vals) { return vals.map(function (v) { return fmtX(mode, v); }); }},
             {size: 92, values: function (u, vals) { return vals.map(fmtBytes); }}],
      cursor: {drag: {x: true, y: false}, sync: {key: "oomdoctor-" + mode}},
      plugins: [markerPlugin(view.markers, mode)]
    };
    var data = [xs].concat(names.map(function (n) { return tl[n]; }));
    var u = new uPlot(opts, data, el);
    charts.push(u);
    return u;
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
    // One y-scale for every chart of a group, so that ranks (or before/after) compare at a glance.
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
      groups[g].forEach(function (it) { drawTimeline(it.el, it.view, mode, ymax); });
    });
  }

  var mode = "event";
  drawAll(mode);
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
    resizeTimer = setTimeout(function () { drawAll(mode); }, 150);
  });
  window.oomdoctorReady = performance.now();
  document.body.setAttribute("data-ready", "1");
})();

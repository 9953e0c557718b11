/* Sparrow dashboard: plain ES2017, no modules, no build step.
 * Live mode polls the same-origin JSON API (api/run, api/progress,
 * api/rounds?since=N, api/clients?limit=200); report mode renders
 * window.SPARROW_STATIC and fetches nothing. Chart.js (global Chart) is
 * embedded in the page by the server. See docs/monitoring.md. */
(function () {
  'use strict';

  var STATIC = (typeof window.SPARROW_STATIC === 'object' && window.SPARROW_STATIC !== null)
    ? window.SPARROW_STATIC : null;
  var MODE = STATIC ? 'static' : 'live';
  var COLORS = ['#2563eb', '#dc2626', '#059669', '#d97706', '#7c3aed',
    '#0891b2', '#db2777', '#4b5563', '#65a30d', '#9333ea'];
  var SOLID = [];
  var DASHED = [6, 4];
  var DOTTED = [2, 3];
  var EM = '\u2014';

  // Chart ids in the order they are written to #sparrow-chart-data.
  var CHART_DEFS = {
    acc_round: { x: 'round', y: 'accuracy', yFrac: true },
    loss_round: { x: 'round', y: 'loss' },
    acc_bytes: { x: 'cumulative uplink bytes', y: 'accuracy', xLog: true, yFrac: true },
    acc_total: { x: 'cumulative bytes (up + down)', y: 'accuracy', xLog: true, yFrac: true },
    bytes_round: { x: 'round', y: 'cumulative bytes', yZero: true, yBytes: true },
    loss_bytes: { x: 'cumulative bytes (up + down)', y: 'test loss', xLog: true },
    duration: { x: 'round', y: 'seconds', yZero: true },
    clients: { x: 'round', y: 'clients', yZero: true, yInt: true },
    rejected: { x: 'round', y: 'updates', yZero: true, yInt: true },
    epsilon: { x: 'round', y: 'epsilon', yZero: true }
  };
  var CHART_IDS = Object.keys(CHART_DEFS);

  // ---------------------------------------------------------------- helpers

  function $(id) { return document.getElementById(id); }
  function isNum(v) { return typeof v === 'number' && isFinite(v); }
  function num0(v) { return isNum(v) ? v : 0; }
  function setText(id, text) {
    var el = $(id);
    if (el && el.textContent !== text) el.textContent = text;
  }
  function show(id, on) {
    var el = $(id);
    if (el) el.hidden = !on;
  }

  function fmtBytes(v) {
    if (!isNum(v)) return EM;
    var units = ['B', 'KB', 'MB', 'GB', 'TB', 'PB'];
    var k = 0;
    var a = Math.abs(v);
    while (a >= 1000 && k < units.length - 1) { a /= 1000; k++; }
    if (k === 0) return String(Math.round(v * 100) / 100) + ' B';
    var x = Number((v / Math.pow(1000, k)).toPrecision(3));
    if (Math.abs(x) >= 1000 && k < units.length - 1) { x = Number((x / 1000).toPrecision(3)); k++; }
    return String(x) + ' ' + units[k];
  }

  function fmtNum(v, digits) {
    if (!isNum(v)) return EM;
    if (Number.isInteger(v)) return String(v);
    return String(Number(v.toPrecision(digits || 4)));
  }

  function fmtTime(t) {
    if (!isNum(t)) return '';
    var d = new Date(t * 1000);
    if (isNaN(d.getTime())) return '';
    return d.toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
  }

  function fmtDuration(s) {
    if (!isNum(s) || s < 0) return '';
    s = Math.floor(s);
    var h = Math.floor(s / 3600);
    var m = Math.floor((s % 3600) / 60);
    var sec = s % 60;
    if (h > 0) return h + 'h ' + (m < 10 ? '0' : '') + m + 'm';
    if (m > 0) return m + 'm ' + (sec < 10 ? '0' : '') + sec + 's';
    return sec + 's';
  }

  function logTick(value) {
    var v = Number(value);
    if (!(v > 0)) return '';
    var m = v / Math.pow(10, Math.floor(Math.log10(v) + 1e-9));
    m = Math.round(m * 1000) / 1000;
    return (m === 1 || m === 2 || m === 5) ? fmtBytes(v) : '';
  }

  // ------------------------------------------------------------ run state

  function newRun(name, info, color) {
    return { name: name, info: info || {}, color: color, rounds: [], cumUp: [], cumDown: [], cumTot: [], last: null };
  }

  // Appends rounds newer than the last one held, in ascending order, and
  // keeps the cumulative byte counts (over all rounds) alongside.
  function addRounds(run, list) {
    if (!Array.isArray(list)) return 0;
    var fresh = list.filter(function (r) {
      return r && typeof r === 'object' && isNum(r.round) && (run.last === null || r.round > run.last);
    });
    fresh.sort(function (a, b) { return a.round - b.round; });
    var n = run.rounds.length;
    var up = n ? run.cumUp[n - 1] : 0;
    var down = n ? run.cumDown[n - 1] : 0;
    var tot = n ? run.cumTot[n - 1] : 0;
    var added = 0;
    fresh.forEach(function (r) {
      if (run.last !== null && r.round <= run.last) return;
      up += num0(r.bytes_up);
      down += num0(r.bytes_down);
      tot += num0(r.bytes_up) + num0(r.bytes_down);
      run.rounds.push(r);
      run.cumUp.push(up);
      run.cumDown.push(down);
      run.cumTot.push(tot);
      run.last = r.round;
      added++;
    });
    return added;
  }

  var state = { runs: [], gen: 0 };

  // ------------------------------------------------------------ series

  function ds(label, color, dash, points) {
    return { label: label, color: color, dash: dash, points: points };
  }

  function buildSeries(runs) {
    var anyDropped = runs.some(function (run) {
      return run.rounds.some(function (r) { return isNum(r.dropped) && r.dropped !== 0; });
    });
    var anyEps = runs.some(function (run) {
      return run.rounds.some(function (r) { return isNum(r.epsilon); });
    });
    // A simulation never rejects an update nor sees a stale one: its chart
    // would always be zero, so it is left out (and its card hidden).
    var simOnly = runs.length > 0 && runs.every(function (run) { return run.info.program === 'sparrow-sim'; });
    var out = {
      acc_round: [], loss_round: [], acc_bytes: [], acc_total: [], bytes_round: [], loss_bytes: [], duration: [],
      clients: []
    };
    if (!simOnly) out.rejected = [];
    if (anyEps) out.epsilon = [];

    runs.forEach(function (run) {
      var name = run.name;
      var c = run.color;
      var acc = [], loss = [], tloss = [], accB = [], accT = [], lossB = [], dur = [];
      var cumU = [], cumD = [], cumT = [];
      var sel = [], accd = [], drop = [], rej = [], stale = [], eps = [];
      run.rounds.forEach(function (r, i) {
        var x = r.round;
        var cu = run.cumUp[i];
        var ct = run.cumTot[i];
        cumU.push([x, cu]);
        cumD.push([x, run.cumDown[i]]);
        cumT.push([x, ct]);
        if (isNum(r.accuracy)) {
          acc.push([x, r.accuracy]);
          if (cu > 0) accB.push([cu, r.accuracy]);
          if (ct > 0) accT.push([ct, r.accuracy]);
        }
        if (isNum(r.loss)) {
          loss.push([x, r.loss]);
          if (ct > 0) lossB.push([ct, r.loss]);
        }
        if (isNum(r.train_loss)) tloss.push([x, r.train_loss]);
        if (isNum(r.duration_s)) dur.push([x, r.duration_s]);
        if (isNum(r.selected)) sel.push([x, r.selected]);
        if (isNum(r.accepted)) accd.push([x, r.accepted]);
        if (isNum(r.dropped)) drop.push([x, r.dropped]);
        if (isNum(r.rejected)) rej.push([x, r.rejected]);
        if (isNum(r.stale)) stale.push([x, r.stale]);
        if (isNum(r.epsilon)) eps.push([x, r.epsilon]);
      });
      out.acc_round.push(ds(name, c, SOLID, acc));
      out.loss_round.push(ds(name, c, SOLID, loss));
      out.loss_round.push(ds(name + ' train', c, DASHED, tloss));
      out.acc_bytes.push(ds(name, c, SOLID, accB));
      out.acc_total.push(ds(name, c, SOLID, accT));
      out.bytes_round.push(ds(name + ' uplink', c, SOLID, cumU));
      out.bytes_round.push(ds(name + ' downlink', c, DASHED, cumD));
      out.bytes_round.push(ds(name + ' total', c, DOTTED, cumT));
      out.loss_bytes.push(ds(name, c, SOLID, lossB));
      out.duration.push(ds(name, c, SOLID, dur));
      out.clients.push(ds(name + ' selected', c, SOLID, sel));
      out.clients.push(ds(name + ' accepted', c, DASHED, accd));
      if (anyDropped) out.clients.push(ds(name + ' dropped', c, DOTTED, drop));
      if (out.rejected) {
        out.rejected.push(ds(name + ' rejected', c, SOLID, rej));
        out.rejected.push(ds(name + ' stale', c, DASHED, stale));
      }
      if (anyEps) out.epsilon.push(ds(name, c, SOLID, eps));
    });
    return out;
  }

  // ------------------------------------------------------------ charts

  var charts = {};

  function makeChart(id) {
    var def = CHART_DEFS[id];
    var canvas = $('chart-' + id);
    if (!canvas || typeof window.Chart !== 'function') return null;
    var fmtX = def.xLog ? fmtBytes : function (v) { return 'round ' + v; };
    var xScale = {
      type: def.xLog ? 'logarithmic' : 'linear',
      title: { display: true, text: def.x },
      ticks: def.xLog ? { callback: logTick, maxRotation: 0 } : { precision: 0, maxRotation: 0 }
    };
    var yScale = {
      type: 'linear',
      beginAtZero: !!def.yZero,
      title: { display: true, text: def.y },
      // An accuracy axis never leaves [0, 1] (Chart.js pads a single point by 1 each way).
      afterDataLimits: def.yFrac ? function (scale) {
        scale.min = Math.max(0, scale.min);
        scale.max = Math.min(1, scale.max);
      } : undefined,
      ticks: def.yInt ? { precision: 0 }
        : (def.yBytes ? { precision: 0, callback: function (v) { return fmtBytes(Number(v)); } } : {})
    };
    return new window.Chart(canvas.getContext('2d'), {
      type: 'scatter',
      data: { datasets: [] },
      options: {
        animation: false,
        responsive: true,
        maintainAspectRatio: false,
        interaction: { mode: 'nearest', intersect: false },
        plugins: {
          legend: { position: 'bottom', labels: { boxWidth: 22, boxHeight: 2 } },
          tooltip: {
            callbacks: {
              label: function (ctx) {
                var y = def.yBytes ? fmtBytes(ctx.parsed.y) : fmtNum(ctx.parsed.y, 5);
                return ctx.dataset.label + ': ' + y + ' @ ' + fmtX(ctx.parsed.x);
              }
            }
          }
        },
        scales: { x: xScale, y: yScale }
      }
    });
  }

  function updateCharts(data) {
    if (typeof window.Chart !== 'function') return;
    CHART_IDS.forEach(function (id) {
      var list = data[id];
      if (!list) return;
      try {
        var chart = charts[id] || (charts[id] = makeChart(id));
        if (!chart) return;
        var sets = chart.data.datasets;
        list.forEach(function (d, k) {
          var t = sets[k] || (sets[k] = {});
          var many = d.points.length > 150;
          t.label = d.label;
          t.data = d.points.map(function (p) { return { x: p[0], y: p[1] }; });
          t.showLine = true;
          t.fill = false;
          t.tension = 0;
          t.borderColor = d.color;
          t.backgroundColor = d.color;
          t.borderDash = d.dash;
          t.borderWidth = 2;
          t.pointRadius = many ? 0 : 2;
          t.pointHoverRadius = 4;
          t.pointHitRadius = 6;
        });
        sets.length = list.length;
        chart.update('none');
      } catch (e) {
        if (window.console) console.error('sparrow: chart ' + id + ': ' + e);
      }
    });
  }

  // ------------------------------------------------------------ render

  var renderCount = 0;

  function render() {
    var runs = state.runs;
    var data = buildSeries(runs);
    show('card-epsilon', !!data.epsilon);
    show('card-rejected', !!data.rejected);
    try {
      updateCharts(data);
    } finally {
      var dump = {};
      CHART_IDS.forEach(function (id) {
        if (!data[id]) return;
        dump[id] = {
          datasets: data[id].map(function (d) { return { label: d.label, points: d.points }; })
        };
      });
      var el = $('sparrow-chart-data');
      if (el) el.textContent = JSON.stringify(dump).replace(/</g, '\\u003c');
      var last = 0;
      runs.forEach(function (run) {
        if (run.rounds.length && run.last > last) last = run.last;
      });
      renderCount++;
      document.body.dataset.renders = String(renderCount);
      document.body.dataset.lastRound = String(last);
    }
  }

  // ------------------------------------------------------------ header/config

  function setStatus(text) {
    var el = $('status');
    if (!el) return;
    el.textContent = text;
    el.className = 'pill ' + String(text).replace(/[^a-z]/gi, '');
  }

  function setConfigPre(pre, text) {
    var t = typeof text === 'string' ? text : '';
    if (pre.textContent !== t) pre.textContent = t;
  }

  // ------------------------------------------------------------ static mode

  function runSummaryRow(run) {
    var tr = document.createElement('tr');
    tr.setAttribute('data-run', run.name);
    var lastAcc = null, bestAcc = null, lastLoss = null;
    run.rounds.forEach(function (r) {
      if (isNum(r.accuracy)) {
        lastAcc = r.accuracy;
        if (bestAcc === null || r.accuracy > bestAcc) bestAcc = r.accuracy;
      }
      if (isNum(r.loss)) lastLoss = r.loss;
    });
    // The settings the report chose for this run: [key, value] pairs, what
    // compresses each way first, then the keys in which the runs differ.
    var settings = Array.isArray(run.settingsList) ? run.settingsList : [];
    var value = function (key) {
      for (var k = 0; k < settings.length; k++) if (settings[k] && settings[k][0] === key) return String(settings[k][1]);
      return EM;
    };
    var differing = settings.filter(function (kv) {
      return kv && kv[0] !== 'compression' && kv[0] !== 'downlink';
    }).map(function (kv) { return String(kv[0]) + ' = ' + String(kv[1]); }).join(', ');
    var n = run.rounds.length;
    var cells = [
      [run.name, ''],
      [String(run.info.model || EM), ''],
      [value('compression'), 'setting'],
      [value('downlink'), 'setting'],
      [String(n), 'num'],
      [fmtNum(lastAcc), 'num'],
      [fmtNum(bestAcc), 'num'],
      [fmtNum(lastLoss), 'num'],
      [fmtBytes(n ? run.cumUp[n - 1] : 0), 'num'],
      [fmtBytes(n ? run.cumDown[n - 1] : 0), 'num'],
      [fmtBytes(n ? run.cumTot[n - 1] : 0), 'num'],
      [differing || EM, 'settings']
    ];
    cells.forEach(function (c, i) {
      var td = document.createElement('td');
      td.textContent = c[0];
      if (c[1]) td.className = c[1];
      if (i === 0) {
        var sw = document.createElement('span');
        sw.style.cssText = 'display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px;background:' + run.color;
        td.insertBefore(sw, td.firstChild);
      }
      tr.appendChild(td);
    });
    return tr;
  }

  function initStatic() {
    var list = Array.isArray(STATIC.runs) ? STATIC.runs : [];
    state.runs = list.map(function (r, i) {
      r = r || {};
      var info = (r.run && typeof r.run === 'object') ? r.run : {};
      var name = String(r.name || info.run_id || ('run' + (i + 1)));
      var run = newRun(name, info, COLORS[i % COLORS.length]);
      run.settingsList = Array.isArray(r.settings) ? r.settings : [];
      addRounds(run, r.rounds);
      return run;
    });

    show('progress-card', false);
    show('clients-card', false);
    show('runs-card', true);

    var first = state.runs[0];
    var program = (first && first.info.program) ? String(first.info.program) : 'sparrow';
    setText('program', program);
    setText('run-id', state.runs.length ? state.runs.map(function (r) { return r.name; }).join(', ') : EM);
    var models = [];
    state.runs.forEach(function (r) {
      if (r.info.model && models.indexOf(String(r.info.model)) < 0) models.push(String(r.info.model));
    });
    setText('model', models.length ? models.join(', ') : EM);
    setStatus('report');
    var gen = STATIC.generated ? String(STATIC.generated) : '';
    setText('generated', gen ? 'report generated ' + gen : 'report');
    show('generated', true);
    document.title = program + ' report' + (gen ? ' ' + EM + ' ' + gen : '');

    var tbody = $('runs').tBodies[0];
    state.runs.forEach(function (run) { tbody.appendChild(runSummaryRow(run)); });

    // Configs: the first run's goes into #config, the others into their own <details>.
    var pre0 = $('config');
    if (first) {
      pre0.className = 'config';
      pre0.setAttribute('data-run', first.name);
      setConfigPre(pre0, first.info.config);
      setText('config-summary', first.name + ' configuration (TOML)');
    } else {
      setText('config-summary', 'no runs in this report');
    }
    var holder = $('configs');
    state.runs.slice(1).forEach(function (run) {
      var det = document.createElement('details');
      var sum = document.createElement('summary');
      sum.textContent = run.name + ' configuration (TOML)';
      var pre = document.createElement('pre');
      pre.className = 'config';
      pre.setAttribute('data-run', run.name);
      setConfigPre(pre, run.info.config);
      det.appendChild(sum);
      det.appendChild(pre);
      holder.appendChild(det);
    });
    setText('footer', 'Sparrow federated learning report' + (gen ? ' ' + EM + ' generated ' + gen : '') +
      ' ' + String.fromCharCode(183) + ' charts by Chart.js');

    render();
  }

  // ------------------------------------------------------------ live mode

  var params = new URLSearchParams(window.location.search);
  var token = params.get('token');
  var stopped = false;
  var timers = [];
  var inflight = {};
  var failing = {};
  var runInfo = null;
  var serverNow = null;
  var lastProgress = null;

  function HttpError(status) {
    this.status = status;
    this.message = 'HTTP ' + status;
  }

  function apiGet(path) {
    var headers = { 'Accept': 'application/json' };
    if (token) headers['Authorization'] = 'Bearer ' + token;
    var ctrl = (typeof AbortController === 'function') ? new AbortController() : null;
    var timer = ctrl ? setTimeout(function () { ctrl.abort(); }, 10000) : null;
    var opts = { method: 'GET', headers: headers, cache: 'no-store', credentials: 'same-origin' };
    if (ctrl) opts.signal = ctrl.signal;
    return fetch(path, opts).then(function (res) {
      if (!res.ok) throw new HttpError(res.status);
      return res.json();
    }).then(function (v) {
      if (timer) clearTimeout(timer);
      return v;
    }, function (e) {
      if (timer) clearTimeout(timer);
      throw e;
    });
  }

  function updateBanner() {
    if (stopped) return;
    var bad = Object.keys(failing).length > 0;
    var b = $('banner');
    if (bad) {
      b.className = '';
      b.textContent = 'connection lost ' + EM + ' retrying';
    }
    b.hidden = !bad;
  }

  function stopUnauthorized() {
    stopped = true;
    timers.forEach(function (t) { clearInterval(t); });
    timers = [];
    var b = $('banner');
    b.className = 'error';
    b.textContent = 'unauthorized: open the page with ?token=...';
    b.hidden = false;
    setStatus('unauthorized');
  }

  function poll(kind, path, onData) {
    if (stopped || inflight[kind]) return;
    inflight[kind] = true;
    apiGet(path).then(function (d) {
      inflight[kind] = false;
      if (stopped) return;
      if (failing[kind]) { delete failing[kind]; updateBanner(); }
      try {
        onData(d);
      } catch (e) {
        if (window.console) console.error('sparrow: ' + kind + ': ' + e);
      }
    }, function (err) {
      inflight[kind] = false;
      if (stopped) return;
      if (err && err.status === 401) { stopUnauthorized(); return; }
      failing[kind] = true;
      updateBanner();
    });
  }

  function liveRun() {
    return state.runs[0];
  }

  function onRun(r) {
    if (!r || typeof r !== 'object') return;
    if (isNum(r.now)) serverNow = r.now;
    var id = r.run_id === undefined || r.run_id === null ? '' : String(r.run_id);
    var name = id || 'run';
    if (runInfo && String(runInfo.run_id === undefined || runInfo.run_id === null ? '' : runInfo.run_id) !== id) {
      // A new run: start the charts over.
      state.gen++;
      state.runs = [newRun(name, r, COLORS[0])];
      lastProgress = null;
      runInfo = r;
      render();
    } else {
      runInfo = r;
      var run = liveRun();
      run.info = r;
      if (run.name !== name) {
        run.name = name;
        render();
      }
    }
    var program = r.program ? String(r.program) : 'sparrow';
    setText('program', program);
    setText('run-id', id || EM);
    setText('model', r.model ? String(r.model) : EM);
    document.title = program + (id ? ' ' + EM + ' ' + id : '');
    setConfigPre($('config'), r.config);
    renderRunTime();
  }

  function renderRunTime() {
    if (!runInfo || !isNum(runInfo.started)) { setText('run-time', ''); return; }
    var el = $('run-time');
    var text = 'started ' + fmtTime(runInfo.started);
    if (isNum(serverNow)) text += ' (' + fmtDuration(serverNow - runInfo.started) + ' ago)';
    el.textContent = text;
  }

  function setBar(id, frac) {
    var el = $(id);
    if (!el) return;
    var f = isNum(frac) ? Math.max(0, Math.min(1, frac)) : 0;
    el.setAttribute('data-value', String(f));
    el.firstElementChild.style.width = (f * 100).toFixed(2) + '%';
  }

  function onProgress(p) {
    if (!p || typeof p !== 'object') return;
    if (isNum(p.now)) serverNow = p.now;
    var refetch = false;
    if (p.run_id !== undefined && p.run_id !== null && runInfo && String(p.run_id) !== String(runInfo.run_id)) refetch = true;
    if (lastProgress && isNum(p.round) && isNum(lastProgress.round) && p.round < lastProgress.round) refetch = true;
    var run = liveRun();
    if (isNum(p.rounds_completed) && run.last !== null && p.rounds_completed < run.last) refetch = true;
    lastProgress = p;
    if (refetch) pollRun();

    var total = isNum(p.rounds_total) ? p.rounds_total : (runInfo && isNum(runInfo.rounds_total) ? runInfo.rounds_total : null);
    var phase = p.phase ? String(p.phase) : 'waiting';
    var sel = isNum(p.selected) ? p.selected : 0;
    var rec = isNum(p.received) ? p.received : 0;
    var done = isNum(p.rounds_completed) ? p.rounds_completed : 0;
    var round = isNum(p.round) ? p.round : 0;
    var sim = !!(runInfo && runInfo.program === 'sparrow-sim');
    var of = total !== null ? ' of ' + total : '';
    setText('progress-text', progressText(p, phase, round, of, sel, rec, done, total, sim));
    setBar('progress-bar', phase === 'done' ? 1 : (sel > 0 ? rec / sel : 0));
    // The deadline only while a round collects updates; a finished run is done.
    if (p.async && typeof p.async === 'object' && phase !== 'done' && phase !== 'stopped') {
      setText('progress-deadline', asyncText(p.async));
    } else if (phase === 'done') {
      setText('progress-deadline', 'done');
    } else if (phase === 'stopped') {
      setText('progress-deadline', 'stopped');
    } else if (phase === 'training' && isNum(p.deadline) && isNum(p.now)) {
      setText('progress-deadline', Math.max(0, Math.ceil(p.deadline - p.now)) + ' s left in this round');
    } else {
      setText('progress-deadline', '');
    }
    setText('rounds-text', done + ' of ' + (total !== null ? total : '?') + ' rounds completed');
    setBar('rounds-bar', total ? done / total : 0);
    var conn = '';
    if (isNum(p.clients_connected)) {
      conn = p.clients_connected + (p.clients_connected === 1 ? ' client' : ' clients') +
        (sim ? ' in this round' : ' connected');
    }
    setText('progress-clients', conn);
    setStatus(phase);
    renderHeadline(p, phase);
    renderRunTime();
  }

  // mode = "async": no round deadline; the model version, the last step's
  // staleness and the rate of accepted updates instead.
  function asyncText(a) {
    var parts = ['model version ' + (isNum(a.version) ? a.version : '?')];
    if (isNum(a.updates_per_min)) parts.push(a.updates_per_min.toFixed(1) + ' updates/min');
    if (isNum(a.staleness_mean) && isNum(a.staleness_max)) {
      parts.push('staleness of the last step: mean ' + a.staleness_mean.toFixed(2) + ', max ' + a.staleness_max);
    }
    if (isNum(a.in_flight)) parts.push(a.in_flight + (a.in_flight === 1 ? ' task' : ' tasks') + ' out');
    if (isNum(a.tasks_expired) && a.tasks_expired > 0) parts.push(a.tasks_expired + ' expired');
    return parts.join(' ' + EM + ' ');
  }

  // The progress line says what the round waits for: the clients it needs to
  // start (min_clients), the updates received of those selected and, when the
  // deadline closes a round with fewer, the quorum.
  function progressText(p, phase, round, of, sel, rec, done, total, sim) {
    var need = isNum(p.min_clients) ? p.min_clients : 0;
    var quorum = isNum(p.quorum) ? p.quorum : 0;
    var conn = isNum(p.clients_connected) ? p.clients_connected : 0;
    if (phase === 'done') return 'Run complete: ' + done + of + ' rounds';
    if (phase === 'stopped') return 'Stopped after ' + done + of + ' rounds';
    var head = 'Round ' + round + of + ' ' + EM + ' ';
    if (phase === 'waiting') {
      if (need > 0) {
        return head + 'waiting for clients: ' + conn + ' connected, ' + need + ' needed to start (min_clients)';
      }
      if (sim) return (done > 0 ? 'Round ' + done + of + ' done ' + EM + ' ' : head) + 'starting the next round';
      return head + 'waiting for clients';
    }
    if (sim && phase === 'training') return head + 'training: ' + rec + ' of ' + sel + ' clients trained';
    if (p.async && phase === 'training') return 'Step ' + round + of + ' ' + EM + ' ' + rec + ' of ' + sel + ' updates buffered';
    var text = head + phase + ': ' + rec + ' of ' + sel + ' updates received';
    if (phase === 'training' && quorum > 0 && quorum < sel) text += ', ' + quorum + ' close the round at its deadline';
    return text;
  }

  // Headline figures: the latest accuracy, the run's ETA, the bytes each way
  // (/api/progress computes them from the completed rounds).
  function renderHeadline(p, phase) {
    var acc = isNum(p.accuracy) ? p.accuracy : null;
    setValue('headline-accuracy', acc === null ? EM : (100 * acc).toFixed(2) + '%', acc === null ? '' : String(acc));
    setText('headline-accuracy-round', acc !== null && isNum(p.accuracy_round) ? 'after round ' + p.accuracy_round : 'no evaluation yet');
    var eta = isNum(p.eta_s) ? p.eta_s : null;
    var etaText = phase === 'done' ? 'done' : (phase === 'stopped' ? 'stopped' : (eta === null ? EM : (fmtDuration(eta) || '0s')));
    setValue('headline-eta', etaText, eta === null ? '' : String(eta));
    var note = '';
    if (phase !== 'done' && phase !== 'stopped' && eta !== null && isNum(p.now)) note = 'at ' + fmtTime(p.now + eta);
    setText('headline-eta-note', note);
    setValue('headline-up', fmtBytes(isNum(p.bytes_up_total) ? p.bytes_up_total : 0), String(num0(p.bytes_up_total)));
    setValue('headline-down', fmtBytes(isNum(p.bytes_down_total) ? p.bytes_down_total : 0), String(num0(p.bytes_down_total)));
  }

  function setValue(id, text, value) {
    setText(id, text);
    var el = $(id);
    if (el && el.getAttribute('data-value') !== value) el.setAttribute('data-value', value);
  }

  function pollRounds() {
    var run = liveRun();
    var since = (run.rounds.length && run.last > 0) ? run.last : 0;
    var gen = state.gen;
    poll('rounds', 'api/rounds?since=' + encodeURIComponent(since), function (d) {
      if (gen !== state.gen) return;
      var list = d && Array.isArray(d.rounds) ? d.rounds : [];
      if (addRounds(liveRun(), list) > 0) render();
    });
  }

  function addCell(tr, text, value, cls, title) {
    var td = document.createElement('td');
    td.textContent = text;
    td.setAttribute('data-value', value);
    if (cls) td.className = cls;
    if (title) td.title = title;
    tr.appendChild(td);
  }

  function rawValue(v) {
    return isNum(v) ? String(v) : (v === null || v === undefined ? '' : String(v));
  }

  function onClients(d) {
    if (!d || typeof d !== 'object') return;
    var list = Array.isArray(d.clients) ? d.clients : [];
    var tbody = $('clients').tBodies[0];
    var frag = document.createDocumentFragment();
    list.forEach(function (c) {
      if (!c || typeof c !== 'object') return;
      var id = rawValue(c.id);
      var tr = document.createElement('tr');
      tr.setAttribute('data-client', id);
      // The client's software (escaped by the server) as the id's tooltip.
      var sw = rawValue(c.software);
      addCell(tr, id, id, '', sw ? 'software: ' + sw : '');
      var conn = c.connected === true;
      addCell(tr, conn ? 'yes' : 'no', conn ? 'true' : 'false', conn ? 'yes' : 'no');
      var ls = c.last_seen;
      var ago = isNum(ls) ? (isNum(serverNow) ? Math.max(0, Math.floor(serverNow - ls)) + 's ago' : fmtTime(ls)) : 'never';
      addCell(tr, ago, rawValue(ls), '', isNum(ls) ? fmtTime(ls) : '');
      addCell(tr, isNum(c.rounds) ? String(c.rounds) : EM, rawValue(c.rounds), 'num');
      addCell(tr, fmtBytes(c.bytes_up), rawValue(c.bytes_up), 'num', isNum(c.bytes_up) ? c.bytes_up + ' bytes' : '');
      addCell(tr, fmtBytes(c.bytes_down), rawValue(c.bytes_down), 'num', isNum(c.bytes_down) ? c.bytes_down + ' bytes' : '');
      addCell(tr, isNum(c.samples) ? String(c.samples) : EM, rawValue(c.samples), 'num');
      frag.appendChild(tr);
    });
    tbody.textContent = '';
    tbody.appendChild(frag);
    var total = isNum(d.total) ? d.total : list.length;
    var summary = 'showing ' + list.length + ' of ' + total + ' clients';
    if (isNum(d.connected)) summary += ' (' + d.connected + ' connected)';
    setText('clients-summary', summary);
  }

  function pollRun() { poll('run', 'api/run', onRun); }
  function pollProgress() { poll('progress', 'api/progress', onProgress); }
  function pollClients() { poll('clients', 'api/clients?limit=200', onClients); }

  function initLive() {
    state.runs = [newRun('run', {}, COLORS[0])];
    render();
    pollRun();
    pollProgress();
    pollRounds();
    pollClients();
    timers.push(setInterval(function () { pollProgress(); pollRounds(); }, 1000));
    timers.push(setInterval(pollClients, 3000));
    timers.push(setInterval(pollRun, 10000));
  }

  // ------------------------------------------------------------ start

  document.body.dataset.mode = MODE;
  if (MODE === 'static') initStatic();
  else initLive();
})();

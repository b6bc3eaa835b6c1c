/* The live view: poll /metrics, keep the scrapes, draw what Prom (prom.js) computes.
 *
 * Cheap for the proxy: one GET of /metrics per interval per open page, none while the
 * tab is hidden, never two at once. The page state (scrapes, token) lives in this tab's
 * memory only; nothing is stored in the browser.
 */
"use strict";

(function () {
  const params = new URLSearchParams(location.search);
  const INTERVAL_MS = Math.max(250, Number(params.get("interval")) || 2000);
  const KEEP_SECONDS = 30 * 60; // 15 min of chart history, each point needing up to 15 min behind it
  const SHOW_SECONDS = 15 * 60;

  const $ = (id) => document.getElementById(id);
  $("every").textContent = String(INTERVAL_MS / 1000);
  const state = {
    token: null,
    scrapes: [],
    points: [], // one summary per scrape, over the window ending at that scrape
    filter: { model: "", endpoint: "" },
    window: Number($("window").value),
    charts: {},
  };

  // Outcome colours: success green; auth and context_length far apart (violet, orange).
  const OUTCOME_COLOURS = {
    success: "#2e9e44",
    auth: "#7b3fc4",
    context_length: "#f08c00",
    rate_limit: "#e6c700",
    bad_request: "#8c6d31",
    not_found: "#7f7f7f",
    upstream_error: "#d62728",
    upstream_unreachable: "#a50f15",
    upstream_timeout: "#e377c2",
    stream_error: "#1f77b4",
    stream_truncated: "#17becf",
    client_cancelled: "#bcbd22",
  };
  const SPLIT_COLOURS = { queue: "#d62728", engine: "#1f77b4", outside: "#f08c00" };
  const SOURCE_COLOURS = { usage: "#2e9e44", token_ids: "#7b3fc4", tokenizer: "#1f77b4", chunks: "#f08c00", none: "#7f7f7f" };
  const LINE_COLOURS = ["#1f77b4", "#f08c00", "#d62728", "#7b3fc4", "#2e9e44"];

  const ms = (s) => s * 1000;
  const share = (p, part) => {
    const whole = p.split.queue + p.split.engine + p.split.outside;
    return whole > 0 ? (100 * p.split[part]) / whole : NaN;
  };
  const rate = (p, n) => (p.seconds > 0 ? n / p.seconds : NaN);
  const q = (p, hist, quant) => Prom.quantile(p, hist, quant);
  const attainment = (p) => (p.sloJudged > 0 ? (100 * p.sloMet) / p.sloJudged : NaN);

  // Each chart: what it shows and, in one line, from which instant to which it measures.
  const CHARTS = [
    {
      id: "ttft", title: "Time to first token and to first answer", unit: "ms",
      caption: "First token: from the proxy receiving the request to the first network read carrying generated content of any kind (reasoning, a tool call or the answer; the role-only first chunk is not a token). First answer: to the first read carrying answer content, what a chat user waits for; on a reasoning model it comes after the thinking. Streaming requests only.",
      lines: [["p50", (p) => ms(q(p, "ttft", 0.5))], ["p95", (p) => ms(q(p, "ttft", 0.95))], ["p99", (p) => ms(q(p, "ttft", 0.99))],
              ["first answer p50", (p) => ms(q(p, "ttfa", 0.5))], ["first answer p95", (p) => ms(q(p, "ttfa", 0.95))]],
    },
    {
      id: "split", title: "Where the first token's time goes", unit: "ms per stream", stacked: true,
      onlyIf: (p) => p.split.streams > 0,
      absent: "No stream carried the engine's per-request metrics: start vLLM with --enable-per-request-metrics to see the split.",
      caption: "Mean per stream, stacked to the client-seen TTFT, over the streams whose engine sent vLLM's per-request metrics: queue (the engine's queue_time_ms: waiting for a slot), engine (its time_to_first_token_ms from scheduling: prefill), outside the engine (the rest: network, the server's front end, the proxy).",
      group: (p) => new Map(["queue", "engine", "outside"].map((k) => [k, p.split.streams > 0 ? ms(p.split[k] / p.split.streams) : 0])),
      colours: SPLIT_COLOURS,
    },
    {
      id: "itl", title: "Inter-token latency and time per output token", unit: "ms",
      caption: "ITL: each gap from the read carrying one content event to the read carrying the next (0 when both came in one read). TPOT: per request, (last token − first token) / (output tokens − 1).",
      lines: [["ITL p50", (p) => ms(q(p, "itl", 0.5))], ["ITL p99", (p) => ms(q(p, "itl", 0.99))], ["TPOT p50", (p) => ms(q(p, "tpot", 0.5))], ["TPOT p99", (p) => ms(q(p, "tpot", 0.99))]],
    },
    {
      id: "speed", title: "Per-stream decode speed", unit: "tokens/s",
      caption: "Per request: (output tokens − 1) / (last token − first token). One stream's speed, not aggregate throughput; p10 is the slow tail.",
      lines: [["p10", (p) => q(p, "speed", 0.1)], ["p50", (p) => q(p, "speed", 0.5)], ["p90", (p) => q(p, "speed", 0.9)]],
    },
    {
      id: "throughput", title: "Aggregate output tokens/s", unit: "tokens/s",
      caption: "Output tokens of all requests that ended in the window, per second of the window (counted when each request ends, so long streams land at their end). Goodput (with --slo): those of requests that met every target.",
      lines: [["output tokens/s", (p) => rate(p, p.outputTokens)], ["goodput tokens/s", (p) => (p.slo ? rate(p, p.goodputTokens) : NaN)]],
    },
    {
      id: "slo", title: "SLO attainment", unit: "%", onlyIf: (p) => p.slo,
      absent: "No SLO targets: start the proxy with --slo (e.g. ttft=2,tpot=0.05) or --slo-file to see attainment.",
      caption: "Of the generative requests that ended in the window and were judged against their model's targets (--slo, --slo-file), the share that met every one, each figure measured from the proxy receiving the request. Client cancellations are left out.",
      lines: [["met every target", (p) => attainment(p)]],
    },
    {
      id: "requests", title: "Requests/s by outcome", unit: "req/s", stacked: true,
      caption: "Requests that ended in the window (last byte relayed, or failed), per second, stacked by outcome: success or the error type.",
      group: (p) => p.outcomes, colours: OUTCOME_COLOURS, perSecond: true,
    },
    {
      id: "cutoff", title: "Share cut off (finish_reason length)", unit: "%",
      caption: "Of requests that ended in the window, the share whose finish_reason the client saw was \"length\" (max_tokens or the context ran out).",
      lines: [["cut off", (p) => (p.requests > 0 ? (100 * p.cutOff) / p.requests : NaN)]],
    },
    {
      id: "inflight", title: "Requests in flight", unit: "requests",
      caption: "Now, at each scrape: measured requests from their body having been read to their last byte (a gauge, not windowed).",
      lines: [["in flight", (p) => p.inFlight]],
    },
    {
      id: "source", title: "Token counts by source", unit: "tokens/s", stacked: true,
      caption: "Output tokens/s by where the count came from: the backend's usage, the token ids a token-in/token-out generate streamed (token_ids), else the tokenizer (--tokenizer), else the number of content events (chunks).",
      group: (p) => p.tokensBySource, colours: SOURCE_COLOURS, perSecond: true,
    },
    {
      id: "rtf", title: "Real-time factor (/v1/realtime)", unit: "×", onlyIf: (p) => p.speech,
      absent: "No realtime transcription yet: sessions on /v1/realtime show here.",
      caption: "Seconds of transcription per second of audio, over the utterances that ended in the window: each from the client's commit to transcription.done, over the PCM16 16 kHz audio appended for it. Below 1 is faster than real time.",
      lines: [["real-time factor", (p) => (p.audioSeconds > 0 ? p.realtimeSeconds / p.audioSeconds : NaN)]],
    },
    {
      id: "cost", title: "Cost per hour", unit: "per hour", onlyIf: (p) => p.priced,
      absent: "No prices set: start the proxy with --prices FILE to see spend.",
      caption: "Spend in the price table's currency (--prices) of requests that ended in the window, priced from their token counts, scaled to one hour. Per model: cost has no endpoint label.",
      lines: [["cost/h", (p) => rate(p, p.cost) * 3600]],
    },
  ];

  // ---- polling ------------------------------------------------------------------------

  async function poll() {
    if (document.hidden) return schedule();
    const headers = state.token ? { Authorization: "Bearer " + state.token } : {};
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), 10000);
    let response;
    try {
      response = await fetch("metrics", { headers, cache: "no-store", signal: abort.signal });
    } catch (err) {
      status("could not reach /metrics: " + err.message + " (retrying)", true);
      return schedule();
    } finally {
      clearTimeout(timer);
    }
    if (response.status === 401) {
      askForToken(state.token !== null);
      return; // polling resumes when a token is given
    }
    if (!response.ok) {
      status("/metrics answered " + response.status + " (retrying)", true);
      return schedule();
    }
    const text = await response.text();
    addScrape({ t: Date.now() / 1000, values: Prom.parse(text, "tokenprobe_") });
    schedule();
  }

  function schedule() {
    setTimeout(poll, INTERVAL_MS);
  }

  function askForToken(wrong) {
    state.token = null;
    $("token-why").textContent = wrong
      ? "That token was refused by /metrics. Try again; it stays in this tab's memory only."
      : "/metrics needs a bearer token (--metrics-token). It stays in this tab's memory only.";
    $("token-form").hidden = false;
    status("waiting for the metrics token", true);
    $("token").focus();
  }

  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.token = $("token").value;
    $("token").value = "";
    $("token-form").hidden = true;
    poll();
  });

  // ---- the data -----------------------------------------------------------------------

  // The oldest scrape inside (t - window, t], or null when there is none before index i.
  function baseFor(i) {
    const scrapes = state.scrapes;
    const from = scrapes[i].t - state.window;
    let j = i;
    while (j > 0 && scrapes[j - 1].t >= from) j--;
    return j < i ? scrapes[j] : null;
  }

  function summaryAt(i) {
    return Prom.summarize(baseFor(i), state.scrapes[i], state.filter);
  }

  function addScrape(scrape) {
    const scrapes = state.scrapes;
    scrapes.push(scrape);
    while (scrapes.length > 2 && scrape.t - scrapes[0].t > KEEP_SECONDS) {
      scrapes.shift();
      state.points.shift();
    }
    state.points.push(summaryAt(scrapes.length - 1));
    updateFilters(scrape.values);
    document.body.dataset.scrapes = String(Number(document.body.dataset.scrapes) + 1);
    render();
  }

  function recomputeAll() {
    state.points = state.scrapes.map((_, i) => summaryAt(i));
    render();
  }

  function updateFilters(values) {
    for (const label of ["model", "endpoint"]) {
      const select = $(label);
      const have = new Set(Array.from(select.options, (o) => o.value));
      for (const value of Prom.labelValues(values, label)) {
        if (!have.has(value)) select.add(new Option(value, value));
      }
    }
  }

  for (const id of ["model", "endpoint"]) {
    $(id).addEventListener("change", () => {
      state.filter[id] = $(id).value;
      recomputeAll();
    });
  }
  $("window").addEventListener("change", () => {
    state.window = Number($("window").value);
    recomputeAll();
  });

  // ---- drawing ------------------------------------------------------------------------

  function status(text, warn) {
    $("status").textContent = text;
    $("status").classList.toggle("warn", Boolean(warn));
  }

  function fmt(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    if (!Number.isFinite(value)) return value > 0 ? "∞" : "−∞";
    const d = digits === undefined ? 3 : digits;
    return Math.abs(value) >= 1000 ? value.toFixed(0) : Number(value.toPrecision(d)).toString();
  }

  function render() {
    const last = state.points[state.points.length - 1];
    const latest = state.scrapes[state.scrapes.length - 1];
    const base = baseFor(state.scrapes.length - 1);
    const body = document.body.dataset;
    body.windowSeconds = String(last.seconds);
    body.baseT = base ? String(base.t) : "";
    body.latestT = String(latest.t);
    const clock = new Date(latest.t * 1000).toLocaleTimeString();
    status(
      base
        ? `last scrape ${clock} · figures over the last ${fmt(last.seconds, 3)} s (window ${state.window / 60} min)`
        : `last scrape ${clock} · the next scrape starts the window`,
      false,
    );
    renderStats(last);
    renderOutcomes(last);
    renderCharts();
  }

  const STATS = [
    ["ttft_p50", "TTFT p50", "ms", (p) => ms(q(p, "ttft", 0.5))],
    ["ttft_p95", "TTFT p95", "ms", (p) => ms(q(p, "ttft", 0.95))],
    ["ttft_p99", "TTFT p99", "ms", (p) => ms(q(p, "ttft", 0.99))],
    ["ttfa_p50", "first answer p50", "ms", (p) => ms(q(p, "ttfa", 0.5))],
    ["itl_p50", "ITL p50", "ms", (p) => ms(q(p, "itl", 0.5))],
    ["tpot_p50", "TPOT p50", "ms", (p) => ms(q(p, "tpot", 0.5))],
    ["speed_p50", "decode p50", "tok/s", (p) => q(p, "speed", 0.5)],
    ["output_rate", "output", "tok/s", (p) => rate(p, p.outputTokens)],
    ["request_rate", "requests", "req/s", (p) => rate(p, p.requests)],
    ["cut_off", "cut off", "%", (p) => (p.requests > 0 ? (100 * p.cutOff) / p.requests : NaN)],
    ["in_flight", "in flight", "", (p) => p.inFlight],
    ["ttft_queue", "TTFT queue", "%", (p) => share(p, "queue")],
    ["ttft_outside", "TTFT outside engine", "%", (p) => share(p, "outside")],
    ["cost_hour", "cost", "/h", (p) => (p.priced ? rate(p, p.cost) * 3600 : NaN)],
    ["slo_attainment", "SLO met", "%", (p) => attainment(p)],
  ];

  const CONVERSATION_STATS = [
    ["conversations_open", "open", "", (p) => p.conversationsOpen],
    ["continuations", "continuations", "", (p) => (p.seconds > 0 ? p.continuations : NaN)],
    ["turn_gap_p50", "turn gap p50", "s", (p) => q(p, "turnGap", 0.5)],
    ["turn_gap_p95", "turn gap p95", "s", (p) => q(p, "turnGap", 0.95)],
    ["continuation_cached", "cached share", "%", (p) => (p.cachedRatioCount > 0 ? (100 * p.cachedRatioSum) / p.cachedRatioCount : NaN)],
    ["continuation_misses", "cache misses", "%", (p) => (p.cachedRatioCount > 0 ? (100 * p.cacheMisses) / p.cachedRatioCount : NaN)],
  ];

  function renderStats(p) {
    fillStats($("stats"), STATS, p);
    fillStats($("conversation-stats"), CONVERSATION_STATS, p);
  }

  function fillStats(box, stats, p) {
    if (!box.childElementCount) {
      for (const [id, label, unit] of stats) {
        const card = document.createElement("div");
        card.className = "stat";
        card.dataset.stat = id;
        card.innerHTML = '<span class="label"></span><span class="value"></span><span class="unit"></span>';
        card.querySelector(".label").textContent = label;
        card.querySelector(".unit").textContent = unit;
        box.appendChild(card);
      }
    }
    for (const [id, , , get] of stats) {
      const value = get(p);
      const card = box.querySelector(`[data-stat="${id}"]`);
      card.dataset.value = String(value);
      card.querySelector(".value").textContent = fmt(value);
    }
  }

  function renderOutcomes(p) {
    const rows = $("outcomes").tBodies[0];
    rows.textContent = "";
    const outcomes = Array.from(p.outcomes.entries()).filter((o) => o[1] > 0).sort((a, b) => b[1] - a[1]);
    for (const [outcome, count] of outcomes) {
      const row = rows.insertRow();
      row.dataset.outcome = outcome;
      row.dataset.count = String(count);
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = OUTCOME_COLOURS[outcome] || "#444";
      const name = row.insertCell();
      name.append(swatch, outcome);
      row.insertCell().textContent = fmt(count, 6);
      row.insertCell().textContent = fmt(rate(p, count));
    }
    if (!outcomes.length) rows.insertRow().insertCell().textContent = "no requests ended in the window";
  }

  function renderCharts() {
    const latest = state.scrapes[state.scrapes.length - 1].t;
    let first = 0;
    while (first < state.scrapes.length - 1 && latest - state.scrapes[first].t > SHOW_SECONDS) first++;
    const points = state.points.slice(first);
    const times = state.scrapes.slice(first).map((s) => s.t);
    for (const spec of CHARTS) {
      if (spec.onlyIf && !points.some(spec.onlyIf)) {
        if (!state.charts[spec.id]) chartBox(spec).querySelector(".plot").textContent = spec.absent || "No prices set: start the proxy with --prices FILE to see spend.";
        continue;
      }
      const names = spec.lines ? spec.lines.map((l) => l[0]) : groupNames(spec, points);
      let data;
      if (spec.lines) {
        data = [times, ...spec.lines.map(([, get]) => points.map((p) => finite(get(p))))];
      } else {
        // Stacked: series k is the sum of groups k..n-1, drawn largest first so each band shows.
        const rows = names.map((name) => points.map((p) => {
          const v = spec.group(p).get(name) || 0;
          return p.seconds > 0 ? (spec.perSecond ? v / p.seconds : v) : null;
        }));
        const stacked = rows.map((_, k) => points.map((_, t) => {
          if (rows[k][t] === null) return null;
          let sum = 0;
          for (let m = k; m < rows.length; m++) sum += rows[m][t];
          return sum;
        }));
        data = [times, ...stacked];
        spec.raw = rows;
      }
      draw(spec, names, data);
    }
  }

  function clockTime(t) {
    return new Date(t * 1000).toLocaleTimeString([], { hourCycle: "h23", hour: "2-digit", minute: "2-digit", second: "2-digit" });
  }

  function finite(v) {
    return Number.isFinite(v) ? v : null;
  }

  function groupNames(spec, points) {
    const seen = new Set();
    for (const p of points) for (const [name, v] of spec.group(p)) if (v > 0) seen.add(name);
    const order = Object.keys(spec.colours);
    return Array.from(seen).sort((a, b) => order.indexOf(a) - order.indexOf(b));
  }

  function chartBox(spec) {
    let box = $("chart-" + spec.id);
    if (!box) {
      box = document.createElement("div");
      box.className = "chart";
      box.id = "chart-" + spec.id;
      box.innerHTML = '<h2></h2><p class="caption"></p><div class="plot"></div>';
      box.querySelector("h2").textContent = `${spec.title} (${spec.unit})`;
      box.querySelector(".caption").textContent = spec.caption;
      $("charts").appendChild(box);
    }
    return box;
  }

  function draw(spec, names, data) {
    const box = chartBox(spec);
    const plot = box.querySelector(".plot");
    let chart = state.charts[spec.id];
    const key = names.join("|");
    if (chart && chart.key === key) {
      chart.plot.setData(data);
      return;
    }
    if (chart) chart.plot.destroy();
    plot.textContent = "";
    const series = [{}].concat(names.map((name, k) => {
      const colour = spec.colours ? spec.colours[name] || "#444" : LINE_COLOURS[k % LINE_COLOURS.length];
      const s = { label: name, stroke: colour, width: 1.5, spanGaps: false };
      if (spec.stacked) {
        s.fill = colour;
        s.value = (u, v, si, i) => (i === null || i === undefined ? "–" : fmt(spec.raw[si - 1][i]));
      } else {
        s.value = (u, v) => fmt(v);
      }
      return s;
    }));
    const width = Math.max(300, plot.clientWidth || box.clientWidth || 600);
    const opts = {
      width,
      height: 200,
      series,
      scales: { x: { time: true } },
      axes: [{ space: 80, values: (u, ticks) => ticks.map(clockTime) }, { size: 60, values: (u, ticks) => ticks.map((t) => fmt(t)) }],
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
    };
    state.charts[spec.id] = { key, plot: new uPlot(opts, data, plot) };
  }

  window.addEventListener("resize", () => {
    for (const id in state.charts) {
      const chart = state.charts[id];
      const plot = $("chart-" + id).querySelector(".plot");
      chart.plot.setSize({ width: Math.max(300, plot.clientWidth), height: 200 });
    }
  });

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) status("resuming …", false);
  });

  poll();
})();

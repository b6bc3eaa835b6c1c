/* Prometheus text exposition in, PromQL-style figures out. No DOM here: app.js draws.
 *
 * A scrape is {t: seconds, values: Map(seriesKey -> number)}. The series key is the
 * exposition's own "name{labels}" text, which prometheus-client writes identically on
 * every scrape, so each series' labels are parsed once and cached in `Series`.
 */
"use strict";

(function (global) {
  const Series = new Map(); // key -> {name, labels}

  function parseNumber(text) {
    if (text === "+Inf" || text === "Inf") return Infinity;
    if (text === "-Inf") return -Infinity;
    if (text === "NaN") return NaN;
    return Number(text);
  }

  // Labels from `{` at `open`; returns the index after the closing `}` or -1.
  function parseLabels(line, open, labels) {
    let i = open + 1;
    while (i < line.length) {
      const c = line.charCodeAt(i);
      if (c === 125 /* } */) return i + 1;
      if (c === 44 /* , */ || c === 32 /* space */) { i++; continue; }
      const eq = line.indexOf("=", i);
      if (eq < 0 || line[eq + 1] !== '"') return -1;
      let j = eq + 2;
      let value = "";
      while (j < line.length && line[j] !== '"') {
        if (line[j] === "\\") {
          const next = line[j + 1];
          value += next === "n" ? "\n" : next;
          j += 2;
        } else {
          value += line[j];
          j++;
        }
      }
      if (j >= line.length) return -1;
      labels[line.slice(i, eq).trim()] = value;
      i = j + 1;
    }
    return -1;
  }

  // Only series whose name starts with `prefix`; HELP/TYPE lines and *_created are skipped.
  function parse(text, prefix) {
    const values = new Map();
    let start = 0;
    while (start < text.length) {
      let end = text.indexOf("\n", start);
      if (end < 0) end = text.length;
      const line = text.slice(start, end);
      start = end + 1;
      if (!line.startsWith(prefix)) continue;
      const brace = line.indexOf("{");
      const space = line.indexOf(" ");
      const labelled = brace >= 0 && (space < 0 || brace < space);
      const name = line.slice(0, labelled ? brace : space);
      if (space < 0 || name.endsWith("_created")) continue;
      let keyEnd;
      if (!labelled) {
        keyEnd = space;
        if (!Series.has(name)) Series.set(name, { name, labels: {} });
      } else if (Series.has(line.slice(0, line.lastIndexOf("}") + 1))) {
        keyEnd = line.lastIndexOf("}") + 1; // a label value may hold "}", never the value
      } else {
        const labels = {};
        keyEnd = parseLabels(line, brace, labels);
        if (keyEnd < 0) continue;
        Series.set(line.slice(0, keyEnd), { name, labels });
      }
      const key = line.slice(0, keyEnd);
      if (!Series.has(key)) continue;
      const rest = line.slice(keyEnd).trim();
      const cut = rest.indexOf(" "); // an optional timestamp follows the value
      values.set(key, parseNumber(cut < 0 ? rest : rest.slice(0, cut)));
    }
    return values;
  }

  // increase() between two samples of one counter; a drop means the counter was reset.
  function increase(now, before) {
    if (before === undefined) return now;
    return now >= before ? now - before : now;
  }

  // PromQL's classic-histogram quantile (prometheus/prometheus promql/quantile.go,
  // BucketQuantile): buckets sorted by upper bound, +Inf required, counts made monotonic,
  // linear interpolation inside the bucket holding rank q*count, lower edge 0 for the
  // first bucket, and the second-highest bound when the rank falls in the +Inf bucket.
  function bucketQuantile(q, byBound) {
    if (Number.isNaN(q)) return NaN;
    if (q < 0) return -Infinity;
    if (q > 1) return Infinity;
    const buckets = Array.from(byBound.entries()).sort((a, b) => a[0] - b[0]);
    if (buckets.length < 2 || buckets[buckets.length - 1][0] !== Infinity) return NaN;
    for (let i = 1; i < buckets.length; i++) {
      if (buckets[i][1] < buckets[i - 1][1]) buckets[i][1] = buckets[i - 1][1];
    }
    const observations = buckets[buckets.length - 1][1];
    if (observations === 0) return NaN;
    let rank = q * observations;
    let b = 0;
    while (b < buckets.length - 1 && buckets[b][1] < rank) b++;
    if (b === buckets.length - 1) return buckets[buckets.length - 2][0];
    if (b === 0 && buckets[0][0] <= 0) return buckets[0][0];
    let start = 0;
    let count = buckets[b][1];
    if (b > 0) {
      start = buckets[b - 1][0];
      count -= buckets[b - 1][1];
      rank -= buckets[b - 1][1];
    }
    return start + (buckets[b][0] - start) * (rank / count);
  }

  // A series is in when each filtered label matches; a series without that label (cost
  // has no endpoint) is in too. Labels nobody filters on are summed over.
  function matches(labels, filter) {
    for (const name in filter) {
      const want = filter[name];
      if (want && labels[name] !== undefined && labels[name] !== want) return false;
    }
    return true;
  }

  const HISTOGRAMS = {
    ttft: "tokenprobe_time_to_first_token_seconds",
    ttfa: "tokenprobe_time_to_first_answer_token_seconds",
    itl: "tokenprobe_inter_token_latency_seconds",
    tpot: "tokenprobe_request_time_per_output_token_seconds",
    speed: "tokenprobe_request_decode_tokens_per_second",
    turnGap: "tokenprobe_conversation_turn_gap_seconds",
  };
  const SPLIT = {
    tokenprobe_engine_queue_time_seconds_sum: "queue",
    tokenprobe_engine_time_to_first_token_seconds_sum: "engine",
    tokenprobe_time_to_first_token_outside_engine_seconds_sum: "outside",
    tokenprobe_time_to_first_token_outside_engine_seconds_count: "streams",
  };
  const BY_BUCKET = new Map(Object.entries(HISTOGRAMS).map(([k, v]) => [v + "_bucket", k]));

  // Everything the page shows for one window: from scrape `base` to scrape `now`.
  function summarize(base, now, filter) {
    const out = {
      seconds: base ? now.t - base.t : 0,
      outcomes: new Map(),
      requests: 0,
      cutOff: 0,
      tokensBySource: new Map(),
      outputTokens: 0,
      cost: 0,
      priced: false,
      audioSeconds: 0, // audio received on /v1/realtime
      realtimeSeconds: 0, // e2e of its utterances
      speech: false,
      // serve --slo: judged requests that ended in the window, those that met every
      // target, and the met ones' output tokens (cancellations are not judged).
      sloJudged: 0,
      sloMet: 0,
      goodputTokens: 0,
      slo: false,
      inFlight: 0,
      // Where the first token's time went: seconds of each part over the streams whose
      // engine sent vLLM's per-request metrics, and how many streams those were.
      split: { queue: 0, engine: 0, outside: 0, streams: 0 },
      // Conversations (docs/conversations.md): remembered now (a gauge), and over the
      // window the continuations, their cached-ratio histogram's sum and count, misses.
      conversationsOpen: 0,
      continuations: 0,
      cachedRatioSum: 0,
      cachedRatioCount: 0,
      cacheMisses: 0,
      buckets: {},
    };
    for (const key in HISTOGRAMS) out.buckets[key] = new Map();
    for (const [key, value] of now.values) {
      const s = Series.get(key);
      if (!matches(s.labels, filter)) continue;
      const name = s.name;
      if (name === "tokenprobe_requests_in_flight") {
        out.inFlight += value;
        continue;
      }
      if (name === "tokenprobe_conversations_open") {
        out.conversationsOpen += value;
        continue;
      }
      if (name === "tokenprobe_cost_total") out.priced = true;
      if (name === "tokenprobe_audio_input_seconds_total") out.speech = true;
      if (name === "tokenprobe_slo_requests_total") out.slo = true;
      if (!base) continue;
      const delta = increase(value, base.values.get(key));
      const hist = BY_BUCKET.get(name);
      if (hist !== undefined) {
        const le = parseNumber(s.labels.le);
        const into = out.buckets[hist];
        into.set(le, (into.get(le) || 0) + delta);
      } else if (name === "tokenprobe_requests_total") {
        const outcome = s.labels.error_type === "none" ? "success" : s.labels.error_type;
        out.outcomes.set(outcome, (out.outcomes.get(outcome) || 0) + delta);
        out.requests += delta;
        if (s.labels.finish_reason === "length") out.cutOff += delta;
      } else if (name === "tokenprobe_generation_tokens_total") {
        const source = s.labels.source;
        out.tokensBySource.set(source, (out.tokensBySource.get(source) || 0) + delta);
        out.outputTokens += delta;
      } else if (name === "tokenprobe_cost_total") {
        out.cost += delta;
      } else if (name === "tokenprobe_slo_requests_total") {
        out.sloJudged += delta;
        if (s.labels.result === "met") out.sloMet += delta;
      } else if (name === "tokenprobe_goodput_tokens_total") {
        out.goodputTokens += delta;
      } else if (SPLIT[name] !== undefined && (s.labels.stream === undefined || s.labels.stream === "true")) {
        out.split[SPLIT[name]] += delta;
      } else if (name === "tokenprobe_conversation_continuations_total") {
        out.continuations += delta;
      } else if (name === "tokenprobe_continuation_cached_prompt_ratio_sum") {
        out.cachedRatioSum += delta;
      } else if (name === "tokenprobe_continuation_cached_prompt_ratio_count") {
        out.cachedRatioCount += delta;
      } else if (name === "tokenprobe_continuation_cache_misses_total") {
        out.cacheMisses += delta;
      } else if (name === "tokenprobe_audio_input_seconds_total") {
        out.audioSeconds += delta;
      } else if (name === "tokenprobe_e2e_request_latency_seconds_sum" && s.labels.endpoint === "/v1/realtime") {
        out.realtimeSeconds += delta;
      }
    }
    return out;
  }

  function quantile(summary, hist, q) {
    return bucketQuantile(q, summary.buckets[hist]);
  }

  // Label values seen in the latest scrape, for the filter menus.
  function labelValues(values, label) {
    const seen = new Set();
    for (const key of values.keys()) {
      const v = Series.get(key).labels[label];
      if (v !== undefined) seen.add(v);
    }
    return Array.from(seen).sort();
  }

  global.Prom = { parse, increase, bucketQuantile, summarize, quantile, labelValues, matches };
})(window);

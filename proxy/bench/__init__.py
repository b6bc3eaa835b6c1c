"""`tokenprobe bench`: a load generator that measures an OpenAI-compatible backend.

It measures with the proxy's own core (the SSE decoder, the stream observer, the error
table), so a figure from the bench and the same figure from the proxy mean the same thing.

  options.py   flags -> a validated, frozen Options
  prompts.py   built-in, file and exact-length synthetic prompts
  client.py    one streamed request -> one Measurement
  wire.py      the protocol-level HTTP/1.1 client the load runs on (httptools, keep-alive)
  load.py      closed loop (concurrency sweep), open loop (Poisson arrivals), replay schedules
  loop.py      the event loop and --tokenizer, shared by every bench command
  stats.py     per-level summaries: quantiles, throughput, goodput
  report.py    the table, the JSON file, and the one-line diagnosis of a failed run
  compare.py   the bench's figures next to a tokenprobe proxy's /metrics
  prefill.py   --input-tokens sweeps: TTFT against prompt length, implied prefill rate
  plot.py      throughput vs latency charts (matplotlib, imported only when asked)

`tokenprobe bench replay` (recorded traffic on a candidate):
  trace.py     access logs and Mooncake traces -> a workload of request shapes; Mooncake out
  synth.py     synthetic prompts of the recorded lengths that share the recorded prefixes
  replay.py    the command: the workload, its schedule, the run file
  recorded.py  the recorded figures beside the replayed ones

Several processes or machines:
  workers.py   --workers N: worker processes on one clock, merged
  merge.py     `tokenprobe bench merge`: shards joined into one run, figures recomputed

`tokenprobe bench compare` (saved runs against each other):
  runs.py          saved run files read back; which settings make two runs comparable
  significance.py  per-level figures and their seeded bootstrap intervals
  compare_runs.py  the command: tables, --fail-if-worse, overlay plot
"""

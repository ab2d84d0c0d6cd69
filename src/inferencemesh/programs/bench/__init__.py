"""`inferencemesh bench`: tokens/s, TPOT and TTFT of the mesh against `transformers` on the same model.

Four benchmarks share one set-up (the model, its prompts, the `transformers` peer, the
speculation strategies): the latency bench (latency.py, the default: one request at a time),
with --concurrency the concurrency bench (concurrency.py: bursts of concurrent streams),
with --multi-turn the prefix-cache bench (multiturn.py: conversations that resend their prefix), and
with --structured the structured-output bench (structured.py: json_schema-constrained vs free text).

    run.py          run_bench: the set-up, then the benchmark the flags choose
    config.py       BenchConfig, its flags (imported by the CLI: nothing heavy, no torch)
    models.py       the model under test: preset random-weight shapes or a checkpoint, prompts
    mesh.py         the pipelines: in-process, or stage processes as `serve` starts them
    runners.py      our engine and the `transformers` peers; speculation set-ups
    report.py       the report's facts, percentiles, the JSON file
"""

"""Training health: archer says, while it trains, when a run is going wrong and which responses and tokens drive
it (docs/health.md).

    rows.py      a step's responses, from its Batch (training) or its entropy-trace step (afterwards)
    figures.py   the per-step figures verl's metrics lack (near-deterministic share, log-prob/advantage
                 covariance, zero-advantage groups, repetition, repeated tool calls)
    history.py   the run's values by step and the windows a trend compares
    checks.py    the checks, each a rule over the history with pointers into the step's responses
    pointers.py  how a flag names the responses and tokens that carry it
    engine.py    one step: figures, history, checks, flags (shared by training and the replay)
    monitor.py   the trainer's side: console lines, <run>/health.jsonl, health/* metrics, stop_on
    offline.py   `archer health RUN_DIR`: the same checks over a run directory
    settings.py  trainer.health.* read and checked
"""

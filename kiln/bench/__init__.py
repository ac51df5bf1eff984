"""Measuring a served model: speed (TPS, TTFT, TPOT) and tool-call cleanliness, with A/B verdicts.

The method is docs/BENCH.md; the command is ``kiln/commands/bench.py``. Library code: it never
prints, and reports progress and warnings through a ``kiln.report.Reporter``.

    client.py     streaming chat-completions client (``connect``, ``stream_chat``)
    wire.py       reading an answer within bounds (deadline, line, body and stream caps)
    prompts.py    the versioned prompt set (texts in ``texts.py``)
    battery.py    the versioned tool-call battery and its judge
    stats.py      mean / median / CV, Student's t, Welch's test, verdicts
    run.py        warm-up, interleaved rounds, concurrent batches (``run_speed``, ``run_battery``)
    evidence.py   the JSON evidence (endpoints, images, machine, every sample)
    plot.py       box plots (optional matplotlib)
"""

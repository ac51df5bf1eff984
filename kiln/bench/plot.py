"""``--plot FILE``: box plots of the per-prompt distributions, one row per concurrency level.

matplotlib is an optional extra (``pip install 'kiln[plot]'``), imported only here and only
when a plot is asked for; without it the request fails in one line before anything runs.

Public API:
    require_matplotlib()                 KilnError when matplotlib cannot be imported
    write_plot(run, path, names=None)    PNG: wall_TPS, TTFT and TPOT per prompt and endpoint
                                         (``names``: label -> legend text)
"""

from __future__ import annotations

import io
from pathlib import Path

from kiln.bench.run import SpeedRun
from kiln.errors import KilnError
from kiln.staging import write_atomic

PLOTTED = (("wall_tps", "wall TPS (tok/s)"), ("ttft", "TTFT (s)"), ("tpot", "TPOT (ms)"))


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise KilnError("--plot needs matplotlib, which is not installed (pip install 'kiln[plot]')") from None
    return pyplot


def write_plot(run: SpeedRun, path: Path, names: dict[str, str] | None = None) -> None:
    pyplot = require_matplotlib()
    prompts = [p.id for p in run.settings.prompts]
    levels = run.settings.concurrency
    figure, axes = pyplot.subplots(len(levels), len(PLOTTED), figsize=(6 * len(PLOTTED), 4 * len(levels)),
                                   squeeze=False)
    width = 0.8 / len(run.labels)
    for row, concurrency in enumerate(levels):
        for column, (metric, title) in enumerate(PLOTTED):
            ax = axes[row][column]
            scale = 1000.0 if metric == "tpot" else 1.0
            for offset, label in enumerate(run.labels):
                data = [[v * scale for v in run.values(label, concurrency, prompt, metric)] or [float("nan")]
                        for prompt in prompts]
                positions = [i + (offset - (len(run.labels) - 1) / 2) * width for i in range(len(prompts))]
                boxes = ax.boxplot(data, positions=positions, widths=width * 0.9, patch_artist=True)
                for box in boxes["boxes"]:
                    box.set_facecolor(f"C{offset}")
                ax.plot([], [], color=f"C{offset}", label=(names or {}).get(label, label), linewidth=6)
            ax.set_xticks(range(len(prompts)), prompts, rotation=30, ha="right")
            ax.set_title(f"{title}, concurrency {concurrency}")
            if row == 0 and column == 0:
                ax.legend()
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format=path.suffix.lstrip(".").lower() or "png", dpi=100)
    pyplot.close(figure)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, image.getvalue())

"""The ``--json`` evidence of a bench run: enough to re-derive every figure and to know what ran.

It records the endpoints (URL, the model ``GET /v1/models`` reported, vLLM's ``/version``), the
image each one serves when the user names it (reference and digest), the prompt set and
battery versions with the hash of their texts, the settings, the machine the client ran on
(CPU, OS, hostname, GPUs when ``nvidia-smi`` answers: the server's GPU when the endpoint is on
this machine), every raw sample (warm-up included, marked), the summaries and the verdicts.

Public API:
    EVIDENCE_SCHEMA                 the format's version (bump on an incompatible change)
    ImageInfo, image_info(text)     ``--image REF``: canonical reference, tag, digest
    machine_info() -> dict
    speed_figures(run) -> list[dict]    per concurrency, prompt and metric: summaries (+ verdict)
    evidence(endpoints, images, settings, speed, battery, machine) -> dict
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from dataclasses import dataclass

from kiln import __version__
from kiln.bench.battery import BATTERY_VERSION
from kiln.bench.client import Endpoint
from kiln.bench.prompts import PROMPT_SET_VERSION, prompt_set_sha256
from kiln.bench.run import METRICS, BatteryRun, BenchSettings, SpeedRun
from kiln.errors import KilnError

EVIDENCE_SCHEMA = 1


@dataclass(frozen=True)
class ImageInfo:
    reference: str  # canonical, as given
    digest: str | None  # sha256:... when the reference is pinned by digest

    def to_json(self) -> dict:
        return {"reference": self.reference, "digest": self.digest}


def image_info(text: str) -> ImageInfo:
    from kiln.oci.reference import parse_reference

    try:
        ref = parse_reference(text)
    except KilnError as err:
        raise KilnError(f"--image {text!r}: {err}") from None
    return ImageInfo(str(ref), ref.digest or None)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[dict]:
    """GPUs as ``nvidia-smi`` names them; [] when there is none or no nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3:
            gpus.append({"name": fields[0], "driver": fields[1], "memory": fields[2]})
    return gpus


def machine_info() -> dict:
    return {"hostname": socket.gethostname(), "os": platform.platform(), "cpu": _cpu(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "gpus": _gpus()}


def _clean_number(value):
    return None if value is None else round(value, 6)


def speed_figures(run: SpeedRun) -> list[dict]:
    rows = []
    for concurrency in run.settings.concurrency:
        for prompt in run.rows():
            for metric in run.metrics(concurrency):
                row = {"concurrency": concurrency, "prompt": prompt, "metric": metric,
                       "unit": METRICS[metric][0], "higher_is_better": METRICS[metric][1],
                       "summaries": {label: {k: _clean_number(v) if isinstance(v, float) else v
                                             for k, v in run.summary(label, concurrency, prompt, metric).to_json().items()}
                                     for label in run.labels}}
                if len(run.labels) > 1:
                    row["comparison"] = run.compare(concurrency, prompt, metric).to_json()
                rows.append(row)
    return rows


def evidence(endpoints: dict[str, Endpoint], images: dict[str, ImageInfo | None], settings: BenchSettings,
             speed: SpeedRun | None, battery: BatteryRun | None, machine: dict) -> dict:
    data = {
        "schema": EVIDENCE_SCHEMA,
        "kiln_version": __version__,
        "endpoints": [{"label": label, **endpoint.to_json(),
                       "image": images[label].to_json() if images.get(label) else None}
                      for label, endpoint in endpoints.items()],
        "compared": f"{' against '.join(endpoints)}" if len(endpoints) > 1 else None,
        "prompt_set": {"version": PROMPT_SET_VERSION, "sha256": prompt_set_sha256(settings.prompts),
                       "prompts": [p.to_json() for p in settings.prompts]},
        "battery_version": BATTERY_VERSION,
        "settings": settings.to_json(),
        "machine": machine,
        "speed": None,
        "battery": None,
    }
    if speed is not None:
        data["speed"] = {
            "figures": speed_figures(speed),
            "failed_requests": len(speed.failures()),
            "unsent_requests": speed.unsent,
            "samples": [s.to_json() for s in speed.samples],
            "batches": [b.to_json() for b in speed.batches],
        }
    if battery is not None:
        data["battery"] = battery.to_json()
    return data

"""What a benchmark run reports: the facts of the run, one entry per configuration (printed as
it is measured), headline ratios, and the JSON file."""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import torch

from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.bench.models import BenchModel


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def header(config: BenchConfig, model: BenchModel, threads: int) -> dict:
    """The facts every report starts with: what was measured, on what."""
    return {
        "model": str(model.model_dir), "shape": config.shape, "dtype": model.dtype_name,
        "quantization": model.quantization,
        "new_tokens": config.new_tokens, "repeats": config.repeats, "torch": torch.__version__,
        "threads": threads, "machine": platform.machine(), "python": sys.version.split()[0],
    }


def find(results: list[dict], label: str, **match: object) -> dict | None:
    """The first entry with `label` whose fields equal `match`."""
    for r in results:
        if r["label"] == label and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def write_report(config: BenchConfig, report: dict) -> int:
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))
    if config.json:
        Path(config.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {config.json}")
    return 0

"""Which CPU a figure was measured on: lscpu's model name plus its CPU family and model numbers (the model name
alone can read just "AMD EPYC"; family 25 model 17 says Zen 4, family 26 Zen 5)."""

from __future__ import annotations

import os
import platform
import subprocess


def lscpu_fields(text: str) -> dict[str, str]:
    """`Key: value` lines of lscpu's output, first occurrence of each key."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def cpu_identity() -> dict[str, str | int | None]:
    """{model_name, family, model, cores, matrix_engine}; from lscpu, with platform fallbacks."""
    try:
        fields = lscpu_fields(subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout)
    except (OSError, subprocess.CalledProcessError):
        fields = {}
    flags = set(fields.get("Flags", "").split())
    return {"model_name": fields.get("Model name") or platform.processor() or platform.machine(),
            "family": fields.get("CPU family"), "model": fields.get("Model"), "cores": os.cpu_count(),
            "matrix_engine": "AMX" if "amx_bf16" in flags else "none (no AMX)"}


def describe(cpu: dict[str, str | int | None]) -> str:
    """One line: 'AMD EPYC (family 25, model 17), 2 cores, no AMX'."""
    return (f"{cpu['model_name']} (family {cpu['family']}, model {cpu['model']}), {cpu['cores']} cores, "
            f"matrix engine: {cpu['matrix_engine']}")

"""What machine a benchmark ran on: every number in docs/BENCHMARKS.md names its CPU."""

from __future__ import annotations

import os
import subprocess


def machine() -> dict[str, str | bool]:
    """The CPU model (name, family and model numbers: a VM's name may be only the vendor's) and its
    AVX-512 flags (`lscpu`), the core count and the commit of this checkout."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    def field(name: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith(name + ":")), "?")

    model = field("Model name")
    flags = next((line.split(":", 1)[1].split() for line in lscpu.splitlines() if line.startswith("Flags")), [])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return {"cpu": model, "cpu_family": field("CPU family"), "cpu_model": field("Model"),
            "avx512": any(f.startswith("avx512") for f in flags),
            "avx512_flags": " ".join(f for f in flags if f.startswith("avx512")), "cpus": str(os.cpu_count()),
            "commit": commit}

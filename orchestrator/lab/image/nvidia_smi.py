#!/usr/bin/env python3
"""Lab stand-in for `nvidia-smi` (installed as /usr/local/bin/nvidia-smi on lab hosts).

THIS IS A SIMULATION: lab hosts have no GPU. It prints a realistic listing for the GPU the host
declares (/var/lib/sglfleet-lab/gpu, written from the inventory's `sglfleet_lab_gpu`; SGLFLEET_LAB_GPU
when rendering at `lab up`), and its first line
always says it is a lab simulation. Supports the plain listing, `-L`, and
`--query-gpu=FIELDS --format=csv[,noheader][,nounits]`.

Knobs for tests (`sglfleet doctor`'s failing hosts), each a file in /var/lib/sglfleet-lab:
`gpu-used-mib` (memory in use on every GPU, default 0) and `driver-cuda` (the CUDA version the
driver says it supports, default CUDA below).
"""

import os
import sys

GPUS = {  # name, memory MiB, power cap W, compute capability
    "h200": ("NVIDIA H200", 143771, 700, "9.0"),
    "h100": ("NVIDIA H100 80GB HBM3", 81559, 700, "9.0"),
    "a100": ("NVIDIA A100-SXM4-80GB", 81920, 400, "8.0"),
    "l40s": ("NVIDIA L40S", 46068, 350, "8.9"),
}
DRIVER, CUDA = "580.159.04", "13.0"
BANNER = "# sglfleet lab simulation: no real GPU on this host"


def declared() -> tuple[str, int]:
    if os.environ.get("SGLFLEET_LAB_GPU"):  # rendering for a host at `lab up`
        text = [os.environ["SGLFLEET_LAB_GPU"]]
    else:
        try:
            text = open("/var/lib/sglfleet-lab/gpu").read().split()
        except OSError:
            return "h200", 1
    kind = text[0].lower() if text else "h200"
    count = int(text[1]) if len(text) > 1 and text[1].isdigit() else 1
    return (kind if kind in GPUS else "h200"), count


def knob(name: str, default: str) -> str:
    try:
        return open(f"/var/lib/sglfleet-lab/{name}").read().strip() or default
    except OSError:
        return default


def main(argv: list[str]) -> int:
    kind, count = declared()
    name, mem, power, cc = GPUS[kind]
    used = min(mem, int(knob("gpu-used-mib", "0")))
    cuda = knob("driver-cuda", CUDA)
    print(BANNER)
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "csv")
    if "-L" in argv:
        for i in range(count):
            print(f"GPU {i}: {name} (UUID: GPU-5a1b-lab-{i:04d})")
        return 0
    if query is not None:
        values = {"index": None, "name": name, "memory.total": f"{mem}", "memory.used": f"{used}",
                  "memory.free": f"{mem - used}", "driver_version": DRIVER, "compute_cap": cc,
                  "utilization.gpu": "0", "temperature.gpu": "31", "power.limit": f"{power}.00"}
        fields = [f.strip() for f in query.split(",")]
        unknown = [f for f in fields if f not in values]
        if unknown:
            print(f'Field "{unknown[0]}" is not a valid field to query.', file=sys.stderr)
            return 2
        if "noheader" not in fmt:
            print(", ".join(fields))
        units = "nounits" not in fmt
        for i in range(count):
            row = []
            for f in fields:
                v = str(i) if f == "index" else values[f]
                if units and f.startswith("memory."):
                    v += " MiB"
                row.append(v)
            print(", ".join(row))
        return 0
    print("+-----------------------------------------------------------------------------------------+")
    print(f"| NVIDIA-SMI {DRIVER}             Driver Version: {DRIVER}     CUDA Version: {cuda:<4}     |")
    print("|-----------------------------------------+------------------------+----------------------+")
    for i in range(count):
        print(f"| {i:>3}  {name:<34} | 00000000:{i + 0x18:02X}:00.0 Off |                    0 |")
        print(f"| N/A   31C    P0   {80:>4}W / {power:>4}W | {used:>6}MiB / {mem:>6}MiB |      0%      Default |")
    print("+-----------------------------------------------------------------------------------------+")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

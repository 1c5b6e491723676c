"""Put in front of the helper programs that ask nvidia-smi (stdlib only): the GPUs of a
target and the compute processes on them; None where there is no nvidia-smi (a CPU target)."""

import subprocess

NVIDIA_GPUS = ["--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu",
               "--format=csv,noheader,nounits"]  # fmt: skip
NVIDIA_APPS = ["--query-compute-apps=pid,gpu_uuid,used_memory,process_name",
               "--format=csv,noheader,nounits"]  # fmt: skip


def nvidia_smi(args):
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    rows = out.stdout.decode("utf-8", "replace").strip().splitlines()
    return [[c.strip() for c in row.split(",")] for row in rows if row.strip()]


def number(text):
    try:
        return int(float(text))
    except ValueError:
        return None


def gpus_info():
    """What nvidia-smi says (None where there is none): GPUs and the processes using them."""
    gpus = nvidia_smi(NVIDIA_GPUS)
    if gpus is None:
        return None
    index = {row[1]: number(row[0]) for row in gpus if len(row) >= 2}
    apps = []
    for row in nvidia_smi(NVIDIA_APPS) or []:
        if len(row) >= 4:
            apps.append({"pid": number(row[0]), "gpu": index.get(row[1]),
                         "used_mib": number(row[2]), "name": row[3]})  # fmt: skip
    return {
        "gpus": [
            {"index": number(r[0]), "name": r[2], "memory_total_mib": number(r[3]),
             "memory_used_mib": number(r[4]), "utilization": number(r[5])}
            for r in gpus if len(r) >= 6
        ],
        "apps": apps,
    }  # fmt: skip

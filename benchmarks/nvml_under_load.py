"""Real NVML sampling through sm120patch.trial.gpu.Sampler while a torch matmul loop loads GPU 0 (a
stand-in for a server under load), to show the sampler reads real watts and utilisation.

Run on a machine with an NVIDIA GPU and torch: `python benchmarks/nvml_under_load.py`. Prints
JSON lines: the probe, a 3 s idle window, a 15 s loaded window (after 3 s of ramp-up), and the
loop's TFLOP/s. torch is imported only by the child process, never by sm120patch."""

import json
import subprocess
import sys
import time

from sm120patch.trial import gpu

LOAD = r"""
import sys, time, torch
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("load running", torch.cuda.get_device_name(0), torch.__version__, flush=True)
end = time.time() + float(sys.argv[1])
iters = 0
t0 = time.time()
while time.time() < end:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
    iters += 20
dt = time.time() - t0
print(f"matmuls {iters} in {dt:.1f}s: {2 * n**3 * iters / dt / 1e12:.0f} TFLOP/s", flush=True)
"""


def window(seconds):
    s = gpu.Sampler(every=0.25).start()
    time.sleep(seconds)
    samples = s.stop()
    return {"problem": s.problem, "n": len(samples),
            "gpus": [f.__dict__ for f in gpu.summarise(samples)],
            "describe": [f.describe() for f in gpu.summarise(samples)]}


found = gpu.read_gpus()
print(json.dumps({"probe": found.to_dict()}, default=str), flush=True)
idle = window(3)
print(json.dumps({"idle": idle}), flush=True)
proc = subprocess.Popen([sys.executable, "-c", LOAD, "25"], stdout=subprocess.PIPE, text=True)
line = proc.stdout.readline().strip()
print("child:", line, flush=True)
time.sleep(3)  # ramp-up: clocks and power settle
loaded = window(15)
print(json.dumps({"loaded": loaded}), flush=True)
rest = proc.communicate()[0]
print("child:", rest.strip(), flush=True)

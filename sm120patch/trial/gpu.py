"""Reading the GPUs through NVML (nvidia-ml-py, module `pynvml`): what GPUs this machine has.
The only module importing pynvml. A missing driver, no GPU or an NVML error is a state, never
a traceback."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from sm120patch.errors import AGAIN, Refused

SM120_MAJOR = 12
NO_LIBRARY = "no NVIDIA driver found (libnvidia-ml is not installed)"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    major: int
    minor: int
    power_w: float | None
    power_limit_w: float | None
    memory_total_mib: int | None
    memory_used_mib: int | None

    @property
    def sm(self) -> str:
        return f"sm_{self.major}{self.minor}"

    @property
    def is_sm120(self) -> bool:
        return self.major == SM120_MAJOR

    def describe(self) -> str:
        return f"GPU {self.index}: {self.name} is {self.sm}"


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs of this machine as NVML reported them once, or why it could not."""

    gpus: list[Gpu] = field(default_factory=list)
    driver: str | None = None
    cuda_driver: str | None = None  # "12.8"
    problem: str | None = None  # why there is nothing to show, in words

    @property
    def has_sm120(self) -> bool:
        return any(g.is_sm120 for g in self.gpus)

    @property
    def family(self) -> str | None:
        """The family: "sm120" when an SM120 GPU is here, else the first GPU's, None without one."""
        if not self.gpus:
            return None
        return "sm120" if self.has_sm120 else f"sm{self.gpus[0].major}{self.gpus[0].minor}"

    def summary(self) -> str:
        if self.problem:
            return self.problem
        if not self.gpus:
            return "no NVIDIA GPU found"
        return "; ".join(g.describe() for g in self.gpus)

    def to_dict(self) -> dict[str, Any]:
        return {
            "driver": self.driver,
            "cuda_driver": self.cuda_driver,
            "problem": self.problem,
            "gpus": [{**asdict(g), "sm": g.sm, "is_sm120": g.is_sm120} for g in self.gpus],
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(fn: Any, *args: Any) -> Any:
    """A value some GPUs or drivers do not report: None instead of an error."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _nvml_library_absent() -> bool:
    """True when the driver's NVML library cannot be loaded, learnt the way pynvml's
    `nvmlInit` learns it (the same `CDLL` of the same name, Linux only). Importing the binding
    costs about as much as `import click` itself (18 ms on the project's machine), and a host
    without the driver (an image build, CI) should not pay that to hear "no driver".
    When pynvml is already imported (a caller or a test set it up), it decides."""
    if sys.platform != "linux" or "pynvml" in sys.modules:
        return False
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return True
    return False


def read_gpus() -> GpuInventory:
    """Start NVML, read every GPU, stop it: a missing driver or an NVML error is `problem`."""
    if _nvml_library_absent():
        return GpuInventory(problem=NO_LIBRARY)
    try:
        import pynvml
    except ImportError:  # pragma: no cover - a runtime dependency
        return GpuInventory(problem="nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return GpuInventory(problem=NO_LIBRARY)
    except pynvml.NVMLError_DriverNotLoaded:
        return GpuInventory(problem="no NVIDIA driver found (the kernel driver is not loaded)")
    except pynvml.NVMLError as exc:
        return GpuInventory(problem=f"NVML could not start: {exc}")
    try:
        driver = _text(_optional(pynvml.nvmlSystemGetDriverVersion) or "") or None
        cuda = _optional(pynvml.nvmlSystemGetCudaDriverVersion)
        cuda_driver = f"{cuda // 1000}.{(cuda % 1000) // 10}" if cuda else None
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            power = _optional(pynvml.nvmlDeviceGetPowerUsage, handle)
            limit = _optional(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            memory = _optional(pynvml.nvmlDeviceGetMemoryInfo, handle)
            gpus.append(
                Gpu(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    major=int(major),
                    minor=int(minor),
                    power_w=None if power is None else power / 1000.0,
                    power_limit_w=None if limit is None else limit / 1000.0,
                    memory_total_mib=None if memory is None else int(memory.total) // 2**20,
                    memory_used_mib=None if memory is None else int(memory.used) // 2**20,
                )
            )
        return GpuInventory(gpus=gpus, driver=driver, cuda_driver=cuda_driver)
    except pynvml.NVMLError as exc:
        return GpuInventory(problem=f"NVML error while reading the GPUs: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def require_sm120(found: GpuInventory | None = None) -> GpuInventory:
    """The apply/trial precondition: at least one SM120 GPU, else a refusal naming what is here."""
    found = found or read_gpus()
    if not found.has_sm120:
        raise Refused(
            f"no SM120 GPU on this machine ({found.summary()})",
            "these patches only help SM120 GPUs; to patch anyway (image builds, CI): "
            f"`sm120patch {AGAIN} --no-gpu-check`",
        )
    return found


# ---- sampling during a measured window -----------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """One GPU at one instant. `util_pct` is NVML's GPU utilisation: the share of the last
    sample period in which at least one kernel ran on the GPU (NVML has no per-SM counter)."""

    index: int
    name: str
    power_w: float | None
    limit_w: float | None
    util_pct: float | None


class Sampler:
    """Reads power and utilisation of every GPU every `every` seconds in a thread, between
    `start()` and `stop()`: a trial samples only while its load runs, never the idle server.
    Without NVML (no driver, no GPU) it collects nothing and says why in `problem`."""

    def __init__(self, every: float = 0.25) -> None:
        import threading

        self.every = every
        self.samples: list[dict[str, Any]] = []
        self.problem: str | None = None
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        self._halt.set()
        self._thread.join(timeout=10)
        return self.samples

    def _run(self) -> None:
        import time

        try:
            import pynvml
        except ImportError:  # pragma: no cover - a runtime dependency
            self.problem = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.problem = f"NVML could not start: {exc}"
            return
        try:
            handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
            names = [_text(pynvml.nvmlDeviceGetName(h)) for h in handles]
            start = time.monotonic()
            while True:
                # One reading at once and one at the stop, so a short window has two points.
                halted = self._halt.wait(0 if not self.samples else self.every)
                readings = [_read(pynvml, i, names[i], h) for i, h in enumerate(handles)]
                self.samples.append(
                    {"t": round(time.monotonic() - start, 3), "gpus": [asdict(r) for r in readings]}
                )
                if halted:
                    return
        except pynvml.NVMLError as exc:
            self.problem = f"NVML error while sampling: {exc}"
        finally:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass


def _read(pynvml: Any, index: int, name: str, handle: Any) -> Reading:
    power = _optional(pynvml.nvmlDeviceGetPowerUsage, handle)
    limit = _optional(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    util = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
    return Reading(
        index=index,
        name=name,
        power_w=None if power is None else power / 1000.0,
        limit_w=None if limit is None else limit / 1000.0,
        util_pct=None if util is None else float(util.gpu),
    )


@dataclass(frozen=True)
class GpuFigures:
    """One GPU over one measured window."""

    index: int
    name: str
    mean_w: float | None
    max_w: float | None
    limit_w: float | None
    limit_share: float | None  # mean draw / power limit, 0..1
    mean_util_pct: float | None

    def describe(self) -> str:
        """'GPU 0: mean 395 W (56% of the 700 W limit), max 477 W, util 93%'."""
        if self.mean_w is None or self.max_w is None:
            return f"GPU {self.index}: no power reading"
        share = ""
        if self.limit_share and self.limit_w:
            share = f" ({100 * self.limit_share:.0f}% of the {self.limit_w:.0f} W limit)"
        util = f", util {self.mean_util_pct:.0f}%" if self.mean_util_pct is not None else ""
        return f"GPU {self.index}: mean {self.mean_w:.0f} W{share}, max {self.max_w:.0f} W{util}"


def summarise(samples: list[dict[str, Any]]) -> list[GpuFigures]:
    """Mean and max draw, share of the limit and mean utilisation per GPU."""
    per: dict[int, list[dict[str, Any]]] = {}
    for sample in samples:
        for g in sample["gpus"]:
            per.setdefault(g["index"], []).append(g)
    out = []
    for index, rows in sorted(per.items()):
        watts = [r["power_w"] for r in rows if r.get("power_w") is not None]
        utils = [r["util_pct"] for r in rows if r.get("util_pct") is not None]
        limit = next((r["limit_w"] for r in reversed(rows) if r.get("limit_w")), None)
        mean = sum(watts) / len(watts) if watts else None
        out.append(
            GpuFigures(
                index=index,
                name=rows[-1].get("name", ""),
                mean_w=None if mean is None else round(mean, 1),
                max_w=max(watts) if watts else None,
                limit_w=limit,
                limit_share=None if (mean is None or not limit) else round(mean / limit, 3),
                mean_util_pct=round(sum(utils) / len(utils), 1) if utils else None,
            )
        )
    return out

"""The NVML probe (nvidia-ml-py, module `pynvml`): what GPUs this machine has. The only module
importing pynvml. A missing driver, no GPU or an NVML error is a state, never a traceback."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sm120patch.errors import Refused

SM120_MAJOR = 12


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
class Probe:
    gpus: list[Gpu] = field(default_factory=list)
    driver: str | None = None
    cuda_driver: str | None = None  # "12.8"
    problem: str | None = None  # why there is nothing to show, in words

    @property
    def has_sm120(self) -> bool:
        return any(g.is_sm120 for g in self.gpus)

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


def probe() -> Probe:
    try:
        import pynvml
    except ImportError:  # pragma: no cover - a runtime dependency
        return Probe(problem="nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return Probe(problem="no NVIDIA driver found (libnvidia-ml is not installed)")
    except pynvml.NVMLError_DriverNotLoaded:
        return Probe(problem="no NVIDIA driver found (the kernel driver is not loaded)")
    except pynvml.NVMLError as exc:
        return Probe(problem=f"NVML could not start: {exc}")
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
        return Probe(gpus=gpus, driver=driver, cuda_driver=cuda_driver)
    except pynvml.NVMLError as exc:
        return Probe(problem=f"NVML error while reading the GPUs: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def require_sm120(found: Probe | None = None) -> Probe:
    """The apply/trial precondition: at least one SM120 GPU, else a refusal naming what is here."""
    found = found or probe()
    if not found.has_sm120:
        raise Refused(
            f"no SM120 GPU on this machine ({found.summary()})",
            "these patches only help SM120 GPUs; pass --no-gpu-check to patch anyway "
            "(image builds, CI)",
        )
    return found

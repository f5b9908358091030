"""What vLLM's own selection code decides on a simulated GPU (the behaviour tier's vLLM probe).

A script, run BY PATH in the behaviour tier's dependency environment (`envs.py`), never
imported by the tests: it imports torch and vLLM. It takes the GPU simulation, the overlay
finder and the placeholders from sm120patch's own probe (`sm120patch/explain/probe.py`, loaded
by path from `request["probe"]`), and adds what vLLM asks beyond torch:

- NVML: vLLM picks its platform by asking NVML (`vllm.third_party.pynvml`) for GPUs, and its
  CUDA platform answers capability, name, memory and NVLink from NVML. The module's functions
  the platform calls are replaced by ones that answer for `devices` GPUs of the simulated arch;
  NVLink P2P is OK between SM100 or SM90 GPUs (NVLink boxes) and not between SM120 ones
  (PCIe-only workstation cards). Nothing else of the module changes.
- Compiled extensions: every `.so` module the release's RECORD lists (`vllm._C_stable_libtorch`,
  `vllm._moe_C_stable_libtorch`, ...; request `extensions`) is a placeholder module, as the GPU
  extensions are for SGLang: importing works, calling anything raises.
- FlashInfer: request `flashinfer` true stands a placeholder package in for `flashinfer` and
  `flashinfer_cubin` (vLLM pins FlashInfer, and its cubins package, in every release): vLLM's
  own availability checks (`has_flashinfer*`: `find_spec`, `hasattr` on submodules) then find
  it, as on a machine where the pinned FlashInfer is installed. No FlashInfer code runs.

    python vllm_probe.py REQUEST.json RESULT.json

Request: `probe` (path of sm120patch's probe.py), `simulate` ("sm120", "sm100", "sm90"),
`devices`, `sys_path`, `overlay` {module: file}, `env`, `extensions`, `flashinfer`, and the
checks to run: `moe` {name: {"moe_backend", "ep", "tp", "b12x"}} (`select_nvfp4_moe_backend`
for a W4A16 NVFP4 layer: weight key kNvfp4Static, no activation key; `b12x` true stands the
optional b12x package in for that call, `b12x_installed`), `fusion` {name: {"tp"}} (the
all-reduce + RMSNorm fusion default of `vllm.config.vllm`), `linear` {name: {"linear_backend",
"b12x", "a16"}} (`init_nvfp4_linear_kernel`, the NVFP4 linear kernel), `allreduce` {name: {"world"}}
(CustomAllreduce's set-up on one node of `world` simulated GPUs, `env` set for the call).

Result: `platform` (the class vLLM resolved and what it answers), then per check name its
answer or `error` and `where`. Exit 5 with `fatal` when vLLM cannot be imported at all.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import io
import json
import logging
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any

# NVML's constants, as nvidia-ml-py defines them (the module keeps its own; these are only
# what the simulated functions return).
P2P_OK = 0
P2P_NOT_SUPPORTED = 4  # NVML_P2P_STATUS_NOT_SUPPORTED


def load_base(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("sm120patch_probe", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NamedPlaceholderFinder(importlib.abc.MetaPathFinder):
    """Placeholder modules for these exact module names and anything under them."""

    def __init__(self, base: Any, names: set[str]) -> None:
        self.names = names
        self.loader = base.PlaceholderFinder(set())

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if not any(name == n or name.startswith(n + ".") for n in self.names):
            return None
        return importlib.util.spec_from_loader(name, self.loader, is_package=True)


class SimulatedNvml(importlib.abc.MetaPathFinder):
    """Loads vLLM's copy of pynvml as usual and makes it answer for the simulated GPUs as soon
    as it has run (`simulate_nvml`), before anything of vLLM can call it: some releases
    resolve the platform while `import vllm` runs."""

    NAME = "vllm.third_party.pynvml"

    def __init__(self, base: Any, arch: str, devices: int) -> None:
        self.base, self.arch, self.devices = base, arch, devices

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.NAME:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, outer = spec.loader, self

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                simulate_nvml(module, outer.base, outer.arch, outer.devices)

        spec.loader = Loader()
        return spec


def simulate_nvml(pynvml: Any, base: Any, arch: str, devices: int) -> None:
    """Make vLLM's copy of pynvml answer for `devices` GPUs of `arch` (module docstring)."""
    major, minor = base.CAPABILITY[arch]
    nvlink = arch != "sm120"

    class Handle(int):
        pass

    def handle(index: int) -> Handle:
        if not 0 <= int(index) < devices:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return Handle(index)

    memory = base.MEMORY_MIB[arch] * 1024 * 1024
    fake = {
        "nvmlInit": lambda *a, **k: None,
        "nvmlInitWithFlags": lambda *a, **k: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: devices,
        "nvmlDeviceGetHandleByIndex": handle,
        "nvmlDeviceGetIndex": lambda h: int(h),
        "nvmlDeviceGetHandleByUUID": lambda uuid: handle(int(str(uuid).rsplit("-", 1)[-1])),
        "nvmlDeviceGetUUID": lambda h: f"GPU-00000000-0000-0000-0000-{int(h):012d}",
        "nvmlDeviceGetCudaComputeCapability": lambda h: (major, minor),
        "nvmlDeviceGetName": lambda h: base.DEVICE_NAME[arch],
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=memory, free=memory, used=0),
        "nvmlDeviceGetP2PStatus": lambda a, b, cap: P2P_OK if nvlink else P2P_NOT_SUPPORTED,
        "nvmlSystemGetConfComputeState": lambda: SimpleNamespace(ccFeature=0, devToolsMode=0,
                                                                  environment=0),
        "nvmlDeviceGetNumaNodeId": lambda h: 0,
        "nvmlSystemGetCudaDriverVersion": lambda: 13000,
        "nvmlSystemGetCudaDriverVersion_v2": lambda: 13000,
        "nvmlSystemGetDriverVersion": lambda: "580.00",
    }
    for name, fn in fake.items():
        setattr(pynvml, name, fn)


class VllmNamespaces(set):  # type: ignore[type-arg]
    """The operator namespaces whose fake-kernel registrations may name a missing operator:
    these and vLLM's compiled ones (`_C`, `_moe_C`, `_rocm_C`, ...: every `_` namespace)."""

    def __contains__(self, name: object) -> bool:
        return str(name).startswith("_") or super().__contains__(name)


class MissingOp:
    """A compiled operator the release's placeholder extension lacks: a call is recorded and
    answers None; every overload (`.default`, `.out`, which modules name at import, as the
    fusion pass's pattern tables do) is the operator itself."""

    def __init__(self, name: str, called: list[str]) -> None:
        self._name, self._called = name, called

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self._called.append(f"{self._name}{tuple(args)!r}")

    def __getattr__(self, overload: str) -> MissingOp:
        if overload.startswith("__"):
            raise AttributeError(overload)
        return self


class CompiledOps:
    """vLLM's compiled operators (`torch.ops._C.*`, `torch.ops._moe_C.*`, ...) are not in a CPU
    torch. Under simulation a lookup that would fail in a namespace starting with `_` (vLLM's;
    torch's own ops resolve as before) gives an operator that records its call and returns
    None. Some modules call capability queries at import (`w8a8_utils`:
    `cutlass_scaled_mm_supports_block_fp8`); each call is listed in the result (`ops_called`),
    so a decision that asked one is visible."""

    def __init__(self) -> None:
        self.called: list[str] = []

    def install(self, torch: Any) -> None:
        namespace = torch._ops._OpNamespace
        original = namespace.__getattr__
        called = self.called

        def lookup(ns: Any, op_name: str) -> Any:
            try:
                return original(ns, op_name)
            except AttributeError:
                if not ns.name.startswith("_") or op_name.startswith("__"):
                    raise

                return MissingOp(f"{ns.name}.{op_name}", called)

        namespace.__getattr__ = lookup


# ----------------------------------------------------------------------------- the checks


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _where() -> list[str]:
    return [ln.strip() for ln in traceback.format_exc().splitlines()
            if ln.startswith("  File")][-8:]


def guarded(check: Any) -> dict[str, Any]:
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        out = dict(check())
    except Exception as exc:
        out = {"error": _error(exc), "where": _where()}
    finally:
        logger.removeHandler(handler)
    out["log"] = [ln for ln in logs.getvalue().splitlines() if ln.strip()]
    return out


def platform_answers() -> dict[str, Any]:
    from vllm.platforms import current_platform as p

    cap = p.get_device_capability()
    return {
        "class": f"{type(p).__module__}.{type(p).__qualname__}",
        "is_cuda": bool(p.is_cuda()),
        "capability": [cap.major, cap.minor] if cap is not None else None,
        "device_name": p.get_device_name(),
        "is_device_capability(120)": bool(p.is_device_capability(120)),
        "is_device_capability(100)": bool(p.is_device_capability(100)),
        "is_device_capability(90)": bool(p.is_device_capability(90)),
        "is_device_capability_family(120)": bool(p.is_device_capability_family(120)),
        "is_device_capability_family(100)": bool(p.is_device_capability_family(100)),
        "has_device_capability(100)": bool(p.has_device_capability(100)),
    }


def moe_config(spec: dict[str, Any]) -> Any:
    """A FusedMoEConfig for one MoE layer of a W4A16 NVFP4 checkpoint: `tp` GPUs, expert
    parallel across them when `ep`, one node, no data parallel. Built from the release's own
    dataclasses; only the fields this release declares are passed."""
    import dataclasses

    import torch
    from vllm.model_executor.layers.fused_moe import config as moe

    tp, ep = int(spec.get("tp", 1)), bool(spec.get("ep", False))
    parallel_values = {
        "tp_size": 1 if ep else tp, "pcp_size": 1, "dp_size": 1, "ep_size": tp if ep else 1,
        "tp_rank": 0, "pcp_rank": 0, "dp_rank": 0, "ep_rank": 0, "sp_size": 1,
        "use_ep": ep, "all2all_backend": "allgather_reducescatter", "enable_eplb": False,
    }
    parallel_fields = {f.name for f in dataclasses.fields(moe.FusedMoEParallelConfig)}
    parallel = moe.FusedMoEParallelConfig(
        **{k: v for k, v in parallel_values.items() if k in parallel_fields})
    experts = 128
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    routing = _routing_method()
    values = {
        "num_experts": experts, "experts_per_token": 8, "hidden_dim": 4096,
        "intermediate_size": 1536, "num_local_experts": experts // (tp if ep else 1),
        "num_logical_experts": experts, "activation": MoEActivation.SILU, "device": "cuda",
        "routing_method": routing, "moe_parallel_config": parallel,
        "in_dtype": torch.bfloat16, "router_logits_dtype": torch.float32,
        "moe_backend": spec.get("moe_backend", "auto"),
    }
    fields = {f.name for f in dataclasses.fields(moe.FusedMoEConfig)}
    return moe.FusedMoEConfig(**{k: v for k, v in values.items() if k in fields})


def _routing_method() -> Any:
    from vllm.model_executor.layers.fused_moe import config as moe

    enum = getattr(moe, "RoutingMethodType", None)
    if enum is None:
        from vllm.model_executor.layers.fused_moe.routing import RoutingMethodType as enum
    return enum.Renormalize


B12X_MODULES = ("b12x", "b12x.moe", "b12x.moe.fused_moe", "b12x.gemm", "b12x.gemm.blockscaled",
                "b12x._lib", "b12x._lib.intrinsics")


def b12x_installed(present: bool) -> None:
    """Stand the optional `b12x` package (`vllm[b12x]`) in, or take it away, and let vLLM's own
    accessor module (`vllm.utils.b12x`) look again: it decides at import time
    (`find_spec("b12x")`, then imports `b12x.moe.fused_moe` and the others), so it is reloaded,
    its own code running again. The stand-in is `b12x`, `b12x.moe.fused_moe` and
    `b12x.gemm.blockscaled`, whose `is_supported()` say yes (what
    `B12xExperts._supports_current_device` and `B12xNvFp4LinearKernel.is_supported` ask of them
    once the GPU is SM12x), and `b12x._lib.intrinsics` (the NVFP4 kernel asks it is there);
    every other b12x submodule stays absent (vLLM then keeps None for it). No b12x code runs."""
    import importlib.machinery
    from types import ModuleType

    for name in B12X_MODULES:
        sys.modules.pop(name, None)
    if present:
        for name in B12X_MODULES:
            module = ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            module.__path__ = []
            sys.modules[name] = module
        for name in ("b12x.moe.fused_moe", "b12x.gemm.blockscaled"):
            sys.modules[name].is_supported = lambda: True  # type: ignore[attr-defined]
    importlib.reload(importlib.import_module("vllm.utils.b12x"))


def select_moe(spec: dict[str, Any]) -> dict[str, Any]:
    """`select_nvfp4_moe_backend` for a W4A16 NVFP4 layer; with `b12x` true, with the b12x
    package stood in for this one call (`b12x_installed`)."""
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import select_nvfp4_moe_backend
    from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Static

    with_b12x = bool(spec.get("b12x", False))
    if with_b12x:
        b12x_installed(True)
    try:
        backend, experts = select_nvfp4_moe_backend(moe_config(spec), kNvfp4Static, None)
    finally:
        if with_b12x:
            b12x_installed(False)
    return {"backend": backend.value, "experts": experts.__name__}


def select_linear(spec: dict[str, Any]) -> dict[str, Any]:
    """`init_nvfp4_linear_kernel` for a W4A4 NVFP4 linear layer (`a16` true: W4A16): the kernel
    the release's own walk takes. `linear_backend` is `--linear-backend` ("auto" where not
    given), what the current vLLM config answers (a config carrying only the two fields
    `_get_linear_backend` reads; none for "auto", as outside an engine); `b12x` true stands the
    b12x package in for the call (`b12x_installed`). The compiled query of whether the build's
    CUTLASS FP4 kernels serve this GPU (`cutlass_scaled_mm_supports_fp4`, a `_C` operator absent
    here) answers as vLLM's CUDA build does: capability 100 and later."""
    import vllm.config
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.quantization.utils import nvfp4_utils

    with_b12x = bool(spec.get("b12x", False))
    backend = spec.get("linear_backend", "auto")
    config = None if backend == "auto" else SimpleNamespace(
        kernel_config=SimpleNamespace(linear_backend=backend, linear_backend_per_quant=None))
    saved = (nvfp4_utils.cutlass_scaled_mm_supports_fp4,
             vllm.config.get_current_vllm_config_or_none)
    nvfp4_utils.cutlass_scaled_mm_supports_fp4 = lambda capability: capability >= 100
    vllm.config.get_current_vllm_config_or_none = lambda: config
    if with_b12x:
        b12x_installed(True)
    try:
        kernel = linear.init_nvfp4_linear_kernel(use_a16=bool(spec.get("a16", False)))
    finally:
        nvfp4_utils.cutlass_scaled_mm_supports_fp4 = saved[0]
        vllm.config.get_current_vllm_config_or_none = saved[1]
        if with_b12x:
            b12x_installed(False)
    return {"kernel": type(kernel).__name__}


def fusion(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's default for the all-reduce + RMSNorm fusion pass, for a `tp`-GPU deployment:
    the release's own function, given a config carrying the one field it reads."""
    from vllm.config import vllm as config

    fn = getattr(config, "enable_allreduce_rms_fusion")  # noqa: B009
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=int(spec["tp"])))
    return {"enabled": bool(fn(cfg))}


def fusion_tables(spec: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's fusion pass takes from its FlashInfer size tables on this GPU for a
    `tp`-GPU deployment: the largest all-reduce it fuses (`PassConfig().flashinfer_max_size`,
    None: the pass turns itself off), and whether a 40 MiB and a 1 MiB tensor take the
    one-shot kernel (`_select_flashinfer_allreduce_use_oneshot`, the trtllm workspace, the
    capability as vLLM's caller passes it)."""
    from vllm.compilation.passes.fusion import allreduce_rms_fusion as fusion_pass
    from vllm.config.compilation import PassConfig
    from vllm.platforms import current_platform

    tp = int(spec["tp"])
    capability = current_platform.get_device_capability().to_int()
    oneshot = getattr(fusion_pass, "_select_flashinfer_allreduce_use_oneshot")  # noqa: B009
    return {
        "max_size": PassConfig().flashinfer_max_size(tp),
        "oneshot_40MiB": oneshot("trtllm", capability, tp, 40 * 2**20),
        "oneshot_1MiB": oneshot("trtllm", capability, tp, 2**20),
    }


class OneNodeGroup:
    """torch.distributed as CustomAllreduce's module sees it, for a gloo group of `world` ranks
    on one node, this process rank 0, rank i on GPU i: every other name is torch's own."""

    def __init__(self, real: Any, world: int) -> None:
        self._real, self._world = real, world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def get_backend(self, group: Any = None) -> Any:
        return self._real.Backend.GLOO

    def get_rank(self, group: Any = None) -> int:
        return 0

    def get_world_size(self, group: Any = None) -> int:
        return self._world

    def all_gather(self, out: list[Any], tensor: Any, group: Any = None) -> None:
        for i, t in enumerate(out):
            t.fill_(i)

    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None) -> None:
        return None


def allreduce(spec: dict[str, Any]) -> dict[str, Any]:
    """CustomAllreduce's set-up on one node of `world` simulated GPUs, up to its P2P check:
    whether the gates before it let the custom allreduce on (`reaches_p2p_check`). The P2P
    check itself (a CUDA test between every pair) answers False, so the object stops there,
    disabled, before allocating anything; the log says which gate stopped it earlier."""
    import torch.distributed as dist
    from vllm.distributed.device_communicators import custom_all_reduce as car

    world = int(spec["world"])
    reached: list[tuple[int, int]] = []

    def can_p2p(rank: int, world_size: int) -> bool:
        reached.append((rank, world_size))
        return False

    car.dist = OneNodeGroup(dist, world)
    car.in_the_same_node_as = lambda group, source_rank=0: [True] * world
    car._can_p2p = can_p2p
    saved = {k: os.environ.get(k) for k in spec.get("env", {})}
    os.environ.update(spec.get("env", {}))
    try:
        obj = car.CustomAllreduce(group=object(), device=0)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"custom_ar_library": bool(car.custom_ar), "reaches_p2p_check": bool(reached),
            "disabled": bool(obj.disabled)}


# ----------------------------------------------------------------------------- main


def run(request: dict[str, Any]) -> dict[str, Any]:
    base = load_base(request["probe"])
    for entry in reversed(request.get("sys_path", [])):
        sys.path.insert(0, entry)
    if request.get("overlay"):
        sys.meta_path.insert(0, base.OverlayFinder(request["overlay"]))
    arch = request["simulate"]
    devices = int(request.get("devices", 8))
    try:
        import torch
    except Exception as exc:
        raise base.Fatal(f"cannot import torch: {_error(exc)}") from None
    base.simulate(torch, arch, request.get("cuda_version", "13.0"), devices)
    names = set(request.get("extensions", []))
    if request.get("flashinfer"):
        names |= {"flashinfer", "flashinfer_cubin"}
    base.tolerate_missing_ops(torch, VllmNamespaces({"torchvision"}))
    ops = CompiledOps()
    ops.install(torch)
    sys.meta_path.append(NamedPlaceholderFinder(base, names))
    sys.meta_path.insert(0, SimulatedNvml(base, arch, devices))
    result: dict[str, Any] = {"simulate": arch, "torch": torch.__version__}
    try:
        import vllm

        result["vllm"] = {"version": vllm.__version__, "file": vllm.__file__}
    except Exception as exc:
        raise base.Fatal(f"cannot import vllm: {_error(exc)}") from None
    result["platform"] = guarded(platform_answers)
    result["moe"] = {name: guarded(lambda s=spec: select_moe(s))
                     for name, spec in request.get("moe", {}).items()}
    result["linear"] = {name: guarded(lambda s=spec: select_linear(s))
                        for name, spec in request.get("linear", {}).items()}
    result["fusion"] = {name: guarded(lambda s=spec: fusion(s))
                        for name, spec in request.get("fusion", {}).items()}
    result["fusion_tables"] = {name: guarded(lambda s=spec: fusion_tables(s))
                               for name, spec in request.get("fusion_tables", {}).items()}
    result["allreduce"] = {name: guarded(lambda s=spec: allreduce(s))
                           for name, spec in request.get("allreduce", {}).items()}
    result["ops_called"] = sorted(set(ops.called))
    return result


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as fh:
        request = json.load(fh)
    os.environ.update(request.get("env", {}))
    try:
        result, code = run(request), 0
    except Exception as exc:  # the base probe's Fatal, or a broken simulation
        if os.environ.get("SM120PATCH_DEBUG"):
            traceback.print_exc()
        result, code = {"fatal": _error(exc), "where": _where()}, 5
    with open(argv[2], "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, sort_keys=True, default=repr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))

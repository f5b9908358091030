"""What SGLang's, FlashInfer's and vLLM's own code decides on this machine, or on a simulated GPU.

This file is a script, run BY PATH in the interpreter that owns the target (the target venv's
`python`), never imported by sm120patch: it imports torch, SGLang and FlashInfer, which the
tool itself never does, and it imports nothing of sm120patch, which need not be installed
there. `sm120patch explain` and tests/behaviour are its two callers.

    python probe.py REQUEST.json RESULT.json

The request (JSON) says:
- `simulate`: "sm120", "sm100", "sm90" or null (the real GPU). Simulation makes torch report a
  CUDA device of that capability (and CUDA `cuda_version`) before SGLang is imported, so
  upstream's own predicates (`is_sm120_supported()`, `get_platform().is_sm120`, ...) compute
  the answer; the result reports them, and the caller checks they say what was simulated.
- `sys_path`: directories put first on sys.path (a release installed with `pip --target`).
- `overlay`: {module name: source file}: these modules load from those files instead of the
  installed ones (the patched or the pristine text), through a finder first on sys.meta_path;
  the installed files are never touched.
- `launches`: {name: [sglang launch arguments]}: each is parsed by the release's own
  `prepare_server_args` and resolved by its `ServerArgs.__post_init__`.
- `sglang`, `flashinfer`, `vllm`: whether to run the SGLang, FlashInfer and vLLM checks (for
  vLLM: its version, the platform its checks ask, and its patches' readers; no launch is
  resolved for it).
- `readers`: what the patches declare `explain` reads at their sites (sm120patch/patchkit/
  readers.py): per reader its patch, target, `name`, the `source` text of its function (with
  its `file` and first `line`), and where its site is by the patch's facts (`modules`,
  `functions`). Each runs after its target imports, on a `site` object carrying those and the
  simulated GPU (`simulate`; `multicast`: under simulation a driver binding without
  multicast on SM120, with it on SM100/SM90, or as `multicast` in the request says; None on a
  real GPU). This script names no site of its own.

The result (JSON) has `predicates`, per launch the whole resolved `server_args` (or `error`),
and per reader its answer under its `name` (or `error` and `where`, when it raised).

Exit codes: 0 done (per-check errors are in the result); 5 the target could not be imported
(torch missing, a broken environment): the result then holds only `fatal`, one line.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import io
import json
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any

EXIT_OK = 0
EXIT_CANNOT_IMPORT = 5

CAPABILITY = {"sm120": (12, 0), "sm100": (10, 0), "sm90": (9, 0)}
DEVICE_NAME = {
    "sm120": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
    "sm100": "NVIDIA B200",
    "sm90": "NVIDIA H100 80GB HBM3",
}
MEMORY_MIB = {"sm120": 97887, "sm100": 183359, "sm90": 81559}

# Compiled GPU-only extensions: on a CPU-only machine their import fails; under simulation a
# placeholder module stands in (any use of it raises). Decision code never calls them.
GPU_EXTENSIONS = ("sgl_kernel", "deep_gemm", "flash_mla", "sgl_deep_gemm", "sgl_flash_mla")
# vLLM's compiled modules (the .so files its wheel's RECORD lists, 0.30-0.34), inside its
# package: on a CPU box they are absent (a release's .py tree) or do not load.
VLLM_EXTENSIONS = (
    "vllm._C",
    "vllm._C_stable_libtorch",
    "vllm._moe_C",
    "vllm._moe_C_stable_libtorch",
    "vllm.cumem_allocator",
    "vllm._flashmla_C",
    "vllm._flashmla_extension_C",
    "vllm._deepselect_C",
    "vllm._flashkda_C",
    "vllm.fs_io_C",
    "vllm.spinloop",
    "vllm.vllm_flash_attn._vllm_fa2_C",
    "vllm.vllm_flash_attn._vllm_fa3_C",
    "vllm.third_party.deep_gemm._C_extension",
)


class Fatal(Exception):
    """The target cannot be imported; one line for the user."""


# ----------------------------------------------------------------------------- loading


class OverlayFinder(importlib.abc.MetaPathFinder):
    """Load the named modules from other source files (the alternate text of a tree)."""

    def __init__(self, overlay: dict[str, str]) -> None:
        self.overlay = overlay

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        source = self.overlay.get(name)
        if source is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            real = finder.find_spec(name, path, target)
            if real is not None:
                break
        else:
            real = None
        is_package = bool(real and real.submodule_search_locations is not None)
        spec = importlib.util.spec_from_file_location(
            name,
            source,
            submodule_search_locations=list(real.submodule_search_locations or [])
            if is_package and real
            else None,
        )
        return spec


class Placeholder:
    """Stands for anything of a GPU extension that cannot load here; using it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is not available (simulated GPU, no compiled kernels)")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serve placeholder modules for the GPU extensions that do not import here."""

    def __init__(self, tops: set[str]) -> None:
        self.tops = tops

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        # a top-level package and all below it, or one module inside another package
        if not any(name == top or name.startswith(top + ".") for top in self.tops):
            return None
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        return None

    def exec_module(self, module: Any) -> None:
        module.__path__ = []
        name = module.__name__

        def attribute(attr: str) -> Placeholder:
            if attr.startswith("__"):
                raise AttributeError(f"module {name!r} has no attribute {attr!r}")
            return Placeholder(f"{name}.{attr}")

        module.__getattr__ = attribute  # type: ignore[method-assign,unused-ignore]  # PEP 562


def _unimportable(names: tuple[str, ...]) -> set[str]:
    out = set()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            out.add(name)
    return out


# ----------------------------------------------------------------------------- simulation


def simulate(torch: Any, arch: str, cuda_version: str, devices: int) -> None:
    """Make torch report `devices` CUDA GPUs of `arch`; nothing else of torch changes."""
    major, minor = CAPABILITY[arch]
    cuda = torch.cuda
    props = SimpleNamespace(
        name=DEVICE_NAME[arch],
        major=major,
        minor=minor,
        total_memory=MEMORY_MIB[arch] * 1024 * 1024,
        multi_processor_count=188 if arch == "sm120" else 132,
        gcnArchName="",
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        L2_cache_size=128 * 1024 * 1024,
        warp_size=32,
    )
    cuda.is_available = lambda: True
    cuda.device_count = lambda: devices
    cuda.get_device_capability = lambda device=None: (major, minor)
    cuda.get_device_name = lambda device=None: DEVICE_NAME[arch]
    cuda.get_device_properties = lambda device=None: props
    cuda.mem_get_info = lambda device=None: (props.total_memory, props.total_memory)
    cuda.current_device = lambda: 0
    cuda.is_initialized = lambda: True
    cuda.set_device = lambda device: None
    torch.version.cuda = cuda_version


def tolerate_missing_ops(torch: Any, namespaces: set[str]) -> None:
    """Under simulation, registering a fake (meta) kernel for an operator of a compiled
    extension that did not load (sgl_kernel's, or PyPI torchvision's, which is built against
    CUDA torch) is skipped instead of failing the import: those operators are never run here.
    Every other registration goes through unchanged."""
    library = torch.library

    def wrap(original: Any) -> Any:
        def tolerant(op: Any, func: Any = None, /, *args: Any, **kwargs: Any) -> Any:
            name = op if isinstance(op, str) else str(getattr(op, "_name", ""))
            if name.split("::")[0] not in namespaces:
                return original(op, func, *args, **kwargs)

            def register(fn: Any) -> Any:
                try:
                    return original(op, fn, *args, **kwargs)
                except RuntimeError as exc:
                    if "does not exist" in str(exc):
                        return fn
                    raise

            return register if func is None else register(func)

        return tolerant

    for name in ("register_fake", "impl_abstract"):
        if hasattr(library, name):
            setattr(library, name, wrap(getattr(library, name)))


def load_cuda_runtime() -> str | None:
    """A CUDA torch has libcudart loaded; FlashInfer's comm module looks for it among the
    process's libraries at import (`find_loaded_library("libcudart")`). Under simulation on a
    CPU torch, load the one an `nvidia-cuda-runtime` wheel ships, if any: loading needs no GPU
    or driver, and nothing here calls into it. Returns the path loaded, or None."""
    import ctypes
    import glob

    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            if "libcudart" in fh.read():
                return None
    except OSError:
        return None
    for entry in sys.path:
        for path in sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_runtime", "lib",
                                                  "libcudart.so*"))):
            with contextlib.suppress(OSError):
                ctypes.CDLL(path)
                return path
    return None


def simulate_vllm() -> Any:
    """vLLM decides through `vllm.platforms.current_platform`, chosen once by NVML: under
    simulation its CUDA platform that asks torch (NonNvmlCudaPlatform, vllm/platforms/cuda.py),
    so the simulated capability is the one its checks read. Returns the platform."""
    import vllm.platforms as platforms
    from vllm.platforms import cuda

    platforms.current_platform = cuda.NonNvmlCudaPlatform()
    return platforms.current_platform


def simulate_sglang(arch: str) -> None:
    """What SGLang asks outside torch: GPU memory through nvidia-smi."""
    common = sys.modules.get("sglang.srt.utils.common")
    if common is not None and hasattr(common, "get_nvgpu_memory_capacity"):
        setattr(common, "get_nvgpu_memory_capacity", lambda: float(MEMORY_MIB[arch]))  # noqa: B010


# ----------------------------------------------------------------------------- checks


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def predicates() -> dict[str, Any]:
    from sglang.srt import utils

    out: dict[str, Any] = {}
    for name in ("is_sm90_supported", "is_sm100_supported", "is_sm120_supported"):
        fn = getattr(utils, name, None)
        out[name] = bool(fn()) if fn is not None else None
    try:
        from sglang.srt.runtime_context import get_platform  # 0.5.19 on
    except ImportError:
        return out
    platform = get_platform()
    for name in ("is_sm90", "is_sm100", "is_sm120"):
        out[f"get_platform().{name}"] = bool(getattr(platform, name))
    return out


def server_args(argv: list[str]) -> dict[str, Any]:
    """The release's own parse and resolution of one launch line, as a plain dict of every
    field (the whole object, so a caller can see any field a patch changed)."""
    import dataclasses
    import logging

    from sglang.srt.server_args import prepare_server_args

    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    # On the "sglang" logger, not the root: releases reset the root's handlers (basicConfig).
    logger = logging.getLogger("sglang")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        args = prepare_server_args(list(argv))
        if hasattr(args, "resolve_once"):  # 0.5.23: resolution is a step of its own
            args.resolve_once()
        if hasattr(args, "resolved_dict"):
            fields = _jsonable(args.resolved_dict())
        else:
            fields = {f.name: _jsonable(getattr(args, f.name)) for f in dataclasses.fields(args)}
    except BaseException as exc:  # SystemExit from argparse included
        return {"error": _error(exc), "where": _where(), "log": logs.getvalue().splitlines()}
    finally:
        logger.removeHandler(handler)
    return {"server_args": fields, "log": logs.getvalue().splitlines()}


def _where() -> list[str]:
    """The last frames of the exception being handled, one line each."""
    return [ln.strip() for ln in traceback.format_exc().splitlines() if ln.startswith("  File")][
        -8:
    ]


# ----------------------------------------------------------------------------- the readers


def load_reader(reader: dict[str, Any]) -> Any:
    """A patch's reader from its source text (patchkit/readers.py says what it may use):
    compiled as its module compiles it (postponed annotations), at its own file and line so
    that a traceback's frames point into the patch module, in a namespace of builtins only."""
    import __future__

    import builtins

    text = "\n" * (int(reader.get("line", 1)) - 1) + reader["source"]
    code = compile(text, reader.get("file", "<reader>"), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    scope: dict[str, Any] = {"__builtins__": builtins, "__name__": f"reader:{reader['patch']}"}
    exec(code, scope)  # the text of a patch module of the catalog sm120patch loaded
    return scope[reader["function"]]


def run_readers(readers: list[dict[str, Any]], target: str, arch: str | None,
                multicast: bool | None) -> dict[str, dict[str, Any]]:
    """Each reader of `target`'s patches, in the order sent, under its name; a reader that
    raises (or does not load) answers its error and where."""
    out = {}
    for reader in readers:
        if reader["target"] != target:
            continue
        site = SimpleNamespace(modules=tuple(reader["modules"]),
                               functions=tuple(reader["functions"]), simulate=arch,
                               multicast=multicast, error=_error)
        out[reader["name"]] = _guarded(lambda r=reader, s=site: load_reader(r)(s))
    return out


# ----------------------------------------------------------------------------- main


def _devices(launches: dict[str, list[str]]) -> int:
    """Enough simulated GPUs for the largest --tp asked for."""
    most = 1
    for argv in launches.values():
        for flag in ("--tp", "--tp-size", "--tensor-parallel-size"):
            if flag in argv:
                i = argv.index(flag)
                with contextlib.suppress(IndexError, ValueError):
                    most = max(most, int(argv[i + 1]))
    return most


def run(request: dict[str, Any]) -> dict[str, Any]:
    for entry in reversed(request.get("sys_path", [])):
        sys.path.insert(0, entry)
    overlay = request.get("overlay", {})
    if overlay:
        sys.meta_path.insert(0, OverlayFinder(overlay))
    arch = request.get("simulate")
    launches: dict[str, list[str]] = request.get("launches", {})
    readers: list[dict[str, Any]] = request.get("readers", [])
    # Simulated GPUs: SM120 boxes are PCIe (no multicast), SM100/SM90 ones NVLink.
    multicast = request.get("multicast", arch != "sm120") if arch else None
    try:
        import torch
    except Exception as exc:
        raise Fatal(f"cannot import torch in {sys.executable}: {_error(exc)}") from None
    if arch:
        simulate(torch, arch, request.get("cuda_version", "12.9"), _devices(launches))
        tolerate_missing_ops(torch, {"torchvision", *GPU_EXTENSIONS})
        load_cuda_runtime()
        missing = _unimportable(GPU_EXTENSIONS)
        if missing:
            sys.meta_path.append(PlaceholderFinder(missing))
        if request.get("vllm", False):
            # First on the path: a compiled module present but unloadable would else be
            # found again by the path finder.
            sys.meta_path.insert(0, PlaceholderFinder(_unimportable(VLLM_EXTENSIONS)))
    result: dict[str, Any] = {
        "python": sys.executable,
        "torch": torch.__version__,
        "simulate": arch,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability(0))
        if torch.cuda.is_available()
        else None,
    }
    if request.get("sglang", True):
        try:
            sglang = importlib.import_module("sglang")
            importlib.import_module("sglang.srt.server_args")
        except Exception as exc:
            raise Fatal(f"cannot import sglang.srt.server_args: {_error(exc)}") from None
        if arch:
            simulate_sglang(arch)
        result["sglang"] = {"version": getattr(sglang, "__version__", None),
                            "file": sglang.__file__}
        result["predicates"] = predicates()
        result["launches"] = {name: server_args(argv) for name, argv in launches.items()}
        result.update(run_readers(readers, "sglang", arch, multicast))
    if request.get("flashinfer", False):
        try:
            flashinfer = importlib.import_module("flashinfer")
        except Exception as exc:
            raise Fatal(f"cannot import flashinfer: {_error(exc)}") from None
        result["flashinfer"] = {"version": getattr(flashinfer, "__version__", None),
                                "file": flashinfer.__file__}
        result.update(run_readers(readers, "flashinfer", arch, multicast))
    if request.get("vllm", False):
        result.update(_vllm(readers, arch, multicast))
    return result


def _vllm(readers: list[dict[str, Any]], arch: str | None, multicast: bool | None
          ) -> dict[str, Any]:
    """vLLM: its version, the platform it decides by (simulated: see simulate_vllm) and the
    capability that platform reports, and the readers of its patches."""
    try:
        vllm = importlib.import_module("vllm")
        platform = simulate_vllm() if arch else importlib.import_module(
            "vllm.platforms").current_platform
    except Exception as exc:
        raise Fatal(f"cannot import vllm.platforms: {_error(exc)}") from None
    found: dict[str, Any] = {"version": getattr(vllm, "__version__", None),
                             "file": vllm.__file__, "platform": type(platform).__name__}
    with contextlib.suppress(Exception):  # a CPU platform has no capability
        found["capability"] = list(platform.get_device_capability())
    return {"vllm": found, **run_readers(readers, "vllm", arch, multicast)}


def _guarded(check: Any) -> dict[str, Any]:
    try:
        return dict(check())
    except Exception as exc:
        return {"error": _error(exc), "where": _where()}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: probe.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as fh:
        request = json.load(fh)
    if request.get("env"):
        os.environ.update(request["env"])
    try:
        result = run(request)
        code = EXIT_OK
    except Fatal as exc:
        if os.environ.get("SM120PATCH_DEBUG"):
            traceback.print_exception(exc.__context__ or exc)
        result, code = {"fatal": str(exc)}, EXIT_CANNOT_IMPORT
    with open(argv[2], "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, sort_keys=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""The attention profile's patches on fixtures in the shapes of SGLang 0.5.19 to 0.5.23, and the
patched default executed: trtllm_mha on SM120 only where upstream's attention hook and the
backend accept it, everything else as upstream decides."""

from __future__ import annotations

import sys
import types

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status
from sm120patch.patchkit.runner import transform_text
from sm120patch.plan import catalog

DEFAULT = load_patch("sglang.attention-default")
GPT_OSS = load_patch("sglang.attention-gpt-oss")

BASE = '''\
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from sglang.srt.platforms import current_platform
from sglang.srt.runtime_context import get_platform
from sglang.srt.utils.common import is_mps, is_no_spec_infer_or_topk_one

logger = logging.getLogger(__name__)


def resolving_view(server_args: Any):
    return server_args


def resolved_view(server_args: Any):
    return server_args


def get_default_attn_backend(server_args: Any, use_mla_backend: bool, model_config):
    """
    Auto select the fastest attention backend.
    """
    cfg = resolving_view(server_args)
    # OOT platforms provide their own default attention backend.
    if current_platform.is_out_of_tree():
        return current_platform.get_default_attention_backend()

    if not use_mla_backend:
        # MHA architecture

        if get_platform().is_hopper_with_cuda_12_3 and is_no_spec_infer_or_topk_one(
            resolved_view(server_args)
        ):
            return "fa3"
        elif (
            get_platform().is_sm100
            and is_no_spec_infer_or_topk_one(resolved_view(server_args))
            and (
                cfg.speculative_algorithm is None
                or cfg.speculative_eagle_topk is not None
            )
        ):
            # trtllm_mha requires equal K/V row widths; fa4 carries
            # v_head_dim through.
            if model_config.has_asymmetric_kv:
                return "fa4"
            return "trtllm_mha"
        elif get_platform().is_hip:
            return "aiter"
        elif is_mps():
            return "torch_native"
        else:
            # FlashInfer does not support attention sinks.
            if get_platform().has_flashinfer and not model_config.has_attention_sinks:
                return "flashinfer"
            return "triton"
    else:
        # MLA architecture
        if get_platform().is_hopper_with_cuda_12_3:
            return "fa3"
        else:
            return "triton"


def _dspark_verify_on_decode_backend(backend: Optional[str], q_len: int) -> bool:
    return False
'''

GPT_OSS_TEXT = '''\
"""Config-time override declarations for gpt_oss."""

import logging
from typing import Any, Dict

from sglang.srt.arg_groups.model_override_base import (
    _register_for,
    is_attention_backend_not_set,
    resolving_view,
)
from sglang.srt.runtime_context import get_platform

logger = logging.getLogger(__name__)


@_register_for("GptOssForCausalLM")
def _gpt_oss_overrides(server_args: Any, hf_config: Any) -> dict:
    cfg = resolving_view(server_args)
    overrides: Dict[str, Any] = {}
    # Set attention backend for GPT-OSS
    if is_attention_backend_not_set(cfg):
        if get_platform().is_sm100:
            overrides["attention_backend"] = "trtllm_mha"
        elif get_platform().is_sm90:
            overrides["attention_backend"] = "fa3"
        else:
            overrides["attention_backend"] = "triton"
    return overrides
'''


def run(patch, text: str, file: str):
    res = transform_text([patch], file, text)
    [outcome] = res.outcomes
    return res, outcome


def test_default_shape_and_second_run() -> None:
    res, outcome = run(DEFAULT, BASE, "sglang/srt/arg_groups/model_override_base.py")
    assert outcome.status is Status.APPLIED, outcome.reason
    assert (
        '            return "trtllm_mha"\n'
        "        elif get_platform().is_sm120 and _sm120_trtllm_mha_fits(cfg, model_config):\n"
        "            # sm120patch attention: SM120 runs trtllm_mha as FMHAv2 prefill and XQA "
        "decode.\n"
        '            return "trtllm_mha"\n'
        "        elif get_platform().is_hip:\n"
    ) in res.after
    # the helper right after the function, before the next one
    assert res.after.index("def _sm120_trtllm_mha_fits(") < res.after.index(
        "def _dspark_verify_on_decode_backend("
    )
    again, second = run(DEFAULT, res.after, "b.py")
    assert second.status is Status.ALREADY_APPLIED and again.after == res.after


@pytest.mark.parametrize(
    ("edit", "status", "found"),
    [
        (
            lambda s: s.replace("get_platform().is_sm100\n", "get_platform().is_blackwell\n"),
            Status.REFUSED,
            "no SM100 branch",
        ),
        (
            lambda s: s.replace("    cfg = resolving_view(server_args)\n", ""),
            Status.REFUSED,
            "no `cfg = ...`",
        ),
        (
            lambda s: s.replace(
                "from typing import Any, Callable", "from typing import Callable"
            ).replace("(server_args: Any", "(server_args"),
            Status.REFUSED,
            "typing import Any",
        ),
        (
            lambda s: s.replace(
                "        elif get_platform().is_hip:",
                "        elif get_platform().is_sm120:\n"
                '            return "trtllm_mha"\n'
                "        elif get_platform().is_hip:",
            ),
            Status.UPSTREAM,
            "picks trtllm_mha on SM120",
        ),
        (
            lambda s: s.replace("def get_default_attn_backend", "def other_default"),
            Status.NOT_APPLICABLE,
            "no `def get_default_attn_backend`",
        ),
    ],
    ids=["no-sm100", "no-cfg", "no-any", "upstream", "absent"],
)
def test_default_refusals(edit, status: Status, found: str) -> None:
    res, outcome = run(DEFAULT, edit(BASE), "b.py")
    assert outcome.status is status and found in outcome.reason, outcome.describe()
    assert res.after == res.before


def test_gpt_oss_shape_and_second_run() -> None:
    res, outcome = run(GPT_OSS, GPT_OSS_TEXT, "sglang/srt/arg_groups/model_overrides/gpt_oss.py")
    assert outcome.status is Status.APPLIED, outcome.reason
    assert res.after == GPT_OSS_TEXT.replace(
        "    _register_for,\n    is_attention_backend_not_set,\n    resolving_view,\n",
        "    _register_for,\n    get_default_attn_backend,\n    is_attention_backend_not_set,\n"
        "    model_config_of,\n    resolving_view,\n    use_mla_backend,\n",
    ).replace(
        '            overrides["attention_backend"] = "trtllm_mha"\n',
        '            overrides["attention_backend"] = "trtllm_mha"\n'
        "        elif get_platform().is_sm120:\n"
        '            overrides["attention_backend"] = get_default_attn_backend(\n'
        "                server_args,\n"
        "                use_mla_backend=use_mla_backend(server_args),\n"
        "                model_config=model_config_of(server_args),\n"
        "            )\n",
    )
    again, second = run(GPT_OSS, res.after, "g.py")
    assert second.status is Status.ALREADY_APPLIED and again.after == res.after


def test_gpt_oss_refuses_another_sm120_branch() -> None:
    text = GPT_OSS_TEXT.replace(
        "        elif get_platform().is_sm90:",
        '        elif get_platform().is_sm120:\n            overrides["attention_backend"] = "x"\n'
        "        elif get_platform().is_sm90:",
    )
    assert run(GPT_OSS, text, "g.py")[1].status is Status.REFUSED


# ---- the patched default, executed ---------------------------------------------------------


class View(types.SimpleNamespace):
    """A resolving view: the fields the default and the helper read."""


def view(**kw) -> View:
    base = dict(
        kv_cache_dtype="auto",
        speculative_algorithm=None,
        speculative_eagle_topk=None,
        attn_cp_size=1,
    )
    return View(**{**base, **kw})


def model(**kw) -> types.SimpleNamespace:
    base = dict(quantization=None, has_asymmetric_kv=False, has_attention_sinks=False, mamba=False)
    return types.SimpleNamespace(**{**base, **kw})


def load(text: str, arch: str, monkeypatch, skip_softmax=None) -> dict:
    """The module `text` after its imports, on a GPU of `arch`, with SGLang's helpers stubbed."""
    platform = types.SimpleNamespace(
        is_hopper_with_cuda_12_3=arch == "sm90",
        is_sm100=arch == "sm100",
        is_sm120=arch == "sm120",
        is_hip=False,
        has_flashinfer=True,
    )
    envs = types.SimpleNamespace(
        SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR=types.SimpleNamespace(
            get=lambda: skip_softmax
        )
    )
    for name, attrs in {
        "sglang": {},
        "sglang.srt": {},
        "sglang.srt.configs": {},
        "sglang.srt.configs.hybrid_arch": {"mambaish_config": lambda mc: {} if mc.mamba else None},
        "sglang.srt.environ": {"envs": envs},
    }.items():
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    scope: dict = {
        "Any": object,
        "Optional": object,
        "current_platform": types.SimpleNamespace(is_out_of_tree=lambda: False),
        "get_platform": lambda: platform,
        "is_mps": lambda: False,
        "is_no_spec_infer_or_topk_one": lambda v: (
            v.speculative_algorithm is None or (v.speculative_eagle_topk in (None, 1))
        ),
    }
    exec(compile(text.split("logger = logging.getLogger(__name__)\n", 1)[1], "b.py", "exec"), scope)
    return scope


PATCHED = transform_text([DEFAULT], "b.py", BASE).after


@pytest.mark.parametrize(
    ("cfg", "mc", "skip", "want"),
    [
        (view(), model(), None, "trtllm_mha"),
        (view(kv_cache_dtype="bfloat16"), model(), None, "trtllm_mha"),
        (view(kv_cache_dtype="bf16"), model(quantization="modelopt_fp4"), None, "trtllm_mha"),
        (view(), model(quantization="mxfp4", has_attention_sinks=True), None, "trtllm_mha"),
        (view(), model(has_attention_sinks=True), None, "trtllm_mha"),
        (view(kv_cache_dtype="fp8_e4m3"), model(), None, "flashinfer"),  # the hook refuses it
        (view(kv_cache_dtype="fp8_e5m2"), model(), None, "flashinfer"),
        (view(kv_cache_dtype="nvfp4"), model(), None, "flashinfer"),  # XQA: no native NVFP4
        (view(), model(quantization="modelopt_fp4"), None, "flashinfer"),  # may carry FP8 KV
        (view(), model(quantization="fp8"), None, "flashinfer"),
        (view(), model(), 0.5, "flashinfer"),  # skip-softmax: the hook refuses it
        (view(attn_cp_size=2), model(), None, "flashinfer"),  # prefill CP: the hook refuses it
        (
            view(speculative_algorithm="EAGLE", speculative_eagle_topk=1),
            model(),
            None,
            "flashinfer",
        ),  # XQA rejects ragged verify
        (view(), model(has_asymmetric_kv=True), None, "flashinfer"),
        (view(), model(mamba=True), None, "flashinfer"),
        (view(), model(has_attention_sinks=True, quantization="fp8"), None, "triton"),
    ],
    ids=[
        "bf16-auto",
        "bfloat16",
        "nvfp4-with-bf16-kv",
        "gpt-oss-mxfp4",
        "sinks",
        "fp8-kv",
        "fp8-e5m2-kv",
        "nvfp4-kv",
        "nvfp4-auto-kv",
        "fp8-auto-kv",
        "skip-softmax",
        "prefill-cp",
        "speculative",
        "asymmetric-kv",
        "hybrid-linear",
        "sinks-fp8",
    ],
)
def test_patched_default_on_sm120(monkeypatch, cfg, mc, skip, want) -> None:
    patched = load(PATCHED, "sm120", monkeypatch, skip)["get_default_attn_backend"]
    assert patched(cfg, False, mc) == want
    pristine = load(BASE, "sm120", monkeypatch, skip)["get_default_attn_backend"]
    if want != "trtllm_mha":
        assert pristine(cfg, False, mc) == want  # upstream's own answer, unchanged


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
@pytest.mark.parametrize("mc", [model(), model(has_asymmetric_kv=True), model(mamba=True)])
def test_patched_default_off_sm120_is_upstreams(monkeypatch, arch, mc) -> None:
    for cfg in (view(), view(kv_cache_dtype="fp8_e4m3")):
        patched = load(PATCHED, arch, monkeypatch)["get_default_attn_backend"]
        pristine = load(BASE, arch, monkeypatch)["get_default_attn_backend"]
        assert patched(cfg, False, mc) == pristine(cfg, False, mc)
        assert patched(cfg, True, mc) == pristine(cfg, True, mc)  # MLA: untouched


# ---- the profile ---------------------------------------------------------------------------


def test_profile_is_trial_only_and_pinned_where_sm120_prefill_is_accepted() -> None:
    cat = catalog.load()
    prof = cat.profile("attention")
    assert prof.status == "experimental"
    assert prof.patches == ("sglang.attention-default", "sglang.attention-gpt-oss")
    assert prof.pinned("sglang", "0.5.19") and prof.pinned("sglang", "0.5.23")
    assert not prof.pinned("sglang", "0.5.18")  # its hook refuses trtllm_mha prefill on SM120
    assert prof.pinned("flashinfer", "0.6.16") and not prof.pinned("flashinfer", "0.6.15")
    others = [
        n
        for n, p in cat.profiles.items()
        if n != "attention" and set(p.patches) & set(prof.patches)
    ]
    assert others == [] and "Trial only" in prof.known

"""What the colocated vLLM engine checks before step 1 (``VLLMEngine.check_team``): settings that vLLM
itself refuses only when an instance starts, at the first rollout, after the models are loaded and
on every rank; here they fail before step 1, naming the fix.

Both concern sleep mode (``enable_sleep_mode``, on by default on GPU): its allocator (vLLM's
``CuMemAllocator``) is one per process and holds one instance's weights and KV cache ("Sleep mode can
only be used for one instance per process"), and before vLLM 0.20.1 it refused PyTorch's expandable
segments (vllm-project/vllm#40812 switches them off around its pool instead; pytorch/pytorch#147851).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Mapping

from lit_marl import ConfigError

ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's old name and its new one
EXPANDABLE_SEGMENTS_SWITCHED_OFF = (0, 20, 1)  # the first vLLM that no longer refuses them
SLEEP_MODE_OFF = "data.engine_options: {enable_sleep_mode: false}"


def vllm_version() -> str | None:
    """The installed vLLM's version (read from its metadata, vLLM not imported); None without one."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def refuses_expandable_segments(version: str | None) -> bool:
    """Whether this vLLM's sleep-mode allocator refuses expandable segments (an unknown version: no
    refusal here; vLLM says so itself at start)."""
    release = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return release is not None and tuple(int(n or 0) for n in release.groups()) < EXPANDABLE_SEGMENTS_SWITCHED_OFF


def expandable_segments(conf: str) -> bool:
    """Whether an allocator setting (``PYTORCH_CUDA_ALLOC_CONF``'s syntax) turns expandable segments
    on, as torch reads it: whitespace ignored, ``True`` spelled so (torch accepts only True/False),
    the last mention wins."""
    on = False
    for item in "".join(conf.split()).split(","):
        key, _, value = item.partition(":")
        if key == "expandable_segments":
            on = value == "True"
    return on


def check_sleep_mode(
    options: Mapping, models: list[str], environ: Mapping[str, str] = os.environ, version: str | None = None
) -> None:
    """Raise ``ConfigError`` where a GPU run's vLLM settings (``options``, as the instances get them)
    cannot start its sleep-mode instances: ``models`` names one entry per instance (per distinct
    served model); ``version``: the installed vLLM's (default: read from its metadata)."""
    if not options.get("enable_sleep_mode"):
        return
    version = vllm_version() if version is None else version
    for name in ALLOC_CONF_VARIABLES:
        value = environ.get(name, "")
        if expandable_segments(value) and refuses_expandable_segments(version):
            raise ConfigError(
                f"{name}={value!r} with data.engine=vllm: vLLM {version}'s sleep-mode allocator "
                f"(enable_sleep_mode, on by default on GPU) refuses expandable segments; unset {name} or set "
                f"expandable_segments:False for the run, use vLLM 0.20.1 or later, or set {SLEEP_MODE_OFF}"
            )
    if len(models) > 1:
        raise ConfigError(
            f"data.engine=vllm with enable_sleep_mode (on by default on GPU): the team's agents hold "
            f"{len(models)} separate models (sources {models}), one vLLM instance each, and vLLM's sleep mode "
            "holds one instance per process; set model.lora_shared_base: true with model.lora (one instance, "
            f"each agent its adapter), model.share_parameters: true, {SLEEP_MODE_OFF} (every instance then "
            "keeps its gpu_memory_utilization share through the update, as the memory plan counts it), or "
            "data.engine: torch"
        )

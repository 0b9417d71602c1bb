"""A vLLM server started by the run (``engine: vllm_server`` without ``servers``): one per distinct model
of the team, on this machine, stopped with the run.

It serves the model's architecture alone (a temporary folder holding its ``config.json``, vLLM's
``--load-format dummy``): the trainer's weights are sent before the first generation, as after every
update. Token ids in and out (``--skip-tokenizer-init --tokens-only``), no sampling defaults but ours
(``--generation-config vllm``), the weight transfer routes on (``VLLM_SERVER_DEV_MODE=1``, the transfer
backend in ``--weight-transfer-config``). It is started as ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm serve`` command of vLLM's CPU build 0.32 does not
start: it asks for the version of a package named ``vllm``) by this interpreter unless ``python`` names
another (a vLLM environment beside a lean trainer's), in a session of its own, so that stopping it
stops its workers; its output goes to a log file whose end every error quotes.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lit_marl.generation.server_http import ServerClient, ServerError

LOG_TAIL_LINES = 40


class ServerProcess:
    """One started server: its process, address and log."""

    def __init__(self, command: list[str], env: dict, url: str, folder: tempfile.TemporaryDirectory, log: Path):
        self.command, self.url, self.folder, self.log = command, url, folder, log
        self.handle = open(log, "wb")
        self.process = subprocess.Popen(
            command, env=env, stdout=self.handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        atexit.register(self.stop)

    def describe(self) -> str:
        """Its state and the end of its log, for an error about it."""
        try:
            code = self.process.wait(timeout=2)  # one killed a moment ago is reaped before it is described
        except subprocess.TimeoutExpired:
            code = None
        state = f"the server the run started (pid {self.process.pid}) " + (
            "is running" if code is None else f"exited with code {code}"
        )
        return f"{state}; the end of its log {self.log}:\n{tail(self.log)}"

    def wait_healthy(self, client: ServerClient, timeout_s: float) -> None:
        """Until ``/health`` answers; a server that exits or takes longer than ``timeout_s`` raises."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"vLLM server {self.url} did not start: {self.describe()}")
            if client.healthy(timeout_s=2.0):
                return
            time.sleep(1.0)
        self.stop()
        raise ServerError(
            f"vLLM server {self.url} was not healthy within {timeout_s:g} s (data.engine_options.start_timeout_s); "
            f"{self.describe()}"
        )

    def stop(self) -> None:
        """Stop it and its workers: the whole session, also when the server itself is dead already (its
        workers outlive it, holding their memory), a SIGTERM, then a SIGKILL after 30 s."""
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:  # nothing of the session is left
                break
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if not _session_alive(self.process.pid):
                break
        self.handle.close()
        self.folder.cleanup()


def _session_alive(session: int) -> bool:
    """Whether a process of the session ``session`` (its leader's pid) still runs."""
    try:
        os.killpg(session, 0)
    except ProcessLookupError:
        return False
    return True


def tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The end of a server's log, led by its first error line where that is further up (vLLM's root
    cause comes before the tracebacks of the processes it stopped)."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    first = next((line for line in text if "Error: " in line), None)
    end = text[-lines:]
    return "\n".join(([first, "..."] if first is not None and first not in end else []) + end)


def server_command(
    python: str,
    folder: str,
    port: int,
    dtype: str,
    backend: str,
    settings,
    cpu: bool = False,
    max_len: int = 0,
    lora: dict | None = None,
):
    """The command line of one server (``settings``: ``ServerSettings``; its ``server_args`` last, as
    flags: ``{max_model_len: 4096}`` -> ``--max-model-len 4096``, true -> the bare flag). On CPU, unless
    told otherwise, it runs eagerly (vLLM's graph compilation there takes minutes at every start) and
    without chunked prefill (its batch budget raised to the model's length ``max_len``): vLLM 0.32 on CPU
    rewinds a seeded request's generator after a partial prefill, which a CPU generator cannot do, and its
    engine dies ("CPU Generator does not use offset") as soon as a batch's prompts outgrow the budget.
    ``lora``: the LoRA slots of a team of adapters on the model (``vllm.lora_slots``), loaded at run time."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
    command += ["--served-model-name", "lit_marl", "--host", settings.host, "--port", str(port)]
    command += ["--dtype", dtype, "--load-format", "dummy", "--skip-tokenizer-init", "--tokens-only"]
    command += ["--generation-config", "vllm", "--enable-prefix-caching", "--seed", "0"]
    command += ["--weight-transfer-config", json.dumps({"backend": backend})]
    command += ["--tensor-parallel-size", str(settings.tensor_parallel_size)]
    command += ["--data-parallel-size", str(settings.data_parallel_size)]
    args = {**(lora or {}), **settings.server_args}
    if cpu:
        defaults: dict = {"enforce_eager": True}
        if not args.get("enable_chunked_prefill"):  # off (ours, or the user's): a budget that holds a whole prompt
            args["enable_chunked_prefill"] = False
            defaults["max_num_batched_tokens"] = max(tokens(args.get("max_model_len")) or max_len, 2048)
        args = {**defaults, **args}
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            command.append(flag)
        elif value is False and key in SWITCHED_ON:  # on by default or by this command: switched off
            command.append("--no-" + key.replace("_", "-"))
        elif value is not False and value is not None:
            command += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return command


SWITCHED_ON = ("enable_chunked_prefill", "enable_prefix_caching")  # false: --no-<flag> (else a false flag is left out)


def tokens(value) -> int:
    """A token count as vLLM reads it: 8192, "8192", "8k" (1000s), "8K" (1024s), "1m", "1M"; 0 if none."""
    if value is None or isinstance(value, bool):
        return 0
    text = str(value).strip()
    scale = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        return int(float(number) * scale)
    except ValueError:
        return 0


def server_env(settings, device_type: str, lora: bool = False) -> dict:
    """The server's environment: this one's, the transfer routes on (with ``lora`` the route that loads
    adapters at run time too), and on CPU its OpenMP threads left unpinned (the trainer shares the cores)
    with a KV cache budget unless the user set one."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if settings.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = settings.gpus
    if device_type == "cpu":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def start_server(
    model_config, settings, dtype: str, backend: str, device_type: str, port: int, lora: dict | None = None
) -> ServerProcess:
    """Start a server for a model of this ``model_config`` (transformers'), serving ``dtype`` (with ``lora``
    slots: adapters loaded at run time)."""
    folder = tempfile.TemporaryDirectory(prefix="lit_marl_server_")
    model_config.save_pretrained(folder.name)  # the architecture only: weights come by transfer
    python = settings.python or sys.executable
    max_len = getattr(model_config, "max_position_embeddings", 0) or 0
    command = server_command(python, folder.name, port, dtype, backend, settings, device_type == "cpu", max_len, lora)
    log = Path(settings.log_dir or Path(tempfile.gettempdir()) / "lit_marl_server_logs") / f"vllm_server_{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = server_env(settings, device_type, lora=bool(lora))
    return ServerProcess(command, env, f"http://{settings.host}:{port}", folder, log)

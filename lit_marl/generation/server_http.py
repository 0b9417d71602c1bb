"""The HTTP side of a vLLM rollout server (``engine: vllm_server``): JSON requests to its routes, each
with a timeout, every failure a ``ServerError`` that names the server, the route and the cause.

The routes (vLLM 0.32): ``GET /health``, ``GET /get_world_size?include_dp=true``, generation by token
ids at ``POST /inference/v1/generate`` (vLLM's token-in/token-out route: the server runs with
``--tokens-only`` or ``--enable-scale-out``), the weight transfer protocol's four phases
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, and ``/reset_prefix_cache`` (all of these only with
``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

TEXT_ROUTES = ("/v1/load_lora_adapter",)  # vLLM answers them in plain text, without a content type


class ServerError(RuntimeError):
    """A vLLM server did not answer as the rollout needs: dead, unreachable, too slow, or refusing."""


class ServerClient:
    """JSON over HTTP to one server. ``describe`` adds what the run knows of it (a server the run started:
    its process's state and the end of its log) to every error."""

    def __init__(self, url: str, timeout_s: float, describe: Callable[[], str] | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.describe = describe or (lambda: "")

    def error(self, route: str, cause: str) -> ServerError:
        extra = self.describe()
        return ServerError(f"vLLM server {self.url}{route}: {cause}" + (f"\n{extra}" if extra else ""))

    def request(self, route: str, body: dict | None = None, method: str = "POST", timeout_s: float | None = None):
        """The decoded JSON reply of ``route`` (None for an empty one; the text of a route that answers plain
        text, ``TEXT_ROUTES``)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + route, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                raw, kind = reply.read(), reply.headers.get("Content-Type") or ""
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            hint = ""
            if error.code == 404 and route.startswith(("/init_weight", "/start_weight", "/update_weights", "/finish")):
                hint = " (the weight transfer routes need VLLM_SERVER_DEV_MODE=1 where the server runs)"
            elif error.code == 404 and route == "/reset_prefix_cache":
                hint = " (this route needs VLLM_SERVER_DEV_MODE=1 where the server runs)"
            elif error.code == 403 and route == "/inference/v1/generate":
                hint = " (start the server with --tokens-only or --enable-scale-out)"
            elif error.code in (400, 404) and route == "/v1/load_lora_adapter":
                hint = " (start the server with --enable-lora, --max-loras and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
            raise self.error(route, f"HTTP {error.code}{hint}: {detail}") from error
        except (TimeoutError, socket.timeout) as error:
            raise self.error(route, f"no reply within {timeout:g} s (data.engine_options.timeout_s)") from error
        except (urllib.error.URLError, ConnectionError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise self.error(route, f"unreachable ({reason})") from error
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as error:
            if route in TEXT_ROUTES and "json" not in kind:  # plain text, without a content type
                return raw.decode(errors="replace")
            raise self.error(route, f"a reply that is not JSON: {raw[:200]!r}") from error

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            self.request("/health", method="GET", timeout_s=timeout_s)
        except ServerError:
            return False
        return True

    def world_size(self) -> int:
        """The server's workers (tensor x pipeline x data parallel): the ranks that receive weights."""
        reply = self.request("/get_world_size?include_dp=true", method="GET")
        return int(reply["world_size"])

    def post(self, route: str, body: dict | None = None, timeout_s: float | None = None):
        return self.request(route, body, timeout_s=timeout_s)

"""A stand-in for a vLLM server in this process: vLLM's HTTP routes (generation by token ids, the weight
transfer protocol's four phases, the prefix cache, the world size, runtime LoRA loading), its "worker" the
handler thread, which joins the trainer's gloo group, receives every tensor and decodes with what it
received (a tiny model that starts from zeros, as a server with dummy weights does); a LoRA adapter loaded
by path is merged into a copy of the received base, and a request naming it decodes with that copy."""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from torch.distributed import TCPStore

from lit_marl.agents import Agent
from lit_marl.generation import Sampling, make_engine
from lit_marl.generation.transfer import gloo_group


class StandIn(ThreadingHTTPServer):
    """vLLM's routes over a tiny model that starts with zero weights (``--load-format dummy``) and serves
    what the transfer sends it; it records every request and the most in flight at once."""

    daemon_threads = True

    def __init__(self, delay_s: float = 0.0):
        super().__init__(("127.0.0.1", 0), Handler)
        self.agent = Agent("tiny-random")
        with torch.no_grad():
            for p in self.agent.model.parameters():
                p.zero_()
        self.delay_s, self.events, self.bodies = delay_s, [], []
        self.version, self.generated_with = None, []  # the weights' version, and each request's
        self.adapters: dict[str, Agent] = {}  # runtime LoRA adapters by name: the base with each merged
        self.group, self.in_flight, self.most_in_flight, self.lock = None, 0, 0, threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def route(self, path: str, body: dict):
        self.events.append(path.split("?")[0])
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            store = TCPStore(info["master_address"], info["master_port"], info["world_size"], False)
            self.group = gloo_group(store, info["rank_offset"], info["world_size"], 30)
            self.store = store
        elif path == "/update_weights":
            info = body["update_info"]
            state = self.agent.model.state_dict()
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                self.group.broadcast(tensor, 0).wait()
                state[name].copy_(tensor)
        elif path == "/finish_weight_update":
            self.events[-1] += f":{body['weight_version']}"
            self.version = body["weight_version"]
        elif path == "/reset_prefix_cache":
            return {"success": True}
        elif path == "/v1/load_lora_adapter":
            from peft import PeftModel

            merged = PeftModel.from_pretrained(copy.deepcopy(self.agent.model), body["lora_path"]).merge_and_unload()
            self.adapters[body["lora_name"]] = Agent("tiny-random", loaded=(merged, self.agent.tokenizer))
            self.events[-1] += f":{body['lora_name']}"
            return "Success"
        elif path == "/inference/v1/generate":
            return self.generate(body)
        return {}

    def generate(self, body: dict) -> dict:
        with self.lock:
            self.bodies.append(body)
            self.generated_with.append(self.version)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(self.delay_s)
        params = body["sampling_params"]
        greedy = params["temperature"] == 0
        sampling = Sampling(max_new_tokens=params["max_tokens"], greedy=greedy, temperature=params["temperature"] or 1)
        engine = make_engine("torch")
        seeds = None if greedy else [[params["seed"] % 2**31]]
        agent = self.adapters.get(body["model"], self.agent)
        gen = engine.generate_team([(agent, [body["token_ids"]], params["n"])], sampling, seeds=seeds)[0]
        choices = []
        for row in range(params["n"]):
            mask = gen.completion_mask[row].bool()
            ids, logprobs = gen.completion_ids[row][mask].tolist(), gen.logprobs[row][mask].tolist()
            stopped = bool(ids) and ids[-1] == params["stop_token_ids"][0]
            choices.append(
                {
                    "token_ids": ids,
                    "finish_reason": "stop" if stopped else "length",
                    "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs)]},
                }
            )
        with self.lock:
            self.in_flight -= 1
        return {"choices": choices}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, reply):
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer({"world_size": 1} if self.path.startswith("/get_world_size") else {})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        self.answer(self.server.route(self.path, body))

"""The vllm_server engine against a stand-in server in this process: vLLM's HTTP routes (generation by
token ids, the weight transfer protocol's four phases, the prefix cache), its "worker" a thread that
joins the trainer's gloo group, receives every tensor and decodes with what it received. So the
engine's side of the protocol, its bookkeeping and its errors are tested without vLLM; the real server
(vLLM's CPU build) is ``tests/vllm/test_server.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from stand_in import StandIn
from torch.distributed import TCPStore

from helpers import lora_team
from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.generation import Sampling, make_engine
from lit_marl.generation.server import ServerSettings
from lit_marl.generation.server_http import ServerClient, ServerError
from lit_marl.generation.server_process import ServerProcess, server_command
from lit_marl.generation.transfer import free_port, gloo_group
from lit_marl.generation.weights import effective_weights, served_metadata

GREEDY = Sampling(max_new_tokens=8, greedy=True)
PROMPTS = [[5, 17, 33, 101], [7, 8, 9], [300, 301, 302, 303, 304], [11, 12]]


@pytest.fixture
def stand_in():
    server = StandIn()
    yield server
    server.shutdown()


def lean(agent, prompts, sampling=GREEDY):
    return make_engine("torch").generate(agent, prompts, 1, sampling)


def same_rows(a, b) -> bool:
    return torch.equal(a.completion_ids * a.completion_mask, b.completion_ids * b.completion_mask)


def test_weights_go_by_the_four_phases_and_the_server_decodes_the_trainers_policy(stand_in):
    """The first rollout sends every weight (the stand-in starts from zeros: its greedy rows equal the
    trainer's only once they arrived), then empties the prefix cache; an unchanged model is not sent
    again; after an optimizer step the next rollout sends version 2 and the rows follow the new
    weights; the engine's log-probs are the served model's."""
    agent = Agent("tiny-random")
    engine = make_engine("vllm_server", {"servers": [stand_in.url]})
    engine.check_team([agent], "cpu")
    with engine.rollout([agent]):
        served = engine.generate(agent, PROMPTS, 1, GREEDY)
    assert same_rows(served, lean(agent, PROMPTS))
    phases = ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update:1"]
    assert stand_in.events[:5] == phases + ["/reset_prefix_cache"]
    with engine.rollout([agent]):
        engine.generate(agent, PROMPTS, 1, GREEDY)
    assert stand_in.events.count("/update_weights") == 1  # nothing changed: nothing sent
    before = lean(agent, PROMPTS)
    optimizer = torch.optim.AdamW(agent.model.parameters(), lr=0.05)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    agent.model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    after = lean(agent, PROMPTS)
    assert not same_rows(before, after), "the step changed no greedy row: the check is void"
    with engine.rollout([agent]):
        served = engine.generate(agent, PROMPTS, 1, GREEDY)
    assert same_rows(served, after) and "/finish_weight_update:2" in stand_in.events
    assert torch.allclose(served.logprobs, after.logprobs, atol=1e-5)


def test_every_prompt_is_a_request_in_flight_at_once_with_every_sampling_field(stand_in):
    """Each prompt its own request, all in flight together; every sampling field sent (vLLM's defaults
    never apply) with a seed per request drawn from the run's generator: a seeded run samples the same
    rows again; greedy samples are asked once and copied (vLLM refuses n > 1 when greedy)."""
    stand_in.delay_s = 0.3
    agent = Agent("tiny-random")
    engine = make_engine("vllm_server", {"servers": [stand_in.url]})
    sampling = Sampling(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=20)
    torch.manual_seed(3)
    first = engine.generate(agent, PROMPTS, 2, sampling)
    assert stand_in.most_in_flight == len(PROMPTS)
    params = stand_in.bodies[-1]["sampling_params"]
    assert {k: params[k] for k in ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "logprobs")} == {
        "n": 2,
        "max_tokens": 6,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.0,
        "logprobs": 0,
    }
    assert params["stop_token_ids"] == [agent.eos_token_id] and params["detokenize"] is False
    seeds = sorted(b["sampling_params"]["seed"] for b in stand_in.bodies)
    assert len(seeds) == len(PROMPTS) and min(b - a for a, b in zip(seeds, seeds[1:])) >= 2  # vLLM: sample k, seed + k
    torch.manual_seed(3)
    again = engine.generate(agent, PROMPTS, 2, sampling)
    assert torch.equal(first.completion_ids, again.completion_ids)
    sent = len(stand_in.bodies)  # seeds handed in (per-task streams, independent turns) are the requests' own
    engine.generate_team([(agent, PROMPTS, 2)], sampling, seeds=[[11, 12, 13, 14]])
    assert sorted(b["sampling_params"]["seed"] for b in stand_in.bodies[sent:]) == [11, 12, 13, 14]
    greedy = engine.generate(agent, PROMPTS[:1], 3, GREEDY)
    assert stand_in.bodies[-1]["sampling_params"]["n"] == 1 and greedy.completion_ids.shape[0] == 3
    assert torch.equal(greedy.completion_ids[0], greedy.completion_ids[2])


def test_a_server_that_is_gone_or_silent_is_named_within_the_timeout(stand_in):
    agent = Agent("tiny-random")
    stand_in.delay_s = 5.0
    engine = make_engine("vllm_server", {"servers": [stand_in.url], "timeout_s": 0.5})
    engine.servers[id(agent.model)] = engine.server(agent)  # reached, weights aside
    engine.servers[id(agent.model)].version = None
    started = time.monotonic()
    with pytest.raises(ServerError, match=rf"{stand_in.url}/inference/v1/generate: no reply within 0.5 s"):
        engine.generate(agent, PROMPTS[:1], 1, GREEDY)
    assert time.monotonic() - started < 3.0
    gone = ServerClient("http://127.0.0.1:9", 1.0)
    with pytest.raises(ServerError, match="127.0.0.1:9/health: unreachable"):
        gone.request("/health", method="GET")


def test_a_started_server_that_dies_mid_rollout_is_named_with_its_exit_and_log(tmp_path):
    """A server the run started, killed while a request waits: the error names it, its exit code and
    the end of its log, well within the request's timeout, and stopping it stops the workers it left
    (vLLM's outlive their server, holding memory); one that exits at start is named so too."""
    script = tmp_path / "server.py"
    script.write_text(
        textwrap.dedent(
            """
            import subprocess, sys, time
            from http.server import BaseHTTPRequestHandler, HTTPServer
            worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # vLLM's workers
            print(f"worker {worker.pid}", flush=True)
            class H(BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
                    self.wfile.write(b"{}")
                def do_POST(self):
                    print("generating, forever", flush=True); time.sleep(600)
            HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
            """
        )
    )
    port = free_port()
    process = ServerProcess(
        [sys.executable, str(script), str(port)],
        {},
        f"http://127.0.0.1:{port}",
        tempfile.TemporaryDirectory(),
        tmp_path / "server.log",
    )
    client = ServerClient(process.url, 60.0, process.describe)
    process.wait_healthy(client, 30)
    threading.Timer(1.0, lambda: process.process.kill()).start()
    started = time.monotonic()
    with pytest.raises(ServerError, match=r"(?s)exited with code -9.*generating, forever"):
        client.post("/inference/v1/generate", {"token_ids": [1]})
    assert time.monotonic() - started < 10
    worker = int(re.search(r"worker (\d+)", process.log.read_text()).group(1))
    process.stop()  # the server is dead; its worker, in its session, is stopped with it
    time.sleep(0.5)
    assert not Path(f"/proc/{worker}").exists() or "zombie" in Path(f"/proc/{worker}/status").read_text().lower()
    failing = ServerProcess(
        [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"],
        {},
        "http://127.0.0.1:9",
        tempfile.TemporaryDirectory(),
        tmp_path / "failing.log",
    )
    with pytest.raises(ServerError, match=r"(?s)did not start.*exited with code 3.*no such model"):
        failing.wait_healthy(ServerClient(failing.url, 1.0), 30)


def test_a_lora_team_on_one_base_is_one_server_its_base_sent_once_each_adapter_loaded_when_it_changed(stand_in):
    """The base goes by the transfer protocol once (adapters off), each agent's adapter is saved and loaded
    by path under its name, and each agent's requests name it: the server's greedy rows are each agent's
    own policy. After agent 0's adapter changes only it is loaded again (in place), and rows follow."""
    agents = lora_team(Agent("tiny-random").model, "tiny-random", Agent("tiny-random").tokenizer)
    shared = agents[0].model.shared
    engine = make_engine("vllm_server", {"servers": [stand_in.url]})
    engine.check_team(agents, "cpu")  # one address for the team: one base
    with engine.rollout(agents):
        rows = [engine.generate(agent, PROMPTS, 1, GREEDY) for agent in agents]
    for agent, served in zip(agents, rows):
        assert same_rows(served, lean(agent, PROMPTS))
    assert not same_rows(*rows), "the two adapters decode alike: the check is void"
    loads = [e for e in stand_in.events if e.startswith("/v1/load_lora_adapter")]
    assert loads == ["/v1/load_lora_adapter:agent0", "/v1/load_lora_adapter:agent1"]
    assert stand_in.events.count("/update_weights") == 1 and {b["model"] for b in stand_in.bodies} == {
        "agent0",
        "agent1",
    }
    base_names = {name for name, *_ in served_metadata(shared)}  # sent with the adapters off: the base's names
    assert not any("lora" in name for name in base_names)
    before = lean(agents[0], PROMPTS)
    with torch.no_grad():
        for name, p in shared.named_parameters():
            if "lora_B" in name and ".agent0." in name:
                p.add_(torch.randn_like(p))
    assert not same_rows(before, lean(agents[0], PROMPTS)), "the change moved no greedy row: the check is void"
    with engine.rollout(agents):
        rows = [engine.generate(agent, PROMPTS, 1, GREEDY) for agent in agents]
    for agent, served in zip(agents, rows):
        assert same_rows(served, lean(agent, PROMPTS))
    loads = [e for e in stand_in.events if e.startswith("/v1/load_lora_adapter")]
    assert loads[2:] == ["/v1/load_lora_adapter:agent0"] and stand_in.events.count("/update_weights") == 1
    assert stand_in.events[-1] == "/inference/v1/generate" and "/reset_prefix_cache" in stand_in.events[-12:]
    folders = [folder for _, folder in next(iter(engine.servers.values())).adapters.values()]
    assert len(folders) == 2 and all(os.path.isdir(f) for f in folders)  # the versions before: deleted
    assert len(os.listdir(os.path.dirname(folders[0]))) == 2
    with shared.disable_adapter():  # the initial policy (MADPO's candidates): the base alone, adapters kept off
        with engine.rollout(agents):
            base_rows = engine.generate(agents[1], PROMPTS, 1, GREEDY)
        assert stand_in.bodies[-1]["model"] == "lit_marl" and same_rows(base_rows, lean(agents[1], PROMPTS))
        assert all(m.disable_adapters for m in shared.modules() if hasattr(m, "lora_A"))
    engine.close()
    assert not any(os.path.isdir(f) for f in folders)


def test_the_declared_metadata_is_what_the_stream_sends():
    """What ``update_info`` declares (names, dtypes, shapes, in order) is what the stream produces, for
    tied weights and a LoRA model alike, without reading a value."""
    agent = Agent("tiny-random")
    lm = agent.model
    lm.lm_head.weight = lm.model.embed_tokens.weight
    lora = get_peft_model(Agent("tiny-random").model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for model in (lm, lora):
        for dtype in (None, torch.bfloat16):
            declared = served_metadata(model, dtype)
            produced = [(n, t.dtype, tuple(t.shape)) for n, t in effective_weights(model, dtype)]
            assert declared == produced
    assert not any("lora" in name or "base_layer" in name for name, _, _ in served_metadata(lora))


def test_settings_are_checked_by_name():
    with pytest.raises(ValueError, match=r"\['tp'\] unknown to the vllm_server engine"):
        make_engine("vllm_server", {"tp": 2})
    with pytest.raises(ConfigError, match="servers"):
        ServerSettings(servers=["localhost:8000"])
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        ServerSettings(tensor_parallel_size=0)
    engine = make_engine("vllm_server", {"servers": ["http://a:1"]})
    with pytest.raises(ConfigError, match="1 addresses for 2 distinct models"):
        engine.check_team([Agent("tiny-random"), Agent("tiny-random")], "cpu")
    if importlib.util.find_spec("vllm") is None:  # the trainer drives vLLM's NCCL engine: it needs vLLM
        with pytest.raises(ConfigError, match="transport=nccl"):
            make_engine("vllm_server", {"transport": "nccl"}).check_team([Agent("tiny-random")], "cuda")
    command = server_command(
        "py",
        "/m",
        8001,
        "bfloat16",
        "nccl",
        ServerSettings(tensor_parallel_size=4, server_args={"max_model_len": 8192, "enforce_eager": True}),
    )
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    assert command[-3:] == ["--max-model-len", "8192", "--enforce-eager"]
    assert json.loads(command[command.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert "--no-enable-chunked-prefill" not in command  # on GPU vLLM's defaults
    # on CPU: eager, and no partial prefill (vLLM's CPU build cannot rewind a seeded request's generator)
    cpu = server_command("py", "/m", 8001, "float32", "lit_marl_gloo", ServerSettings(), cpu=True, max_len=8192)
    assert "--no-enable-chunked-prefill" in cpu and "--enforce-eager" in cpu
    assert cpu[cpu.index("--max-num-batched-tokens") + 1] == "8192"
    mine = ServerSettings(server_args={"enable_chunked_prefill": True, "max_model_len": 1024})
    assert "--no-enable-chunked-prefill" not in server_command("py", "/m", 1, "float32", "g", mine, cpu=True)
    mine = ServerSettings(server_args={"enable_chunked_prefill": False, "max_model_len": "8k"})  # vLLM's 8000
    cpu = server_command("py", "/m", 1, "float32", "g", mine, cpu=True, max_len=131072)
    assert "--no-enable-chunked-prefill" in cpu and cpu[cpu.index("--max-num-batched-tokens") + 1] == "8000"
    no_cache = ServerSettings(server_args={"enable_prefix_caching": False})
    off = server_command("py", "/m", 1, "bfloat16", "nccl", no_cache)
    assert off.index("--no-enable-prefix-caching") > off.index("--enable-prefix-caching")  # the last one counts


def test_the_trainer_side_group_times_out_rather_than_hangs():
    """A gloo group whose other ranks never come raises within its timeout (the transfer's bound)."""
    store = TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=2), wait_for_workers=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        gloo_group(store, 0, 2, 2)
    assert time.monotonic() - started < 30


def test_replies_are_json_or_named_and_vllms_plain_text_answers_are_read_as_text():
    """vLLM's LoRA routes answer plain text without a content type: read as text; a reply declared JSON that
    is not raises naming the route."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = b"{broken" if self.path == "/json" else b"Success: LoRA adapter 'a' added successfully."
            self.send_response(200)
            if self.path == "/json":
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = ServerClient(f"http://127.0.0.1:{server.server_address[1]}", 5.0)
        assert client.post("/v1/load_lora_adapter", {}) == "Success: LoRA adapter 'a' added successfully."
        with pytest.raises(ServerError, match="/json: a reply that is not JSON"):
            client.post("/json", {})
        with pytest.raises(ServerError, match="/reset_prefix_cache: a reply that is not JSON"):  # not a text route
            client.post("/reset_prefix_cache", {})
    finally:
        server.shutdown()

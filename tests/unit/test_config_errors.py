"""Bad input fails with one error that names the field to fix, before any model weights load."""

from __future__ import annotations

import json

import lightning as L
import pytest

from helpers import SLOGAN_HELDOUT, SLOGAN_PROMPTS, SLOGAN_TRAIN, cli_fit, make_trainer
from lit_marl import ConfigError
from lit_marl.algorithms import MAGRPO
from lit_marl.data import RolloutDataModule

REWARD = "lit_marl.envs.slogan:reward"


def datamodule(**overrides) -> RolloutDataModule:
    kwargs = dict(
        train_path=str(SLOGAN_TRAIN),
        val_path=str(SLOGAN_HELDOUT),
        agent_prompts=SLOGAN_PROMPTS,
        reward_fn=REWARD,
        tasks_per_step=2,
        num_generations=2,
        sampling={"max_new_tokens": 4},
    )
    kwargs.update(overrides)
    return RolloutDataModule(**kwargs)


def trainer(tmp_path) -> L.Trainer:
    return make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, logger=False)


# --------------------------------------------------------------------------- model
def test_unknown_model(no_model_loads):
    with pytest.raises(ValueError, match=r"^model\.model='no-such-model-xyz'.*HF_HUB_OFFLINE"):
        MAGRPO(model="no-such-model-xyz")
    assert no_model_loads == []


def test_unknown_model_in_list_names_its_index():
    with pytest.raises(ValueError, match=r"^model\.model\[1\]='no-such-model-xyz'"):
        MAGRPO(model=["tiny-random", "no-such-model-xyz"])


def test_model_list_length_must_match_num_agents():
    with pytest.raises(ValueError, match=r"model\.model lists 3 sources for 2 agents"):
        MAGRPO(model=["tiny-random"] * 3, num_agents=2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_agents": 0}, "model.num_agents=0"),
        ({"memory": {"forward_batch_size": 0}}, "model.memory.forward_batch_size=0"),
        ({"memory": {"forward_token_budget": 0}}, "model.memory.forward_token_budget=0"),
        ({"advantage": {"mode": "median"}}, "model.advantage.mode='median'"),
    ],
)
def test_bad_model_settings(kwargs, field):
    with pytest.raises(ValueError) as err:
        MAGRPO(**kwargs)
    assert field in str(err.value)


ALGORITHMS = ["MAGRPO", "MARLOO", "MAREINFORCE", "MAReMax", "GRPO", "RLOO", "PPO", "IAC", "MAAC"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"learning_rate": -1.0}, "model.learning_rate=-1.0: must be > 0"),  # trained by gradient ascent
        ({"learning_rate": 0.0}, "model.learning_rate=0.0: must be > 0"),  # weights never moved
        ({"max_grad_norm": -1.0}, "model.max_grad_norm=-1.0: must be >= 0"),  # silently no clipping
    ],
)
def test_learning_rate_and_clipping_bounds_in_every_algorithm(algorithm, kwargs, message, no_model_loads):
    import lit_marl.algorithms as algorithms

    with pytest.raises(ValueError) as err:
        getattr(algorithms, algorithm)(**kwargs)
    assert str(err.value) == message
    assert no_model_loads == []


@pytest.mark.parametrize(
    "algorithm, kwargs, message",
    [
        ("PPO", {"critic": {"learning_rate": -1e-3}}, "model.critic.learning_rate=-0.001: must be > 0 (or null)"),
        ("IAC", {"critic": {"learning_rate": 0.0}}, "model.critic.learning_rate=0.0: must be > 0 (or null)"),
        ("MAGRPO", {"lora": {"r": 0}}, "model.lora.r=0: must be > 0"),
        ("GRPO", {"lora": {"dropout": 1.0}}, "model.lora.dropout=1.0: must be >= 0 and < 1"),
        ("PPO", {"lora": {"alpha": -8}}, "model.lora.alpha=-8: must be > 0"),
    ],
)
def test_critic_rate_and_lora_bounds(algorithm, kwargs, message, no_model_loads):
    import lit_marl.algorithms as algorithms
    from lit_marl.agents import LoraSettings

    if "lora" in kwargs:
        with pytest.raises(ValueError) as err:
            LoraSettings(**kwargs["lora"])
    else:
        with pytest.raises(ValueError) as err:
            getattr(algorithms, algorithm)(**kwargs)
    assert str(err.value) == message
    assert no_model_loads == []


def test_valid_module_loads_nothing_in_init(no_model_loads):
    module = MAGRPO(model="tiny-random")
    assert module.agents is None
    assert no_model_loads == []


# --------------------------------------------------------------------------- data
@pytest.mark.parametrize(
    "reward_fn, detail",
    [
        ("lit_marl.envs.slogan:nope", "has no attribute 'nope'"),
        ("no_such_module:f", "cannot import module 'no_such_module'"),
        ("lit_marl.envs.slogan.nope", "has no attribute 'nope'"),  # dotted form
        ("nocolon", "give an import path"),
        ("lit_marl.envs.slogan:MAX_WORDS", "is not callable"),
    ],
)
def test_bad_reward_fn(reward_fn, detail):
    with pytest.raises(ValueError, match=r"^data\.reward_fn=") as err:
        datamodule(reward_fn=reward_fn)
    assert detail in str(err.value)
    assert repr(reward_fn) in str(err.value)


def test_dotted_reward_path_works():
    from lit_marl.envs.slogan import reward

    assert datamodule(reward_fn="lit_marl.envs.slogan.reward").env.reward_fn is reward


def test_jsonl_missing_prompt_field(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"topic": f"t{i}", "word0": "sun"}) for i in range(3)) + "\n")
    with pytest.raises(ValueError, match=r"^data\.train_path=") as err:
        datamodule(train_path=str(path))
    message = str(err.value)
    assert "['word1']" in message
    assert "data.agent_prompts" in message


def test_val_file_missing_prompt_field(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text(json.dumps({"topic": "t", "word1": "sun"}) + "\n")
    with pytest.raises(ValueError, match=r"^data\.val_path=.*\['word0'\]"):
        datamodule(val_path=str(path))


def test_missing_train_file(tmp_path):
    with pytest.raises(ValueError, match=r"^data\.train_path=.*file not found"):
        datamodule(train_path=str(tmp_path / "nope.jsonl"))


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "tasks.txt"
    path.write_text("topic\n")
    with pytest.raises(ValueError, match=r"^data\.train_path=.*\.jsonl"):
        datamodule(train_path=str(path))


def test_csv_tasks_are_read(tmp_path):
    path = tmp_path / "tasks.csv"
    path.write_text("topic,word0,word1\ntea,sun,moon\nbread,cat,dog\n")
    data = datamodule(train_path=str(path))
    assert data.train_tasks == [
        {"topic": "tea", "word0": "sun", "word1": "moon"},
        {"topic": "bread", "word0": "cat", "word1": "dog"},
    ]
    assert data.prompts_for(data.train_tasks[:1]) == [
        [
            'Write line 1 of a slogan for tea with the word "sun".',
            'Write line 2 of a slogan for tea with the word "moon".',
        ]
    ]


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"agent_prompts": []}, "data.agent_prompts"),
        ({"num_generations": 0}, "data.num_generations=0"),
        ({"joint_mode": "both"}, "data.joint_mode='both'"),
        ({"tasks_per_step": 0}, "data.tasks_per_step"),
        ({"sampling_streams": "per_task", "engine": "hf"}, "data.sampling_streams=per_task samples with the lean"),
    ],
)
def test_bad_data_settings(overrides, field):
    with pytest.raises(ValueError) as err:
        datamodule(**overrides)
    assert field in str(err.value)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"temperature": 0.0}, "data.sampling.temperature"),
        ({"temperature": -1.0}, "data.sampling.temperature"),
        ({"max_new_tokens": 0}, "data.sampling.max_new_tokens"),
        ({"top_p": 1.5}, "data.sampling.top_p"),
        ({"top_k": -1}, "data.sampling.top_k=-1: must be >= 0"),
        ({"top_k": 2.5}, "data.sampling.top_k=2.5: must be a positive integer"),
        ({"top_k": True}, "data.sampling.top_k=True: must be a positive integer"),
    ],
    ids=["temperature=0", "temperature<0", "max_new_tokens=0", "top_p>1", "top_k<0", "top_k=2.5", "top_k=True"],
)
def test_bad_sampling_settings_fail_at_config_time(overrides, field):
    """Sampling settings that generation rejects must fail here, naming the field, not at the
    first training step after the models have loaded (with a message that names no field)."""
    with pytest.raises(ConfigError) as err:
        datamodule(sampling=overrides)
    assert field in str(err.value)


# --------------------------------------------------------------------------- at fit time
def test_one_generation_fails_in_fit_before_loading(tmp_path, no_model_loads):
    module = MAGRPO(model="tiny-random")
    with pytest.raises(ValueError, match=r"data\.num_generations=1") as err:
        trainer(tmp_path).fit(module, datamodule=datamodule(num_generations=1))
    assert "num_generations >= 2" in str(err.value)
    assert module.agents is None
    assert no_model_loads == []


def test_agent_count_mismatch_fails_in_fit_before_loading(tmp_path, no_model_loads):
    module = MAGRPO(model="tiny-random", num_agents=3)
    with pytest.raises(ValueError, match=r"the data gives 2 agents \(data\.agent_prompts.*model\.num_agents=3"):
        trainer(tmp_path).fit(module, datamodule=datamodule())
    assert module.agents is None
    assert no_model_loads == []


# --------------------------------------------------------------------------- through the CLI
def _cli_fit(tmp_path, *extra):
    return cli_fit(tmp_path, *extra)


def test_cli_one_generation(in_repo_root, tmp_path, no_model_loads):
    with pytest.raises(ValueError, match=r"data\.num_generations=1"):
        _cli_fit(tmp_path, "--data.num_generations", "1")
    assert no_model_loads == []


def test_cli_bound_breaking_number_is_one_clear_line(in_repo_root, tmp_path, no_model_loads):
    """A number outside its type's bounds fails at construction with the field, the value and the
    rule, not in a jsonargparse union report."""
    with pytest.raises(ValueError) as err:
        _cli_fit(tmp_path, "--data.init_args.sampling.max_new_tokens", "0")
    assert str(err.value) == "data.sampling.max_new_tokens=0: must be > 0"
    assert no_model_loads == []


def test_cli_bad_reward_fn(in_repo_root, tmp_path, no_model_loads):
    with pytest.raises(ValueError, match=r"^data\.reward_fn='lit_marl\.envs\.slogan:nope'"):
        _cli_fit(tmp_path, "--data.reward_fn", "lit_marl.envs.slogan:nope")
    assert no_model_loads == []


def test_cli_unknown_model(in_repo_root, tmp_path, no_model_loads):
    with pytest.raises(ValueError) as err:
        _cli_fit(tmp_path, "--model.init_args.model", "no-such-model-xyz")
    assert "model.model='no-such-model-xyz'" in str(err.value)
    assert no_model_loads == []


def test_cli_unknown_model_error_is_clear(in_repo_root, tmp_path):
    """The CLI must give the same one-line error as the class, not bury it in jsonargparse's
    'Does not validate against any of the Union subtypes ... Expected a NoneType ... Namespace(...)'."""
    with pytest.raises(ValueError) as err:
        _cli_fit(tmp_path, "--model.init_args.model", "no-such-model-xyz")
    message = str(err.value)
    assert message.startswith("model.model='no-such-model-xyz'"), message
    assert "NoneType" not in message


@pytest.mark.parametrize(
    "args, message",
    [
        (("--model.init_args.learning_rate=-1",), "model.learning_rate=-1.0: must be > 0"),
        (("--model.init_args.lora.r=0",), "model.lora.r=0: must be > 0"),
    ],
)
def test_cli_negative_learning_rate_and_bad_lora_are_one_line(args, message, in_repo_root, tmp_path, no_model_loads):
    with pytest.raises(ValueError) as err:
        _cli_fit(tmp_path, *args)
    assert message in str(err.value)
    assert no_model_loads == []


def test_cli_offers_no_optimizer_it_cannot_honour(in_repo_root, tmp_path, no_model_loads, capsys):
    """Each learner builds its own AdamW: a CLI-wide --optimizer used to be accepted and ignored."""
    with pytest.raises(SystemExit):
        _cli_fit(tmp_path, "--optimizer", "SGD")
    assert "unrecognized arguments: --optimizer" in capsys.readouterr().err
    assert no_model_loads == []


# --------------------------------------------------------------------------- task files
TASK_FILES = [
    ("empty.jsonl", b"", r"is empty \(0 bytes\)"),
    ("blank.jsonl", b"\n\n  \n", r"holds no rows"),
    ("header.csv", b"topic,word0,word1\n", r"holds no rows"),
    ("latin1.jsonl", '{"topic": "tea"}\n{"topic": "caf\xe9"}\n'.encode("latin-1"), r"line 2: not UTF-8 text"),
    ("broken.jsonl", b'{"topic": "tea"}\n{"topic": "tea",\n', r"line 2: not JSON"),
    ("list.jsonl", b'{"topic": "tea"}\n["tea"]\n', r"line 2: a JSON list, not an object"),
    ("null.jsonl", b'{"topic": "tea", "word0": "a", "word1": "b"}\n{"topic": null, "word0": "a", "word1": "b"}\n',
     r"line 2: no value for \['topic'\] \(missing or null\)"),
    ("lacking.jsonl", b'{"topic": "tea", "word0": "a", "word1": "b"}\n\n{"word0": "a", "word1": "b"}\n',
     r"line 3: no value for \['topic'\]"),
    ("dupes.jsonl", b'{"id": 1, "topic": "a", "word0": "a", "word1": "b"}\n' * 2,
     r"id 1 appears twice \(lines 1 and 2\)"),
]  # fmt: skip


@pytest.mark.parametrize("name, content, message", TASK_FILES, ids=[t[0] for t in TASK_FILES])
def test_bad_task_files_are_one_line_naming_the_file_and_line(name, content, message, tmp_path, no_model_loads):
    """A row without a template field was rendered as the text 'None'; a 0-byte file crashed the
    argument parser's error formatter; blank-line, header-only, non-UTF-8 and malformed files gave
    90-140 lines of dump."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        datamodule(train_path=str(path))
    text = str(err.value)
    assert text.startswith(f"data.train_path='{path}'") and "\n" not in text
    assert __import__("re").search(message, text), text
    assert no_model_loads == []


def test_blank_lines_in_a_task_file_are_skipped(tmp_path):
    path = tmp_path / "spaced.jsonl"
    path.write_text('{"topic": "tea", "word0": "a", "word1": "b"}\n\n{"topic": "pie", "word0": "c", "word1": "d"}\n\n')
    assert [t["topic"] for t in datamodule(train_path=str(path)).train_tasks] == ["tea", "pie"]


def test_cli_empty_task_file_is_one_line(in_repo_root, tmp_path, no_model_loads):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"data\.train_path=.*is empty \(0 bytes\)"):
        _cli_fit(tmp_path, "--data.init_args.train_path", str(empty))
    assert no_model_loads == []

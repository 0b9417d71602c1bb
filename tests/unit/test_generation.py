"""Padding and masks, batched generation, and the training log-prob forward."""

from __future__ import annotations

import pytest
import torch

from lit_marl.agents import Agent
from lit_marl.generation import Sampling, generate, left_pad, mask_through_first
from lit_marl.logprobs import completion_logprobs

EOS, PAD = 7, 0


# --------------------------------------------------------------------------- mask_through_first
def test_mask_end_token_in_middle():
    ids = torch.tensor([[5, 6, EOS, PAD, PAD]])
    assert mask_through_first(ids, EOS).tolist() == [[1, 1, 1, 0, 0]]


def test_mask_end_token_at_last_position():
    ids = torch.tensor([[5, 6, 4, 3, EOS]])
    assert mask_through_first(ids, EOS).tolist() == [[1, 1, 1, 1, 1]]


def test_mask_end_token_first():
    ids = torch.tensor([[EOS, 6, 4]])
    assert mask_through_first(ids, EOS).tolist() == [[1, 0, 0]]


def test_mask_end_token_absent_keeps_all():
    ids = torch.tensor([[5, 6, 4, 3]])
    assert mask_through_first(ids, EOS).tolist() == [[1, 1, 1, 1]]


def test_mask_pad_equals_eos():
    # when pad == eos, the padding after the first end token is more end tokens: only the first counts
    ids = torch.tensor([[5, EOS, EOS, EOS], [EOS, EOS, EOS, EOS], [5, 6, 4, EOS], [5, 6, 4, 3]])
    assert mask_through_first(ids, EOS).tolist() == [
        [1, 1, 0, 0],
        [1, 0, 0, 0],
        [1, 1, 1, 1],
        [1, 1, 1, 1],
    ]


def test_mask_is_per_row_and_long():
    ids = torch.tensor([[EOS, 1, 1], [1, EOS, 1], [1, 1, 1]])
    mask = mask_through_first(ids, EOS)
    assert mask.dtype == torch.long
    assert mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


# --------------------------------------------------------------------------- left_pad
def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4], [5, 6]], pad_id=9, device=torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4], [9, 5, 6]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_left_pad_empty_sequence():
    ids, mask = left_pad([[1, 2], []], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[1, 2], [0, 0]]
    assert mask.tolist() == [[1, 1], [0, 0]]


# --------------------------------------------------------------------------- generate
@pytest.fixture(scope="module")
def prompts(tiny_agent):
    long = tiny_agent.encode_prompt("write one line of a slogan for a coffee cart with the word friend")
    short = tiny_agent.encode_prompt("hi")
    assert len(long) > len(short) + 5  # the short one really gets left-padded
    return [long, short]


def test_encode_prompt_uses_chat_template(tiny_agent):
    text = tiny_agent.tokenizer.decode(tiny_agent.encode_prompt("hello"))
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_encode_prompt_with_system_prompt():
    agent = Agent("tiny-random", system_prompt="Be brief.")
    text = agent.tokenizer.decode(agent.encode_prompt("hello"))
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_generate_shapes_and_grouping(tiny_agent, prompts):
    torch.manual_seed(0)
    G, max_new = 3, 5
    gen = generate(tiny_agent, prompts, num_samples=G, sampling=Sampling(max_new_tokens=max_new))
    B = len(prompts) * G
    width = max(len(p) for p in prompts)
    assert gen.prompt_ids.shape == gen.prompt_mask.shape == (B, width)
    assert gen.completion_ids.shape == gen.completion_mask.shape
    assert gen.completion_ids.shape[0] == B and 1 <= gen.completion_ids.shape[1] <= max_new
    for i, prompt in enumerate(prompts):
        for k in range(G):
            row = i * G + k
            assert gen.prompt_ids[row][gen.prompt_mask[row].bool()].tolist() == prompt
            assert int(gen.prompt_mask[row].sum()) == len(prompt)
            # left padding: the mask is zeros then ones
            assert gen.prompt_mask[row, width - len(prompt) :].all()
            assert not gen.prompt_mask[row, : width - len(prompt)].any()
    assert torch.equal(gen.completion_mask, mask_through_first(gen.completion_ids, tiny_agent.eos_token_id))
    assert gen.num_generated_tokens == int(gen.completion_mask.sum())


def test_sampling_is_not_truncated_to_top_k(tiny_agent):
    """Training rollouts sample from the policy itself (temperature 1, top_p 1, and no top-k, as
    ``generate`` asks with ``top_k=None``). The tiny model's next-token distribution is close to
    uniform over ~1000 tokens, so untruncated samples land beyond rank 50 almost every time; with a
    hidden top-k of 50 none ever does."""
    torch.manual_seed(0)
    gen = generate(tiny_agent, [tiny_agent.encode_prompt("hi")], num_samples=32, sampling=Sampling(max_new_tokens=4))
    input_ids = torch.cat([gen.prompt_ids, gen.completion_ids], dim=1)
    attention_mask = torch.cat([gen.prompt_mask, gen.completion_mask], dim=1)
    C = gen.completion_ids.shape[1]
    with torch.no_grad():
        logits = tiny_agent.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -C - 1 : -1]
    assert logits.log_softmax(-1).max() < -4.0  # near uniform (log(1/1024) = -6.9): the premise holds
    chosen = logits.gather(-1, gen.completion_ids.unsqueeze(-1))
    ranks = (logits > chosen).sum(-1)[gen.completion_mask.bool()]
    assert int(ranks.max()) >= 50, f"every sampled token is in the top {int(ranks.max()) + 1}: a top-k filter is on"


def test_generate_greedy_rows_of_a_group_agree(tiny_agent, prompts):
    gen = generate(tiny_agent, prompts, num_samples=2, sampling=Sampling(max_new_tokens=4, greedy=True))
    assert torch.equal(gen.completion_ids[0], gen.completion_ids[1])
    assert torch.equal(gen.completion_ids[2], gen.completion_ids[3])
    # the two prompts are different, so this would catch rows not grouped by prompt
    assert not torch.equal(gen.completion_ids[0], gen.completion_ids[2])


def test_generate_restores_training_mode(tiny_agent, prompts):
    tiny_agent.model.train()
    try:
        generate(tiny_agent, prompts[:1], num_samples=1, sampling=Sampling(max_new_tokens=2, greedy=True))
        assert tiny_agent.model.training
    finally:
        tiny_agent.model.eval()


def test_generate_masks_and_pads_after_end_token(prompts):
    """Make a token the model greedily emits the end token: rows stop there and pad after."""
    agent = Agent("tiny-random")  # own copy: its tokenizer is changed below
    first = generate(agent, prompts, num_samples=2, sampling=Sampling(max_new_tokens=6, greedy=True))
    stop = int(first.completion_ids[0, 0])
    assert stop not in first.completion_ids[2:].flatten().tolist(), "need a token only prompt 0 produces"
    agent.tokenizer.eos_token = agent.tokenizer.convert_ids_to_tokens(stop)
    assert agent.eos_token_id == stop
    gen = generate(agent, prompts, num_samples=2, sampling=Sampling(max_new_tokens=6, greedy=True))
    assert gen.completion_ids[:2, 0].tolist() == [stop, stop]
    assert gen.completion_mask[:2].tolist() == [[1, 0, 0, 0, 0, 0]] * 2
    assert (gen.completion_ids[:2, 1:] == agent.pad_token_id).all()
    assert gen.completion_mask[2:].all()  # prompt 1 never produced it: all of its tokens count
    assert gen.num_generated_tokens == 2 + 2 * 6
    assert agent.decode(gen.completion_ids, gen.completion_mask)[2] == agent.tokenizer.decode(gen.completion_ids[2])


# --------------------------------------------------------------------------- completion_logprobs
def _sampled_with_logits(agent, prompts, max_new_tokens, seed):
    """Sample with HF generate directly and keep the raw logits of every step."""
    ids, mask = left_pad(prompts, agent.pad_token_id, torch.device("cpu"))
    torch.manual_seed(seed)
    with torch.no_grad():
        out = agent.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            do_sample=True,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=agent.eos_token_id,
            pad_token_id=agent.pad_token_id,
        )
    completion = out.sequences[:, ids.shape[1] :]
    logits = torch.stack(out.logits, dim=1).float()
    gen_logprobs = logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    return ids, mask, completion, gen_logprobs


def test_completion_logprobs_match_generation(tiny_agent, prompts):
    ids, mask, completion, gen_logprobs = _sampled_with_logits(tiny_agent, prompts, max_new_tokens=6, seed=1)
    completion_mask = mask_through_first(completion, tiny_agent.eos_token_id)
    input_ids = torch.cat([ids, completion], dim=1)
    attention_mask = torch.cat([mask, completion_mask], dim=1)
    with torch.no_grad():
        logprobs = completion_logprobs(tiny_agent.model, input_ids, attention_mask, completion.shape[1])
    assert logprobs.shape == completion.shape
    keep = completion_mask.bool()
    torch.testing.assert_close(logprobs[keep], gen_logprobs[keep], atol=1e-4, rtol=0)


def test_completion_logprobs_match_unpadded_forward(tiny_agent, prompts):
    """Each left-padded row scores like the same row run alone, without any padding."""
    ids, mask, completion, _ = _sampled_with_logits(tiny_agent, prompts, max_new_tokens=5, seed=2)
    C = completion.shape[1]
    input_ids = torch.cat([ids, completion], dim=1)
    attention_mask = torch.cat([mask, torch.ones_like(completion)], dim=1)
    with torch.no_grad():
        batched = completion_logprobs(tiny_agent.model, input_ids, attention_mask, C)
        # the same batch attending to its padding: what a forward that ignores the mask would give
        unmasked = completion_logprobs(tiny_agent.model, input_ids, torch.ones_like(attention_mask), C)
        for row, prompt in enumerate(prompts):
            alone = torch.tensor([prompt + completion[row].tolist()])
            logits = tiny_agent.model(input_ids=alone).logits[0, -C - 1 : -1]
            expected = logits.log_softmax(-1).gather(-1, completion[row].unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(batched[row], expected, atol=1e-4, rtol=0)
    # the comparison is sensitive: attending to the left padding changes the padded row's scores
    assert (unmasked[1] - batched[1]).abs().max() > 1e-3
    torch.testing.assert_close(unmasked[0], batched[0], atol=1e-4, rtol=0)  # row 0 has no padding


def test_shared_prefix_logprobs_and_gradients_equal_full_forward(prompts):
    """Running each distinct prompt once and sharing its KV cache among its G samples changes
    neither the log-probs nor the gradient (LoRA adapters sit on q/k/v/o, so the gradient has to
    flow back through the shared prompt cache)."""
    from lit_marl.agents import Agent, LoraSettings

    agent = Agent("tiny-random", LoraSettings(r=4))
    torch.manual_seed(0)
    for p in agent.trainable_parameters():  # peft starts B at zero: make the adapters matter
        p.data.normal_(0, 0.05)
    gen = generate(agent, prompts, num_samples=3, sampling=Sampling(max_new_tokens=7))
    input_ids = torch.cat([gen.prompt_ids, gen.completion_ids], dim=1)
    attention_mask = torch.cat([gen.prompt_mask, gen.completion_mask], dim=1)
    groups = torch.arange(len(prompts)).repeat_interleave(3)
    C, keep = gen.completion_ids.shape[1], gen.completion_mask.float()
    params = agent.trainable_parameters()

    full = completion_logprobs(agent.model, input_ids, attention_mask, C)
    shared = completion_logprobs(agent.model, input_ids, attention_mask, C, prompt_groups=groups)
    torch.testing.assert_close(shared * keep, full * keep, atol=1e-5, rtol=0)
    grad_full = torch.autograd.grad((full * keep).sum(), params)
    grad_shared = torch.autograd.grad((shared * keep).sum(), params)
    assert max(g.abs().max() for g in grad_full) > 1e-3
    for a, b in zip(grad_full, grad_shared):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)

    # groups given out of order and with single rows still map rows to their own prompts
    order = torch.tensor([5, 0, 3, 4])
    subset = completion_logprobs(agent.model, input_ids[order], attention_mask[order], C, prompt_groups=groups[order])
    torch.testing.assert_close(subset * keep[order], full[order] * keep[order], atol=1e-5, rtol=0)


def test_shared_prefix_rejects_groups_with_different_prompts(tiny_agent, prompts):
    gen = generate(tiny_agent, prompts, num_samples=1, sampling=Sampling(max_new_tokens=3))
    input_ids = torch.cat([gen.prompt_ids, gen.completion_ids], dim=1)
    attention_mask = torch.cat([gen.prompt_mask, gen.completion_mask], dim=1)
    with pytest.raises(ValueError, match="same prompt"):
        completion_logprobs(tiny_agent.model, input_ids, attention_mask, 3, prompt_groups=torch.zeros(len(prompts)))


# --------------------------------------------------------------------------- masked_logprobs
def test_masked_logprobs_and_gradients_equal_the_full_forward_at_the_masked_tokens(prompts):
    """The LM head on only the positions that predict masked tokens (an agent's replies in an
    episode) gives the full forward's log-probs there, 0 elsewhere, the same gradient, and the same
    hidden states; a model that ignores a boolean ``logits_to_keep`` is handled too."""
    from lit_marl.agents import Agent, LoraSettings
    from lit_marl.logprobs import masked_logprobs, sequence_logprobs

    agent = Agent("tiny-random", LoraSettings(r=4))
    torch.manual_seed(0)
    for p in agent.trainable_parameters():
        p.data.normal_(0, 0.05)
    gen = generate(agent, prompts, num_samples=2, sampling=Sampling(max_new_tokens=7))
    input_ids = torch.cat([gen.prompt_ids, gen.completion_ids], dim=1)
    attention_mask = torch.cat([gen.prompt_mask, gen.completion_mask], dim=1)
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    mask[:, -gen.completion_ids.shape[1] :] = gen.completion_mask.bool()
    mask[0, 0] = mask[1, 2] = True  # column 0 has no context: it stays 0; a prompt token counts
    counts = mask.sum(1)
    assert len(set(counts.tolist())) > 1  # rows keep different numbers of positions
    params = agent.trainable_parameters()

    full = sequence_logprobs(agent.model, input_ids, attention_mask)
    picked, hidden = masked_logprobs(agent.model, input_ids, attention_mask, mask, hidden=True)
    expected = full * mask
    expected[:, 0] = 0
    torch.testing.assert_close(picked, expected, atol=1e-5, rtol=0)
    assert picked[1, 2] != 0 and picked[0, 0] == 0
    out = agent.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
    )
    torch.testing.assert_close(hidden, out.hidden_states[-1])
    grad_full = torch.autograd.grad(expected.sum(), params)
    grad_masked = torch.autograd.grad(picked.sum(), params)
    assert max(g.abs().max() for g in grad_full) > 1e-3
    for a, b in zip(grad_full, grad_masked):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)

    class FullLogits(torch.nn.Module):  # a model whose forward returns every position's logits
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, logits_to_keep=None, **kwargs):
            return self.model(**kwargs)

    with torch.no_grad():
        fallback, _ = masked_logprobs(FullLogits(agent.model), input_ids, attention_mask, mask)
    torch.testing.assert_close(fallback, expected.detach(), atol=1e-5, rtol=0)
    with torch.no_grad():  # no masked token: no logits at all, all zeros
        none, _ = masked_logprobs(agent.model, input_ids, attention_mask, torch.zeros_like(mask))
    assert none.abs().sum() == 0

import torch

from surefit.eval.generate import Decode, greedy_generate


def _greedy_one(model, prompt, n, eos):
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == eos:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_batched_left_padded_generation_equals_one_by_one_and_stops_at_eos():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1))
    model.eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    free = [_greedy_one(model, p, 6, eos=-1) for p in prompts]
    # Use a token that prompt 0 would generate third as EOS: its answer must stop right before it.
    eos = free[0][2]
    got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=[eos], max_new_tokens=6, batch_size=3))
    want = [_greedy_one(model, p, 6, eos=eos) for p in prompts]
    assert got == want
    assert got[0] == free[0][: free[0].index(eos)] and len(got[0]) < len(free[0])
    assert all(len(g) <= 6 and eos not in g for g in got)


def _generate_reference(model, prompts, eos, n):
    """What a careful user writes: transformers' generate, batched with left padding, greedy."""
    from transformers import GenerationConfig

    from surefit.data.collate import PadCollator

    batch = PadCollator(pad_token_id=0, padding_side="left")([{"input_ids": p} for p in prompts])
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=list(eos), pad_token_id=0)
    with torch.no_grad():
        new = model.generate(**batch, generation_config=cfg)[:, batch["input_ids"].shape[1] :].tolist()
    return [seq[: next((k for k, t in enumerate(seq) if t in eos), len(seq))] for seq in new]


def test_own_decode_loop_equals_transformers_generate_and_drops_finished_rows():
    from peft import LoraConfig, get_peft_model

    from conftest import tiny_llama

    model = tiny_llama(seed=3)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (7,), generator=g)]
    free = _generate_reference(model, prompts, {-1}, 12)
    eos = {free[0][1], free[3][4]}  # rows end at different steps; some never do
    want = _generate_reference(model, prompts, eos, 12)
    sizes = []
    hook = model.get_base_model().model.register_forward_pre_hook(
        lambda m, args, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=12, batch_size=7))
    hook.remove()
    assert got == want
    assert len(set(map(len, got))) > 1 and max(map(len, got)) == 12  # some rows ended early, one ran to the limit
    assert sizes[0] == 7 and sizes[-1] < 7 and sizes == sorted(sizes, reverse=True)  # ended rows left the batch

import torch

from surefit.eval.generate import greedy_generate


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
    got = greedy_generate(model, prompts, pad_token_id=0, eos_token_ids=[eos], max_new_tokens=6, batch_size=3)
    want = [_greedy_one(model, p, 6, eos=eos) for p in prompts]
    assert got == want
    assert got[0] == free[0][: free[0].index(eos)] and len(got[0]) < len(free[0])
    assert all(len(g) <= 6 and eos not in g for g in got)

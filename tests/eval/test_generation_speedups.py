"""Generation for evaluation: the optimised loop (reserved KV cache, shared prefixes, lean or merged LoRA forward)
gives every row the tokens of the unoptimised generation, and leaves the trained weights untouched."""

import contextlib

import pytest
import torch

from conftest import tiny_llama
from surefit.eval.generate import MIN_SHARED_PREFIX, Decode, greedy_generate, merged_lora


def _lora_model(bf16: bool, seed: int = 3):
    from peft import LoraConfig, get_peft_model

    from surefit.training.precision import store_frozen_in
    from surefit.training.speedups.lora_fast import fuse_lora

    model = get_peft_model(tiny_llama(seed=seed), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    fuse_lora(model)  # as training and evaluation run it
    if bf16:
        store_frozen_in(model, torch.bfloat16)
    return model.eval()


def _autocast(bf16: bool):
    return (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else None


def _plain(model, prompts, eos, n, autocast=None, batch_size=None):
    """The unoptimised generation: transformers' generate, greedy, under the same autocast, on the same left-padded
    batches as greedy_generate makes (longest prompts first). In 16 bits a row's numbers depend on its batch's
    padding, for generate() as for any batched forward, so the reference uses the same batches."""
    from transformers import GenerationConfig

    from surefit.data.collate import PadCollator

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    size = batch_size or len(prompts)
    out = [None] * len(prompts)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=sorted(eos) or [-1], pad_token_id=0)
    for start in range(0, len(order), size):
        idx = order[start : start + size]
        batch = PadCollator(pad_token_id=0, padding_side="left")([{"input_ids": prompts[i]} for i in idx])
        ctx = autocast() if autocast else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            new = model.generate(**batch, generation_config=cfg)[:, batch["input_ids"].shape[1] :].tolist()
        for i, seq in zip(idx, new, strict=True):
            out[i] = seq[: next((k for k, t in enumerate(seq) if t in eos), len(seq))]
    return out


def _prompts():
    """Mixed lengths; three rows on one 'paragraph', two on another (prefixes longer than MIN_SHARED_PREFIX), three
    alone, one that is a single token longer than a shared prefix."""
    g = torch.Generator().manual_seed(1)

    def rand(n):
        return torch.randint(2, 64, (n,), generator=g).tolist()

    para_a, para_b = rand(MIN_SHARED_PREFIX + 9), rand(MIN_SHARED_PREFIX + 2)
    return [para_a + rand(3), rand(5), para_b + rand(6), para_a + rand(1), rand(23), para_b + rand(2),
            para_a + rand(7), rand(2), para_b[:-1] + rand(1)]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-frozen+autocast"])
@pytest.mark.parametrize("batch_size", [3, 9])
def test_evaluation_generation_equals_the_unoptimised_generation_row_by_row(bf16, batch_size):
    """The default evaluation path (lean LoRA forward, reserved cache, finished rows dropped, LM head at the last
    position) against generate() on the same batches: the same tokens, in fp32 and in bf16."""
    from surefit.training.speedups.lora_generate import lean_lora

    model = _lora_model(bf16)
    prompts = _prompts()
    free = _plain(model, prompts, set(), 10, _autocast(bf16), batch_size)
    # Two stop ids, as a chat template gives (end of turn and EOS): rows end at different steps, others run to the
    # max_new_tokens limit.
    eos = {free[0][2], free[4][5]}
    want = _plain(model, prompts, eos, 10, _autocast(bf16), batch_size)
    assert len(set(map(len, want))) > 2 and max(map(len, want)) == 10 and min(map(len, want)) < 10
    got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=10, batch_size=batch_size), autocast=_autocast(bf16), lora_context=lean_lora)
    assert got == want
    # The earlier path (growing cache, training's LoRA forward) gives the same rows.
    assert greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=10, batch_size=batch_size, reuse_cache=False), autocast=_autocast(bf16)) == want


def test_shared_prefix_generation_equals_the_unoptimised_generation_in_fp32():
    """--eval_share_prefixes: each shared prompt beginning computed once; in fp32 the same tokens row by row."""
    model = _lora_model(bf16=False)
    prompts = _prompts()
    free = _plain(model, prompts, set(), 10)
    eos = {free[0][2], free[4][5]}
    want = _plain(model, prompts, eos, 10)
    for batch_size in (3, 9):
        stats: dict = {}
        got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=10, batch_size=batch_size, share_prefixes=True), stats=stats)
        assert got == want, batch_size
        assert stats["prefill_tokens"] < stats["prompt_tokens"]  # shared prefixes were computed once


def test_lean_lora_forward_is_bit_identical_and_restored():
    from surefit.training.speedups.lora_fast import fused_forward
    from surefit.training.speedups.lora_generate import lean_lora

    model = _lora_model(bf16=True)
    x = torch.randint(2, 64, (3, 11))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(input_ids=x).logits
        with lean_lora(model) as n:
            got = model(input_ids=x).logits
    assert n == 14 and torch.equal(got, want)  # 7 linear layers x 2 blocks
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    assert all(m.forward.__func__ is fused_forward for m in layers)


@pytest.mark.parametrize("bf16", [True, False], ids=["16-bit frozen weights", "fp32"])
def test_lean_lora_skips_a_new_adapters_zero_term_with_the_same_logits(bf16):
    # peft starts B at zero: before training the adapter adds exactly nothing, and the evaluation before training
    # runs the frozen layers alone. Layers whose B is not zero keep the adapter.
    from surefit.training.speedups import lora_generate
    from surefit.training.speedups.lora_fast import fused_forward

    model = _lora_model(bf16=bf16)
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    with torch.no_grad():
        for m in layers[1:]:
            m.lora_B["default"].weight.zero_()
    x = torch.randint(2, 64, (3, 11))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for m in layers:  # the training path's forward, adapter term included, as the reference
            assert m.forward.__func__ is fused_forward
        want = model(input_ids=x).logits
        with lora_generate.lean_lora(model) as n:
            kinds = [m.forward.func for m in layers]
            got = model(input_ids=x).logits
    full, skipped = ((lora_generate._lean_mixed, lora_generate._lean_base) if bf16 else
                     (lora_generate._lean_full, lora_generate._lean_full_base))
    assert n == 14 and kinds == [full] + [skipped] * 13
    assert torch.equal(got, want)
    assert all(m.forward.__func__ is fused_forward for m in layers)


def test_merged_generation_leaves_adapter_and_base_weights_unchanged():
    model = _lora_model(bf16=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {id(m): m.__dict__.get("forward") for m in model.modules()}
    prompts = _prompts()
    with merged_lora(model) as info:
        assert info.layers == 14 and not info.out_of_memory
        # the unoptimised generation with the same merged weights
        want = _plain(model, prompts, set(), 8, _autocast(True), batch_size=4)
    stats: dict = {}
    got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=[], max_new_tokens=8, batch_size=4, merge_lora=True), autocast=_autocast(True), stats=stats)
    assert got == want and stats["merged_layers"] == 14
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert {id(m): m.__dict__.get("forward") for m in model.modules()} == forwards
    assert all(not m.merged_adapters for m in model.modules() if hasattr(m, "merged_adapters"))
    # An error inside the merge (here: out of memory in a forward) restores the layers too.
    with pytest.raises(torch.OutOfMemoryError), merged_lora(model):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")
    assert {id(m): m.__dict__.get("forward") for m in model.modules()} == forwards


def test_out_of_memory_during_generation_halves_the_eval_batch_and_keeps_the_answers():
    from transformers import PreTrainedTokenizerFast  # noqa: F401 - the tokenizer type generate_texts decodes with

    from conftest import build_tokenizer
    from surefit.tasks.sft.train_sft import Generation, generate_texts
    from surefit.training.precision import make_accelerator
    from surefit.training.work import Switches

    tok = build_tokenizer()
    model = _lora_model(bf16=False)
    prompts = [p for p in _prompts() if len(p) < 10] + [[5, 6, 7], [9, 8], [11, 12, 13, 14], [3, 4, 5, 6, 7]]
    eos = [0]
    want = generate_texts(model, prompts, tok, make_accelerator("fp32"), Generation(eos, 6, 8), say=lambda _: None)
    said: list[str] = []
    seen: list[int] = []

    def fail_big(module, args, kwargs):
        seen.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")

    hook = model.get_base_model().model.register_forward_pre_hook(fail_big, with_kwargs=True)
    try:
        got = generate_texts(model, prompts, tok, make_accelerator("fp32"),
                             Generation(eos, 6, 8, Switches(eval_merge_lora=True)), say=said.append)
    finally:
        hook.remove()
    assert got == want
    assert said == ["out of memory during generation: retrying with batch size 4 (training is unaffected)",
                    "out of memory during generation: retrying with batch size 2 (training is unaffected)"]
    assert max(seen[-3:]) <= 2
    assert all(not m.merged_adapters for m in model.modules() if hasattr(m, "merged_adapters"))


def test_training_evaluation_uses_the_exact_path_by_default_and_the_options_when_asked(tmp_path, tiny_lm_dir,
                                                                                         qa_jsonl, monkeypatch):
    from surefit.tasks.sft import train_sft as recipe
    from surefit.training.speedups.lora_generate import lean_lora

    calls: list[dict] = []
    real = recipe.greedy_generate

    def spy(model, prompts, decode, **kwargs):
        calls.append({**kwargs, "merge_lora": decode.merge_lora, "share_prefixes": decode.share_prefixes,
                      "by_length": decode.prefill_by_length})
        return real(model, prompts, decode, **kwargs)

    monkeypatch.setattr(recipe, "greedy_generate", spy)
    from surefit.cli import main

    common = ["train", "--model", str(tiny_lm_dir), "--data", str(qa_jsonl), "--epochs", "1", "--lora_r", "4",
              "--max_new_tokens", "3", "--precision", "fp32"]
    assert main([*common, "--output_dir", str(tmp_path / "a")]) == 0
    assert calls and all(c["merge_lora"] is False and c["share_prefixes"] is False and c["lora_context"] is lean_lora
                         and c["by_length"] is True for c in calls)
    calls.clear()
    assert main([*common, "--eval_merge_lora", "true", "--eval_share_prefixes", "true",
                 "--output_dir", str(tmp_path / "b")]) == 0
    assert calls and all(c["merge_lora"] is True and c["share_prefixes"] is True for c in calls)
    calls.clear()
    from surefit.training.speedups.lora_generate import packed_lora

    # --eval_generate_batch_size: each batch prefilled whole (generate()'s batches), not in parts by length
    assert main([*common, "--eval_pack_lora", "true", "--eval_generate_batch_size", "2",
                 "--output_dir", str(tmp_path / "c")]) == 0
    assert calls and all(c["lora_context"] is packed_lora and c["merge_lora"] is False and c["by_length"] is False
                         for c in calls)
    # `surefit eval` and `predict` of that run: eval keeps the run's whole batches (its numbers are the last epoch's),
    # predict has no epoch to match and cuts by length
    calls.clear()
    assert main(["eval", "--run", str(tmp_path / "c")]) == 0
    assert calls and all(c["by_length"] is False for c in calls)
    calls.clear()
    assert main(["predict", "--run", str(tmp_path / "c"), "--file", str(qa_jsonl),
                 "--out", str(tmp_path / "preds.jsonl")]) == 0
    assert calls and all(c["by_length"] is True for c in calls) and (tmp_path / "preds.jsonl").exists()


def test_length_parts_are_the_cheapest_cut_within_the_limit():
    """The cut of sorted prompts into prefill parts: what an exhaustive search over every cut finds cheapest, never
    more rows than the limit; SQuAD-like lengths split where the padding would cost more than a forward."""
    import itertools
    import random

    from surefit.data.collate import length_parts

    def cost(runs, lengths, tails, part_cost):
        return sum((e - s) * (max(lengths[s:e]) + max(tails[s:e])) + part_cost for s, e in runs)

    rnd = random.Random(0)
    for _ in range(200):
        n = rnd.randint(1, 7)
        lengths = sorted((rnd.randint(1, 300) for _ in range(n)), reverse=True)
        tails = [rnd.choice([0, rnd.randint(1, 40)]) for _ in range(n)]
        limit, part_cost = rnd.randint(1, n), rnd.choice([0, 32, 4096])
        got = length_parts(lengths, tails, limit, part_cost)
        assert [s for s, _ in got] == [0] + [e for _, e in got[:-1]] and got[-1][1] == n
        assert all(e - s <= limit for s, e in got)
        best = min(cost(list(zip((0, *cuts), (*cuts, n), strict=True)), lengths, tails, part_cost)
                   for k in range(n) for cuts in itertools.combinations(range(1, n), k)
                   if all(e - s <= limit for s, e in zip((0, *cuts), (*cuts, n), strict=True)))
        assert cost(got, lengths, tails, part_cost) == best
    squad = [231, 193, 193, 121, 120, 115, 114, 107]
    assert length_parts(squad, [0] * 8, 8, 32) == [(0, 1), (1, 3), (3, 8)]
    assert length_parts(squad, [0] * 8, 8, 4096) == [(0, 8)]  # a GPU's forward costs more than the padding
    assert length_parts(squad, [0] * 8, 2, 32) == [(0, 1), (1, 3), (3, 5), (5, 7), (7, 8)]


@pytest.mark.parametrize("loss", [False, True], ids=["prompts", "loss-in-prefill"])
def test_prefill_in_parts_by_length_gives_generates_tokens_in_fp32(loss):
    """Prompts of very different lengths prefilled in parts of similar length (one forward each, caches stacked):
    in fp32 every row's tokens are generate()'s, and the loss computed in those forwards is the separate loss pass's;
    fewer padded tokens are computed than in one forward over the batch."""
    from test_loss_in_prefill import _head_loss, _separate_loss

    from surefit.eval.generate import LossPass
    from surefit.training.speedups.lora_generate import lean_lora

    model = _lora_model(bf16=False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (41, 3, 38, 4, 5, 20, 2, 40, 6)]
    feats = [{"input_ids": p + [5, 9, 0], "labels": [-100] * len(p) + [5, 9, 0]} for p in prompts]
    want = _plain(model, prompts, set(), 6, batch_size=9)
    widths: list[int] = []
    hook = model.get_base_model().model.register_forward_pre_hook(
        lambda m, args, kw: widths.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    stats: dict = {}
    passes = LossPass(feats, _head_loss) if loss else None
    got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=[], max_new_tokens=6, batch_size=9,
                                                 prefill_by_length=True, loss_pass=passes),
                          lora_context=lean_lora, stats=stats)
    hook.remove()
    assert got == want
    tail = 3 if loss else 0
    # 41, 40, 38, 20 | 6, 5, 4, 3, 2: forwards of 4 x 41 and 5 x 6 prompt tokens against one of 9 x 41
    assert stats["prefill_parts"] == 2 and widths[:2] == [(4, 41 + tail), (5, 6 + tail)]
    assert widths[2:] == [(9, 1)] * 5  # then one decode batch of all nine rows
    if loss:
        want_loss, want_n = _separate_loss(model, feats)
        assert passes.tokens == want_n and passes.loss_sum / passes.tokens == pytest.approx(want_loss, rel=1e-5)


@pytest.mark.parametrize("share", [False, True], ids=["whole-prompts", "shared-prefixes"])
def test_decode_batch_larger_than_the_prefill_batch_gives_generates_tokens_in_fp32(share):
    """Prompts prefilled 3 at a time and decoded 9 at a time (caches stacked, left padded to the longest): in fp32
    every row's tokens are those of generate() on batches of 3, rows ending at different steps."""
    from surefit.training.speedups.lora_generate import lean_lora

    model = _lora_model(bf16=False)
    prompts = _prompts()
    free = _plain(model, prompts, set(), 10, batch_size=3)
    eos = {free[0][2], free[4][5]}
    want = _plain(model, prompts, eos, 10, batch_size=3)
    assert len(set(map(len, want))) > 2 and max(map(len, want)) == 10
    sizes: list[int] = []
    hook = model.get_base_model().model.register_forward_pre_hook(
        lambda m, args, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    stats: dict = {}
    got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=10,
                                                 batch_size=9, prefill_batch=3, share_prefixes=share),
                          lora_context=lean_lora, stats=stats)
    hook.remove()
    assert got == want
    first_step = sizes.index(9)  # prefilled in threes (one or two forwards each), then decoded as one batch
    assert first_step >= 3 and max(sizes[:first_step]) <= 3 and sizes[first_step:] == sorted(sizes[first_step:])[::-1]
    assert (stats["prefill_tokens"] < stats["prompt_tokens"]) == share


def test_stacked_decode_in_bf16_agrees_with_generate_on_the_prefill_batches():
    """In bf16 a decode step over 9 rows can round differently from one over 3 (another matmul shape, more masked
    keys), so the tokens are counted, not required equal: at least 8 of the 9 rows identical on this tiny model (the
    real model's figure is in benchmarks/results/generation.md)."""
    from surefit.training.speedups.lora_generate import lean_lora

    model = _lora_model(bf16=True)
    prompts = _prompts()
    want = _plain(model, prompts, set(), 10, _autocast(True), batch_size=3)
    got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=[], max_new_tokens=10, batch_size=9,
                                                 prefill_batch=3), autocast=_autocast(True), lora_context=lean_lora)
    same = sum(a == b for a, b in zip(got, want, strict=True))
    assert same >= 8, (same, got, want)


def test_training_caps_answers_at_the_longest_reference_and_decodes_the_planners_batch(tmp_path, tiny_lm_dir,
                                                                                         monkeypatch, capsys):
    """The default generation length is the longest validation answer (+4), printed with why, so no reference-length
    answer is cut even where validation answers are longer than any training answer; the decode batch is the
    planner's (all 12 prompts here), the prompts run --eval_batch_size at a time."""
    import json

    from conftest import qa_rows
    from surefit.cli import main
    from surefit.tasks.sft import train_sft as recipe

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    val_rows = [{"input": f"the {r['target']} and the mat .\n\nQuestion: list them {i} ?",
                 "target": f"{r['target']} then the mat and the {r['target']} again"} for i, r in enumerate(qa_rows(12))]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in val_rows), encoding="utf-8")
    decodes: list = []
    real = recipe.greedy_generate
    monkeypatch.setattr(recipe, "greedy_generate",
                        lambda model, prompts, decode, **kw: decodes.append(decode) or real(model, prompts, decode, **kw))
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(train), "--val_data", str(val), "--epochs", "1",
                 "--lora_r", "4", "--precision", "fp32", "--eval_batch_size", "2",
                 "--output_dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    from surefit.models import load_tokenizer, resolve_model

    tok, _ = load_tokenizer(str(tiny_lm_dir), resolve_model(str(tiny_lm_dir)))
    longest_val = max(len(tok(r["target"], add_special_tokens=False)["input_ids"]) for r in val_rows) + 1  # + EOS
    longest_train = max(len(tok(r["target"], add_special_tokens=False)["input_ids"]) for r in qa_rows(24)) + 1
    assert longest_val > longest_train + 4  # the training answers alone would have cut these
    assert f"eval generates up to {longest_val + 4} tokens (the longest validation answer, {longest_val} tokens " \
           "with its terminator, + 4)" in out
    assert decodes and all(d.max_new_tokens == longest_val + 4 for d in decodes)
    assert all(d.batch_size == 12 and d.prefill_batch == 2 for d in decodes)
    assert "generation decodes up to 12 rows at once, their prompts run up to 2 at a time in parts of similar length" in out


def test_merged_generation_in_bf16_equals_generate_on_peft_merge_and_unload():
    """--eval_merge_lora under bf16 autocast computes what peft's merged model computes: the tokens of generate() on a
    merge_and_unload() copy, batch for batch (the exact path: decode batch = prefill batch)."""
    import copy

    model = _lora_model(bf16=True)
    prompts = _prompts()
    merged = copy.deepcopy(model).merge_and_unload().eval()
    free = _plain(merged, prompts, set(), 10, _autocast(True), batch_size=4)
    eos = {free[0][2], free[4][5]}
    want = _plain(merged, prompts, eos, 10, _autocast(True), batch_size=4)
    assert len(set(map(len, want))) > 2
    stats: dict = {}
    got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=10,
                                                 batch_size=4, merge_lora=True), autocast=_autocast(True), stats=stats)
    assert stats["merged_layers"] == 14 and got == want
    # Tokens can agree by luck on a tiny model: the logits are equal bit for bit too.
    x = torch.randint(2, 64, (3, 11))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with merged_lora(model):
            ours = model(input_ids=x).logits
        theirs = merged(input_ids=x).logits
    assert torch.equal(ours, theirs)


def test_one_cast_serves_the_layers_that_read_the_same_input_and_an_in_place_write_makes_a_new_one():
    from surefit.eval.generate_speedups import LastCast

    cast = LastCast()
    x = torch.randn(3, 5)
    first = cast(x, torch.bfloat16)
    assert cast(x, torch.bfloat16) is first and torch.equal(first, x.to(torch.bfloat16))
    x.mul_(2.0)  # same tensor, new values: the old copy must not be served
    again = cast(x, torch.bfloat16)
    assert again is not first and torch.equal(again, x.to(torch.bfloat16))
    y = x.clone()  # equal values, another tensor
    assert cast(y, torch.bfloat16) is not again


def test_packed_generation_equals_generate_under_the_same_packed_layers_and_restores_the_model():
    """--eval_pack_lora: greedy_generate with packed layers gives the tokens of generate() run with the same packed
    layers, batch for batch (the exact path: decode batch = prefill batch); the weights, the adapter and every
    forward are as they were afterwards, also after an error."""
    from surefit.training.speedups.lora_generate import packed_lora

    model = _lora_model(bf16=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {id(m): m.__dict__.get("forward") for m in model.modules()}
    prompts = _prompts()
    with packed_lora(model) as packed:
        assert packed.modules == 14 and not packed.out_of_memory  # per block: q, k, v, gate, up, the MLP (down_proj inside it) and o_proj
        free = _plain(model, prompts, set(), 10, _autocast(True), batch_size=4)
        eos = {free[0][2], free[4][5]}
        want = _plain(model, prompts, eos, 10, _autocast(True), batch_size=4)
    assert len(set(map(len, want))) > 2
    assert {id(m): m.__dict__.get("forward") for m in model.modules()} == forwards
    got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=10,
                                                 batch_size=4), autocast=_autocast(True), lora_context=packed_lora)
    assert got == want
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert {id(m): m.__dict__.get("forward") for m in model.modules()} == forwards
    with pytest.raises(torch.OutOfMemoryError), packed_lora(model):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")
    assert {id(m): m.__dict__.get("forward") for m in model.modules()} == forwards


def test_packed_lora_leaves_fp32_weights_to_the_lean_forward():
    """Frozen weights in fp32 (no mixed precision): nothing is packed and the logits are the training forward's."""
    from surefit.training.speedups.lora_generate import packed_lora

    model = _lora_model(bf16=False)
    x = torch.randint(2, 64, (3, 11))
    with torch.no_grad():
        want = model(input_ids=x).logits
        with packed_lora(model) as packed:
            got = model(input_ids=x).logits
    assert packed.modules == 0 and torch.equal(got, want)


@pytest.mark.parametrize("b_std", [0.02, 0.0002], ids=["trained-size", "young"])
def test_packed_layer_errs_as_much_as_the_training_forward_and_less_than_merging(b_std):
    """One adapted layer's output against the exact value (fp64) of what the layer holds: the packed GEMM rounds the
    output once to bf16, the training forward rounds base and adapter outputs each and sums in fp32: errors of the
    same size. Merging also rounds W + s * B @ A into bf16 weights: larger errors, for a trained or a young adapter."""
    from peft import LoraConfig, get_peft_model

    from surefit.training.precision import store_frozen_in
    from surefit.training.speedups.lora_fast import fuse_lora
    from surefit.training.speedups.lora_generate import lean_lora, packed_lora

    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("o_proj", torch.nn.Linear(256, 384, bias=False))
    model = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, target_modules=["o_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    model.eval()
    layer = model.get_base_model().o_proj
    x = torch.randn(64, 256)
    xh = x.bfloat16().double()
    a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    exact = xh @ layer.base_layer.weight.double().t() + layer.scaling["default"] * (xh @ a.t()) @ b.t()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with lean_lora(model):
            lean = model(x)
        with packed_lora(model) as info:
            packed = model(x)
        with merged_lora(model):
            merged = model(x)
    assert info.modules == 1 and lean.dtype == torch.float32 and packed.dtype == torch.bfloat16

    def rms(y):
        return (y.double() - exact).pow(2).mean().sqrt().item()

    # fp64 sizes (seed 0): training forward 9.97e-4 / 9.73e-4, packed 1.007e-3 / 9.75e-4, merged 1.35e-3 / 1.12e-3
    assert rms(packed) < 1.1 * rms(lean)
    assert rms(merged) > 1.1 * rms(packed)


def test_packed_siblings_reuse_a_result_only_for_the_same_input_unchanged():
    """q, k and v share one GEMM when called in a row on the same tensor; another input, or the same tensor written
    in place in between, gets its own GEMM: k_proj gives what it gives when its group is run on that input."""
    from surefit.training.speedups.lora_generate import packed_lora

    model = _lora_model(bf16=True)
    attn = model.get_base_model().model.layers[0].self_attn
    x, other = torch.randn(2, 5, attn.q_proj.in_features), torch.randn(2, 5, attn.q_proj.in_features)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_lora(model):
        attn.q_proj(other)
        want_other = attn.k_proj(other)
        attn.q_proj(x)
        assert torch.equal(attn.k_proj(other), want_other)  # not the k of x
        attn.q_proj(x)
        x.mul_(2)  # written in place after q_proj read it
        got = attn.k_proj(x)
        attn.q_proj(x)
        assert torch.equal(got, attn.k_proj(x)) and not torch.equal(got, attn.k_proj(x / 2))


def test_out_of_memory_while_packing_generates_unpacked_and_says_so(monkeypatch):
    """The packed weights are a copy of the adapted layers': where that copy does not fit (a GPU's out of memory while
    packing), evaluation generates with the lean forward, the same answers as without the option, and says so."""
    from conftest import build_tokenizer
    from surefit.tasks.sft.train_sft import Generation, generate_texts
    from surefit.training.precision import make_accelerator
    from surefit.training.speedups import lora_generate
    from surefit.training.work import Switches

    tok = build_tokenizer()
    model = _lora_model(bf16=True)
    prompts = [p for p in _prompts() if len(p) < 10]
    forwards = {id(m): m.__dict__.get("forward") for m in model.modules()}
    want = generate_texts(model, prompts, tok, make_accelerator("bf16", lora=True), Generation([0], 6, 8), say=lambda _: None)
    made = []

    class FullPack(lora_generate._Pack):
        def __init__(self, layers, names):
            if made:  # the second group's copy does not fit
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            made.append(1)
            super().__init__(layers, names)

    monkeypatch.setattr(lora_generate, "_Pack", FullPack)
    said: list[str] = []
    got = generate_texts(model, prompts, tok, make_accelerator("bf16", lora=True),
                         Generation([0], 6, 8, Switches(eval_pack_lora=True)), say=said.append)
    assert got == want and made
    assert said == ["out of memory while packing the LoRA layers' weights for generation: generated with the adapter "
                    "applied as in training instead (slower; --eval_pack_lora false skips the attempt)"]
    assert {id(m): m.__dict__.get("forward") for m in model.modules()} == forwards


def _copying_prompts():
    """Prompts that end with the beginning of their own first tokens again, so that greedy answers and the prompts
    share n-grams and drafts get confirmed as well as turned down."""
    return [p + p[:5] for p in _prompts()]


@pytest.mark.parametrize("batch_size,prefill", [(3, None), (9, None), (9, 3)],
                         ids=["batches-of-3", "one-batch", "prefilled-in-threes"])
@pytest.mark.parametrize("tokens", [2, 5])
def test_prompt_lookup_gives_generates_tokens_in_fp32_in_fewer_forwards(batch_size, prefill, tokens, monkeypatch):
    """--prompt_lookup_num_tokens: drafts copied from each row's context, confirmed in one forward, give every row the
    tokens of generate() on the same (prefill) batches (rows ending at different steps, at the length cap and on a
    stop id met inside a draft), in fewer decode forwards, and the reserved cache never has to grow."""
    from surefit.eval import generate_speedups
    from surefit.training.speedups.lora_generate import lean_lora

    update = generate_speedups.Reserved.update

    def within_room(self, keys, values, *args, **kwargs):
        assert self._n + keys.shape[-2] <= self._k.shape[-2], "a draft went past the reserved room"
        return update(self, keys, values, *args, **kwargs)

    monkeypatch.setattr(generate_speedups.Reserved, "update", within_room)
    model = _lora_model(bf16=False)
    prompts = _copying_prompts()
    free = _plain(model, prompts, set(), 12, batch_size=prefill or batch_size)
    eos = {free[0][2], free[4][5]}
    want = _plain(model, prompts, eos, 12, batch_size=prefill or batch_size)
    assert len(set(map(len, want))) > 2 and max(map(len, want)) == 12
    runs = {}
    for k in (0, tokens):
        stats: dict = {}
        got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=12,
                                                     batch_size=batch_size, prefill_batch=prefill, lookup_tokens=k),
                              lora_context=lean_lora, stats=stats)
        assert got == want, k
        runs[k] = stats
    assert runs[0]["drafted"] == 0
    assert 0 < runs[tokens]["confirmed"] < runs[tokens]["drafted"]  # some confirmed, some turned down
    assert runs[tokens]["decode_forwards"] < runs[0]["decode_forwards"]


def test_prompt_lookup_in_bf16_agrees_with_the_one_token_decode():
    """In bf16 a step over several columns can round differently from one over one column, so the rows are counted:
    at least 8 of 9 identical on this tiny model (the real model's figures: docs/performance.md)."""
    from surefit.training.speedups.lora_generate import lean_lora

    model = _lora_model(bf16=True)
    prompts = _copying_prompts()
    common = dict(pad_token_id=0, eos_token_ids=[], max_new_tokens=12, batch_size=9)
    one = greedy_generate(model, prompts, Decode(**common), autocast=_autocast(True), lora_context=lean_lora)
    stats: dict = {}
    drafted = greedy_generate(model, prompts, Decode(**common, lookup_tokens=5), autocast=_autocast(True),
                              lora_context=lean_lora, stats=stats)
    assert stats["confirmed"] > 0
    assert sum(a == b for a, b in zip(one, drafted, strict=True)) >= 8


def test_a_draft_continues_the_earliest_earlier_occurrence_of_the_longest_tail():
    from surefit.eval.generate_speedups import PromptLookup

    look = PromptLookup([[1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]], tokens=3)
    assert look.draft(0, 10) == [4, 9, 2]  # tail (2, 3) first seen at 1, so 4, 9, 2 followed it; at most 3
    look.extend(0, [5])
    assert look.draft(0, 10) == [6, 2, 3]  # tail (2, 3, 5) occurs once before: 6, 2, 3 followed it
    assert look.draft(0, 1) == [6]
    look.extend(0, [7])
    assert look.draft(0, 10) == []  # 7 occurs nowhere earlier
    assert look.odds(0) == 0.5
    look.confirmed(0, drafted=4, kept=3)
    assert look.odds(0) == (3 + 1) / (4 + 2)


def test_the_draft_width_follows_the_hardware_and_the_rows_furthest_behind():
    """Wide steps cost a CPU core in fp32 most: there 24 rows with drafts confirmed half the time run one column, where
    a GPU runs them all; drafts of rows that are ahead never widen a step by themselves."""
    from surefit.eval.generate_speedups import DraftWidth

    drafts, half = [[5, 6, 7, 8, 9]] * 24, [0.5] * 24
    behind = [True] * 24
    assert DraftWidth.on("cpu", sixteen_bit=False).choose(drafts, half, behind) == 1
    assert DraftWidth.on("cuda", sixteen_bit=True).choose(drafts, half, behind) == 6
    sure = [0.95] * 24
    assert DraftWidth.on("cpu", sixteen_bit=True).choose(drafts, sure, behind) == 6
    # only the rows ahead have drafts: the rows behind gain nothing from a wider step
    ahead_only = [[5, 6, 7]] * 12 + [[]] * 12
    assert DraftWidth.on("cuda", sixteen_bit=True).choose(ahead_only, sure, [False] * 12 + [True] * 12) == 1
    assert DraftWidth.on("cpu", sixteen_bit=True).choose([[]] * 4, [0.5] * 4, [True] * 4) == 1


def _windowed_lora_model(family: str, window: int):
    """A Mistral- or Phi-3-style tiny model whose every layer attends within ``window`` tokens, LoRA as in training."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from surefit.training.speedups.lora_fast import fuse_lora

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               pad_token_id=0, eos_token_id=0, sliding_window=window)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    fuse_lora(model)
    return model.eval()


@pytest.mark.parametrize("family", ["mistral", "phi3"])
@pytest.mark.parametrize("switch", ["share_prefixes", "lookup"])
def test_gaps_in_the_cache_never_move_a_sliding_window(family, switch):
    """Shared prefixes and prompt lookup leave gaps between a row's cache columns, and a sliding window is counted in
    columns: with an 8-token window and prompts of up to 28 tokens they gave other tokens than generate(). A batch
    whose cache could pass the window is now generated without them (counted); where the window cannot bite
    (64 tokens) they are still used, with generate()'s tokens."""
    from surefit.training.speedups.lora_generate import lean_lora

    on = {"share_prefixes": True} if switch == "share_prefixes" else {"lookup_tokens": 3}
    prompts = _copying_prompts() if switch == "lookup" else _prompts()
    for window, n in ((8, 10), (64, 6)):
        model = _windowed_lora_model(family, window)
        free = _plain(model, prompts, set(), n, batch_size=3)
        eos = {free[0][2], free[4][3]}
        want = _plain(model, prompts, eos, n, batch_size=3)
        stats: dict = {}
        got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=n,
                                                     batch_size=3, **on), lora_context=lean_lora, stats=stats)
        assert got == want, window
        if window == 8:  # every prompt is longer than the window: every batch that would leave gaps is counted
            from surefit.eval.generate import _batches

            gapped = len(prompts) if switch == "lookup" else sum(
                len(idx) for idx, shared in _batches(prompts, 3, True) if any(shared))
            assert stats["window"] == 8 and stats["window_rows"] == gapped > 0
            assert stats["prefill_tokens"] == stats["prompt_tokens"] and stats["drafted"] == 0
        else:
            assert "window_rows" not in stats
            used = stats["prefill_tokens"] < stats["prompt_tokens"] if switch == "share_prefixes" else stats["drafted"]
            assert used


def test_an_evaluation_says_which_answers_a_sliding_window_kept_from_the_shared_prefixes():
    from conftest import build_tokenizer
    from surefit.tasks.sft.train_sft import Generation, generate_texts
    from surefit.training.precision import make_accelerator
    from surefit.training.work import Switches

    tok = build_tokenizer()
    model = _windowed_lora_model("mistral", 24)
    g = torch.Generator().manual_seed(2)

    def rand(n):
        return torch.randint(2, 64, (n,), generator=g).tolist()

    para = rand(20)
    # batches of 3: three rows of 30 tokens, three on one paragraph (23), three of 4 that stay within the window
    # with room for 6 answer tokens and 6 turned-down drafts
    prompts = [rand(30) for _ in range(3)] + [para + rand(3) for _ in range(3)] + [rand(4) for _ in range(3)]
    said: list[str] = []
    sw = Switches(eval_share_prefixes=True, prompt_lookup_num_tokens=2)
    got = generate_texts(model, prompts, tok, make_accelerator("fp32"), Generation([0], 6, 3, sw), say=said.append)
    want = generate_texts(model, prompts, tok, make_accelerator("fp32"), Generation([0], 6, 3), say=lambda _: None)
    assert got == want
    hits = [s for s in said if "sliding window" in s]
    assert len(hits) == 1, said
    assert hits[0].startswith("--eval_share_prefixes and --prompt_lookup_num_tokens: not used for 6 of 9 answers: ")
    assert "sliding window (24 tokens)" in hits[0] and "(the same answers, slower)" in hits[0]


@pytest.mark.parametrize("family", ["lfm2", "qwen3_next"])
def test_a_model_with_convolution_or_linear_attention_layers_generates_generates_tokens(family):
    """LFM2's convolution layers and Qwen3-Next's linear attention keep states, not keys: the reserved cache left
    them alone only after reading their (absent) keys, and a finished row could not leave the batch
    (``batch_select_indices`` does not cover them): every evaluation of such a model stopped with an AttributeError.
    Now their states are selected as beam search reorders them, and rows end at different steps."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from surefit.training.speedups.lora_generate import lean_lora

    torch.manual_seed(0)
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, eos_token_id=0)
    if family == "lfm2":
        kw.update(layer_types=["conv", "full_attention"])
    else:
        kw.update(head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                  linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])
    from peft import LoraConfig, get_peft_model

    from surefit.training.speedups.lora_fast import fuse_lora

    model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw)),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    fuse_lora(model)
    model.eval()
    prompts = _prompts()
    free = _plain(model, prompts, set(), 8, batch_size=3)
    eos = {free[0][2], free[4][3]}
    want = _plain(model, prompts, eos, 8, batch_size=3)
    assert len(set(map(len, want))) > 1
    for decode in (dict(batch_size=3), dict(batch_size=3, reuse_cache=False), dict(batch_size=9, prefill_batch=3)):
        got = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=sorted(eos), max_new_tokens=8,
                                                     **decode), lora_context=lean_lora)
        assert got == want, decode

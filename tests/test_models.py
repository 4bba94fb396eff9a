import os
from pathlib import Path

import pytest

from surefit.errors import ModelError
from surefit.models import resolve_model
from surefit.models.gguf import EMBEDDED_LM_FILE


def test_resolve_local_folder_gguf_file_gguf_folder_and_hub_id(tmp_path, tiny_lm_dir):
    assert resolve_model(str(tiny_lm_dir)).kind == "folder"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)).kind == "gguf"
    assert resolve_model(str(tmp_path)).path == str(gguf)  # a folder holding exactly one .gguf
    assert resolve_model("HuggingFaceTB/SmolLM2-135M").kind == "hub"


def test_default_is_the_embedded_smollm2():
    src = resolve_model(None)
    assert src.kind == "gguf" and src.path.endswith(EMBEDDED_LM_FILE)


@pytest.mark.parametrize("make,expected", [
    (lambda p: str(p / "missing"), "model not found"),
    (lambda p: (p / "w.bin").write_bytes(b"x") and str(p / "w.bin"), "not a .gguf file"),
    (lambda p: str(p), "cannot tell which model to load"),
])
def test_bad_model_paths_name_the_flag_and_the_fix(tmp_path, make, expected):
    with pytest.raises(ModelError) as e:
        resolve_model(make(tmp_path))
    assert expected in e.value.render() and "--model" in e.value.render()


@pytest.mark.slow
def test_embedded_gguf_converts_once_encodes_squad_and_generates(tmp_path, monkeypatch):
    """The real default model: GGUF -> cached transformers folder -> tokenizer + model that generate text."""
    import torch

    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.rows import Row
    from surefit.eval.generate import Decode, greedy_generate
    from surefit.models import load_causal_lm, load_tokenizer, model_folder

    src = resolve_model(None)
    folder = Path(model_folder(src, log=lambda *_: None))
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert Path(model_folder(src, log=lambda *_: None)) == folder  # second call hits the cache
    tok, notes = load_tokenizer(str(folder), src)
    assert tok.pad_token_id == tok.eos_token_id and notes == []  # SmolLM2: pad == eos, the seeds' trap
    row = Row({"input": "Paris is the capital of France.\n\nQuestion: What is the capital of France?", "target": "Paris"},
              "x line 1", 0)
    [ex], _ = encode_rows([row], tok, build_prompt_format(tok), max_seq_length=128)
    assert ex.labels[-1] == tok.eos_token_id
    model = load_causal_lm(str(folder), src)
    with torch.no_grad():
        [out] = greedy_generate(model, [ex.prompt_ids], Decode(pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id], max_new_tokens=8, batch_size=1))
    assert "paris" in tok.decode(out).lower()


def small_gguf(path: Path, vocab: int = 512) -> Path:
    """A real GGUF model cut from the embedded one: its first block, its first ``vocab`` tokens (with the merges among
    them) and every other field as it is. transformers converts it in about 3 s where the embedded model takes 35 s,
    most of it building the 49,152-token tokenizer."""
    import gguf

    from surefit.models.gguf import embedded_lm_path

    src = gguf.GGUFReader(str(embedded_lm_path()))
    tokens = src.fields["tokenizer.ggml.tokens"].contents()[:vocab]
    have = set(tokens)
    out = gguf.GGUFWriter(str(path), "llama")
    cut = {"llama.block_count": lambda v: 1, "llama.vocab_size": lambda v: vocab,
           "tokenizer.ggml.tokens": lambda v: tokens, "tokenizer.ggml.token_type": lambda v: v[:vocab],
           "tokenizer.ggml.merges": lambda v: [m for m in v if m.replace(" ", "") in have
                                               and all(part in have for part in m.split(" "))]}
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        value = cut.get(key, lambda v: v)(field.contents())
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            out.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            out.add_key_value(key, value, kind)
    for t in src.tensors:
        if t.name.startswith("blk.") and not t.name.startswith("blk.0."):
            continue
        data = t.data[:vocab] if t.name == "token_embd.weight" else t.data  # quantized rows: one token each
        out.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path


@pytest.mark.slow
def test_two_processes_converting_a_gguf_model_at_once_both_get_the_folder(tmp_path):
    # torchrun's processes (or two runs) on a fresh machine each convert the GGUF file; the second rename onto the
    # finished folder must leave both with it, not fail one of them.
    import subprocess
    import sys

    gguf = small_gguf(tmp_path / "small.gguf")
    code = ("import sys; from surefit.models.gguf import gguf_to_folder;"
            "print(gguf_to_folder(sys.argv[1], log=lambda *_: None))")
    env = dict(os.environ, SUREFIT_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(gguf)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    folders = {o.strip().splitlines()[-1] for o, _ in outs}
    assert len(folders) == 1 and (Path(folders.pop()) / "config.json").is_file()
    assert not list((tmp_path / "cache" / "gguf").glob("*.tmp*"))  # the loser's copy removed


def test_weights_read_into_bf16_piece_by_piece_equal_transformers_cast_and_a_short_file_is_refused(
        tmp_path, tiny_lm_dir, monkeypatch):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from surefit.models import lowbit

    # pieces of 100 bytes: every tensor spans several reads into the one buffer, most ending in a shorter piece
    monkeypatch.setattr(lowbit, "_CHUNK_BYTES", 100)
    model = lowbit.load_in_dtype(str(tiny_lm_dir), torch.bfloat16, False, say=lambda _: None)
    expected = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32).state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, v in got.items():
        want = expected[name].to(v.dtype)  # bf16 for Linear and Embedding, fp32 for the norms
        assert v.dtype in (torch.bfloat16, torch.float32) and torch.equal(v, want), name
    assert {v.dtype for n, v in got.items() if n.endswith("proj.weight")} == {torch.bfloat16}

    short = tmp_path / "short"
    shutil.copytree(tiny_lm_dir, short)
    weights = short / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # the last tensor ends early, as a cut download does
    with pytest.raises(ValueError, match="ends inside a tensor"):
        lowbit.load_in_dtype(str(short), torch.bfloat16, False, say=lambda _: None)

"""Encoding one long conversation: seconds against its number of turns (issue 33: the prefix renders made it cubic).

Run: PYTHONPATH=src python benchmarks/chat_encode_scaling.py  (writes results/chat_encode_scaling.{json,md})

Each conversation alternates user and assistant turns of ~12 words. Two templates: the built-in ChatML (prefix-stable:
one example) and Qwen3's own (read from trl's package data when installed; it rewrites earlier turns, so every
assistant turn is its own example), at --max_seq_length 512 (oldest exchanges dropped to fit) and 1,000,000 (all
turns kept).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from surefit.data.encode import BUILTIN_CHAT_TEMPLATES, ChatEncodeSettings, chat_format, encode_conversations
from surefit.data.rows import Row


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|im_start|>", "<|im_end|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(f"word{i} answer question turn" for i in range(300))] * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")


def conversation(turns: int) -> list[dict]:
    out = []
    for t in range(turns):
        if t % 2 == 0:
            out.append({"role": "user", "content": f"question {t}: " + " ".join(f"word{(t * 7 + i) % 300}"
                                                                              for i in range(12))})
        else:
            out.append({"role": "assistant", "content": f"answer {t}: " + " ".join(f"word{(t * 5 + i) % 300}"
                                                                                for i in range(12)), "train": True})
    return out


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tok = tokenizer()
    templates = {"chatml": chat_format(BUILTIN_CHAT_TEMPLATES["chatml"], "chatml")}
    try:
        import trl

        src = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
        templates["qwen3"] = chat_format(src, "qwen3")
    except ImportError:
        pass
    results = []
    for name, fmt in templates.items():
        for max_len in (512, 1_000_000):
            for turns in (250, 500, 1000):
                row = Row({"messages": conversation(turns), "tools": None}, "bench line 1", 0)
                start = time.perf_counter()
                examples, rep, failures, _ = encode_conversations([row], tok, fmt, ChatEncodeSettings(max_len))
                secs = time.perf_counter() - start
                assert not failures, failures
                results.append({"template": name, "max_seq_length": max_len, "turns": turns, "seconds": round(secs, 2),
                                "examples": len(examples), "tokens": rep.tokens})
                print(results[-1], flush=True)
    out = Path(__file__).parent / "results"
    (out / "chat_encode_scaling.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["| template | --max_seq_length | turns | seconds | examples | tokens |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['template']} | {r['max_seq_length']} | {r['turns']} | {r['seconds']} | {r['examples']} | "
              f"{r['tokens']} |" for r in results]
    (out / "chat_encode_scaling.md").write_text(
        "# Encoding one long conversation (benchmarks/chat_encode_scaling.py, 2 shared CPU cores)\n\n"
        + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

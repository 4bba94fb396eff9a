"""A finished sft run: ``final/`` read back (``load``), scored as each epoch was (``evaluate``), asked (``predict``),
exported; and ``inspect``, what a run would supervise. Training itself is ``train_sft.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from surefit.config import SFTConfig
from surefit.data.encode import (
    ChatReport,
    EncodeReport,
    Example,
    encode_rows,
)
from surefit.data.encoded_store import merge_reports
from surefit.data.formats import (
    detect_format,
    fill_template,
    parse_role_map,
    template_fields,
    to_conversations,
)
from surefit.data.readers import check_text_fields, read_checked
from surefit.data.rows import Row
from surefit.data.summary import TextFacts
from surefit.errors import ConfigError, DataError, ModelError, Problem, raise_input_problems
from surefit.eval.progress import phase
from surefit.models import ModelSource, load_causal_lm, load_tokenizer, model_folder, resolve_model
from surefit.models.lowbit import import_peft, keep_4bit_trainable
from surefit.run_folder.open_run import Run
from surefit.tasks.finished_common import Loaded, chunks, rows_from_texts
from surefit.tasks.sft.train_sft import (
    FINAL_FILES,
    Decoded,
    EncodedData,
    Encoder,
    Generation,
    Say,
    Scoring,
    choose_metric,
    encode_settings,
    eos_token_ids,
    evaluate_examples,
    generate_texts,
    load_data,
    prediction_input,
    prediction_records,
    prerendered,
    stored_data,
)
from surefit.training.precision import make_accelerator, store_frozen_in
from surefit.training.speedups.lora_fast import fuse_lora
from surefit.training.work import Switches


def finished_base_model(run: Run, say: Say) -> tuple[str, ModelSource]:
    """The base model the run was trained from (a LoRA adapter is applied to it), resolved as training did."""
    try:
        source = resolve_model(run.cfg.model)
        return model_folder(source, log=say), source
    except ModelError as e:
        raise run.config_problem(e, ("model",)) from e


def load(run: Run, say: Say = print, as_trained: bool = True, merge_dtype: str | None = None) -> Loaded:
    """The causal LM (base + LoRA adapter, or the full model), its tokenizer and the run's prompt format.

    ``as_trained``: frozen weights as training held them: read in the 16-bit dtype it computed in, or quantised
    (``--quantize``) as it was. ``False``: the unquantised base in ``merge_dtype`` (fp32 when ``None``), to merge.
    """
    import torch

    run.require(*FINAL_FILES)
    cfg = run.config_as(SFTConfig)
    final_source = ModelSource("folder", str(run.final), str(run.final))
    tokenizer, _ = load_tokenizer(str(run.final), final_source, cfg.trust_remote_code)
    if (run.final / "adapter_config.json").is_file():
        PeftModel = import_peft().PeftModel  # noqa: N806 - the class, as `from peft import` would name it

        path, source = finished_base_model(run, say)
        # Adapters marked trainable as in training: what stays frozen is what training may have stored in 16 bits.
        quantize = getattr(cfg, "quantize", "none") if as_trained else "none"
        dtype = run.frozen_dtype if as_trained else merge_dtype
        base = load_causal_lm(path, source, cfg.trust_remote_code, dtype=dtype, quantize=quantize, say=say)
        model = PeftModel.from_pretrained(base, str(run.final), is_trainable=bool(run.frozen_dtype))
        keep_4bit_trainable(model)  # the kernels training evaluated with, so the numbers are training's
        if as_trained:
            fuse_lora(model)  # the forward training used (adapters summed in fp32)
            if run.frozen_dtype:
                store_frozen_in(model, {"bf16": torch.bfloat16, "fp16": torch.float16}[run.frozen_dtype])
    else:
        model = load_causal_lm(str(run.final), final_source, cfg.trust_remote_code)
    accelerator = make_accelerator(run.precision)
    model.to(accelerator.device).eval()
    # The saved tokenizer carries the chat template training used (a --chat_format file need not exist any more).
    used = replace(cfg, chat_format=None) if getattr(tokenizer, "chat_template", None) else cfg
    summary = run.summary
    encoder = Encoder.build(used, tokenizer, summary.format or "input_target", bool(summary.format_conversational))
    eos = sorted(set(eos_token_ids(model, tokenizer)) | set(summary.facts_as(TextFacts).stop_ids or []))
    return Loaded(model, tokenizer, accelerator, {"fmt": encoder.prompt, "encoder": encoder, "eos": eos})


def _quiet(_: str) -> None:
    pass


def evaluate(run: Run, data: str | None, batch_size: int, max_new_tokens: int | None, fields: dict[str, str],
             say: Say = print) -> tuple[str, int, dict[str, Any], list[dict[str, Any]]]:
    """``surefit eval`` of an sft run: its validation split re-derived as training did (or ``data``), scored by
    :func:`evaluate_examples` as each epoch was.

    Returns:
        ``(what was evaluated, rows, metrics, prediction records)``.
    """
    cfg = run.config_as(SFTConfig)
    input_field = fields.get("input_field") or cfg.input_field
    target_field = fields.get("target_field") or cfg.target_field
    train_rows = None
    if data is None:
        run.check_training_data()
        train_rows, rows, _ = load_data(cfg, say=_quiet)
        described = run.validation_described()
    else:
        rows = _read_run_file(run, data, [(input_field, "--input_field"), (target_field, "--target_field")])
        described = str(data)
    with phase("loading the run's model"):
        loaded = load(run, say)
    enc = encode_settings(cfg, input_field, target_field)
    encoder: Encoder = loaded.extra["encoder"]
    if encoder.chat is not None:
        examples, rep = encoder.encode(rows, "evaluation")
    else:
        examples, rep = encode_rows(rows, loaded.tokenizer, loaded.extra["fmt"], split="evaluation", **enc)
    for where, why in rep.excluded[:10]:
        say(f"excluded {where}: {why}")
    if not examples:
        if rep.template_tokens:  # what left no room: the template's share named, as training names it
            what = rep.nothing_fits(cfg.max_seq_length)[0].replace("no evaluation rows left after encoding",
                                                                   f"no rows of {described} fit", 1)
            fix = (f"evaluate on rows that fit the run's max_seq_length {cfg.max_seq_length}, or train a run with "
                   f"--max_seq_length {rep.longest_whole} (every one of these rows whole)")
        else:
            what = (f"no rows of {described} fit: all {rep.rows} targets are longer than max_seq_length "
                    f"{cfg.max_seq_length} allows")
            fix = "evaluate on rows with shorter targets"
        raise DataError(Problem(what, run.where("max_seq_length"), fix))
    # training's rule for the rows it scores: no answer longer than their longest reference needs (train_sft.py)
    scored = max((len(e.input_ids) - e.prompt_len for e in examples), default=0)
    max_new = _max_new_tokens(run, max_new_tokens, loaded, train_rows, enc, scored)
    metric = choose_metric(cfg, bool(run.summary.format_conversational))
    scoring = Scoring(target_field, metric, Generation(loaded.extra["eos"], max_new, batch_size, Switches.of(cfg),
                                                       prefill_by_length=not cfg.eval_generate_batch_size),
                      answer=encoder.answer_of())
    metrics, preds, golds = evaluate_examples(loaded.model, examples, loaded.tokenizer, loaded.accelerator, scoring,
                                              say)
    records = prediction_records(examples, preds, golds, input_field, metric)
    if rep.excluded:
        metrics["excluded_rows"] = len(rep.excluded)
    return described, len(examples), metrics, records


def _max_new_tokens(run: Run, given: int | None, loaded: Loaded, train_rows: list | None, enc: dict,
                    scored: int = 0) -> int:
    """Generation length as training chose it: --max_new_tokens, else the longest answer (with its terminator) of the
    rows being scored + 4, as each epoch's evaluation capped it; rows without answers (predict): the longest training
    target + 4."""
    if given:
        return given
    if (configured := run.config_as(SFTConfig).max_new_tokens):
        return configured
    if scored:
        return scored + 4
    longest = run.summary.encoded("train", "longest_target")
    if not longest and train_rows is not None:
        longest = loaded.extra["encoder"].encode(train_rows, "train")[1].longest_target
    if not longest:
        raise ConfigError(Problem(f"cannot tell how many tokens to generate: {run.folder / 'data_report.json'} does not "
                                  "give the longest training target", "--max_new_tokens", "pass --max_new_tokens N"))
    return longest + 4


def _read_run_file(run: Run, path: str, text_fields: list[tuple[str, str]], complete: bool = True) -> list[Row]:
    """Rows of another file for ``eval`` / ``predict``, in the run's format: conversations when the run trained on
    conversations (and the file holds them), else the flat fields checked. Every problem is raised at once."""
    from surefit.data.readers import SKIP_HINT, read_rows

    if not run.summary.format_conversational:
        return read_checked(path, text_fields)
    problems: list[Problem] = []
    rows = read_rows(path, problems)
    choice = detect_format(rows, str(path), "auto", text_fields[0][0], "target", parse_role_map(run.config_as(SFTConfig).role_map)[0])
    if isinstance(choice, Problem):
        problems.append(choice)
    elif choice.conversational:
        rows = to_conversations(rows, choice, str(path), problems, complete=complete)
    else:  # flat rows for a chat run: each input is one user turn
        rows, _ = check_text_fields(rows, text_fields[:1], problems, str(path))
        rows = [r.with_fields(messages=[{"role": "user", "content": str(r.fields[text_fields[0][0]])}]
                              + ([{"role": "assistant", "content": str(r.fields[text_fields[1][0]]), "train": True}]
                                 if len(text_fields) > 1 and text_fields[1][0] in r.fields else []), tools=None)
                for r in rows]
    raise_input_problems([replace(p, fix=p.fix.replace(f"; {SKIP_HINT}", "").replace(SKIP_HINT, ""))
                          for p in problems])
    return rows


def predict(run: Run, inputs: str | list[str] | None, file: str | None, batch_size: int,
            max_new_tokens: int | None, fields: dict[str, str], say: Say = print) -> Iterator[list[dict[str, Any]]]:
    """Generated responses in the run's prompt format, one batch of records at a time, in input order.

    A conversation (``messages`` / ``conversations`` row) is continued with the next assistant turn; generation
    stops at every end-of-turn id of the template and the generation config."""
    input_field = fields.get("input_field") or run.config_as(SFTConfig).input_field
    text_fields = [(input_field, "--input_field")]
    conversational = bool(run.summary.format_conversational)
    if file is not None:
        rows = _read_run_file(run, str(file), text_fields, complete=False)
    else:
        rows = rows_from_texts(inputs, text_fields)
        if conversational:
            rows = [r.with_fields(messages=[{"role": "user", "content": r.fields[input_field]}], tools=None)
                    for r in rows]
    cfg = run.config_as(SFTConfig)
    template = cfg.template
    if template is not None and prerendered(cfg) and not conversational:  # prerendered: a --template was given
        names = template_fields(template)
        rows = [r.with_fields(**{input_field: fill_template(template, {
            n: r.fields.get(input_field if n == "input" else n) for n in names})}) for r in rows]
    with phase("loading the run's model"):
        loaded = load(run, say)
    encoder: Encoder = loaded.extra["encoder"]
    max_new = _max_new_tokens(run, max_new_tokens, loaded, None, encode_settings(cfg))
    # Like training, prompt + answer fit in max_seq_length: the input is cut (and counted) so that they do.
    room = max(cfg.max_seq_length - max_new, 1)
    for part in chunks(rows, batch_size):
        prompts, cut = [], []
        for r in part:
            ids, n_cut = encoder.prompt_ids(r, room)
            prompts.append(ids)
            cut.append(n_cut)
        gen = Generation(loaded.extra["eos"], max_new, batch_size, Switches.of(cfg))
        out = Decoded()
        preds = generate_texts(loaded.model, prompts, loaded.tokenizer, loaded.accelerator, gen, say, progress=True,
                               out=out)
        lengths, raw = out.lengths, out.raw
        batch = []
        for row, pred, n_cut, n, text in zip(part, preds, cut, lengths, raw, strict=True):
            rec = {"where": row.where, "input": prediction_input(row, input_field), "prediction": pred,
                   "stopped": "end of turn" if n < max_new else f"max_new_tokens ({max_new})"}
            parts = encoder.reasoning_answer(text)
            if parts is not None:  # the template marks reasoning: both, apart; "prediction" is the answer
                rec.update(prediction=parts["answer"], reasoning=parts["reasoning"], answer=parts["answer"])
            if n_cut:
                rec["input_tokens_cut"] = n_cut
                what = "oldest turns" if conversational else f"input tokens cut from the {cfg.truncation_side}"
                say(f"{row.where}: {n_cut} tokens of {what} dropped so that prompt + answer "
                    f"fit max_seq_length {cfg.max_seq_length}")
            batch.append(rec)
        yield batch


def export(run: Run, folder: Path, merge: bool, say: Say = print) -> str:
    """Write the run's model into ``folder`` (new); with ``merge``, a LoRA adapter folded into the base weights: a
    plain causal LM that ``AutoModelForCausalLM`` loads without peft. Returns what was written, in words."""
    import shutil

    run.require(*FINAL_FILES)
    lora = (run.final / "adapter_config.json").is_file()
    if merge and lora:
        import torch

        folder.mkdir(parents=True)
        quantized = getattr(run.config_as(SFTConfig), "quantize", "none") != "none"
        # A quantised run merges into a 16-bit copy of the unquantised base: folding an adapter into 4-bit (or
        # 8-bit) weights would round it away into the quantisation grid, and the result would need bitsandbytes.
        dtype = (run.frozen_dtype or "bf16") if quantized else None
        loaded = load(run, say, as_trained=False, merge_dtype=dtype)
        merged = loaded.model.merge_and_unload()
        if dtype:
            merged.to({"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
            bits = run.config_as(SFTConfig).quantize.replace("bit", "-bit")
            say(f"--merge: {run.folder} trained on a {bits} base (--quantize {run.config_as(SFTConfig).quantize}); the adapter is merged "
                f"into a {dtype} copy of the unquantised base, never into the {bits} weights")
        merged.save_pretrained(folder, safe_serialization=True)
        loaded.tokenizer.save_pretrained(folder)
        return "merged model (adapter folded into the base weights" + (f", {dtype})" if dtype else ")")
    shutil.copytree(run.final, folder)
    if merge:
        say(f"--merge: {run.folder} was trained in full (no LoRA adapter); copied the model as it is")
    return "LoRA adapter (load with peft; its base model is named in adapter_config.json)" if lora else "model"


# ------------------------------------------------------------------------------------------------------------ inspect


def inspect(cfg: SFTConfig, out: str | None = None, show: int = 2, color: bool | None = None,
            say: Say = print) -> dict[str, Any]:
    """``surefit inspect --task sft``: what training would supervise, without loading the model's weights.

    Every row is read, checked and encoded as training would (format, template, truncation); the first ``show``
    examples are printed with the supervised spans marked (colour on a terminal, ``[[ ]]`` otherwise), then counts
    per role. ``out``: one JSON object per encoded example (``where``, ``input_ids``, ``labels``, ``text``).

    Returns:
        The counts printed.
    """

    from surefit.run_folder.guard import Output, check_outputs, config_inputs

    check_outputs([Output("--out", Path(out))] if out else [], config_inputs(cfg))
    source = resolve_model(cfg.model)
    # A training run with these settings encoded every row already (train + validation, no augmentation variants):
    # read its examples from the encoded-data cache instead of encoding a large file a second time.
    found = stored_data(cfg, source, say) if cfg.augmentation_factor == 1 else None
    if found is not None:
        return _inspect_stored(found, out, show, color, say)
    rows_cfg = replace(cfg, val_fraction=0.0, augmentation_factor=1)
    rows, _, report = load_data(rows_cfg, say)
    rejected = report.rejected or []
    _say_rejected(rejected, say)
    path = model_folder(source, log=say)
    tokenizer, _ = load_tokenizer(path, source, cfg.trust_remote_code)
    encoder = Encoder.build(cfg, tokenizer, str(report.format), bool(report.format_conversational))
    say(encoder.why)
    examples, rep = encoder.encode(rows, "all", cfg.on_bad_rows == "skip")
    return _inspect_report(cfg, tokenizer, examples, rep, rejected, (out, show, color), say)


def _say_rejected(rejected: list[Any], say: Say) -> None:
    """inspect writes no run folder, so the rows left out are listed here (training writes rejected_rows.jsonl)."""
    if rejected:
        say(f"--on_bad_rows skip: {len(rejected)} row{'s' if len(rejected) != 1 else ''} rejected and left out:")
        for r in rejected[:10]:
            say(f"  {r.where}: {r.reason}")
        if len(rejected) > 10:
            say(f"  and {len(rejected) - 10} more")


def _inspect_stored(found: EncodedData, out: str | None, show: int, color: bool | None,
                    say: Say) -> dict[str, Any]:
    """:func:`inspect` from the encoded-data cache: every row's example (training's and validation's), the counts
    of both encoding reports added, the rejected, excluded and shortened rows as the encoding run found them."""
    rejected = found.summary.rejected or []
    _say_rejected(rejected, say)
    say(f"encoded data: read from the cache {found.store.folder} (no encoding; --no_cache encodes again)")
    say(found.encoder.why)
    kind = ChatReport if found.summary.format_conversational else EncodeReport
    reports = []
    for split in ("train", "validation"):
        counts = dict((found.summary.encoding or {})[split])
        counts["excluded"] = [(e["where"], e["reason"]) for e in found.excluded if e["split"] == split]
        if kind is ChatReport:
            counts["rows_shortened"] = [(e["where"], e["turns_dropped"]) for e in found.shortened if e["split"] == split]
        reports.append(kind(**counts))
    rep = merge_reports(reports)
    rep.split = "all"
    val = found.val_ex
    train = found.features

    class Examples(Sequence[Example]):
        """Training's examples (read from the store), then validation's, as :class:`Example` (rows by location)."""

        def __len__(self) -> int:
            return len(train) + len(val)

        def __getitem__(self, i: Any) -> Any:
            if isinstance(i, slice):
                return [self[j] for j in range(*i.indices(len(self)))]
            if i >= len(train):
                return val[i - len(train)]
            f = train[i]
            prompt = next((j for j, t in enumerate(f["labels"]) if t != -100), len(f["labels"]))
            return Example(f["input_ids"], f["labels"], prompt, Row({}, found.where(i), i))

    return _inspect_report(found.encoder.cfg, found.tokenizer, Examples(), rep, rejected, (out, show, color), say)


def _inspect_report(cfg: SFTConfig, tokenizer: Any, examples: Sequence[Example], rep: EncodeReport,
                    rejected: list[Any], view: tuple[str | None, int, bool | None], say: Say) -> dict[str, Any]:
    """What :func:`inspect` prints and writes, from the examples and their encoding report; ``view``: ``(out, show,
    color)`` as :func:`inspect` takes them."""
    out, show, color = view
    import json
    import sys

    from surefit.run_folder.guard import atomic_file
    if color is None:
        color = sys.stdout.isatty()
    on, off = ("\033[1;32m", "\033[0m") if color else ("[[", "]]")
    for ex in examples[:show]:
        say(f"--- {ex.row.where} (supervised spans marked {on}like this{off}) ---")
        say(marked_text(tokenizer, ex, on, off))
    roles = getattr(rep, "roles", {}) or {}
    counts = {"rejected": len(rejected), "rows": rep.rows, "encoded": rep.encoded, "tokens": rep.tokens, "supervised_tokens": rep.supervised_tokens,
              "turns": roles, "shortened": len(getattr(rep, "rows_shortened", [])), "excluded": len(rep.excluded)}
    say(f"{rep.encoded}/{rep.rows} rows encoded; {rep.tokens} tokens, {rep.supervised_tokens} supervised "
        f"({100.0 * rep.supervised_tokens / max(rep.tokens, 1):.1f}%)")
    chat_rep = rep if isinstance(rep, ChatReport) else None
    if chat_rep and chat_rep.split_rows:
        say(f"{chat_rep.split_rows} conversations became {chat_rep.split_examples} examples: the template rewrites earlier "
            "turns (e.g. drops their reasoning), so each trained turn is its own example, rendered as at inference")
    if chat_rep and chat_rep.reasoning_turns:
        say(f"reasoning: {chat_rep.reasoning_turns} assistant turns carry reasoning, trained with their answer")
    if (line := getattr(rep, "thinking_line", lambda: None)()):
        say(line)
    if chat_rep and chat_rep.system_folded:
        say(f"system turns: {chat_rep.system_folded} written at the start of the first user turn (the template rejects "
            "the system role; --system_turn refuse keeps its error)")
    if roles:
        trained = "every assistant turn" if cfg.train_on == "all_assistant" else "the last assistant turn"
        say("turns per role: " + ", ".join(f"{r} {n}" for r, n in roles.items()) + f"; supervised: {trained} "
            "and its terminator; system, user and tool turns never")
    if isinstance(rep, ChatReport) and rep.tools_rows:
        say(f"tools: {rep.tools_rows} rows give tool schemas ({rep.tools_how}); {rep.tool_call_turns} assistant turns "
            "call a tool (trained like any assistant turn)")
    say(f"shortened to fit: {counts['shortened']} of {rep.rows} rows (oldest turns dropped); excluded: "
        f"{counts['excluded']} of {rep.rows} rows")
    for where, why in rep.excluded[:10]:
        say(f"  excluded {where}: {why}")
    if out:
        with atomic_file(out) as f:
            for ex in examples:
                f.write(json.dumps({"where": ex.row.where, "input_ids": ex.input_ids, "labels": ex.labels,
                                    "text": tokenizer.decode(ex.input_ids, skip_special_tokens=False)},
                                   ensure_ascii=False) + "\n")
        say(f"wrote {len(examples)} encoded examples to {out}")
    return counts


def marked_text(tokenizer: Any, ex: Example, on: str, off: str) -> str:
    """The example's text with each supervised run of tokens between ``on`` and ``off``."""
    parts: list[str] = []
    run: list[int] = []
    trained = False
    for t, label in [*zip(ex.input_ids, ex.labels, strict=True), (None, None)]:
        if t is None or (label != -100) != trained:
            if run:
                text = tokenizer.decode(run, skip_special_tokens=False)
                parts.append(f"{on}{text}{off}" if trained else text)
            run, trained = [], label is not None and label != -100
        if t is not None:
            run.append(t)
    return "".join(parts)
